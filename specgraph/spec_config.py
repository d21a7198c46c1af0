"""What ``specgraph.compile`` fixed for a SpecModel (``SpecConfig``), and the KV cache size argument."""
from __future__ import annotations

import warnings
from dataclasses import dataclass

from .trees import Chain, DynamicTree, StaticTree, WithLookup

DEFAULT_CACHE_LEN = 2048
MAX_LENGTH_RENAMED = ("{where} is now {new} (KV cache slots per row, transformers' StaticCache spelling), so that "
                      "max_length keeps generate's meaning (prompt + new tokens); the old spelling goes after 0.1")


@dataclass(frozen=True)
class SpecConfig:
    tree: Chain | StaticTree | DynamicTree
    backend: str
    max_batch: int
    max_cache_len: int  # KV cache slots per row (transformers' StaticCache spelling)
    synthetic_accept: int | None = None  # benchmarks only: forced accepted length, NOT lossless
    policy: str = "fixed"  # "fixed": always the tree; "measured"/"cost": per batch size, the tree, a chain or plain
    verify: str = "exact"  # "typical": Medusa's typical acceptance when sampling, NOT lossless
    typical: tuple[float, float] | None = None  # (posterior_threshold, posterior_alpha) with verify="typical"
    one_row_tree: Chain | StaticTree | DynamicTree | WithLookup | None = None  # tree=None, max_batch > 1: B = 1's own
    fast_start: bool = False  # serve uncompiled while inductor compiles in the background (runtime/fast_start.py)

    def tree_for(self, batch: int):
        """The tree a call of ``batch`` rows speculates with: ``one_row_tree`` for one row where compile
        chose one (``tree=None``), else ``tree``."""
        return self.one_row_tree if batch == 1 and self.one_row_tree is not None else self.tree

    @property
    def max_length(self) -> int:
        """Deprecated spelling of ``max_cache_len`` (``generate(max_length=)`` keeps transformers' meaning)."""
        warnings.warn(MAX_LENGTH_RENAMED.format(where="SpecConfig.max_length", new="max_cache_len"), FutureWarning,
                      stacklevel=2)
        return self.max_cache_len


def cache_len_argument(max_cache_len: int, max_length: int | None, where: str) -> int:
    """``compile``/``attach``'s cache size from ``max_cache_len``, or from the deprecated ``max_length``
    (a FutureWarning); both given is refused."""
    if max_length is None:
        return max_cache_len
    if max_cache_len != DEFAULT_CACHE_LEN:
        raise TypeError(f"{where}: max_length= is the old spelling of max_cache_len=; pass max_cache_len only")
    warnings.warn(MAX_LENGTH_RENAMED.format(where=f"{where}(max_length=)", new="max_cache_len="), FutureWarning,
                  stacklevel=3)
    return max_length

