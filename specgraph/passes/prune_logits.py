"""prune_logits: compute the LM head only for the node rows that need it.

Requires: one LM-head ``aten.linear`` (module path ending ``lm_head``) over
  ``[B, N, hidden]``.
Ensures: with ``ctx.logits_rows = (start, stop)`` the head sees
  ``hidden[:, start:stop]`` and the logits output is ``[B, stop-start, V]``
  (a prefill chunk needs only its last row; a verify step needs all N).
  Hidden-state taps are unaffected.
"""
from __future__ import annotations

import torch

from .pass_result import GraphContext, PassResult, ensure, graph_pass, lm_head_nodes, recompile


# the taps find layer boundaries by module path, before the LM head reads a slice
@graph_pass(after=("tap_hidden_states",))
def prune_logits(gm: torch.fx.GraphModule, ctx: GraphContext) -> PassResult:
    if ctx.logits_rows is None:
        return PassResult(gm, False, {"rows": -1})
    start, stop = ctx.logits_rows
    heads = lm_head_nodes(gm)
    ensure(len(heads) == 1, "prune_logits",
           f"{len(heads)} LM-head linear nodes")
    head = heads[0]
    hidden = head.args[0]
    n = hidden.meta["val"].shape[1]
    if not 0 <= start < stop <= n:
        raise ValueError(f"logits_rows=({start}, {stop}) must lie inside the step's {n} nodes")
    with gm.graph.inserting_before(head):
        rows = gm.graph.call_function(torch.ops.aten.slice.Tensor, (hidden, 1, start, stop))
    rows.meta["val"] = hidden.meta["val"][:, start:stop]
    head.replace_input_with(hidden, rows)
    gm.graph.lint()
    recompile(gm)
    ensure(head.args[0] is rows, "prune_logits", "the LM head does not read the row slice")
    return PassResult(gm, True, {"rows": stop - start, "rows_pruned": n - (stop - start)})
