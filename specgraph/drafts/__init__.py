"""Drafts: what proposes the tree's tokens.

Each draft is a ``base.Draft``: a ``kind``, ``session(tree, batch, max_length, device)`` (the
per-generate state the step drives: prefill / propose / commit) and, when it reads the target,
``bind(model) -> blockers``. ``Plain`` is plain decoding (``compile(model, None)``).
"""
from .eagle import Eagle
from .eagle3 import Eagle3
from .medusa import Medusa
from .mtp import MTP
from .ngram import NGram
from .plain import Plain

__all__ = ["Eagle", "Eagle3", "Medusa", "MTP", "NGram", "Plain"]
