"""``specgraph::fused_linear``: a few-row matrix product with HF's RMSNorm or the gated MLP's
SiLU·mul as its prologue and the residual add as its epilogue, in one launch.

Contract:
  x:        [..., K]  M rows in all (batch x step rows)
  weight:   [N, K]    ``nn.Linear`` layout, in x's dtype
  gamma:    [K] or None   with it, x is first normalized as HF's LlamaRMSNorm does:
                      ``gamma * (x32 * rsqrt(mean(x32 ** 2) + eps)).to(x.dtype)``, x32 = x in float32
                      (one row: the kernel computes ``rsqrt(...) * ((gamma * x32) @ weight.T)``, the
                      normalized row not rounded to x's dtype; the reference is HF's formula op for op)
  eps:      float
  gated:    with it (and no gamma), x is [..., 2K], gate then up, and the product reads
                      ``silu(gate) * up`` (each rounded to x's dtype, as HF's MLP rounds them)
  residual: [..., N] or None   with it, the output is ``residual + product`` (the product rounded to
                      x's dtype first, as ``residual + o_proj(...)`` rounds it)
  silu_mul: with it, weight is [2N, K] (gate rows, then up rows) and the product's epilogue writes
                      ``silu(gate) * up`` [..., N] (each half rounded to x's dtype, as HF's MLP rounds them)
  row_squares: [..., P] float32 or None   with it (and no gamma), x is ``gamma * h`` as a producer handed
                      it over, and each row of the product is scaled by ``rsqrt(sum(row_squares) / K + eps)``,
                      h's rstd: HF's norm-then-product without a prologue (the rounding of ``gamma * h``
                      replaces HF's rounding of the normalized row)
  bias:     [N] or None   with it, the product is ``F.linear(..., weight, bias)``: the bias added in float32 to
                      the (row-scaled) product before it is rounded, as cuBLAS's addmm does (Qwen2's q/k/v);
                      not with silu_mul or row_squares
  out:      [..., N]  ``[residual +] epilogue(F.linear([rms_norm](x) or [silu(gate) * up], weight[, bias]))``
``specgraph::fused_linear_norm_out(x, weight, residual, next_gamma)`` is the producer of such an x: the
product with the residual add, plus ``next_gamma * out`` and out's float32 sums of squares per 16 columns
([..., ceil(N / 16)]), written by the same programs (``norm_out_reference``). The pass fold_norms_rows
uses the pair and ``silu_mul`` for steps of 2..16 rows, where a prologue in front of ``tl.dot`` lost to
cuBLAS and the bare 16-row tiles matched it (H200, 2026-12-01, docs/benchmarks.md; the 8B verify step of 8
nodes went from 1.136x to 1.046x its plain step).

Why: at batch 1 a small model's step is bound by launches, not bytes (SmolLM2-135M: ~250 launches a
decode step at ~3 us each, 14x its bytes floor, docs/benchmarks.md). A decoder layer launches a
norm kernel (the residual add fused into it) before q/k/v and again before gate/up; with the norm in
the q/k/v and gate/up products' prologue and the residual add in the o and down products' epilogue,
those two launches go, and with the SiLU·mul in the down product's prologue a third. Every program
reads the M rows of x whole (K is a few thousand at most: kilobytes, from L2 after the first
program) and streams its BLOCK_N rows of ``weight``. With the norm, one row sums its squares in the
same K loop and scales the sums by the rstd after it (a pass over x before the first weight load cost
3-10 us at 8B shapes); more rows make that pass first (the in-loop sums ran slower in the tl.dot
tiles: 8B q/k/v at 8 rows 30.6 against 23.4 us). One row runs on the CUDA cores (BLOCK_M = 1: per-lane
FMAs over [BLOCK_N, BLOCK_K], one reduction after the K loop), more rows through ``tl.dot`` with the
rows padded to 16, or, for a few rows of a small weight, the one-row path with a program per row (grid
axis 1; each program re-reads its weight rows from L2: SmolLM2's o and down at 5 rows 3.8 and 4.9 us
against 4.3 and 5.8 in 16-row tiles, a 5-node verify step 795 -> 751 us; docs/benchmarks.md). Past 16 rows
one tile takes all the rows (up to MAX_ROWS), so the weight streams once; the op sends a call there only
where it paid (``max_rows``: a small weight under PDL, where the cuBLAS path's launches left the GPU idle
between kernels: SmolLM2's 24-node step 1.336 -> 1.212 ms); other calls take the reference (the norm, a
cuBLAS product, the add).

A tile's optional 6th entry splits K over that many programs a tile (tl.dot tiles only): each stores its
float32 partial, and the tile's last program to arrive (an arrival counter, as tree attention's merge) sums them
in split order, deterministically, and runs the epilogue. tile_config splits K in three where 17-32 rows of a
small weight without silu_mul make at most FEW_TILES tiles (fewer programs than SMs): SmolLM2's 32-row q/k/v,
o and down made the default's whole step 1.180 -> 1.156 ms and its tokens/s 1.0-1.5% higher; splitting every
17-64-row tile, gate/up's included, had made it 0.19 ms slower (H100, 2026-12-07, docs/benchmarks.md). A
benchmark passes other tiles per row count through TILE_OVERRIDE.

Measured (``benchmarks/fused_linear.py``, H200, 2026-12-01, docs/benchmarks.md), one row, each
product with its prologue and epilogue in ``tile_config``'s tile against cuBLAS with the product alone:
SmolLM2 2.6-3.9 us against 3.8-5.4; Llama-3.1-8B q/k/v + norm 15.6 against 16.2, o + add 11.5 against
13.5, gate/up + norm 56.9 against 57.3, down + SiLU·mul + add 30.6 against 32.2. Layers without attention
(each product in its best tile): SmolLM2 21.9 -> 12.2 us, 8B 126.8 -> 113.0. At 8 rows only o wins, by
1.2 us (12.3 against 13.5); the rest lose, the norm and gated products badly (q/k/v 23.4 against 15.5:
the prologue in front of ``tl.dot``). The pass fold_norms uses it only where it won.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import config
from .arrivals import arrival_counters
from .pdl import pdl_kwargs, pdl_launch
from .tree_attention import _dot

MAX_ROWS = 64  # the kernel's limit: one tl.dot tile of up to 64 rows of x per program
TILE_ROWS = 16  # where it pays without PDL, or for a large weight (max_rows)
SQUARE_COLS = 16  # norm_out: one partial sum of squares per row and 16 output columns
SMALL_WEIGHT_BYTES = 8 << 20  # a small model's weight (SmolLM2's 0.7-3.5 MB; 8B's 34-235 MB): its own tiles
ROW_GRID_PROGRAMS = 768  # a few rows of a small weight: a program per row and 8 weight rows up to this many
PREFETCH_LINES = 16  # pdl "prefetch": the first 16 128-byte lines (2 KB) of each weight row a program streams
FEW_PROGRAMS = 256  # one row of a large weight in fewer 8-row programs (two waves of 132 SMs) takes small tiles
FEW_TILES = 64  # 17-32 rows of a small weight in at most this many tiles: K split over SPLIT_PROGRAMS programs
SPLIT_PROGRAMS = 3


@triton.jit
def _prefetch_l2(W, weight_rows, k_start, K, stride_wn, LINES: tl.constexpr, LINE: tl.constexpr):
    """Ask L2 for the first LINES 128-byte lines (LINE elements each) from column k_start of each of
    ``weight_rows``: no registers, no wait; addresses clamped into the weight."""
    cols = tl.minimum(k_start + tl.arange(0, LINES) * LINE, K - 1)
    ptrs = W + weight_rows[:, None].to(tl.int64) * stride_wn + cols[None, :]
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _fused_linear_kernel(X, W, Gamma, Bias, Residual, Out, SquaresIn, NextGamma, Scaled, SquaresOut, Partials, Arrived,
                         M, N, K, P, eps,
                         stride_xm, stride_wn, stride_rm, stride_om, stride_sim, stride_som,
                         NORM: tl.constexpr, GATED: tl.constexpr, BIAS: tl.constexpr, RESIDUAL: tl.constexpr,
                         SILU_MUL: tl.constexpr,
                         ROW_SCALE: tl.constexpr, NORM_OUT: tl.constexpr, SQUARE_COLS: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
                         SPLIT_K: tl.constexpr = 1,
                         PDL: tl.constexpr = False, PREFETCH_LINES: tl.constexpr = 0, LINE: tl.constexpr = 64):
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # grid axis 1: the row blocks
    row_ok = rows < M
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    x_rows = X + rows[:, None].to(tl.int64) * stride_xm
    w_rows = W + cols[:, None].to(tl.int64) * stride_wn
    w_up_rows = W + (N + cols)[:, None].to(tl.int64) * stride_wn  # SILU_MUL: the up half's rows
    k_span = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K  # grid axis 2: this program's share of K
    k_start = tl.program_id(2) * k_span
    if PDL:  # launched before the kernel ahead ends: weights (never its output) may stream, the rest waits
        if PREFETCH_LINES > 0:
            _prefetch_l2(W, tl.where(col_ok, cols, 0), k_start, K, stride_wn, PREFETCH_LINES, LINE)
            if SILU_MUL:
                _prefetch_l2(W, tl.where(col_ok, cols, 0) + N, k_start, K, stride_wn, PREFETCH_LINES, LINE)
        tl.extra.cuda.gdc_wait()

    rstd = tl.zeros([BLOCK_M], tl.float32)
    if NORM and BLOCK_M != 1:  # more rows: each row's mean square first, in float32 as HF (for the tl.dot
        squares = tl.zeros([BLOCK_M], tl.float32)  # tiles this beat summing them in the product's loop)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & (ks < K)[None, :], other=0.0).to(tl.float32)
            squares += tl.sum(x * x, 1)
        rstd = 1.0 / tl.sqrt(squares / K + eps)  # [M]

    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)  # the rows (normalized, or times gamma) x BLOCK_N weight rows
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)  # SILU_MUL: the up half's product
    lanes = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)  # one row: per-lane partial sums, reduced once after the loop
    lanes_up = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    row_squares = tl.zeros([1, BLOCK_K], tl.float32)  # one row with NORM: per-lane sums of x ** 2, same pass
    for k0 in range(k_start, tl.minimum(k_start + k_span, K), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [M, BK]
        if NORM:
            gamma = tl.load(Gamma + ks, mask=k_ok, other=0.0)
            if BLOCK_M == 1:  # rms_norm(x) @ w.T == rstd * ((gamma * x) @ w.T): the rstd waits for the loop's end
                x32 = x.to(tl.float32)
                row_squares += x32 * x32
                x = gamma[None, :].to(tl.float32) * x32
            else:  # rounded to x's dtype, then times gamma rounded again, as HF
                x = (x.to(tl.float32) * rstd[:, None]).to(X.dtype.element_ty)
                x = (gamma[None, :].to(tl.float32) * x.to(tl.float32)).to(X.dtype.element_ty)
        if GATED:  # x holds the gate; the up half is K further on: silu(gate) rounded, times up rounded
            up = tl.load(x_rows + K + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            gate = x.to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(X.dtype.element_ty)
            x = (act.to(tl.float32) * up.to(tl.float32)).to(X.dtype.element_ty)
        w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)  # [BN, BK]
        if SILU_MUL:
            w_up = tl.load(w_up_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if BLOCK_M == 1:  # one row: CUDA-core FMAs, no 16-row padding, no reduction inside the loop
            lanes += x.to(tl.float32) * w.to(tl.float32)
            if SILU_MUL:
                lanes_up += x.to(tl.float32) * w_up.to(tl.float32)
        else:
            acc += _dot(x, tl.trans(w), UPCAST)
            if SILU_MUL:
                acc_up += _dot(x, tl.trans(w_up), UPCAST)
    if PDL:  # the weights are read: the next kernel may launch (it waits for this one's end to read)
        tl.extra.cuda.gdc_launch_dependents()
    if BLOCK_M == 1:
        acc += tl.sum(lanes, 1)[None, :]
        acc_up += tl.sum(lanes_up, 1)[None, :]
    last = row_ok  # the programs that write the output: all of them, or each tile's last split to arrive
    if SPLIT_K > 1:  # split over K: partials out, then the tile's last program sums them in split order
        acc, acc_up, last = _sum_splits(acc, acc_up, Partials, Arrived, rows, cols, row_ok, col_ok, M, N,
                                        SILU_MUL, SPLIT_K)
    if NORM and BLOCK_M == 1:  # the row's mean square, in float32 as HF
        rstd_row = 1.0 / tl.sqrt(tl.sum(row_squares, 1)[:, None] / K + eps)
        acc *= rstd_row
        acc_up *= rstd_row
    if ROW_SCALE:  # x is gamma * h; the rms of h from the P partial sums of h ** 2 its producer wrote
        squares = tl.zeros([BLOCK_M], tl.float32)
        for p0 in range(0, P, 64):
            parts = p0 + tl.arange(0, 64)
            squares += tl.sum(tl.load(SquaresIn + rows[:, None].to(tl.int64) * stride_sim + parts[None, :],
                                      mask=row_ok[:, None] & (parts < P)[None, :], other=0.0), 1)
        rstd_rows = (1.0 / tl.sqrt(squares / K + eps))[:, None]
        acc *= rstd_rows
        acc_up *= rstd_rows

    if BIAS:  # after the rstd, in float32, rounded once with the product (cuBLAS's addmm epilogue)
        acc += tl.load(Bias + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = acc.to(Out.dtype.element_ty)
    if SILU_MUL:  # silu(gate) * up, each rounded to x's dtype as HF's MLP rounds them
        gate = out.to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(Out.dtype.element_ty)
        out = (act.to(tl.float32) * acc_up.to(Out.dtype.element_ty).to(tl.float32)).to(Out.dtype.element_ty)
    ok = last[:, None] & col_ok[None, :]
    if RESIDUAL:  # residual + the product as x's dtype rounded it
        residual = tl.load(Residual + rows[:, None].to(tl.int64) * stride_rm + cols[None, :], mask=ok, other=0.0)
        out = (residual.to(tl.float32) + out.to(tl.float32)).to(Out.dtype.element_ty)
    tl.store(Out + rows[:, None].to(tl.int64) * stride_om + cols[None, :], out, mask=ok)
    if NORM_OUT:  # for the next norm's readers: gamma * out, and this program's share of each row's sum of squares
        out32 = tl.where(ok, out.to(tl.float32), 0.0)
        next_gamma = tl.load(NextGamma + cols, mask=col_ok, other=0.0).to(tl.float32)
        tl.store(Scaled + rows[:, None].to(tl.int64) * stride_om + cols[None, :],
                 (next_gamma[None, :] * out32).to(Out.dtype.element_ty), mask=ok)
        chunks = tl.program_id(0) * (BLOCK_N // SQUARE_COLS) + tl.arange(0, BLOCK_N // SQUARE_COLS)
        sums = tl.sum(tl.reshape(out32 * out32, [BLOCK_M, BLOCK_N // SQUARE_COLS, SQUARE_COLS]), 2)
        tl.store(SquaresOut + rows[:, None].to(tl.int64) * stride_som + chunks[None, :], sums,
                 mask=last[:, None] & (chunks * SQUARE_COLS < N)[None, :])


@triton.jit
def _sum_splits(acc, acc_up, Partials, Arrived, rows, cols, row_ok, col_ok, M, N, SILU_MUL: tl.constexpr,
                SPLIT_K: tl.constexpr):
    """Store this program's partial product(s) [M, BN] in float32, count it in, and return the sum of the
    tile's SPLIT_K partials in split order (deterministic) with the row mask of the program that writes the
    output: the tile's last to arrive, which also resets the tile's counter for the next launch."""
    split = tl.program_id(2)
    ok = row_ok[:, None] & col_ok[None, :]
    cell = rows[:, None].to(tl.int64) * N + cols[None, :]  # Partials: [SPLIT_K, 2, M, N] float32
    tl.store(Partials + (split * 2) * M * N + cell, acc, mask=ok)
    if SILU_MUL:
        tl.store(Partials + (split * 2 + 1) * M * N + cell, acc_up, mask=ok)
    tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    tl.debug_barrier()  # every thread's partial stored before the release below (as tree attention's merge)
    arrived = tl.atomic_add(Arrived + tile, 1, sem="acq_rel", scope="gpu")
    tl.debug_barrier()
    last = arrived == SPLIT_K - 1
    tl.store(Arrived + tile, 0, mask=last)
    acc = tl.zeros_like(acc)
    acc_up = tl.zeros_like(acc_up)
    for s in tl.static_range(SPLIT_K):  # .cg: written by other programs of this launch (read past L1)
        acc += tl.load(Partials + (s * 2) * M * N + cell, mask=ok & last, other=0.0, cache_modifier=".cg")
        if SILU_MUL:
            acc_up += tl.load(Partials + (s * 2 + 1) * M * N + cell, mask=ok & last, other=0.0, cache_modifier=".cg")
    return acc, acc_up, row_ok & last


TILE_OVERRIDE: dict[tuple[int, ...], tuple[int, ...]] | None = None  # benchmarks: (n, k) or (m, n, k) -> tile


def tile_config(m: int, n: int, k: int, itemsize: int, norm: bool = False,
                silu_mul: bool = False) -> tuple[int, ...]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for M rows of an [N, K] weight (silu_mul: N output
    columns of a [2N, K] weight), from the sweeps of ``benchmarks/fused_linear.py`` (H200; figures in
    docs/benchmarks.md). One row: on the CUDA cores in 8-row slices of the weight; small weights, and those
    whose N / 8 programs stay under two waves, the whole of K per step (up to 2048) in 8 warps; larger ones
    1024 columns a step in 4 warps with the norm (512 over 16 rows where that pads K less: Qwen2.5-1.5B's
    gate/up), 512 in 8 without. More rows: 16-row tl.dot tiles (64 x 128 in 3 stages for a large gate/up
    with silu_mul), except a few rows of a small weight without silu_mul: a program per row while the grid
    stays within ROW_GRID_PROGRAMS (about one wave; past it the re-reads from L2 lose). 17-32 rows of a small
    weight in at most FEW_TILES tiles: K split over SPLIT_PROGRAMS programs a tile (H100: SmolLM2's verify)."""
    if TILE_OVERRIDE:
        for key in ((m, n, k), (n, k)):
            if key in TILE_OVERRIDE:
                return TILE_OVERRIDE[key]
    small = n * k * itemsize <= SMALL_WEIGHT_BYTES
    if m == 1 and (small or triton.cdiv(n, 8) < FEW_PROGRAMS):  # few programs: each streams the whole of K fast
        return 1, 8, min(2048, max(1024, triton.next_power_of_2(k))), 8, 3
    if m == 1 and norm and triton.cdiv(k, 512) < 2 * triton.cdiv(k, 1024):  # 512-column steps pad K less
        return 1, 16, 512, 4, 3
    if m == 1:
        return (1, 8, 1024, 4, 3) if norm else (1, 8, 512, 8, 3)
    if silu_mul and not small:
        return 16, 64, min(128, triton.next_power_of_2(k)), 4, 3
    if small and not silu_mul and m * triton.cdiv(n, 8) <= ROW_GRID_PROGRAMS:
        return 1, 8, 512, 4, 3
    if m > 16:  # all the rows in one tile, so the weight streams once; 128 columns a step keep x's stages small
        block_m, block_n = min(MAX_ROWS, triton.next_power_of_2(m)), 16 if small else 32
        if small and not silu_mul and m <= 32 and triton.cdiv(n, block_n) <= FEW_TILES:  # few tiles fill few SMs
            return block_m, block_n, 128 if k >= SPLIT_PROGRAMS * 512 else 64, 4, 3, SPLIT_PROGRAMS
        return block_m, block_n, min(128, triton.next_power_of_2(k)), 4, 3
    return 16, 16 if small else 32, min(256, triton.next_power_of_2(k)), 4, 4


