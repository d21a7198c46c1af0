"""fold_norms: HF's RMSNorm into the products that read it, the residual add into the product whose
output it adds, and the gated MLP's SiLU·mul into the down product, as ``specgraph::fused_linear`` --
where that was measured faster: one-row steps (decode at batch 1), at every weight size.

Requires: export IR after fuse_projections: ``aten.linear`` nodes.
Ensures: in a one-row step: (1) every ``linear(n, W[, b])`` whose input n is HF's LlamaRMSNorm of x,
  ``gamma * (x32 * rsqrt(mean(x32 ** 2, -1, keepdim) + eps)).to(x.dtype)`` with x32 = x in float32 and
  gamma a parameter of x's dtype, where every user of n is such a linear, becomes
  ``fused_linear(x, W, gamma, eps, None)`` (with the bias: ``..., bias=b``; Qwen2's q/k/v); (2) every ``add(r, linear(y, W))`` (either order; the
  linear bias-free, feeding only that add, maybe through an eval-mode dropout, of r's shape and
  dtype) becomes ``fused_linear(y, W, None, 0.0, r)``, any size; (3) a product (a bias-free linear, or a
  fused_linear without a norm) reading ``silu(gu[..., :I]) * gu[..., I:]``, the halves of one packed
  gate/up output as fuse_projections splits it, reads gu itself with ``gated=True``, any size. The norm chains
  left dead, and export's dtype asserts on them, are removed. Other norms (Gemma's ``1 + weight``, a
  norm also read elsewhere), other activations and a gate/up chunked by the model's own code (Phi-3)
  stay, not refused: this is a speed-up. Counters: norms_folded, adds_folded, gated_folded, and what
  was left alone: too_many_rows.
Why: a decoder layer launches a norm kernel (the residual add fused in) before q/k/v and again before
  gate/up, and a SiLU·mul kernel before down; folded, those three go: 8 launches a layer become 5.
  Measured on the H200 (``benchmarks/fused_linear.py``, docs/benchmarks.md, 2026-12-01), one
  row: SmolLM2's layers without attention 21.9 us (norms + cuBLAS) -> 12.2 folded, the 8B shape's
  126.8 -> 113.0 (every product beats cuBLAS with its prologue and epilogue: q/k/v with the norm 15.6
  against 16.2 + a norm kernel, gate/up 56.9 against 57.3 + a norm kernel). At 8 rows the padded
  16-row tiles lost (the prologue's SiLU on 16 rows is compute-bound): left alone.
"""
from __future__ import annotations

import math
import operator

import torch

from .. import kernels  # noqa: F401  (registers the specgraph ops)
from .pass_result import GraphContext, PassResult, drop_dead_code, ensure, graph_pass, recompile
from .pass_result import is_call as _call, val as _val
from .replace_attention import CASTS

aten = torch.ops.aten
LINEAR = aten.linear.default
FOLD_MAX_ROWS = 1  # fused_linear takes up to 16; folding measured faster only at one
FUSED_LINEAR = torch.ops.specgraph.fused_linear.default


def _cast_to(node, dtype) -> bool:
    return any(_call(node, t) for t in CASTS) and _val(node) is not None and _val(node).dtype == dtype


