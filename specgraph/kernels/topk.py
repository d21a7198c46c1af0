"""``specgraph::topk``: the k best entries of every row of a long last dimension
(a draft's vocabulary), best first, in one launch (two past 8,192 entries).

Contract:
  x:       [..., V] float32, bfloat16 or float16 (compared exactly as float32), V >= k
  k:       1 .. 64
  returns  values [..., k] (x's dtype, x's own values), indices [..., k] int64
Order: larger first; equal values (-0.0 = +0.0) by lower index (so the result
is one exact answer, unlike ``torch.topk``'s); NaN ranks with +inf (ties by index).

Why: ``torch.topk`` over a few long rows runs one block per row, and the
chunked form in ``selection.top_k`` costs two launches of 9 + 4 µs at a draft
level (a profile of a SmolLM2 EAGLE-2 step on the H200, 2026-12-01: 0.20 ms
of its 0.82 ms draft). Here program (row, chunk) keeps its chunk in registers and
takes its k best by k rounds of one int64 max over (value, lane) packed, the rounds touching registers
only (the k values are gathered and stored once after them; a load and two stores a round before, untimed
since on the GPU: the step's profile in docs/benchmarks.md has the earlier form); rows longer
than one chunk write each chunk's k best and the same kernel picks the k
best of those (chunk-major, so equal values stay in index order).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_K = 64
ONE_PASS = 8192  # rows up to this many entries: one program a row, one launch
CHUNK = 4096  # longer rows: chunks of this many, then a second launch over chunks * k


@triton.jit
def _k_best(packed, lane, dead, BLOCK: tl.constexpr, K: tl.constexpr, K_POW2: tl.constexpr):
    """The lanes [K_POW2] of the K largest ``packed`` entries, best first, by K rounds of one max; -1 where
    fewer than K are alive (not ``dead``) and past K. Only registers in the loop: the caller gathers after."""
    slots = tl.arange(0, K_POW2)
    best = tl.full([K_POW2], -1, tl.int32)
    for i in tl.static_range(K):
        top = tl.max(packed, 0)
        pos = BLOCK - 1 - (top & (BLOCK - 1)).to(tl.int32)
        packed = tl.where(lane == pos, dead, packed)
        best = tl.where(slots == i, tl.where(top != dead, pos, -1), best)
    return best


@triton.jit
def _topk_kernel(X, IdxIn, Values, Indices, V, stride_xr, stride_ir, stride_or,
                 K: tl.constexpr, K_POW2: tl.constexpr, BLOCK: tl.constexpr, HAS_IDX: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    lane = tl.arange(0, BLOCK)
    offs = chunk * BLOCK + lane
    alive = offs < V
    x = tl.load(X + row * stride_xr + offs, mask=alive, other=0.0).to(tl.float32)
    if HAS_IDX:  # the second pass: candidates carry their index in the row (-1: none)
        alive = alive & (tl.load(IdxIn + row * stride_ir + offs, mask=alive, other=-1) >= 0)
    key = tl.where(x != x, float("inf"), tl.where(x == 0.0, 0.0, x))  # NaN ranks with +inf; -0.0 ties +0.0
    # one int64 a lane: the float's bits made order-preserving as a signed int, over the lane reversed,
    # so a single max finds the largest value and, among equal ones, the lowest lane
    bits = key.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    packed = (ordered.to(tl.int64) << 32) | (BLOCK - 1 - lane).to(tl.int64)
    dead = -9223372036854775807 - 1  # -2**63: below every lane (-inf orders as -2**31 + 2**23 - 1)
    packed = tl.where(alive, packed, dead)
    best = _k_best(packed, lane, dead, BLOCK, K, K_POW2)  # [K_POW2] lanes, -1: none
    found = best >= 0
    entry = chunk * BLOCK + tl.where(found, best, 0)
    value = tl.load(X + row * stride_xr + entry, mask=found, other=float("-inf"))  # itself (NaN stays)
    if HAS_IDX:
        index = tl.load(IdxIn + row * stride_ir + entry, mask=found, other=-1)
    else:
        index = tl.where(found, entry.to(tl.int64), -1)
    slots = tl.arange(0, K_POW2)
    out = (row * tl.num_programs(1) + chunk) * stride_or
    tl.store(Values + out + slots, value, mask=slots < K)
    tl.store(Indices + out + slots, index, mask=slots < K)


def topk_triton(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    v = x.shape[-1]
    rows = x.reshape(-1, v).contiguous()  # [R, V]
    r = rows.shape[0]
    values = torch.empty(r, k, dtype=x.dtype, device=x.device)
    indices = torch.empty(r, k, dtype=torch.int64, device=x.device)
    if v <= ONE_PASS:
        block = triton.next_power_of_2(v)
        _topk_kernel[(r, 1)](rows, rows, values, indices, v, rows.stride(0), 0, k, K=k,
                             K_POW2=triton.next_power_of_2(k), BLOCK=block, HAS_IDX=False,
                             num_warps=8 if block >= 4096 else 4)
    else:
        chunks = triton.cdiv(v, CHUNK)
        part_v = torch.empty(r, chunks * k, dtype=x.dtype, device=x.device)
        part_i = torch.empty(r, chunks * k, dtype=torch.int64, device=x.device)
        _topk_kernel[(r, chunks)](rows, rows, part_v, part_i, v, rows.stride(0), 0, k, K=k,
                                  K_POW2=triton.next_power_of_2(k), BLOCK=CHUNK, HAS_IDX=False, num_warps=8)
        block = triton.next_power_of_2(chunks * k)
        _topk_kernel[(r, 1)](part_v, part_i, values, indices, chunks * k, part_v.stride(0), part_i.stride(0), k,
                             K=k, K_POW2=triton.next_power_of_2(k), BLOCK=block, HAS_IDX=True,
                             num_warps=8 if block >= 4096 else 4)
    return values.view(*x.shape[:-1], k), indices.view(*x.shape[:-1], k)


def topk_reference(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch: a stable descending sort of the key (NaN as +inf), its first k."""
    key = torch.where(x.isnan(), float("inf"), x.float())
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices[..., :k].contiguous()
    return x.gather(-1, order), order


