"""The invariants of README.md here that hold at every stage of the pipeline, checked as one function.

``run_pipeline`` calls ``check_invariants`` after every pass when ``config.check_graph`` or
``config.debug`` is on (the tests turn it on: tests/conftest.py). Each pass still checks its own
postcondition; this catches a pass that breaks what another one set up.
"""
from __future__ import annotations

import torch

from .. import kernels  # noqa: F401  (registers the specgraph ops)
from .pass_result import GraphContext, PassContractError

aten = torch.ops.aten
SCATTER = aten.scatter_.src
SELECT = aten.select.int
KV_WRITE = torch.ops.specgraph.kv_write.default
TREE_ATTENTION_WRITE = torch.ops.specgraph.tree_attention_write.default
# ops that make the host wait for the device (invariant 3: the step must replay inside one CUDA graph)
HOST_SYNCS = (aten._local_scalar_dense.default, aten.item.default, aten.nonzero.default,
              aten.masked_select.default, aten.unique_consecutive.default, aten._unique2.default)


def cache_writes(gm: torch.fx.GraphModule, ctx: GraphContext) -> tuple[list[int], list[int]]:
    """The stacked cache's writes: (layers written by kv_write / tree_attention_write, cache slices
    ``c`` written by export's ``scatter_(select(kv, 0, c), ...)``)."""
    kv = ctx.placeholder(gm, "kv")
    graph = gm.graph
    layers = [int(n.args[1]) for n in graph.find_nodes(op="call_function", target=KV_WRITE)]
    layers += [int(n.args[2]) for n in graph.find_nodes(op="call_function", target=TREE_ATTENTION_WRITE)]
    slices = []
    for node in graph.find_nodes(op="call_function", target=SCATTER):
        target = node.args[0]
        if isinstance(target, torch.fx.Node) and target.target == SELECT and target.args[0] is kv:
            slices.append(int(target.args[2]))
    return layers, slices


def problems(gm: torch.fx.GraphModule, ctx: GraphContext) -> list[str]:
    """What is wrong with ``gm`` against the invariants (empty: nothing)."""
    found = []
    try:
        gm.graph.lint()
    except Exception as err:  # noqa: BLE001 - torch.fx raises plain RuntimeErrors; reported as a problem
        found.append(f"torch.fx lint: {err}")
    for role in ("kv", "cache_len", "tree_mask"):
        try:
            ctx.placeholder(gm, role)
        except KeyError as err:
            found.append(str(err.args[0]))
    if found:
        return found
    n_layers = ctx.info.num_layers
    layers, slices = cache_writes(gm, ctx)
    if layers or not slices:  # after inplace_cache_writes: one write per layer, by either op
        if sorted(layers) != list(range(n_layers)) or slices:
            found.append(f"invariant 1: layers written {sorted(layers)} (and {len(slices)} scatter_ into kv); "
                         f"each of 0..{n_layers - 1} must be written exactly once")
    elif sorted(slices) != list(range(2 * n_layers)):
        found.append(f"invariant 1: cache slices written {sorted(slices)}; each of 0..{2 * n_layers - 1} once")
    syncs = [n.name for n in gm.graph.nodes if n.op == "call_function" and n.target in HOST_SYNCS]
    if syncs:
        found.append(f"invariant 3: host synchronisations {syncs}")
    (outputs,) = gm.graph.find_nodes(op="output")[0].args
    if not outputs:
        found.append("the step returns nothing: its first output must be the logits")
    return found


def check_invariants(gm: torch.fx.GraphModule, ctx: GraphContext, after: str) -> None:
    """Raise ``PassContractError`` naming the pass ``after`` which the graph broke the invariants."""
    broken = problems(gm, ctx)
    if broken:
        raise PassContractError(f"after pass {after}: " + "; ".join(broken))
