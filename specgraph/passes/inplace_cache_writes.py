"""inplace_cache_writes: each layer's two cache writes become one ``specgraph::kv_write``.

Requires: replace_attention has run: per layer l, ``scatter_(select(kv, 0, 2l), 2, index, k)``
  then ``scatter_(select(kv, 0, 2l + 1), 2, index, v)`` with the same index, and every use of a
  write's result comes after the layer's V write.
Ensures: no ``scatter_`` into ``kv`` is left; exactly one ``specgraph::kv_write(kv, l, index, k, v)``
  per layer (it mutates ``kv``: impure, never eliminated); every former use of a write's result reads
  ``select(kv, 0, c)`` placed right after its layer's kv_write, so each read still follows its write.
Why: torch.compile functionalizes a scatter into a view of a graph input (``kv[2l]``) into a
  ``select_scatter`` of the whole stacked base, which inductor did not re-inplace: every compiled step
  copied every layer's cache, and step time grew with max_length instead of the context (on the CPU,
  a tiny Llama's plain decode went from 1.2 to 20.5 ms/token between max_length 128 and 32768). An op
  that declares its mutation is kept in place. Eager runs the op; export traces its reference
  (plain scatters, which torch.export functionalizes: export.py).
"""
from __future__ import annotations

import torch

from .. import kernels  # noqa: F401  (registers the specgraph ops)
from .pass_result import GraphContext, PassResult, ensure, graph_pass, recompile

aten = torch.ops.aten
SCATTER = aten.scatter_.src
SELECT = aten.select.int
KV_WRITE = torch.ops.specgraph.kv_write.default


def _cache_index(node: torch.fx.Node, kv: torch.fx.Node) -> int | None:
    """c if ``node`` is ``scatter_(select(kv, 0, c), 2, index, src)``."""
    target = node.args[0]
    if (isinstance(target, torch.fx.Node) and target.target == SELECT and target.args[0] is kv
            and target.args[1] == 0 and node.args[1] == 2):
        return int(target.args[2])
    return None


@graph_pass(after=("replace_attention",))  # which finds each layer's K/V through its scatter_ writes
def inplace_cache_writes(gm: torch.fx.GraphModule, ctx: GraphContext) -> PassResult:
    graph = gm.graph
    kv = ctx.placeholder(gm, "kv")
    layers = ctx.info.num_layers
    writes: dict[int, torch.fx.Node] = {}
    for node in graph.find_nodes(op="call_function", target=SCATTER):
        c = _cache_index(node, kv)
        if c is not None:
            ensure(c not in writes, "inplace_cache_writes",
                   f"cache {c} written twice")
            writes[c] = node
    ensure(sorted(writes) == list(range(2 * layers)), "inplace_cache_writes",
           f"cache writes {sorted(writes)}, expected 0 .. {2 * layers - 1}")
    order = {node: i for i, node in enumerate(graph.nodes)}
    for layer in range(layers):
        k_write, v_write = writes[2 * layer], writes[2 * layer + 1]
        ensure(k_write.args[2] is v_write.args[2], "inplace_cache_writes",
               f"layer {layer}: K and V written at different slots")
        ensure(order[k_write] < order[v_write], "inplace_cache_writes",
               f"layer {layer}: V written before K")
        early = [u.name for w in (k_write, v_write) for u in w.users if order[u] < order[v_write]]
        ensure(not early, "inplace_cache_writes",
               f"layer {layer}: {early} read a cache write before the layer's V write")
        with graph.inserting_after(v_write):
            op = graph.call_function(KV_WRITE, (kv, layer, k_write.args[2], k_write.args[3], v_write.args[3]))
        op.meta["val"] = None
        last = op
        for write, c in ((k_write, 2 * layer), (v_write, 2 * layer + 1)):
            with graph.inserting_after(last):
                read = graph.call_function(SELECT, (kv, 0, c))
            read.meta["val"] = write.meta.get("val")
            write.replace_all_uses_with(read)
            last = read
        graph.erase_node(v_write)
        graph.erase_node(k_write)
    graph.eliminate_dead_code()
    recompile(gm)

    # Postconditions.
    ensure(not [n for n in graph.find_nodes(op="call_function", target=SCATTER) if _cache_index(n, kv) is not None],
           "inplace_cache_writes", "a scatter_ into kv is left")
    ops = graph.find_nodes(op="call_function", target=KV_WRITE)
    ensure(sorted(int(n.args[1]) for n in ops) == list(range(layers)), "inplace_cache_writes",
           "not one kv_write per layer")
    position = {node: i for i, node in enumerate(graph.nodes)}
    written_at = {int(n.args[1]): position[n] for n in ops}
    for read in graph.find_nodes(op="call_function", target=SELECT):
        if read.args[0] is kv and read.users:
            ensure(position[read] > written_at[int(read.args[2]) // 2], "inplace_cache_writes",
                   f"{read.name} reads before its write")
    return PassResult(gm, True, {"kv_writes": len(ops), "scatters_replaced": 2 * layers})
