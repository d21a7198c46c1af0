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
# self-distilled ShareGPT answers: benchmarks/investigations/lookup_calibration.py, docs/benchmarks.md)
LOOKUP_FIRST = (0.0, 0.25, 0.5, 0.78)
LOOKUP_GO_ON = (0.0, 0.63, 0.71, 0.9)


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

    def compile_host_work(self, compile_fn) -> None:
        self.inner.compile_host_work(compile_fn)

    def state_owners(self) -> list[object]:
        return self.inner.state_owners() + self.lookup.state_owners()

    def couple(self, keys, temperature) -> bool:
        return self.inner.couple(keys, temperature)  # the lookup chain has no distribution to couple

    def prefill(self, prompts, features) -> None:
        self.inner.prefill(prompts, features)
        self.lookup.prefill(prompts, None)

    def propose(self, roots) -> Tree:
        if not self.tree.shared:
            return join_lookup(self.inner.propose(roots), self.lookup.continuation(self.tree.depth))  # [B, N + K]
        return self._propose_shared(roots)

    def _propose_shared(self, roots) -> Tree:
        """EAGLE-2's selection over the draft's candidates and the branch's K tokens (a chain under the
        root, token d scored log LOOKUP_FIRST[n] + (d - 1) log LOOKUP_GO_ON[n], the log-probability that it
        is accepted): the tree's N nodes go where acceptance is expected."""
        scores, tokens, parents = self.inner.candidates()  # [B, E] each
        b, e = scores.shape
        k = self.tree.depth
        look, n = self.lookup.continuation_matched(k)  # [B, K], [B]
        first, go_on = torch.zeros(b, device=scores.device), torch.zeros(b, device=scores.device)
        for length in range(1, len(LOOKUP_FIRST)):  # n past the table takes its last entry
            first = torch.where(n >= length, LOOKUP_FIRST[length], first)
            go_on = torch.where(n >= length, LOOKUP_GO_ON[length], go_on)
        depth = torch.arange(1, k + 1, device=scores.device)
        look_scores = torch.where((n > 0).view(b, 1), first.log().view(b, 1) + go_on.log().view(b, 1) * (depth - 1),
                                  float("-inf"))  # [B, K]: no match, no rows
        look_parents = torch.arange(e - 1, e + k - 1, device=scores.device).masked_fill(depth == 1, -1).expand(b, k)
        return select_tree(torch.cat([scores, look_scores.to(scores.dtype)], 1),
                           torch.cat([tokens, look.to(tokens.dtype)], 1),
                           torch.cat([parents, look_parents.to(parents.dtype)], 1), roots, self.tree.tree, extra=k)

    def commit(self, tree, acc, features, accept_len) -> None:
        self.inner.commit(tree, acc, features, accept_len)  # acc.path indexes the joined tree, as features do
        self.lookup.commit(tree, acc, None, accept_len)
