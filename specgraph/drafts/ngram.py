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


@dataclass(frozen=True)
class NGram:
    max_ngram: int = 3
    min_ngram: int = 1

    kind = "ngram"

    def __post_init__(self):
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
        return NGramSession(self, tree, device)


class NGramSession:
    """Per generate call: proposes from each row's sequence; keeps no state."""

    taps = None

    def __init__(self, draft: NGram, tree, device):
        self.draft, self.tree, self.device = draft, tree, device

    def caches(self) -> list:
        return []

    def prefill(self, prompts, features) -> None:
        pass

    def propose(self, sequences: list[list[int]], roots: torch.Tensor) -> Tree:
        k = self.tree.num_nodes - 1
        drafts = torch.tensor([self.draft.propose(seq, k) for seq in sequences], dtype=torch.int64, device=self.device)
        return Tree.from_spec(self.tree, torch.cat([roots.view(-1, 1), drafts.view(len(sequences), k)], 1))

    def commit(self, tree, acc, features, accept_len) -> None:
        pass
