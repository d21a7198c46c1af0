"""Plain decoding as a draft: every tree is the root alone (``Chain(0)``), so each step verifies one
token — the target's own decoding on the same engine, the baseline speculation is measured against.
``specgraph.compile(model, None)`` uses it."""
from __future__ import annotations

import torch

from ..trees import Chain, Tree
from .base import Draft, DraftSession


class Plain(Draft):
    """No proposals: ``tree`` must be ``Chain(0)``."""

    kind = "plain"

    def tree_problems(self, tree) -> list[str]:
        return [] if tree == Chain(0) else [f"tree={tree}: plain decoding verifies the root alone: Chain(0)"]

    def session(self, tree, batch: int, max_length: int, device) -> "PlainSession":
        return PlainSession()


class PlainSession(DraftSession):
    """Stateless: the root is the whole tree."""

    def prefill(self, prompts, features) -> None:
        pass

    def propose(self, roots: torch.Tensor) -> Tree:
        return Tree.from_spec(Chain(0), roots.view(-1, 1))

    def commit(self, tree, acc, features, accept_len) -> None:
        pass
