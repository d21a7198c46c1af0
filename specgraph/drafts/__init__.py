"""Drafts: what proposes the tree's tokens.

Each draft has a ``kind``, ``session(tree, batch, max_length, device)`` (the
per-generate state the loop drives: prefill / propose / commit) and, when it
reads the target, ``bind(model) -> blockers``.
"""
from .eagle import Eagle
from .eagle3 import Eagle3
from .medusa import Medusa
from .mtp import MTP
from .ngram import NGram

__all__ = ["Eagle", "Eagle3", "Medusa", "MTP", "NGram"]