def topk_packed(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's packing in plain torch (the CPU implementation): one ``torch.topk`` over int64
    (order-preserving float bits << 32 | the index reversed), exact and unique, where a sort of the
    whole row would cost several times more. x: [..., V] -> values [..., k], indices [..., k] int64."""
    v = x.shape[-1]
    inf = float("inf")
    key = torch.nan_to_num(x.float() + 0.0, nan=inf, posinf=inf, neginf=-inf)  # NaN as +inf; -0 + 0 = +0
    bits = key.view(torch.int32)
    ordered = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(torch.int64)  # signed order = float order
    packed = (ordered << 32) | torch.arange(v - 1, -1, -1, device=x.device)  # equal values: lower index wins
    indices = v - 1 - (packed.topk(k, -1).values & 0xFFFFFFFF)
    return x.gather(-1, indices), indices


def _check(x: torch.Tensor, k: int) -> None:
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or x.dim() < 1:
        raise ValueError(f"topk: x must be a float32, bfloat16 or float16 tensor [..., V]; got {x.dtype} "
                         f"{tuple(x.shape)} (cast it: the kernel compares in float32)")
    if not 1 <= k <= min(MAX_K, x.shape[-1]):
        raise ValueError(f"topk: k={k} must be in 1 .. min({MAX_K}, V={x.shape[-1]})")


@torch.library.custom_op("specgraph::topk", mutates_args=())
def topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best of each row, best first, ties to the lower index (contract above). Other devices: the
    reference."""
    _check(x, k)
    return topk_reference(x, k)


@topk.register_kernel("cpu")
def _topk_cpu(x, k):
    _check(x, k)
    return topk_packed(x, k)


@topk.register_kernel("cuda")
def _topk_cuda(x, k):
    _check(x, k)
    return topk_triton(x, k)


@topk.register_fake
def _topk_fake(x, k):
    _check(x, k)
    shape = (*x.shape[:-1], k)
    return x.new_empty(shape), x.new_empty(shape, dtype=torch.int64)