def max_rows(weight: torch.Tensor) -> int:
    """The most rows of x the op sends to the kernel for this weight (more take the reference), and the
    passes fold for: MAX_ROWS for a small weight launched with PDL (H100, 2026-12-06: SmolLM2's layer at
    24 / 64 rows 18.2 / 19.3 us folded against 19.7 / 22.6 for norm + cuBLAS + SiLU·mul, which launch without
    it; docs/benchmarks.md), TILE_ROWS else (without PDL the 32/64-row tiles lost: commit 0493e19; a large
    weight's tiles are measured up to 16 rows)."""
    small = weight.numel() * weight.element_size() <= SMALL_WEIGHT_BYTES
    return MAX_ROWS if small and pdl_launch(weight.device) else TILE_ROWS


def fused_linear_triton(x: torch.Tensor, weight: torch.Tensor, gamma: torch.Tensor | None = None, eps: float = 1e-6,
                        residual: torch.Tensor | None = None, gated: bool = False,
                        tiles: tuple[int, ...] | None = None, silu_mul: bool = False,
                        row_squares: torch.Tensor | None = None, next_gamma: torch.Tensor | None = None,
                        bias: torch.Tensor | None = None):
    """One launch, grid (cdiv(N, BLOCK_N), row blocks); M <= MAX_ROWS. x [..., K] ([..., 2K] gated) -> [..., N]
    (silu_mul: weight [2N, K]); with next_gamma, (out, next_gamma * out, row_squares of out [..., ceil(N / 16)])."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m, k = rows.shape[0], weight.shape[1]
    n = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    if m > MAX_ROWS or weight.stride(-1) != 1:
        raise ValueError(f"fused_linear_triton: {m} rows and weight stride {weight.stride()}: the kernel takes at "
                         f"most {MAX_ROWS} rows and contiguous weight rows (the op falls back to the reference)")
    res = residual.reshape(m, n) if residual is not None else None
    if res is not None and res.stride(-1) != 1:
        res = res.contiguous()
    squares_in = row_squares.reshape(m, -1).contiguous() if row_squares is not None else None
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    tiles = tiles or tile_config(m, n, k, weight.element_size(), norm=gamma is not None, silu_mul=silu_mul)
    block_m, block_n, block_k, num_warps, num_stages = tiles[:5]
    split_k = tiles[5] if len(tiles) > 5 else 1  # a 6th entry: K split over that many programs a tile
    block_m = 1 if block_m == 1 else max(16, block_m)  # BLOCK_M 1 with more rows: a program per row and BLOCK_N
    # columns; else tl.dot tiles of BLOCK_M rows (at least 16), the row blocks on grid axis 1
    scaled = squares_out = None
    if next_gamma is not None:
        block_n = max(block_n, SQUARE_COLS)  # whole chunks of 16 columns per program
        block_k = min(block_k, 512) if block_m == 1 else block_k  # one row's [BN, BK] lanes stay in registers
        if block_n % SQUARE_COLS:
            raise ValueError(f"fused_linear_triton: tiles={tiles}: next_gamma needs BLOCK_N a multiple of {SQUARE_COLS}")
        scaled = torch.empty_like(out)
        squares_out = torch.empty((m, triton.cdiv(n, SQUARE_COLS)), dtype=torch.float32, device=x.device)
    partials, arrived = out, out  # unused unless split over K
    if split_k > 1:
        if block_m == 1:
            raise ValueError(f"fused_linear_triton: tiles={tiles}: a split of K needs tl.dot tiles (BLOCK_M >= 16); "
                             "the one-row path sums the norm's squares in its K loop")
        arrived = arrival_counters("fused_linear", x.device, triton.cdiv(n, block_n) * triton.cdiv(m, block_m))
        if arrived is None:  # first allocated inside a graph capture: this call unsplit
            split_k, arrived = 1, out
        else:
            partials = torch.empty((split_k, 2, m, n), dtype=torch.float32, device=x.device)
    pdl = pdl_launch(x.device)
    line = 128 // weight.element_size()
    lines = min(PREFETCH_LINES, triton.next_power_of_2(triton.cdiv(k, line))) if pdl and config.pdl == "prefetch" else 0
    _fused_linear_kernel[(triton.cdiv(n, block_n), triton.cdiv(m, block_m), split_k)](
        rows, weight, gamma if gamma is not None else weight, bias if bias is not None else weight,
        res if res is not None else out, out,
        squares_in if squares_in is not None else out, next_gamma if next_gamma is not None else weight,
        scaled if scaled is not None else out, squares_out if squares_out is not None else out, partials, arrived,
        m, n, k, squares_in.shape[1] if squares_in is not None else 0, eps,
        rows.stride(0), weight.stride(0), res.stride(0) if res is not None else 0, out.stride(0),
        squares_in.stride(0) if squares_in is not None else 0, squares_out.stride(0) if squares_out is not None else 0,
        NORM=gamma is not None, GATED=gated, BIAS=bias is not None, RESIDUAL=res is not None, SILU_MUL=silu_mul,
        ROW_SCALE=squares_in is not None, NORM_OUT=next_gamma is not None, SQUARE_COLS=SQUARE_COLS,
        BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, SPLIT_K=split_k, UPCAST=not x.is_cuda and x.dtype == torch.bfloat16, num_warps=num_warps,
        num_stages=num_stages, **pdl_kwargs(pdl, PREFETCH_LINES=lines, LINE=line))
    out = out.view(*x.shape[:-1], n)
    if next_gamma is None:
        return out
    return out, scaled.view_as(out), squares_out.view(*x.shape[:-1], -1)


# ----------------------------------------------------------------------------- the op
def rms_norm_reference(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm, op for op."""
    x32 = x.to(torch.float32)
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return gamma * normed.to(x.dtype)


