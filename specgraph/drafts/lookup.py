"""A prompt-lookup branch beside any draft's tree (``trees.WithLookup``).

The draft's own session proposes its tree; an n-gram session over the same rows proposes a chain
that ``join_lookup`` hangs off the root as its last branch. Both see every commit: the draft reads
the accepted path's features (whichever branch it came from), the lookup table the emitted tokens.
Verification takes the deepest accepted node, so the step accepts the longer of the two.
"""
from __future__ import annotations

from ..trees import Chain, Tree, WithLookup, join_lookup
from .base import Draft, DraftSession
from .ngram import NGram, NGramSession


def open_session(draft: Draft, tree, batch: int, max_length: int, device) -> DraftSession:
    """``draft.session(tree, ...)``, with a lookup session beside it when ``tree`` is a ``WithLookup``."""
    if isinstance(tree, WithLookup):
        return LookupSession(draft.session(tree.tree, batch, max_length, device), tree, batch, max_length, device)
    return draft.session(tree, batch, max_length, device)


class LookupSession(DraftSession):
    """The draft's session and an n-gram one, proposing one joined tree."""

    def __init__(self, inner: DraftSession, tree: WithLookup, batch: int, max_length: int, device):
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
        return join_lookup(self.inner.propose(roots), self.lookup.continuation(self.tree.depth))  # [B, N + K]

    def commit(self, tree, acc, features, accept_len) -> None:
        self.inner.commit(tree, acc, features, accept_len)  # acc.path indexes the joined tree, as features do
        self.lookup.commit(tree, acc, None, accept_len)
