"""Ancestor bitmasks: one int64 per tree node.

Bit j of ``mask[b, i]`` is set iff node j is an ancestor-or-self of node i.
With at most 64 nodes a row fits one int64 (bit 63 is the sign bit; the
bitwise operations never care).

Inside ``arithmetic_bits()`` (export.py traces the verify step in it) bit tests
are exact integer arithmetic instead (Div/Sub/Mul/Less/Where, the sign tested
apart): TensorRT has no integer bitwise ops.

Everything is plain torch on ``[B, N]`` tensors with a fixed number of
steps (ceil(log2 N) pointer-doubling rounds), no host synchronisation: it
runs under CUDA-graph capture and on the meta device.
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

MAX_NODES = 64
INT64_MIN = torch.iinfo(torch.int64).min
_ARITHMETIC = False  # export only: elsewhere bitwise is cheaper (no int64 divisions over [B, R, S_max])


@contextlib.contextmanager
def arithmetic_bits():
    """Within: ``mask_to_matrix`` and the other bit tests in the arithmetic form (``bit_at``)."""
    global _ARITHMETIC
    before, _ARITHMETIC = _ARITHMETIC, True
    try:
        yield
    finally:
        _ARITHMETIC = before


def check_num_nodes(n: int, what: str = "number of tree nodes") -> None:
    if n > MAX_NODES:
        raise ValueError(
            f"{what} is {n}, but a tree holds at most {MAX_NODES} nodes (one int64 "
            f"ancestor bitmask per node); choose a tree with nodes <= {MAX_NODES}"
        )
    if n < 1:
        raise ValueError(f"{what} is {n}; a tree has at least its root (1 node)")


def node_bits(n: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``[n]`` int64 with element j equal to ``1 << j`` (j = 63 is the sign bit).

    Built on the device from exact float64 powers of two, not with a shift:
    traced graphs then need only bitwise_and (ONNX has no signed BitShift),
    and nothing is copied from the host (CUDA-graph capture).
    """
    j = torch.arange(n, dtype=torch.float64, device=device)
    powers = torch.exp2(j.clamp(max=62)).to(torch.int64)
    return torch.where(j < 63, powers, INT64_MIN)


def mask_to_matrix(mask: torch.Tensor, n: int) -> torch.Tensor:
    """Expand bitmasks into booleans.

    mask: [..., R] int64  ->  [..., R, n] bool, ``out[..., i, j] = bit j of mask[..., i]``.
    """
    if _ARITHMETIC:
        return _bit_at_arithmetic(mask.unsqueeze(-1), torch.arange(n, device=mask.device))
    return torch.bitwise_and(mask.unsqueeze(-1), node_bits(n, mask.device)) != 0


def low_bits(x: torch.Tensor, r: int) -> torch.Tensor:
    """``x & (2^r - 1)``, 1 <= r <= 63; inside ``arithmetic_bits()`` without bitwise ops."""
    if not _ARITHMETIC:
        return x & ((1 << r) - 1)
    low = _low63(x)
    return low if r == 63 else low - _div(low, 1 << r) * (1 << r)


def bit_at(x: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """Bit j of x (bool): x int64, j int64 in 0 .. 63, broadcast together."""
    if _ARITHMETIC:
        return _bit_at_arithmetic(x, j)
    return (x & node_bits(64, x.device)[j]) != 0


def _bit_at_arithmetic(x: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """``bit_at`` in integer Div/Sub/Mul/Less/Where/Gather and bool And/Or/Not only: bit 63 is the
    sign, bit j < 63 the parity of low63(x) // 2^j."""
    below = j < 63
    power = node_bits(63, x.device)[torch.where(below, j, 0)]  # 2^j, positive
    q = _div(_low63(x), power)
    return below & (q - _div(q, 2) * 2 == 1) | ~below & (x < 0)  # not a bool Where: onnxruntime has none


def _low63(x: torch.Tensor) -> torch.Tensor:
    """x's low 63 bits, non-negative: x + 2^63 where x < 0 (in range: no step overflows)."""
    return x - torch.where(x < 0, INT64_MIN, 0)


def _div(a: torch.Tensor, b) -> torch.Tensor:
    """a // b for a >= 0, b > 0 (truncation = floor there) as one ONNX integer Div: aten's integer
    divisions export through float32 (inexact past 2^24) or, floored, through Mod and a bool Equal."""
    if isinstance(b, torch.Tensor):
        a, b = torch.broadcast_tensors(a, b)  # prims do not broadcast
    return torch.ops.prims.div(a, b)


def ancestor_masks(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Ancestor-or-self bitmask and depth of every node by pointer doubling.

    parents: [B, N] int64, ``-1`` for a root; any forest without cycles.
    returns (mask [B, N] int64, depth [B, N] int64), root depth 0.
    """
    n = parents.shape[-1]
    check_num_nodes(n)
    parents = parents.to(torch.int64)
    # After round k: mask covers distances 0 .. 2^k - 1 above the node, up
    # holds the 2^k-th ancestor (-1 past the root), and depth counts the
    # min(2^k, depth) edges between the node and `up`.
    mask = node_bits(n, parents.device).expand_as(parents)
    up = parents
    depth = (parents >= 0).to(torch.int64)
    for _ in range((n - 1).bit_length()):
        has_up = up >= 0
        at = up.clamp(min=0)
        zero = torch.zeros_like(mask)
        mask = mask | torch.where(has_up, mask.gather(-1, at), zero)
        depth = depth + torch.where(has_up, depth.gather(-1, at), zero)
        up = torch.where(has_up, up.gather(-1, at), up)
    return mask, depth


def first_child_next_sibling(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-child / right-sibling encoding of a tree, -1 where there is none.

    parents: [B, N] int64 (-1 root). Children are ordered by node index, so
    under depth-first best-child-first numbering the first child is the best.
    returns (first_child [B, N], next_sibling [B, N]).
    """
    b, n = parents.shape
    idx = torch.arange(n, dtype=torch.int64, device=parents.device)
    # N <= 64: [B, N, N] comparisons are tiny, one fused reduction each (a scatter_reduce for the first child
    # stayed an aten fallback of its own in inductor's code of the compiled step, looked at on the CPU)
    # first_child[p]: the smallest i whose parent is p
    child = parents.unsqueeze(-2) == idx.view(1, n, 1)  # [B, p, i]
    first = torch.where(child, idx.view(1, 1, n), n).amin(-1)
    # next_sibling[i]: the smallest j > i with the same parent
    later_sibling = (parents.unsqueeze(-1) == parents.unsqueeze(-2)) & (idx.view(1, 1, n) > idx.view(1, n, 1))
    nxt = torch.where(later_sibling, idx.view(1, 1, n), n).amin(-1)
    none = torch.full_like(first, -1)
    return torch.where(first == n, none, first), torch.where(nxt == n, none, nxt)


# ----------------------------------------------------------------------------- Triton helpers
@triton.jit
def bit_or(a, b):
    """Combine function for ``tl.reduce``: the union of bitmasks."""
    return a | b


@triton.jit
def popcount64(x):
    """Set bits of each int64 in ``x`` (int32)."""
    count = tl.zeros(x.shape, tl.int32)
    for j in tl.static_range(64):
        count += ((x >> j) & 1).to(tl.int32)
    return count
