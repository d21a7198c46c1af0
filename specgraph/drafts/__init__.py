"""Drafts: what proposes the tree's tokens. Built so far: NGram (no weights)."""
from .ngram import NGram

__all__ = ["NGram"]
