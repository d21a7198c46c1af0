"""``specgraph::compact_kv``: after verification, move each row's accepted
tree nodes to the front of its window, in every K and V cache, in place.

Contract:
  kv:         [C, B, H_kv, S_max, D]  every cache tensor the step owns (the K
                                     and V of every layer, target and draft),
                                     stacked in one buffer; any dtype
  cache_len:  [B] int                committed length (unchanged here)
  path:       [B, P] int64           accepted nodes root first, -1 after
                                     (P = D+1, from verification)
  accept_len: [B]                    entries of path in use
For d in 1 .. accept_len-1: slot cache_len+d <- slot cache_len+path[d].
The accepted path of a depth-first-numbered tree is strictly increasing
with path[d] >= d, so copying in increasing d never overwrites a source
still to be read. Rows with accept_len 1, or whose path is already 0,1,2..,
move nothing. Nothing is written at or past S_max.

One launch moves every cache: program (c, b, kv head) walks d in order and
copies D-element rows as raw integer words (dtype-agnostic).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_WORD = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def _compact_kv_kernel(KV, CacheLen, Path, AcceptLen,
                       stride_c, stride_b, stride_h, stride_s, stride_d, stride_pb,
                       B, H_KV, S_MAX, P: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)  # (c, b, kv head)
    h = pid % H_KV
    b = (pid // H_KV) % B
    c = pid // (H_KV * B)
    base = KV + c.to(tl.int64) * stride_c + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h
    cache_len = tl.load(CacheLen + b).to(tl.int64)
    accept_len = tl.load(AcceptLen + b)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    for d in tl.static_range(1, P):  # in order: a destination is never a later source
        node = tl.load(Path + b * stride_pb + d).to(tl.int64)
        src = cache_len + node
        dst = cache_len + d
        move = (d < accept_len) & (node != d) & (node >= 0) & (src < S_MAX) & (dst < S_MAX)
        row = tl.load(base + src * stride_s + dims * stride_d, mask=dim_ok & move)
        tl.store(base + dst * stride_s + dims * stride_d, row, mask=dim_ok & move)


def compact_kv_triton(kv: torch.Tensor, cache_len: torch.Tensor, path: torch.Tensor, accept_len: torch.Tensor) -> None:
    c, b, h_kv, s_max, d = kv.shape
    words = kv.view(_WORD[kv.element_size()])
    _compact_kv_kernel[(c * b * h_kv,)](
        words, cache_len, path, accept_len, *words.stride(), path.stride(0),
        b, h_kv, s_max, P=path.shape[1], HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d),
    )


def compact_kv_reference(kv: torch.Tensor, cache_len: torch.Tensor, path: torch.Tensor, accept_len: torch.Tensor,
                         bitwise: bool = True) -> None:
    """Plain torch, in place: one gather/scatter per depth (one slot per row, so no index repeats).
    ``bitwise`` moves raw integer words (every dtype, bit-exact); False moves the values themselves
    (what ONNX export uses: it has no bit-cast)."""
    c, b, h_kv, s_max, d = kv.shape
    if bitwise:
        kv = kv.view(_WORD[kv.element_size()])
    base = cache_len.to(torch.int64)
    for depth in range(1, path.shape[1]):
        node = path[:, depth].to(torch.int64)
        src, dst = base + node, base + depth
        move = (depth < accept_len) & (node != depth) & (node >= 0) & (src < s_max) & (dst < s_max)
        src, dst = torch.where(move, src, 0), torch.where(move, dst, 0)  # idle rows rewrite slot 0 with itself
        index = lambda slot: slot.view(1, b, 1, 1, 1).expand(c, b, h_kv, 1, d)  # noqa: E731
        value = torch.where(move.view(1, b, 1, 1, 1), kv.gather(3, index(src)), kv.gather(3, index(dst)))
        kv.scatter_(3, index(dst), value)


def _check(kv, cache_len, path, accept_len) -> None:
    problems = []
    if kv.dim() != 5:
        raise ValueError(f"compact_kv: kv must be [C, B, H_kv, S_max, D] (all caches stacked); got {tuple(kv.shape)}")
    b = kv.shape[1]
    if cache_len.shape != (b,):
        problems.append(f"cache_len must be [B={b}]; got {tuple(cache_len.shape)}")
    if path.dim() != 2 or path.shape[0] != b or not 1 <= path.shape[1] <= 64:
        problems.append(f"path must be [B={b}, D+1] with D+1 <= 64; got {tuple(path.shape)}")
    if accept_len.shape != (b,):
        problems.append(f"accept_len must be [B={b}]; got {tuple(accept_len.shape)}")
    if kv.element_size() not in _WORD:
        problems.append(f"kv dtype {kv.dtype} has no integer word of its size")
    if problems:
        raise ValueError("compact_kv: " + "; ".join(problems))


# flexible_layout: the kernel and the reference take any strides, so inductor need not restride ``kv``.
# (With the default fixed-stride constraint, torch <= 2.12 inductor copies a mutated B=1 buffer onto
# itself and fails in Scheduler.compute_ancestors: pytorch/pytorch#189271.)
@torch.library.custom_op("specgraph::compact_kv", mutates_args=("kv",), tags=(torch.Tag.flexible_layout,))
def compact_kv(kv: torch.Tensor, cache_len: torch.Tensor, path: torch.Tensor, accept_len: torch.Tensor) -> None:
    """Move accepted nodes to the window front in every cache (contract above). CPU: the reference."""
    _check(kv, cache_len, path, accept_len)
    compact_kv_reference(kv, cache_len, path, accept_len)


@compact_kv.register_kernel("cuda")
def _compact_kv_cuda(kv, cache_len, path, accept_len):
    _check(kv, cache_len, path, accept_len)
    compact_kv_triton(kv, cache_len, path, accept_len)


@compact_kv.register_fake
def _compact_kv_fake(kv, cache_len, path, accept_len):
    _check(kv, cache_len, path, accept_len)