def _rms_norm_parts(node):
    """(x, gamma, eps, the chain's nodes) when ``node`` is HF's LlamaRMSNorm of x; else None."""
    if not (_call(node, aten.mul.Tensor) and len(node.args) == 2 and _val(node) is not None):
        return None
    for gamma, cast in (node.args, node.args[::-1]):
        if not (isinstance(gamma, torch.fx.Node) and gamma.op in ("placeholder", "get_attr")
                and _val(gamma) is not None and _val(gamma).dim() == 1 and _cast_to(cast, _val(node).dtype)):
            continue
        scaled = cast.args[0]
        if not (_call(scaled, aten.mul.Tensor) and len(scaled.args) == 2):
            continue
        for x32, rsqrt in (scaled.args, scaled.args[::-1]):
            if not (_call(rsqrt, aten.rsqrt.default) and _call(rsqrt.args[0], aten.add.Tensor)):
                continue
            mean, eps = rsqrt.args[0].args
            if not (_call(mean, aten.mean.dim) and isinstance(eps, float) and eps > 0 and _val(mean) is not None
                    and list(mean.args[1]) in ([-1], [_val(mean).dim() - 1]) and mean.args[2:3] == (True,)):
                continue
            square = mean.args[0]
            if not (_call(square, aten.pow.Tensor_Scalar) and square.args == (x32, 2)):
                continue
            x = x32.args[0] if _cast_to(x32, torch.float32) else x32
            x_val = _val(x)
            if x_val is None or _val(x32).dtype != torch.float32 or x_val.dtype != _val(node).dtype \
                    or _val(gamma).dtype != x_val.dtype or _val(gamma).shape[0] != x_val.shape[-1]:
                continue
            return x, gamma, eps, (node, cast, scaled, rsqrt, rsqrt.args[0], mean, square, x32)
    return None


def norms_read_by_linears(graph: torch.fx.Graph, biased: bool = False):
    """(norm, its users, ``_rms_norm_parts``) for each HF LlamaRMSNorm whose every user is a linear reading it
    as x, bias-free unless ``biased``; a list, so callers may rewrite the graph while they go."""
    found = []
    for node in graph.find_nodes(op="call_function", target=aten.mul.Tensor):
        users = list(node.users)
        if not users or not all(_call(u, LINEAR) and u.args[0] is node and (biased or _bias_free(u)) for u in users):
            continue
        parts = _rms_norm_parts(node)
        if parts is not None:
            found.append((node, users, parts))
    return found


def _gated_source(node):
    """``gu`` when node is ``silu(gu[..., :I]) * gu[..., I:]`` (HF's gated MLP on a packed gate/up
    product, as fuse_projections splits it) and only one product reads it; else None."""
    if not (_call(node, aten.mul.Tensor) and len(node.args) == 2 and len(node.users) == 1):
        return None
    for act, up in (node.args, node.args[::-1]):
        if not (_call(act, aten.silu.default) and len(act.users) == 1):
            continue
        gate = act.args[0]
        if not (_call(gate, operator.getitem) and _call(up, operator.getitem) and gate.args == (up.args[0], 0)
                and up.args[1] == 1 and len(gate.users) == 1 and len(up.users) == 1):
            continue
        split = gate.args[0]
        if not (_call(split, aten.split_with_sizes.default) and len(split.args[1]) == 2
                and split.args[1][0] == split.args[1][1] and len(split.users) == 2):
            continue
        dim = split.args[2] if len(split.args) > 2 else 0
        if _val(node) is None or dim not in (-1, _val(node).dim() - 1) or _val(up) is None \
                or _val(up).dtype != _val(node).dtype:  # the last dim, and no dtype change on the way
            continue
        return split.args[0]
    return None


def _why_not(rows_node) -> str | None:
    """None when folding pays, measured (H200, 2026-12-01, docs/benchmarks.md): one row (decode at
    batch 1); else the counter to bump. More rows ran slower as fused_linear (the padded 16-row tiles'
    prologue is compute-bound)."""
    val = _val(rows_node)
    if val is None or math.prod(val.shape[:-1]) > FOLD_MAX_ROWS:
        return "too_many_rows"
    return None


def _bias_free(linear) -> bool:
    return len(linear.args) < 3 or linear.args[2] is None


def residual_product(add):
    """(linear, the nodes between it and the add, r) when ``add`` is ``r + linear(y, W)`` (either order,
    maybe through an eval-mode dropout, Phi-3's), the linear bias-free and read only on the way to the add,
    all of the add's shape and dtype; else None."""
    if not (_call(add, aten.add.Tensor) and len(add.args) == 2 and not add.kwargs and _val(add) is not None):
        return None
    for residual, product in (add.args, add.args[::-1]):
        linear, between = product, []
        if _call(product, aten.dropout.default) and product.args[2:3] == (False,) and list(product.users) == [add]:
            linear, between = product.args[0], [product]
        reader = between[0] if between else add
        if residual is product or residual is linear:  # y + y: no residual apart from the product
            continue
        if not (_call(linear, LINEAR) and _bias_free(linear) and list(linear.users) == [reader]
                and isinstance(residual, torch.fx.Node) and _val(residual) is not None and _val(linear) is not None):
            continue
        if {(_val(t).shape, _val(t).dtype) for t in (residual, linear)} == {(_val(add).shape, _val(add).dtype)}:
            return linear, between, residual
    return None


