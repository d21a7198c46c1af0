"""``specgraph::kv_write``: write one layer's new keys and values into the stacked cache, in place.

Contract:
  kv:     [2L, B, H_kv, S_max, D]  the stacked cache (K of layer l at 2l, V at 2l+1); any dtype
  layer:  int                      the layer l
  index:  [B, H_kv, N, D] int64    slot of node i of row b (``cache_len[b] + i``), broadcast over
                                   heads and head_dim (an expanded view is fine)
  key, value: [B, H_kv, N, D]      already in kv's dtype
kv[2l][b, h, index[b, h, i, d], d] = key[b, h, i, d], and V likewise at 2l+1. Every slot must be
< S_max (the generate loop guarantees it; the CPU path raises, a CUDA device assert fires).

Why an op and not the two ``scatter_`` calls the captured model makes: torch.compile functionalizes a
scatter into a view of a graph input (``kv[2l]``) into a ``select_scatter`` of the whole stacked base,
and inductor did not re-inplace it, so every compiled step copied every layer's cache (step time grew
with max_length, not with the context). An op that declares its mutation (``mutates_args``) stays in
place. There is no Triton kernel: the two scatters are one launch each and move only the new rows.
"""
from __future__ import annotations

import torch


def kv_write_reference(kv: torch.Tensor, layer: int, index: torch.Tensor, key: torch.Tensor,
                       value: torch.Tensor) -> None:
    """Plain torch, in place (also what export traces in the op's place: export.py)."""
    kv[2 * layer].scatter_(2, index, key)
    kv[2 * layer + 1].scatter_(2, index, value)


def _check(kv, layer, index, key, value) -> None:
    problems = []
    if kv.dim() != 5 or kv.shape[0] % 2:
        raise ValueError(f"kv_write: kv must be [2L, B, H_kv, S_max, D]; got {tuple(kv.shape)}")
    if not 0 <= layer < kv.shape[0] // 2:
        problems.append(f"layer {layer} outside 0 .. {kv.shape[0] // 2 - 1}")
    b, h, _, d = kv.shape[1:]
    for name, t in (("index", index), ("key", key), ("value", value)):
        if t.dim() != 4 or (t.shape[0], t.shape[1], t.shape[3]) != (b, h, d):
            problems.append(f"{name} must be [B={b}, H_kv={h}, N, D={d}]; got {tuple(t.shape)}")
    if key.dtype != kv.dtype or value.dtype != kv.dtype:
        problems.append(f"key/value dtype {key.dtype}/{value.dtype} must be the cache's {kv.dtype}")
    if problems:
        raise ValueError("kv_write: " + "; ".join(problems))


# flexible_layout, as for compact_kv: the writes take any strides, so inductor need not restride kv.
@torch.library.custom_op("specgraph::kv_write", mutates_args=("kv",), tags=(torch.Tag.flexible_layout,))
def kv_write(kv: torch.Tensor, layer: int, index: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """Write layer ``layer``'s K and V rows (contract above); CPU and CUDA alike."""
    _check(kv, layer, index, key, value)
    kv_write_reference(kv, layer, index, key, value)


@kv_write.register_fake
def _kv_write_fake(kv, layer, index, key, value):
    _check(kv, layer, index, key, value)
