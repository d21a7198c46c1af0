"""fold_norms_rows: in steps of 2..max_rows rows (``kernels.fused_linear.max_rows``: 64 for a small weight
under PDL, 16 else), each RMSNorm whose input is a residual add of a product moves into that product's
epilogue and its readers' row scaling, and the gated MLP's SiLU·mul into the packed gate/up product's
epilogue -- so no multi-row product has anything between its load of x and ``tl.dot`` (with a prologue
there, the 16-row tiles lost to cuBLAS; without, they matched it: H200, 2026-12-01, docs/benchmarks.md).

Requires: fold_norms has run (it folds one-row steps; it leaves steps of more rows untouched).
Ensures: in a step of 2 rows up to the least ``max_rows`` of the products' weights: (1) a norm ``n`` = HF's
  LlamaRMSNorm of ``h = add(r, linear(y, W))`` (the linear bias-free, read only by the add, maybe through an
  eval-mode dropout; either order), every user of n a bias-free linear, becomes
  ``(h, scaled, squares) = fused_linear_norm_out(y, W, r, gamma)``: every reader of h reads the first
  output, each linear ``linear(n, V)`` becomes ``fused_linear(scaled, V, None, eps, None, False, False,
  squares)`` (the product of ``gamma * h``, each row times its rstd from the squares); (2)
  ``silu(gu[..., :I]) * gu[..., I:]`` on the halves of one packed gate/up product gu (a bias-free linear, or
  a fused_linear of (1) without a prologue), gu read only by that split, becomes that product with
  ``silu_mul=True`` (output [..., I]). Norms with another producer (the first layer's, after the embedding),
  Gemma's (1 + weight) norms, other activations stay, counted when the rows are out of range.
  Counters: norms_folded, silu_mul_folded, rows_out_of_range.
Numerics: the readers scale the product of ``gamma * h`` (rounded to h's dtype) by the rstd, where HF
  rounds the normalized row first; the rstd sums h ** 2 in float32 per 16 columns, then over the row. Within
  the bf16 tolerance of fused_linear's tests, not bit for bit.
Measured (H200, 2026-12-01, docs/benchmarks.md): the 8B verify step of 8 nodes 4.786 -> 4.388 ms
  (1.136x -> 1.046x its plain step, same run); the layer's products at 8 rows 125.6 -> 120.9 us (8B) and
  21.4 -> 19.6 us (SmolLM2) against norm + cuBLAS + SiLU·mul + add. Past 16 rows under PDL (H100,
  2026-12-06): SmolLM2's 24-node step 1.336 -> 1.212 ms (the unfolded kernels launch without PDL: idle gaps).
"""
from __future__ import annotations

import math
import operator

import torch

from .. import kernels  # noqa: F401  (registers the specgraph ops)
from ..kernels.fused_linear import SQUARE_COLS, max_rows
from .fold_norms import FUSED_LINEAR, LINEAR, _bias_free, _gated_source, norms_read_by_linears, residual_product
from .pass_result import GraphContext, PassResult, drop_dead_code, ensure, graph_pass, recompile
from .pass_result import is_call as _call, val as _val

aten = torch.ops.aten
NORM_OUT = torch.ops.specgraph.fused_linear_norm_out.default


def _rows_in_range(node, weights) -> bool:
    """node's rows fit the kernel of every weight its fold makes a fused_linear read (``max_rows``): past
    that the op's reference would replace what inductor fuses."""
    val, weight_vals = _val(node), [_val(w) for w in weights]
    if val is None or any(w is None for w in weight_vals):
        return False
    return 2 <= math.prod(val.shape[:-1]) <= min(max_rows(w) for w in weight_vals)


def _fake_like(val, shape, dtype):
    with val.fake_mode:
        return torch.empty(shape, dtype=dtype, device=val.device)