@graph_pass(after=("all_reduce_partial_sums", "fuse_projections"))  # into the fused projections; not across an all-reduce
def fold_norms(gm: torch.fx.GraphModule, ctx: GraphContext) -> PassResult:
    graph = gm.graph
    norms = adds = gated = 0
    skipped = {"too_many_rows": 0}
    chains = []
    # (1) a norm whose every user is a linear: each linear takes x and the norm itself (and its bias)
    for _, users, (x, gamma, eps, chain) in norms_read_by_linears(graph, biased=True):
        if reason := _why_not(x):
            skipped[reason] += 1
            continue
        for linear in users:
            bias = None if _bias_free(linear) else linear.args[2]
            with graph.inserting_before(linear):
                fused = graph.call_function(FUSED_LINEAR, (x, linear.args[1], gamma, eps, None),
                                            {"bias": bias} if bias is not None else {})
            fused.meta = dict(linear.meta)
            linear.replace_all_uses_with(fused)
            graph.erase_node(linear)
        chains.append(chain)
        norms += 1
    # (2) residual + linear(y, W): the add becomes the product's epilogue
    for add in list(graph.find_nodes(op="call_function", target=aten.add.Tensor)):
        match = residual_product(add)
        if match is None:
            continue
        if reason := _why_not(add):
            skipped[reason] += 1
            continue
        linear, between, residual = match
        with graph.inserting_before(add):
            fused = graph.call_function(FUSED_LINEAR, (linear.args[0], linear.args[1], None, 0.0, residual))
        fused.meta = dict(add.meta)
        add.replace_all_uses_with(fused)
        for dead in (add, *between, linear):
            graph.erase_node(dead)
        adds += 1
    # (3) a product reading silu(gate) * up, the halves of one packed gate/up output: SiLU·mul in its prologue
    for node in list(graph.nodes):
        if _call(node, LINEAR) and _bias_free(node):
            prologue_free, args = True, (node.args[0], node.args[1], None, 0.0, None)
        elif _call(node, FUSED_LINEAR):
            prologue_free, args = node.args[2] is None and not node.args[5:6] == (True,), node.args[:5]
        else:
            continue
        gate_up = _gated_source(args[0]) if prologue_free else None
        if gate_up is None:
            continue
        if reason := _why_not(node):
            skipped[reason] += 1
            continue
        with graph.inserting_before(node):
            fused = graph.call_function(FUSED_LINEAR, (gate_up, *args[1:5], True))
        fused.meta = dict(node.meta)
        node.replace_all_uses_with(fused)
        graph.erase_node(node)
        gated += 1
    drop_dead_code(graph, [node for chain in chains for node in chain])  # the folded norm chains
    recompile(gm)

    # Postconditions: no folded norm survives; every fused_linear is a norm (gamma) or an add (residual).
    ensure(all(node._erased for chain in chains for node in chain[:-1]), "fold_norms", "a folded norm is left alive")
    fused = graph.find_nodes(op="call_function", target=FUSED_LINEAR)
    ensure(len(fused) >= norms + adds and sum(n.args[5:6] == (True,) for n in fused) == gated, "fold_norms",
           f"{len(fused)} fused_linear nodes for {norms} norms and {adds} adds folded, {gated} gated expected")
    ensure(all(n.args[2] is not None or n.args[4] is not None or n.args[5:6] == (True,) for n in fused), "fold_norms",
           "a fused_linear with neither a norm, a residual nor a gate: nothing folded into it")
    return PassResult(gm, bool(norms or adds or gated),
                      {"norms_folded": norms, "adds_folded": adds, "gated_folded": gated, **skipped})
