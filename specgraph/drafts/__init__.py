"""Drafts: what proposes the tree's tokens. Built so far: NGram (no weights), Medusa."""
from .medusa import Medusa
from .ngram import NGram

__all__ = ["Medusa", "NGram"]
