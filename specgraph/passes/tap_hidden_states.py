"""tap_hidden_states: return residual-stream states of chosen layers (and the
final pre-LM-head state) as extra graph outputs, for the draft to read.

Requires: the captured step (any point of the pipeline); decoder layers are
  modules whose path ends in ``layers.<i>``; the LM head is an ``aten.linear``
  inside a module whose path ends in ``lm_head``.
Ensures: the output tuple is ``(logits, tap_0, tap_1, ...)`` in the order of
  ``HiddenTaps.layer_ids`` then ``final``; each tap is ``[B, N, hidden]``.
  Nothing else changes. A layer whose output cannot be identified uniquely is
  a blocker (CompileError).
"""
from __future__ import annotations

import re

import torch

from .pass_result import GraphContext, PassResult, ensure, graph_pass, lm_head_nodes, recompile

LAYER = re.compile(r"(?:^|\.)layers\.(\d+)$")


def _layer_of(node: torch.fx.Node) -> int | None:
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        match = LAYER.search(path)
        if match:
            return int(match.group(1))
    return None


def _is_hidden(node, hidden: int) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dim() == 3 and val.shape[-1] == hidden and val.is_floating_point()


def layer_boundaries(gm: torch.fx.GraphModule, hidden: int, num_layers: int):
    """(inputs, outputs, lm_head_input): per layer the residual state entering and leaving it."""
    layer = {n: _layer_of(n) for n in gm.graph.nodes}
    outputs, inputs, problems = {}, {}, []
    for i in range(num_layers):
        inside = [n for n in gm.graph.nodes if layer[n] == i and n.op == "call_function"]
        leaving = [n for n in inside if _is_hidden(n, hidden) and any(layer[u] != i for u in n.users)]
        entering = {a for n in inside for a in n.all_input_nodes if layer[a] != i and _is_hidden(a, hidden)}
        if len(leaving) == 1:
            outputs[i] = leaving[0]
        else:
            problems.append(f"layer {i}: {len(leaving)} candidate outputs {[n.name for n in leaving]}")
        if len(entering) == 1:
            inputs[i] = entering.pop()
        else:
            problems.append(f"layer {i}: {len(entering)} candidate inputs")
    heads = lm_head_nodes(gm)
    lm_input = heads[0].args[0] if len(heads) == 1 else None
    if lm_input is None:
        problems.append(f"{len(heads)} LM-head linear nodes found (expected 1)")
    return inputs, outputs, lm_input, problems


@graph_pass()
def tap_hidden_states(gm: torch.fx.GraphModule, ctx: GraphContext) -> PassResult:
    taps = ctx.taps
    if taps is None or (not taps.layer_ids and not taps.final):
        return PassResult(gm, False, {"taps": 0})
    info = ctx.info
    heads = lm_head_nodes(gm)
    if len(heads) != 1:
        from ..errors import CompileError

        raise CompileError("tap_hidden_states cannot find the LM head", [f"{len(heads)} LM-head linear nodes (expected 1)"])
    hidden = heads[0].args[0].meta["val"].shape[-1]  # the residual width: the LM head's input features
    inputs, outputs, lm_input, problems = layer_boundaries(gm, hidden, info.num_layers)
    chosen = []
    for i in taps.layer_ids:
        if not 0 <= i < info.num_layers:
            problems.append(f"tap layer {i}: the model has layers 0 .. {info.num_layers - 1}")
            continue
        chosen.append((inputs if taps.convention == "layer_input" else outputs).get(i))
    if taps.final:
        chosen.append(lm_input)
    if problems or any(c is None for c in chosen):
        from ..errors import CompileError

        raise CompileError("tap_hidden_states cannot find the requested states", problems or ["unidentified layer"])
    output = next(iter(gm.graph.find_nodes(op="output")))
    results = tuple(output.args[0])
    output.args = (results + tuple(chosen),)
    recompile(gm)
    outputs = len(gm.graph.find_nodes(op="output")[0].args[0])
    ensure(outputs == len(results) + len(chosen), "tap_hidden_states",
           f"{outputs} outputs; {len(results)} before + {len(chosen)} taps expected")
    return PassResult(gm, True, {"taps": len(chosen), "outputs": len(results) + len(chosen)})

