"""A prompt-lookup branch beside any draft's tree (``trees.WithLookup``).

The draft's own session proposes its tree; an n-gram session over the same rows proposes a chain
that ``join_lookup`` hangs off the root as its last branch. Both see every commit: the draft reads
the accepted path's features (whichever branch it came from), the lookup table the emitted tokens.
Verification takes the deepest accepted node, so the step accepts the longer of the two.
"""
from __future__ import annotations

import torch

from ..selection import select_tree
from ..trees import Chain, Tree, WithLookup, join_lookup
from .autoregressive import ARSession
from .base import Draft, DraftSession
from .ngram import NGram, NGramSession

# shared branch: by the length n of the n-gram the lookup matched (none, 1, 2, 3 or more), the share of its
# first tokens accepted and of accepted tokens followed by an accepted one (measured on Qwen2.5-Coder-1.5B's
# self-distilled ShareGPT answers: benchmarks/investigations/lookup_calibration.py, docs/benchmarks.md);
# the prior of each call's online estimate, worth LOOKUP_PRIOR_WEIGHT observations
LOOKUP_FIRST = (0.0, 0.25, 0.5, 0.78)
LOOKUP_GO_ON = (0.0, 0.63, 0.71, 0.9)
LOOKUP_PRIOR_WEIGHT = 16.0
LOOKUP_DECAY = 0.98  # per step: the estimate follows the text (about the last 50 steps)


def lookup_outcomes(look: torch.Tensor, matched: torch.Tensor, emitted: torch.Tensor,
                    emitted_len: torch.Tensor) -> torch.Tensor:
    """What one step says about the lookup chain's rates, whether or not its tokens were verified.

    look [B, K] the chain proposed, matched [B] its n-gram's length (0: none), emitted [B, W] the tokens
    the step emitted (valid up to emitted_len [B]). -> [4, 4]: per n (0, 1, 2, 3 or more) the first
    token's (accepted, tried) and the next tokens' (accepted after an accepted one, tried). A chain token
    counts as accepted when the target emitted it there: exactly its acceptance, greedy or sampled."""
    b, k = look.shape
    w = min(k, emitted.shape[1])
    seen = emitted_len.clamp(max=w)  # [B] positions this step observed
    agree = (look[:, :w] == emitted[:, :w]) & (torch.arange(w, device=look.device) < seen.view(b, 1))
    m = agree.long().cumprod(1).sum(1)  # [B] the chain's tokens the target emitted, in a row
    used = (matched > 0) & (seen > 0)
    zero = torch.zeros_like(m)
    stats = torch.stack([(used & (m >= 1)).long(), used.long(), torch.where(used, (m - 1).clamp(min=0), zero),
                         torch.where(used, torch.minimum(m, seen - 1), zero)], 1).float()  # [B, 4]
    bucket = torch.nn.functional.one_hot(matched.clamp(0, len(LOOKUP_FIRST) - 1), len(LOOKUP_FIRST)).float()
    return bucket.t() @ stats  # [4, 4]


