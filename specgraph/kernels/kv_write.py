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
place. On CUDA one Triton launch writes K and V together (the two aten scatters were 2 x 3.5 us per
layer on the H200 at decode, 0.22 ms of a 4.57 ms 8B-shaped step); a slot outside 0 .. S_max-1 is
not written there (masked), never past the cache.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _kv_write_kernel(KCache, VCache, Index, Key, Value,
                     stride_cb, stride_ch, stride_cs, stride_cd,
                     stride_ib, stride_ih, stride_in,
                     stride_kb, stride_kh, stride_kn, stride_kd,
                     stride_vb, stride_vh, stride_vn, stride_vd,
                     H_KV, N, S_MAX, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)  # (b, kv head)
    h = (pid % H_KV).to(tl.int64)
    b = (pid // H_KV).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # node i
    dims = tl.arange(0, BLOCK_D)
    slot = tl.load(Index + b * stride_ib + h * stride_ih + rows.to(tl.int64) * stride_in, mask=rows < N,
                   other=-1).to(tl.int64)
    ok = (rows < N) & (slot >= 0) & (slot < S_MAX)
    mask = ok[:, None] & (dims < HEAD_DIM)[None, :]
    dst = b * stride_cb + h * stride_ch + slot[:, None] * stride_cs + dims[None, :] * stride_cd
    k = tl.load(Key + b * stride_kb + h * stride_kh + rows[:, None] * stride_kn + dims[None, :] * stride_kd, mask=mask)
    tl.store(KCache + dst, k, mask=mask)
    v = tl.load(Value + b * stride_vb + h * stride_vh + rows[:, None] * stride_vn + dims[None, :] * stride_vd,
                mask=mask)
    tl.store(VCache + dst, v, mask=mask)


def kv_write_triton(kv: torch.Tensor, layer: int, index: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor) -> None:
    """One launch, grid (B * H_kv, cdiv(N, BLOCK_N)); reads ``index[b, h, i, 0]``."""
    k_cache, v_cache = kv[2 * layer], kv[2 * layer + 1]  # [B, H_kv, S_max, D] views
    b, h_kv, s_max, d = k_cache.shape
    n = key.shape[2]
    block_n = min(triton.next_power_of_2(max(n, 1)), 64)
    _kv_write_kernel[(b * h_kv, triton.cdiv(n, block_n))](
        k_cache, v_cache, index, key, value, *k_cache.stride(), *index.stride()[:3], *key.stride(), *value.stride(),
        h_kv, n, s_max, HEAD_DIM=d, BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(d))


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
    """Write layer ``layer``'s K and V rows (contract above): plain torch (the CPU path)."""
    _check(kv, layer, index, key, value)
    kv_write_reference(kv, layer, index, key, value)


@kv_write.register_kernel("cuda")
def _kv_write_cuda(kv, layer, index, key, value):
    _check(kv, layer, index, key, value)
    kv_write_triton(kv, layer, index, key, value)


@kv_write.register_fake
def _kv_write_fake(kv, layer, index, key, value):
    _check(kv, layer, index, key, value)
