"""The draft protocol: what ``specgraph.compile`` and the decode step ask of a draft and of the
per-call session it opens. Every draft kind (NGram, Medusa, EAGLE-1/2, EAGLE-3, MTP) implements it;
``compile`` refuses anything else by name.

    session = draft.session(tree, batch, max_length, device)   # one per (batch, tree) bucket
    session.prefill(prompts, features)       # each call: the prompts and their tapped target states
    tree = session.propose(roots)            # the first tree, from device state
    ... each step: verify -> session.commit(tree, acc, features, accept_len) -> session.propose(bonus)

Proposing reads device state only, so it is part of the one compiled decode step.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ..passes import HiddenTaps
from ..trees import Chain, Tree


class DraftSession(ABC):
    """One draft's state for one (batch, tree) bucket, reset by ``prefill`` at each generate call."""

    taps: HiddenTaps | None = None  # the target states the draft reads (None: none)

    @abstractmethod
    def prefill(self, prompts: list[list[int]], features: torch.Tensor | None) -> None:
        """Take a call's prompts and their tapped features ``[B, T-1, F]`` (None without taps), in place."""

    @abstractmethod
    def propose(self, roots: torch.Tensor) -> Tree:
        """The next tree from each row's root token ``[B]`` and the session's device state."""

    @abstractmethod
    def commit(self, tree: Tree, acc, features: torch.Tensor | None, accept_len: torch.Tensor) -> None:
        """Extend the session's state by each row's accepted path (``accept_len`` 0: the row finished)."""

    def compile_host_work(self, compile_fn) -> None:
        """Wrap host-side per-call work (e.g. a pass over the prompt) with ``compile_fn``; default: none."""

    def couple(self, keys: torch.Tensor, temperature: torch.Tensor) -> bool:
        """Sampled calls: rank candidates with the target's seeded noise (``kernels.gumbel.coupled_scores``),
        reading ``keys`` [B, 2] and ``temperature`` (0-d) in place at every propose. Returns whether this
        session does (default: no; a draft with no distribution over tokens, e.g. n-gram lookup, cannot)."""
        return False

    def state_owners(self) -> list[object]:
        """The objects whose tensor attributes are this session's state (a recorded CUDA-graph step keeps
        them in static buffers and carries reassignments back into them); default: the session itself.
        A session made of others lists theirs: state it leaves out stays frozen at the recording."""
        return [self]


class Draft(ABC):
    """A draft kind: checks itself against the target and the tree at ``compile``, then opens sessions."""

    kind: str
    taps: HiddenTaps | None = None  # the target states its sessions read (the prefill taps them); None: none

    @abstractmethod
    def session(self, tree, batch: int, max_length: int, device) -> DraftSession:
        """A session for one bucket: ``batch`` rows over ``tree``, caches of ``max_length`` slots."""

    def tree_problems(self, tree) -> list[str]:
        """Why this draft cannot fill ``tree`` (empty: it can)."""
        return []

    def ranked_vocab_size(self, target_vocab_size: int) -> int:
        """How many tokens the draft ranks a node's children among: a tree's sibling ranks must stay below it."""
        return target_vocab_size

    def default_tree(self, device: torch.device, max_batch: int):
        """The tree ``compile(tree=None)`` takes for this draft on ``device`` up to ``max_batch`` rows: the
        measured best where one was measured (docs/benchmarks.md), else a 4-deep chain."""
        return Chain(4)

    def bind(self, model) -> list[str]:
        """Check against the target and borrow what the draft shares with it; returns blockers."""
        return []
