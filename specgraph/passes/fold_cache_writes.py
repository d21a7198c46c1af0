"""fold_cache_writes: each layer's ``kv_write`` folds into its ``tree_attention``, one launch per layer.

Requires: inplace_cache_writes has run: per layer l, ``kv_write(kv, l, index, k, v)`` followed by
  ``select(kv, 0, 2l)`` / ``select(kv, 0, 2l + 1)``, with ``index`` the step's slots
  ``cache_len + arange(R)`` (capture's ``_TreeCache``, broadcast over heads and head_dim).
Ensures: a layer whose two reads feed only its ``tree_attention(q, k_read, v_read, cache_len,
  tree_mask, scale, window)`` over R = N rows becomes one ``specgraph::tree_attention_write(q, kv, l, k,
  v, cache_len, tree_mask, scale, window)`` at the attention's place (it mutates ``kv``: impure, never
  eliminated); any other layer keeps its ``kv_write`` (counted, not refused: this is a speed-up, not a
  requirement). Every layer's K/V is still written exactly once, before anything reads it.
Why: the write was a launch of its own (~1.5 us per layer on the H200, ~0.05 ms of SmolLM2's
  1.08 ms step); the attention reads window slot j's K/V (row j of this step) from the step's own
  tensors instead of the cache, and one of its programs writes them to the cache. Prefix programs read
  only slots below cache_len, so nothing races with the write.
"""
from __future__ import annotations

import logging

import torch

from .. import kernels  # noqa: F401  (registers the specgraph ops)
from .pass_result import GraphContext, PassResult, ensure, graph_pass, recompile, walk_back

log = logging.getLogger(__name__)
aten = torch.ops.aten
KV_WRITE = torch.ops.specgraph.kv_write.default
TREE_ATTENTION = torch.ops.specgraph.tree_attention.default
TREE_ATTENTION_WRITE = torch.ops.specgraph.tree_attention_write.default
SHAPE_OPS = {aten.expand.default, aten.expand_as.default, aten.view.default, aten.reshape.default,
             aten.unsqueeze.default, aten._unsafe_view.default}
CASTS = {aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.unsqueeze.default, aten.view.default}


def _is_step_slots(index, cache_len: torch.fx.Node, rows: int) -> bool:
    """``index`` is, up to shape ops, ``cache_len + arange(rows)``."""
    add = walk_back(index, SHAPE_OPS)
    if not (isinstance(add, torch.fx.Node) and add.target == aten.add.Tensor and len(add.args) == 2):
        return False
    for base, ramp in (add.args, add.args[::-1]):
        if (walk_back(base, CASTS) is cache_len and isinstance(ramp, torch.fx.Node) and ramp.target == aten.arange.default
                and tuple(ramp.args) == (rows,)):
            return True
    return False


def _layer_plan(write: torch.fx.Node, cache_len, reads_of: dict):
    """(reads, attention) if layer ``write.args[1]``'s write can fold into its attention, else the reason."""
    layer = int(write.args[1])
    reads = reads_of.get(2 * layer, []), reads_of.get(2 * layer + 1, [])
    if len(reads[0]) != 1 or len(reads[1]) != 1:
        return f"layer {layer}: its caches are read {len(reads[0])} / {len(reads[1])} times, not once each"
    (k_read,), (v_read,) = reads
    users = set(k_read.users) | set(v_read.users)
    attention = next(iter(users)) if len(users) == 1 else None
    if attention is None or attention.target != TREE_ATTENTION or attention.args[1:3] != (k_read, v_read):
        return f"layer {layer}: its caches feed {sorted(u.name for u in users)}, not one tree_attention"
    q_val, key_val = attention.args[0].meta.get("val"), write.args[3].meta.get("val")
    if q_val is None or key_val is None:
        return f"layer {layer}: no shape recorded on the query or the new keys"
    rows = q_val.shape[2]
    if key_val.shape[2] != rows or not _is_step_slots(write.args[2], cache_len, rows):
        return f"layer {layer}: the write's slots are not cache_len + arange({rows}) of the attention's rows"
    return (k_read, v_read), attention


@graph_pass(after=("replace_attention", "inplace_cache_writes"))  # it folds kv_write into tree_attention
def fold_cache_writes(gm: torch.fx.GraphModule, ctx: GraphContext) -> PassResult:
    graph = gm.graph
    kv, cache_len = ctx.placeholder(gm, "kv"), ctx.placeholder(gm, "cache_len")
    reads_of: dict[int, list[torch.fx.Node]] = {}
    for node in graph.find_nodes(op="call_function", target=aten.select.int):
        if node.args[0] is kv and node.args[1] == 0:
            reads_of.setdefault(int(node.args[2]), []).append(node)
    folded, unfolded = 0, []
    for write in list(graph.find_nodes(op="call_function", target=KV_WRITE)):
        plan = _layer_plan(write, cache_len, reads_of)
        if isinstance(plan, str):
            unfolded.append(plan)
            continue
        reads, attention = plan
        q, _, _, _, tree_mask, scale, window = attention.args
        with graph.inserting_before(attention):
            fused = graph.call_function(TREE_ATTENTION_WRITE, (q, kv, write.args[1], write.args[3], write.args[4],
                                                               attention.args[3], tree_mask, scale, window))
        fused.meta.update(val=attention.meta.get("val"), nn_module_stack=attention.meta.get("nn_module_stack", {}))
        attention.replace_all_uses_with(fused)
        for node in (attention, *reads, write):
            graph.erase_node(node)
        folded += 1
    graph.eliminate_dead_code()  # the slot arithmetic only the writes read
    recompile(gm)

    # Postconditions: every layer written exactly once, by a fold or a kv_write, each before its reads.
    layers = ctx.info.num_layers
    fused = graph.find_nodes(op="call_function", target=TREE_ATTENTION_WRITE)
    writes = graph.find_nodes(op="call_function", target=KV_WRITE)
    written = sorted(int(n.args[2]) for n in fused) + sorted(int(n.args[1]) for n in writes)
    ensure(sorted(written) == list(range(layers)), "fold_cache_writes",
           f"layers written {sorted(written)}, expected 0 .. {layers - 1}")
    ensure(len(fused) == folded and len(writes) == layers - folded, "fold_cache_writes",
           f"{len(fused)} folded and {len(writes)} kv_write nodes; {folded} and {layers - folded} expected")
    ensure(all(n.args[1] is kv for n in fused), "fold_cache_writes",
           "a folded write does not mutate the stacked cache")
    if unfolded:
        log.debug("fold_cache_writes left these writes apart:\n  %s", "\n  ".join(unfolded))
    return PassResult(gm, folded > 0, {"writes_folded": folded, "writes_unfolded": len(unfolded)})
