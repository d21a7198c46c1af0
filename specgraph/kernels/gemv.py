"""``specgraph::gemv``: ``x @ w.T`` for a few rows of ``x`` (decode at batch 1), bandwidth-bound.

Contract:
  x:   [M, K]  M <= 8 rows (a decode step's tokens), any float dtype
  w:   [N, K]  an nn.Linear weight (row-major, contiguous in K), x's dtype
  out: [M, N]  x's dtype, products summed in fp32

Why: at M = 1 a matrix product is a read of ``w``. On the H200, cuBLAS runs the 8B-shaped decode's
thin products (q/k/v 4096 -> 6144, o 4096 -> 4096) at 3.1 TB/s with 64x8 tiles and a split-K
reduction launch after o and down (docs/benchmarks.md); the copy bandwidth is 4.24 TB/s. Here each
program owns BLOCK_N whole rows of ``w`` and walks K in BLOCK_K tiles, so no split-K and no second
launch; N / BLOCK_N programs (384 for q/k/v at BLOCK_N = 16) keep every SM streaming.
Not wired into the step yet: a pass will route M-small products here once the H200 numbers
(``benchmarks/kernels.py --gemv``) show it beats cuBLAS.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 8


# ----------------------------------------------------------------------------- Triton kernel
@triton.jit
def _gemv_kernel(X, W, Out, M, N, K, stride_xm, stride_wn, stride_om,
                 M_POW2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    pid = tl.program_id(0)
    rows_m = tl.arange(0, M_POW2)  # x's rows
    rows_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # w's rows = output columns
    cols = tl.arange(0, BLOCK_K)
    m_ok = rows_m < M
    n_ok = rows_n < N
    acc = tl.zeros([M_POW2, BLOCK_N], tl.float32)
    w_ptr = W + rows_n[:, None].to(tl.int64) * stride_wn + cols[None, :]  # [BLOCK_N, BLOCK_K]
    x_ptr = X + rows_m[:, None] * stride_xm + cols[None, :]  # [M, BLOCK_K]
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptr, mask=n_ok[:, None], other=0.0)
            x = tl.load(x_ptr, mask=m_ok[:, None], other=0.0)
        else:
            k_ok = (k + cols) < K
            w = tl.load(w_ptr, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_ptr, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        # [M, 1, BLOCK_K] * [1, BLOCK_N, BLOCK_K] summed over K: no tensor cores needed at M <= 8
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        w_ptr += BLOCK_K
        x_ptr += BLOCK_K
    out_ptr = Out + rows_m[:, None] * stride_om + rows_n[None, :]
    tl.store(out_ptr, acc.to(Out.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def launch_config(m: int, n: int, k: int, **override) -> dict:
    """Tile sizes and warps (static shapes only). ``override`` replaces any key (tests, the sweep)."""
    m_pow2 = triton.next_power_of_2(m)
    # the product tile [M, BLOCK_N, BLOCK_K] lives in registers: fewer K columns per step at larger M
    config = dict(block_n=16, block_k=max(64, 512 // m_pow2), num_warps=4, num_stages=4)
    config.update(override)
    config["block_k"] = min(config["block_k"], triton.next_power_of_2(k))
    return config


def gemv_triton(x: torch.Tensor, w: torch.Tensor, **override) -> torch.Tensor:
    """One launch, grid (cdiv(N, BLOCK_N),)."""
    m, k = x.shape
    n = w.shape[0]
    config = launch_config(m, n, k, **override)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, config["block_n"]),)](
        x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
        M_POW2=triton.next_power_of_2(m), BLOCK_N=config["block_n"], BLOCK_K=config["block_k"],
        EVEN_K=k % config["block_k"] == 0, num_warps=config["num_warps"], num_stages=config["num_stages"])
    return out


# ----------------------------------------------------------------------------- the op
def _check(x: torch.Tensor, w: torch.Tensor) -> None:
    problems = []
    if x.dim() != 2 or w.dim() != 2:
        raise ValueError(f"gemv: x must be [M, K] and w [N, K]; got {tuple(x.shape)} and {tuple(w.shape)}")
    if not 1 <= x.shape[0] <= MAX_ROWS:
        problems.append(f"x has {x.shape[0]} rows: 1 .. {MAX_ROWS} (use a matrix product for more)")
    if x.shape[1] != w.shape[1]:
        problems.append(f"x's K={x.shape[1]} must match w's K={w.shape[1]}")
    if x.dtype != w.dtype:
        problems.append(f"x and w dtypes differ: {x.dtype}, {w.dtype}")
    if x.stride(1) != 1 or w.stride(1) != 1:
        problems.append(f"x and w must be contiguous along K; strides {x.stride()} and {w.stride()}")
    if problems:
        raise ValueError("gemv: " + "; ".join(problems))


def gemv_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Plain torch, fp32 products: the CPU path, the decomposition, the kernel's oracle."""
    return (x.float() @ w.float().T).to(x.dtype)


@torch.library.custom_op("specgraph::gemv", mutates_args=())
def gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` for M <= 8 rows (contract above). CPU: the reference."""
    _check(x, w)
    return gemv_reference(x, w)


@gemv.register_kernel("cuda")
def _gemv_cuda(x, w):
    _check(x, w)
    return gemv_triton(x, w)


@gemv.register_fake
def _gemv_fake(x, w):
    _check(x, w)
    return x.new_empty((x.shape[0], w.shape[0]))