# norms fold into the fused projections, and fold_norms takes the one-row steps first
@graph_pass(after=("fuse_projections", "fold_norms"))
def fold_norms_rows(gm: torch.fx.GraphModule, ctx: GraphContext) -> PassResult:
    graph = gm.graph
    norms = silu_muls = out_of_range = 0
    producers_before = len(graph.find_nodes(op="call_function", target=NORM_OUT))
    chains, bypassed = [], []
    # (1) a norm of a residual add of a product: the product hands its readers gamma * h and h's squares
    for _, users, (h, gamma, eps, chain) in norms_read_by_linears(graph):
        if h._erased:  # a second norm of an h already handed over: its readers keep that norm
            continue
        producer = residual_product(h)
        if producer is None:
            continue
        linear, between, residual = producer
        if not _rows_in_range(h, [linear.args[1], *(reader.args[1] for reader in users)]):
            out_of_range += 1
            continue
        with graph.inserting_before(h):
            fused = graph.call_function(NORM_OUT, (linear.args[0], linear.args[1], residual, gamma))
            outs = [graph.call_function(operator.getitem, (fused, i)) for i in range(3)]
        h_val = _val(h)
        squares = _fake_like(h_val, (*h_val.shape[:-1], -(-h_val.shape[-1] // SQUARE_COLS)), torch.float32)
        fused.meta["val"] = (h_val, _fake_like(h_val, h_val.shape, h_val.dtype), squares)
        for out, value in zip(outs, fused.meta["val"]):
            out.meta["val"] = value
        for reader in users:
            with graph.inserting_before(reader):
                read = graph.call_function(FUSED_LINEAR, (outs[1], reader.args[1], None, eps, None, False, False,
                                                          outs[2]))
            read.meta = dict(reader.meta)
            reader.replace_all_uses_with(read)
            graph.erase_node(reader)
        h.replace_all_uses_with(outs[0])  # the norm chain too: it is dead now, and dropped below
        for dead in (h, *between, linear):
            graph.erase_node(dead)
        chains.append(chain)  # dead now, but x32: h itself, or its cast that may also carry the residual on
        norms += 1
    # (2) silu(gate) * up on one packed gate/up product: the product's epilogue
    for node in list(graph.find_nodes(op="call_function", target=aten.mul.Tensor)):
        gate_up = _gated_source(node)
        if gate_up is None or len(gate_up.users) != 1:
            continue
        if _call(gate_up, LINEAR) and _bias_free(gate_up):
            args = (gate_up.args[0], gate_up.args[1], None, 0.0, None, False, True, None)
        elif _call(gate_up, FUSED_LINEAR) and gate_up.args[2] is None and gate_up.args[4] is None \
                and gate_up.args[5:7] in ((), (False,), (False, False)):
            args = (*gate_up.args[:5], False, True, gate_up.args[7] if len(gate_up.args) > 7 else None)
        else:
            continue
        if not _rows_in_range(node, [args[1]]):
            out_of_range += 1
            continue
        with graph.inserting_before(node):
            fused = graph.call_function(FUSED_LINEAR, args)
        fused.meta = dict(node.meta)
        node.replace_all_uses_with(fused)
        bypassed.append(node)
        silu_muls += 1
    drop_dead_code(graph, [n for chain in chains for n in chain if not n._erased] + bypassed)
    recompile(gm)

    # Postconditions: no folded norm survives; each producer feeds readers that scale by its squares.
    ensure(all(n._erased for chain in chains for n in chain[:-1]), "fold_norms_rows", "a folded norm is left alive")
    ensure(all(n._erased for n in bypassed), "fold_norms_rows", "a folded SiLU·mul is left alive")
    producers = len(graph.find_nodes(op="call_function", target=NORM_OUT))
    ensure(producers == producers_before + norms, "fold_norms_rows",
           f"{producers} fused_linear_norm_out nodes; {producers_before} before + {norms} folded norms expected")
    scaled_readers = [n for n in graph.find_nodes(op="call_function", target=FUSED_LINEAR)
                      if len(n.args) > 7 and n.args[7] is not None]
    ensure(all(_call(n.args[7], operator.getitem) and n.args[7].args[0].target == NORM_OUT for n in scaled_readers),
           "fold_norms_rows", "a reader scales its rows by squares that no fused_linear_norm_out produced")
    return PassResult(gm, bool(norms or silu_muls),
                      {"norms_folded": norms, "silu_mul_folded": silu_muls, "rows_out_of_range": out_of_range})
