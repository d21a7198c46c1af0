"""all_reduce_partial_sums: the all-reduces of a tensor-parallel target (specgraph/parallel.py).

Requires: ``ctx.tp`` set (else the pass does nothing): the target was sharded by
  ``parallel.shard_model``, so each decoder layer's ``self_attn.o_proj`` and ``mlp.down_proj``
  (row-parallel) are one ``aten.linear`` each, inside a module whose path ends in that name, and
  their outputs are this rank's partial sums. Runs first in the pipeline: before any pass folds
  the residual add into the product (fold_norms), or fuses projections.
Ensures: every row-parallel product ``y = linear(x, W_r)`` is read only through
  ``wait_tensor(all_reduce(y, "sum", group))`` (torch.distributed's functional collectives, which
  survive the passes, torch.compile and CUDA graphs): exactly two per decoder layer, nothing else
  changes. The inserted nodes carry the product's metadata (module path, value), so passes that
  find layers by module path see them inside the layer. No host synchronisation is added.
"""
from __future__ import annotations

import torch

from .pass_result import GraphContext, PassResult, ensure, graph_pass, recompile

ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")
ALL_REDUCE = torch.ops._c10d_functional.all_reduce.default
WAIT = torch.ops._c10d_functional.wait_tensor.default


def _row_parallel(node: torch.fx.Node) -> str | None:
    """The module path when ``node`` is the linear of a row-parallel projection, else None."""
    paths = [path for path, _ in (node.meta.get("nn_module_stack") or {}).values()]
    if paths and paths[-1].endswith(ROW_PARALLEL):
        return paths[-1]
    return None


@graph_pass()  # first: nothing may fold into the row-parallel products before their all-reduce
def all_reduce_partial_sums(gm: torch.fx.GraphModule, ctx: GraphContext) -> PassResult:
    tp = ctx.tp
    if tp is None:
        return PassResult(gm, False, {"all_reduces": 0})
    from ..errors import CompileError

    graph = gm.graph
    products = [n for n in graph.find_nodes(op="call_function", target=torch.ops.aten.linear.default)
                if _row_parallel(n)]
    expected = 2 * ctx.info.num_layers
    paths = sorted({_row_parallel(n) for n in products})
    if len(products) != expected or len(paths) != expected:
        raise CompileError("tensor parallelism: the row-parallel products were not found", [
            f"expected one aten.linear in each of {expected} modules ending in {ROW_PARALLEL} "
            f"(2 per layer), found {len(products)} in {len(paths)} modules: {paths[:6]}"])
    for linear in products:
        with graph.inserting_after(linear):
            reduced = graph.call_function(ALL_REDUCE, (linear, "sum", tp.group_name))
        with graph.inserting_after(reduced):
            waited = graph.call_function(WAIT, (reduced,))
        for node in (reduced, waited):
            node.meta = {k: v for k, v in linear.meta.items() if k in ("nn_module_stack", "val", "tensor_meta")}
        linear.replace_all_uses_with(waited, delete_user_cb=lambda user: user is not reduced)
    graph.lint()
    recompile(gm)
    # Postcondition: each product is read by its all-reduce alone, and each all-reduce by its wait alone
    for linear in products:
        users = list(linear.users)
        reduced = users[0] if len(users) == 1 else None
        ensure(reduced is not None and reduced.target == ALL_REDUCE and reduced.args == (linear, "sum", tp.group_name),
               "all_reduce_partial_sums", f"{linear.name} is read by other nodes than its all-reduce")
        waits = list(reduced.users)
        ensure(len(waits) == 1 and waits[0].target == WAIT, "all_reduce_partial_sums",
               f"the all-reduce of {linear.name} is not read by its wait_tensor alone")
    ensure(len(graph.find_nodes(op="call_function", target=ALL_REDUCE)) == expected, "all_reduce_partial_sums",
           f"expected {expected} all-reduces")
    return PassResult(gm, True, {"all_reduces": len(products), "world_size": tp.world_size})
