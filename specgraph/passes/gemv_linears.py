"""gemv_linears: a bucket's matrix products over a few rows become ``specgraph::gemv``.

At decode (B·N <= 8 rows) a linear layer is a read of its weight; ``specgraph::gemv`` streams it in
one launch without cuBLAS's split-K reduction (kernels/gemv.py). Opt-in (``GraphContext.gemv``, set
by ``SPECGRAPH_GEMV=1``) until the H200 measurements (``benchmarks/kernels.py --gemv``, e2e) show it
beats cuBLAS at every product it takes.

Requires: export IR, after ``fuse_projections`` (a fused group is one linear, on a get_attr view);
  every ``aten.linear`` input carries ``meta["val"]``.
Ensures: with ``ctx.gemv``, no ``aten.linear`` whose input has at most ``MAX_ROWS`` rows (the product
  of its leading dims) and whose weight is 2-D and contiguous along K is left; each became
  ``view(x, [M, K]) -> specgraph.gemv(., W) [-> add(., bias)] -> view(., [..., N])`` (same values up to
  the summation order, same shape and dtype). Without ``ctx.gemv`` the graph is untouched.
"""
from __future__ import annotations

import math

import torch

from ..kernels.gemv import MAX_ROWS
from .pass_result import GraphContext, PassResult

LINEAR = torch.ops.aten.linear.default


def _weight_value(node: torch.fx.Node, gm: torch.fx.GraphModule, params: dict):
    if node.op == "get_attr":
        return getattr(gm, node.target)
    return params.get(node.name, node.meta.get("val"))


def _eligible(node: torch.fx.Node, gm: torch.fx.GraphModule, params: dict) -> bool:
    x = node.args[0].meta.get("val")
    w = _weight_value(node.args[1], gm, params)
    return (x is not None and w is not None and w.dim() == 2 and x.dtype == w.dtype
            and math.prod(x.shape[:-1]) <= MAX_ROWS and w.stride(1) == 1)


def gemv_linears(gm: torch.fx.GraphModule, ctx: GraphContext) -> PassResult:
    if not ctx.gemv:
        return PassResult(gm, False, {"linears_to_gemv": 0})
    graph, params = gm.graph, ctx.params or {}
    replaced = 0
    for node in list(graph.find_nodes(op="call_function", target=LINEAR)):
        if not _eligible(node, gm, params):
            continue
        x, weight = node.args[0], node.args[1]
        bias = node.args[2] if len(node.args) > 2 else None
        lead, k = tuple(x.meta["val"].shape[:-1]), x.meta["val"].shape[-1]
        n = _weight_value(weight, gm, params).shape[0]
        with graph.inserting_before(node):
            rows = graph.call_function(torch.ops.aten.view.default, (x, [math.prod(lead), k]))
            out = graph.call_function(torch.ops.specgraph.gemv.default, (rows, weight))
            if bias is not None:
                out = graph.call_function(torch.ops.aten.add.Tensor, (out, bias))
            out = graph.call_function(torch.ops.aten.view.default, (out, [*lead, n]))
        out.meta.update(node.meta)
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        replaced += 1
    graph.lint()
    gm.recompile()
    left = [node for node in graph.find_nodes(op="call_function", target=LINEAR) if _eligible(node, gm, params)]
    assert not left, f"gemv_linears: {len(left)} small-M linears left"
    return PassResult(gm, replaced > 0, {"linears_to_gemv": replaced})