def lookup_rates(outcomes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[4] first-token and [4] next-token acceptance per matched length: the measured table, moved toward
    what this call observed (``outcomes``, ``lookup_outcomes`` summed with decay)."""
    prior = torch.tensor([LOOKUP_FIRST, LOOKUP_GO_ON], device=outcomes.device) * LOOKUP_PRIOR_WEIGHT  # [2, 4]
    rates = (prior + outcomes[:, 0::2].t()) / (LOOKUP_PRIOR_WEIGHT + outcomes[:, 1::2].t())
    return rates[0].clamp(1e-4, 0.999), rates[1].clamp(1e-4, 0.999)


def open_session(draft: Draft, tree, batch: int, max_length: int, device) -> DraftSession:
    """``draft.session(tree, ...)``, with a lookup session beside it when ``tree`` is a ``WithLookup``."""
    if isinstance(tree, WithLookup):
        return LookupSession(draft.session(tree.tree, batch, max_length, device), tree, batch, max_length, device)
    return draft.session(tree, batch, max_length, device)


class LookupSession(DraftSession):
    """The draft's session and an n-gram one, proposing one joined tree."""

    def __init__(self, inner: DraftSession, tree: WithLookup, batch: int, max_length: int, device):
        if tree.shared and not isinstance(inner, ARSession):
            raise TypeError(f"{tree}: a shared lookup branch needs an autoregressive draft's DynamicTree "
                            f"(EAGLE, EAGLE-3, MTP); got {type(inner).__name__}")
        self.inner, self.tree = inner, tree
        self.lookup = NGramSession(NGram(tree.max_ngram, tree.min_ngram), Chain(tree.depth), batch, max_length, device)
        self.taps = inner.taps
        if tree.shared:  # state (state_owners): the chain last proposed and what the steps said of its rates
            self.proposed = torch.zeros(batch, tree.depth, dtype=torch.int64, device=device)
            self.proposed_matched = torch.zeros(batch, dtype=torch.int64, device=device)
            self.outcomes = torch.zeros(len(LOOKUP_FIRST), 4, device=device)

    def compile_host_work(self, compile_fn) -> None:
        self.inner.compile_host_work(compile_fn)

    def state_owners(self) -> list[object]:
        return self.inner.state_owners() + self.lookup.state_owners() + ([self] if self.tree.shared else [])

    def couple(self, keys, temperature) -> bool:
        return self.inner.couple(keys, temperature)  # the lookup chain has no distribution to couple

    def prefill(self, prompts, features) -> None:
        self.inner.prefill(prompts, features)
        self.lookup.prefill(prompts, None)
        if self.tree.shared:  # each call starts from the measured table (a host reassignment: copied in)
            self.outcomes = torch.zeros_like(self.outcomes)
            self.proposed_matched = torch.zeros_like(self.proposed_matched)

    def propose(self, roots) -> Tree:
        if not self.tree.shared:
            return join_lookup(self.inner.propose(roots), self.lookup.continuation(self.tree.depth))  # [B, N + K]
        return self._propose_shared(roots)

    def _propose_shared(self, roots) -> Tree:
        """EAGLE-2's selection over the draft's candidates and the branch's K tokens (a chain under the
        root, token d scored log first[n] + (d - 1) log go_on[n], the log-probability that it is accepted,
        by the length n of the n-gram matched: ``lookup_rates``): the tree's N nodes go where acceptance is
        expected."""
        scores, tokens, parents = self.inner.candidates()  # [B, E] each
        b, e = scores.shape
        k = self.tree.depth
        look, n = self.lookup.continuation_matched(k)  # [B, K], [B]
        self.proposed, self.proposed_matched = look, n  # what the next commit scores
        first_rates, go_on_rates = lookup_rates(self.outcomes)  # [4] each
        bucket = n.clamp(max=len(LOOKUP_FIRST) - 1)  # n past the table takes its last entry
        first, go_on = first_rates[bucket], go_on_rates[bucket]  # [B]
        depth = torch.arange(1, k + 1, device=scores.device)
        look_scores = torch.where((n > 0).view(b, 1), first.log().view(b, 1) + go_on.log().view(b, 1) * (depth - 1),
                                  float("-inf"))  # [B, K]: no match, no rows
        look_parents = torch.arange(e - 1, e + k - 1, device=scores.device).masked_fill(depth == 1, -1).expand(b, k)
        return select_tree(torch.cat([scores, look_scores.to(scores.dtype)], 1),
                           torch.cat([tokens, look.to(tokens.dtype)], 1),
                           torch.cat([parents, look_parents.to(parents.dtype)], 1), roots, self.tree.tree, extra=k)

    def commit(self, tree, acc, features, accept_len) -> None:
        if self.tree.shared:
            self.outcomes = self.outcomes * LOOKUP_DECAY + lookup_outcomes(self.proposed, self.proposed_matched,
                                                                           acc.emitted, accept_len)
        self.inner.commit(tree, acc, features, accept_len)  # acc.path indexes the joined tree, as features do
        self.lookup.commit(tree, acc, None, accept_len)
