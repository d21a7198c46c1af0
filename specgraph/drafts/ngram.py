"""NGram: prompt-lookup drafting from the sequence so far (no weights).

For each row, find the most recent earlier occurrence of the sequence's last
n tokens (n = max_ngram down to min_ngram) and propose the tokens that
followed it. Rows with no match propose a repeat of their last token
(rejected cheaply; greedy output stays exact whatever is proposed).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..trees import Tree
from .base import Draft, DraftSession


@dataclass(frozen=True)
class NGram(Draft):
    """Prompt lookup, no weights: the continuation of the most recent earlier occurrence of the
    sequence's last n tokens (n from ``max_ngram`` down to ``min_ngram``), proposed on the device as
    a Chain. ``propose(sequence, k)`` is the host reference."""

    max_ngram: int = 3
    min_ngram: int = 1

    kind = "ngram"

    def __post_init__(self):
        bad = [f"{name}={value!r}" for name, value in (("max_ngram", self.max_ngram), ("min_ngram", self.min_ngram))
               if not isinstance(value, int) or isinstance(value, bool)]
        if bad:
            raise TypeError(f"NGram({', '.join(bad)}): whole numbers of tokens")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"NGram(min_ngram={self.min_ngram}, max_ngram={self.max_ngram}): need 1 <= min <= max")

    def propose(self, sequence: list[int], k: int) -> list[int]:
        """k draft tokens to follow ``sequence`` (its last token is the tree's root)."""
        n_tokens = len(sequence)
        for n in range(min(self.max_ngram, n_tokens - 1), self.min_ngram - 1, -1):
            tail = sequence[n_tokens - n:]
            for start in range(n_tokens - n - 1, -1, -1):  # most recent earlier match first
                if sequence[start:start + n] == tail:
                    follow = sequence[start + n:start + n + k]
                    if follow:
                        return (follow + [follow[-1]] * k)[:k]
        return [sequence[-1]] * k

    def session(self, tree, batch: int, max_length: int, device) -> "NGramSession":
        return NGramSession(self, tree, batch, max_length, device)


def propose_on_device(seq: torch.Tensor, length: torch.Tensor, k: int, max_ngram: int, min_ngram: int) -> torch.Tensor:
    """``NGram.propose`` for a batch, in tensor ops (no host sync, static shapes).

    seq [B, L] tokens (row b valid up to length[b], its last token the root), length [B] -> [B, k].
    The longest n with an earlier occurrence wins; among those, the latest occurrence.
    """
    return lookup_on_device(seq, length, k, max_ngram, min_ngram)[0]


def lookup_on_device(seq: torch.Tensor, length: torch.Tensor, k: int, max_ngram: int,
                     min_ngram: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``propose_on_device``, and [B] int64 the length n of the n-gram each row's proposal matched (0: none)."""
    b, cap = seq.shape
    idx = torch.arange(cap, device=seq.device)
    root = seq.gather(1, (length - 1).clamp(min=0).view(b, 1))
    out, found = root.expand(b, k).clone(), torch.zeros(b, dtype=torch.bool, device=seq.device)
    matched = torch.zeros(b, dtype=torch.int64, device=seq.device)
    for n in range(max_ngram, min_ngram - 1, -1):
        if n >= cap:
            continue
        tail = seq.gather(1, (length.view(b, 1) - n + torch.arange(n, device=seq.device)).clamp(min=0))  # [B, n]
        windows = seq.unfold(1, n, 1)  # [B, L-n+1, n]: windows[b, s] = seq[b, s:s+n]
        starts = idx[: windows.shape[1]]
        match = (windows == tail.unsqueeze(1)).all(-1) & (starts.view(1, -1) <= (length - n - 1).view(b, 1))
        match &= (length > n).view(b, 1)  # n <= len - 1, as the host version requires
        start = torch.where(match, starts.view(1, -1), -1).amax(1)  # [B] latest match, -1: none
        first = start + n  # the continuation: seq[first : min(first + k, length)], its last token repeated
        pos = torch.minimum(first.view(b, 1) + torch.arange(k, device=seq.device), (length - 1).view(b, 1))
        follow = seq.gather(1, pos.clamp(min=0, max=cap - 1))
        take = (start >= 0) & ~found
        out = torch.where(take.view(b, 1), follow, out)
        matched = torch.where(take, n, matched)
        found |= start >= 0
    return out.to(torch.int64), matched


class NGramSession(DraftSession):
    """Per generate call: every row's tokens on the device, so proposing is part of the decode step."""

    def __init__(self, draft: NGram, tree, batch: int, max_length: int, device):
        self.draft, self.tree, self.device = draft, tree, device
        # int32: inductor fuses a scatter of int32 values; one of int64 is aten's own launch on a GPU
        self.seq = torch.zeros(batch, max_length + 64, dtype=torch.int32, device=device)
        self.length = torch.zeros(batch, dtype=torch.int64, device=device)

    def prefill(self, prompts, features) -> None:
        for row, prompt in enumerate(prompts):
            self.seq[row, : len(prompt)] = torch.tensor(prompt, device=self.device)
        self.length.copy_(torch.tensor([len(p) for p in prompts], device=self.device))  # in place: see ARSession

    def continuation(self, k: int) -> torch.Tensor:
        """[B, k]: each row's lookup proposal after its last committed token."""
        return self.continuation_matched(k)[0]

    def continuation_matched(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``continuation``, and [B] the matched n-gram's length (0: none)."""
        return lookup_on_device(self.seq, self.length, k, self.draft.max_ngram, self.draft.min_ngram)

    def propose(self, roots: torch.Tensor) -> Tree:
        drafts = self.continuation(self.tree.num_nodes - 1)
        return Tree.from_spec(self.tree, torch.cat([roots.view(-1, 1), drafts], 1))

    def commit(self, tree, acc, features, accept_len) -> None:
        """Append each row's emitted tokens (rows past accept_len write slots later overwritten)."""
        width = acc.emitted.shape[1]
        slots = (self.length.view(-1, 1) + torch.arange(width, device=self.device)).clamp(max=self.seq.shape[1] - 1)
        self.seq.scatter_(1, slots, acc.emitted.to(torch.int32).clamp(min=0))
        self.length = self.length + accept_len
