"""``specgraph::topk``: the k best entries of every row of a long last dimension
(a draft's vocabulary), best first, in one launch (two past 8,192 entries).

Contract:
  x:       [..., V] float32, bfloat16 or float16 (compared exactly as float32), V >= k
  k:       1 .. 64
  returns  values [..., k] (x's dtype, x's own values), indices [..., k] int64
Order: larger first; equal values (-0.0 = +0.0) by lower index (so the result
is one exact answer, unlike ``torch.topk``'s); NaN ranks with +inf (ties by index).
``specgraph::top_log_probs(x, k)``: the same indices, and as values ``log_softmax(x.float())`` at them
(float32): an EAGLE-2 draft step's ranking, where the row's max and sum of exponentials come from the
registers the ranking reads, one launch up to 8,192 entries (the log-softmax was a reduction kernel of its
own before the top-k).

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

from .arrivals import arrival_counters

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
def _load(pointers, mask, other, CG: tl.constexpr):
    if CG:  # written by other programs of this launch: read through L2
        return tl.load(pointers, mask=mask, other=other, cache_modifier=".cg")
    return tl.load(pointers, mask=mask, other=other)


@triton.jit
def _pass(Src, IdxIn, Values, Indices, n, row, chunk, stride_src, stride_idx, out, active,
          K: tl.constexpr, K_POW2: tl.constexpr, BLOCK: tl.constexpr, HAS_IDX: tl.constexpr, CG: tl.constexpr,
          LOG_SOFTMAX: tl.constexpr = False):
    """Entries ``chunk * BLOCK ..`` of ``row`` of Src (n a row): their K best into Values/Indices at ``out``,
    where ``active``. HAS_IDX: a pass over candidates that carry their row index in IdxIn (-1: none). CG: read
    through L2 (.cg: written by other programs of this launch). LOG_SOFTMAX (the whole row in this chunk): the
    values stored are the row's log-softmax at the K best, ``(x - max) - log(sum(exp(x - max)))``."""
    lane = tl.arange(0, BLOCK)
    offs = chunk * BLOCK + lane
    alive = (offs < n) & active
    x = _load(Src + row * stride_src + offs, alive, 0.0, CG).to(tl.float32)
    if LOG_SOFTMAX:  # the row's max and sum of exponentials, from the registers the ranking reads
        row_max = tl.max(tl.where(alive, x, float("-inf")), 0)
        log_sum = tl.log(tl.sum(tl.where(alive, tl.exp(x - row_max), 0.0), 0))
    if HAS_IDX:  # candidates carry their index in the row (-1: none)
        alive = alive & (_load(IdxIn + row * stride_idx + offs, alive, -1, CG) >= 0)
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
    value = _load(Src + row * stride_src + entry, found, float("-inf"), CG)
    if LOG_SOFTMAX:
        value = (value.to(tl.float32) - row_max) - log_sum
    if HAS_IDX:
        index = _load(IdxIn + row * stride_idx + entry, found, -1, CG)
    else:
        index = tl.where(found, entry.to(tl.int64), -1)
    slots = tl.arange(0, K_POW2)
    tl.store(Values + out + slots, value, mask=(slots < K) & active)  # the value itself (NaN stays)
    tl.store(Indices + out + slots, index, mask=(slots < K) & active)