def fused_linear_reference(x, weight, gamma=None, eps: float = 1e-6, residual=None, gated: bool = False,
                           silu_mul: bool = False, row_squares=None, bias=None):
    """Plain torch: the CPU path, the decomposition, the kernel's oracle."""
    if gamma is not None:
        x = rms_norm_reference(x, gamma, eps)
    if gated:
        gate, up = x.chunk(2, -1)
        x = torch.nn.functional.silu(gate) * up
    out = torch.nn.functional.linear(x, weight, bias)
    if row_squares is not None:  # x = gamma * h: each row of the product times h's rstd (the kernel scales its
        # float32 sums; rounding the product first spares a float32 copy of the weight on this path)
        rstd = torch.rsqrt(row_squares.sum(-1, keepdim=True) / x.shape[-1] + eps)
        out = (out.float() * rstd).to(x.dtype)
    if silu_mul:  # weight packs gate then up: silu(gate) * up, each rounded as HF's MLP rounds them
        gate, up = out.chunk(2, -1)
        out = torch.nn.functional.silu(gate) * up
    return out if residual is None else residual + out


def norm_out_reference(out: torch.Tensor, next_gamma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What a product hands the next RMSNorm's readers: ``next_gamma * out`` rounded to out's dtype, and
    each row's sums of ``out ** 2`` (float32) over consecutive chunks of SQUARE_COLS columns."""
    out32 = out.float()
    scaled = (next_gamma.float() * out32).to(out.dtype)
    squares = torch.nn.functional.pad(out32 * out32, (0, -out.shape[-1] % SQUARE_COLS))
    return scaled, squares.unflatten(-1, (-1, SQUARE_COLS)).sum(-1)


def _check(x, weight, gamma, eps, residual, gated, silu_mul=False, row_squares=None, next_gamma=None,
           bias=None) -> None:
    k = x.shape[-1] // 2 if gated else x.shape[-1]
    problems = []
    if gated and (gamma is not None or x.shape[-1] % 2):
        problems.append(f"gated: x must be [..., 2K] (gate, then up) and gamma None; got x {tuple(x.shape)}, "
                        f"gamma {'given' if gamma is not None else None}")
    if weight.dim() != 2 or weight.shape[1] != k or (silu_mul and weight.shape[0] % 2):
        problems.append(f"weight must be [{'2N' if silu_mul else 'N'}, K={k}]; got {tuple(weight.shape)}")
    if gamma is not None and gamma.shape != (k,):
        problems.append(f"gamma must be [K={k}]; got {tuple(gamma.shape)}")
    n = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    want = (*x.shape[:-1], n)
    if residual is not None and tuple(residual.shape) != want:
        problems.append(f"residual must be the output's shape {list(want)}; got {tuple(residual.shape)}")
    if row_squares is not None and (gamma is not None or gated or row_squares.dtype != torch.float32
                                    or tuple(row_squares.shape[:-1]) != tuple(x.shape[:-1])):
        problems.append(f"row_squares must be float32 [..., P] over x's rows {list(x.shape[:-1])}, without gamma "
                        f"or gated; got {row_squares.dtype} {tuple(row_squares.shape)}")
    if bias is not None and (silu_mul or row_squares is not None or tuple(bias.shape) != (n,)):
        problems.append(f"bias must be [N={n}], without silu_mul or row_squares; got {tuple(bias.shape)}"
                        f"{', silu_mul' if silu_mul else ''}{', row_squares' if row_squares is not None else ''}")
    if next_gamma is not None and tuple(next_gamma.shape) != (n,):
        problems.append(f"next_gamma must be [N={n}]; got {tuple(next_gamma.shape)}")
    dtypes = {t.dtype for t in (x, weight, gamma, residual, next_gamma, bias) if t is not None}
    if len(dtypes) > 1:
        problems.append(f"x, weight, gamma, bias, residual, next_gamma must share one dtype; got {sorted(map(str, dtypes))}")
    if (gamma is not None or row_squares is not None) and not eps > 0:
        problems.append(f"eps={eps}: must be > 0")
    if problems:
        raise ValueError("fused_linear: " + "; ".join(problems))


def _use_kernel(x, weight) -> bool:
    m = x.numel() // x.shape[-1]
    return not config.reference_kernels and m <= max_rows(weight) and weight.stride(-1) == 1


@torch.library.custom_op("specgraph::fused_linear", mutates_args=())
def fused_linear(x: torch.Tensor, weight: torch.Tensor, gamma: torch.Tensor | None, eps: float,
                 residual: torch.Tensor | None, gated: bool = False, silu_mul: bool = False,
                 row_squares: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``[residual +] epilogue(F.linear(prologue(x), weight))`` (contract in the module docstring). CPU: the
    reference."""
    _check(x, weight, gamma, eps, residual, gated, silu_mul, row_squares, bias=bias)
    return fused_linear_reference(x, weight, gamma, eps, residual, gated, silu_mul, row_squares, bias)


@fused_linear.register_kernel("cuda")
def _fused_linear_cuda(x, weight, gamma, eps, residual, gated=False, silu_mul=False, row_squares=None, bias=None):
    _check(x, weight, gamma, eps, residual, gated, silu_mul, row_squares, bias=bias)
    if not _use_kernel(x, weight):
        return fused_linear_reference(x, weight, gamma, eps, residual, gated, silu_mul, row_squares, bias)
    return fused_linear_triton(x, weight, gamma, eps, residual, gated, silu_mul=silu_mul, row_squares=row_squares,
                               bias=bias)


@fused_linear.register_fake
def _fused_linear_fake(x, weight, gamma, eps, residual, gated=False, silu_mul=False, row_squares=None, bias=None):
    _check(x, weight, gamma, eps, residual, gated, silu_mul, row_squares, bias=bias)
    return x.new_empty((*x.shape[:-1], weight.shape[0] // 2 if silu_mul else weight.shape[0]))


def fused_linear_norm_out_reference(x, weight, residual, next_gamma):
    """Plain torch (CPU, decomposition, oracle): ``(out, *norm_out_reference(out, next_gamma))``."""
    out = fused_linear_reference(x, weight, None, 0.0, residual)
    return (out, *norm_out_reference(out, next_gamma))


@torch.library.custom_op("specgraph::fused_linear_norm_out", mutates_args=())
def fused_linear_norm_out(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None,
                          next_gamma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``out = [residual +] F.linear(x, weight)`` and what the next RMSNorm's readers take instead of its
    output: ``(out, next_gamma * out, row sums of out ** 2 per 16 columns)`` (``norm_out_reference``); a
    reader is then ``fused_linear(scaled, W, None, eps, None, row_squares=squares)``. CPU: the reference."""
    _check(x, weight, None, 0.0, residual, False, next_gamma=next_gamma)
    return fused_linear_norm_out_reference(x, weight, residual, next_gamma)


@fused_linear_norm_out.register_kernel("cuda")
def _fused_linear_norm_out_cuda(x, weight, residual, next_gamma):
    _check(x, weight, None, 0.0, residual, False, next_gamma=next_gamma)
    if not _use_kernel(x, weight):
        return fused_linear_norm_out_reference(x, weight, residual, next_gamma)
    return fused_linear_triton(x, weight, None, 0.0, residual, next_gamma=next_gamma)


@fused_linear_norm_out.register_fake
def _fused_linear_norm_out_fake(x, weight, residual, next_gamma):
    _check(x, weight, None, 0.0, residual, False, next_gamma=next_gamma)
    out = x.new_empty((*x.shape[:-1], weight.shape[0]))
    return out, torch.empty_like(out), x.new_empty((*x.shape[:-1], triton.cdiv(weight.shape[0], SQUARE_COLS)),
                                                   dtype=torch.float32)
