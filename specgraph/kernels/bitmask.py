"""Ancestor bitmasks: one int64 per tree node.

Bit j of ``mask[b, i]`` is set iff node j is an ancestor-or-self of node i.
With at most 64 nodes a row fits one int64 (bit 63 is the sign bit; every
operation here is a bitwise one, so the sign never matters).

Everything is plain torch on ``[B, N]`` tensors with a fixed number of
steps (ceil(log2 N) pointer-doubling rounds), no host synchronisation: it
runs under CUDA-graph capture and on the meta device.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_NODES = 64


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
    return torch.where(j < 63, powers, torch.iinfo(torch.int64).min)


def mask_to_matrix(mask: torch.Tensor, n: int) -> torch.Tensor:
    """Expand bitmasks into booleans.

    mask: [..., R] int64  ->  [..., R, n] bool, ``out[..., i, j] = bit j of mask[..., i]``.
    """
    return torch.bitwise_and(mask.unsqueeze(-1), node_bits(n, mask.device)) != 0


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
    # first_child: min child index per parent; roots scatter into a spare column n.
    slot = torch.where(parents >= 0, parents, n)
    first = torch.full((b, n + 1), n, dtype=torch.int64, device=parents.device)
    first = first.scatter_reduce(1, slot, idx.expand(b, n), reduce="amin", include_self=True)
    first = first[:, :n]
    # next_sibling[i]: the smallest j > i with the same parent. N <= 64: [B, N, N] is tiny.
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