@triton.jit
def _topk_kernel(X, IdxIn, Values, Indices, PartV, PartI, Arrived, V, stride_xr, stride_ir, stride_or,
                 K: tl.constexpr, K_POW2: tl.constexpr, BLOCK: tl.constexpr, HAS_IDX: tl.constexpr,
                 MERGE: tl.constexpr = False, MERGE_BLOCK: tl.constexpr = 1, LOG_SOFTMAX: tl.constexpr = False):
    """Program (row, chunk): the chunk's K best; without MERGE into Values/Indices [R, chunks * K] (a second
    launch over them, HAS_IDX, or the answer with one chunk), with MERGE into PartV/PartI, then the row's last
    program to arrive takes the K best of the row's chunks * K candidates (one launch). LOG_SOFTMAX (one chunk
    a row): the log-softmax's values at them."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    chunks = tl.num_programs(1)
    if MERGE:
        _pass(X, IdxIn, PartV, PartI, V, row, chunk, stride_xr, stride_ir, (row * chunks + chunk) * K, True,
              K, K_POW2, BLOCK, False, False)
        tl.debug_barrier()  # every thread's candidates stored before the release below (as tree attention's merge)
        arrived = tl.atomic_add(Arrived + row, 1, sem="acq_rel", scope="gpu")
        tl.debug_barrier()
        last = arrived == chunks - 1
        tl.store(Arrived + row, 0, mask=last)
        _pass(PartV, PartI, Values, Indices, chunks * K, row, 0, chunks * K, chunks * K, row * stride_or, last,
              K, K_POW2, MERGE_BLOCK, True, True)  # chunk-major: equal values stay in index order
    else:
        _pass(X, IdxIn, Values, Indices, V, row, chunk, stride_xr, stride_ir, (row * chunks + chunk) * stride_or,
              True, K, K_POW2, BLOCK, HAS_IDX, False, LOG_SOFTMAX)


def topk_triton(x: torch.Tensor, k: int, chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``chunk`` (a power of two; benchmarks): every row in chunks of that many entries, one program each, the
    row's last to finish picking from their candidates (one launch). None: rows up to ONE_PASS in one program,
    longer ones in CHUNK-entry chunks and a second launch."""
    v = x.shape[-1]
    rows = x.reshape(-1, v).contiguous()  # [R, V]
    r = rows.shape[0]
    values = torch.empty(r, k, dtype=x.dtype, device=x.device)
    indices = torch.empty(r, k, dtype=torch.int64, device=x.device)
    k_pow2 = triton.next_power_of_2(k)
    arrived = arrival_counters("topk", x.device, r) if chunk is not None else None
    if arrived is not None:
        chunks = triton.cdiv(v, chunk)
        part_v = torch.empty(r, chunks * k, dtype=x.dtype, device=x.device)
        part_i = torch.empty(r, chunks * k, dtype=torch.int64, device=x.device)
        _topk_kernel[(r, chunks)](rows, rows, values, indices, part_v, part_i, arrived, v, rows.stride(0), 0, k,
                                  K=k, K_POW2=k_pow2, BLOCK=chunk, HAS_IDX=False, MERGE=True,
                                  MERGE_BLOCK=triton.next_power_of_2(chunks * k), num_warps=8 if chunk >= 4096 else 4)
    elif v <= ONE_PASS:
        block = triton.next_power_of_2(v)
        _topk_kernel[(r, 1)](rows, rows, values, indices, rows, rows, rows, v, rows.stride(0), 0, k, K=k,
                             K_POW2=k_pow2, BLOCK=block, HAS_IDX=False, num_warps=8 if block >= 4096 else 4)
    else:
        chunks = triton.cdiv(v, CHUNK)
        part_v = torch.empty(r, chunks * k, dtype=x.dtype, device=x.device)
        part_i = torch.empty(r, chunks * k, dtype=torch.int64, device=x.device)
        _topk_kernel[(r, chunks)](rows, rows, part_v, part_i, rows, rows, rows, v, rows.stride(0), 0, k, K=k,
                                  K_POW2=k_pow2, BLOCK=CHUNK, HAS_IDX=False, num_warps=8)
        block = triton.next_power_of_2(chunks * k)
        _topk_kernel[(r, 1)](part_v, part_i, values, indices, rows, rows, rows, chunks * k, part_v.stride(0),
                             part_i.stride(0), k, K=k, K_POW2=k_pow2, BLOCK=block, HAS_IDX=True,
                             num_warps=8 if block >= 4096 else 4)
    return values.view(*x.shape[:-1], k), indices.view(*x.shape[:-1], k)


def top_log_probs_triton(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of up to ONE_PASS entries: the k best and the row's log-softmax there, one program a row, one
    launch (where a log-softmax over the row, then a top-k, were two)."""
    v = x.shape[-1]
    if v > ONE_PASS:
        raise ValueError(f"top_log_probs_triton: rows of up to {ONE_PASS} entries, got {v}")
    rows = x.reshape(-1, v).contiguous()  # [R, V]
    r = rows.shape[0]
    values = torch.empty(r, k, dtype=torch.float32, device=x.device)
    indices = torch.empty(r, k, dtype=torch.int64, device=x.device)
    block = triton.next_power_of_2(v)
    _topk_kernel[(r, 1)](rows, rows, values, indices, rows, rows, rows, v, rows.stride(0), 0, k, K=k,
                         K_POW2=triton.next_power_of_2(k), BLOCK=block, HAS_IDX=False, LOG_SOFTMAX=True,
                         num_warps=8 if block >= 4096 else 4)
    return values.view(*x.shape[:-1], k), indices.view(*x.shape[:-1], k)


def top_log_probs_reference(x: torch.Tensor, k: int, indices: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch: ``topk_reference``'s k best of x (or ``indices``), and ``log_softmax(x.float())`` there."""
    if indices is None:
        indices = topk_reference(x, k)[1]
    return torch.log_softmax(x.float(), -1).gather(-1, indices), indices


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


@torch.library.custom_op("specgraph::top_log_probs", mutates_args=())
def top_log_probs(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An EAGLE-2 draft step's ranking: the k best entries of each row of logits (``topk``'s order and ties)
    and ``log_softmax(x.float())`` at them, float32 (the log-softmax is monotone: the same k). On CUDA rows of up
    to ONE_PASS entries take one launch. Other devices: the reference."""
    _check(x, k)
    return top_log_probs_reference(x, k)


@top_log_probs.register_kernel("cpu")
def _top_log_probs_cpu(x, k):
    _check(x, k)
    return top_log_probs_reference(x, k, topk_packed(x, k)[1])


@top_log_probs.register_kernel("cuda")
def _top_log_probs_cuda(x, k):
    _check(x, k)
    if x.shape[-1] <= ONE_PASS:
        return top_log_probs_triton(x, k)
    return top_log_probs_reference(x, k, topk_triton(x, k)[1])


@top_log_probs.register_fake
def _top_log_probs_fake(x, k):
    _check(x, k)
    shape = (*x.shape[:-1], k)
    return x.new_empty(shape, dtype=torch.float32), x.new_empty(shape, dtype=torch.int64)
