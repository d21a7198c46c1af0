"""fuse_projections: the linear layers that read the same input become one matrix product.

``pack_projections(model)`` (run by ``Capture`` before anything is exported) lays out each
attention's q/k/v weights, and each MLP's gate/up weights, in one contiguous tensor: the modules keep
their Parameters, whose data become row slices of it (values unchanged, no second copy; HF's
``save_pretrained`` still writes them as separate tensors). The pass then sees, in the graph, linears
that share an input and whose weights lie back to back in memory, and reads them as one
``[sum(out), in]`` matrix: one GEMM (one weight stream, one launch, no split-K reduction per piece)
instead of three or two. At decode (M = B rows) a GEMM is a weight stream, and the small k/v products
alone ran at well under the copy bandwidth on the H200 (docs/benchmarks.md).

Requires: export IR (``aten.linear`` nodes, parameters as placeholders); ``ctx.params`` maps each
  parameter placeholder to its tensor.
Ensures: no two ``aten.linear`` nodes share an input while their weights (and biases, if any) lie back
  to back in one storage; each fused group is ``linear(x, W[, b])`` on a get_attr view of that storage
  (``meta["fused_from"]``: the parameter placeholders it joins, in order; export.py concatenates them),
  then ``split_with_sizes`` along the last dim, whose pieces replace the old outputs (same values, same
  shapes). Weights not laid out together are left alone (``linears_unfused`` counts the linears that
  share an input with another and were not fused).
"""
from __future__ import annotations

import math
import operator
from collections import defaultdict

import torch

from .pass_result import GraphContext, PassResult, ensure, graph_pass, recompile, val

LINEAR = torch.ops.aten.linear.default
SPLIT = torch.ops.aten.split_with_sizes.default
PACK_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # HF names of sibling projections


def _back_to_back(tensors: list[torch.Tensor]) -> bool:
    """True if ``tensors`` (same dtype and trailing shape, contiguous) tile one storage in order."""
    first = tensors[0]
    if any(t.dtype != first.dtype or t.device != first.device or t.shape[1:] != first.shape[1:]
           or not t.is_contiguous() or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
           for t in tensors):
        return False
    return all(b.storage_offset() == a.storage_offset() + a.numel() for a, b in zip(tensors, tensors[1:]))


def _place(t: torch.Tensor) -> tuple[int, int]:
    """Where ``t`` starts: (its storage, its offset in it)."""
    return t.untyped_storage().data_ptr(), t.storage_offset()


def _joined(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The one tensor that ``tensors`` (back to back) are row slices of: a view, no copy."""
    rows = sum(t.shape[0] for t in tensors)
    shape = (rows, *tensors[0].shape[1:])
    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))  # row-major
    return tensors[0].detach().as_strided(shape, stride)


def joined_view(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight, bias) of sibling ``linears`` as one product: views over their storage when their weights
    (and biases) lie back to back (``pack_projections``), else None."""
    weights, biases = [m.weight.data for m in linears], [m.bias for m in linears]
    if not _back_to_back(weights):
        return None
    if all(b is None for b in biases):
        return _joined(weights), None
    if any(b is None for b in biases) or not _back_to_back([b.data for b in biases]):
        return None
    return _joined(weights), _joined([b.data for b in biases])


@torch.no_grad()
def pack_projections(model: torch.nn.Module) -> int:
    """Lay out every group of sibling projections (PACK_GROUPS) back to back in one tensor, in place.
    A group already laid out, or one with a weight that is not a plain dense tensor of the same dtype,
    device and input width (quantized, offloaded to meta), is left as it is. Returns groups packed."""
    packed = 0
    for linears in projection_groups(model):
        weights = [m.weight for m in linears]
        biases = [m.bias for m in linears]
        if any(type(w.data) is not torch.Tensor or w.device.type == "meta" or w.dtype != weights[0].dtype
               or w.device != weights[0].device or w.shape[1] != weights[0].shape[1] for w in weights):
            continue
        if any(b is None for b in biases) and not all(b is None for b in biases):
            continue
        params = [weights] + ([biases] if biases[0] is not None else [])
        if all(_back_to_back([p.data for p in group]) for group in params):
            continue
        for group in params:
            whole = torch.cat([p.data for p in group])
            start = 0
            for p in group:
                p.data = whole[start:start + p.shape[0]]
                start += p.shape[0]
        packed += 1
    return packed


def projection_groups(model: torch.nn.Module):
    """Each group of sibling ``nn.Linear`` projections named in PACK_GROUPS, as a list of modules."""
    for parent in model.modules():
        for names in PACK_GROUPS:
            linears = [getattr(parent, n, None) for n in names]
            if all(isinstance(m, torch.nn.Linear) for m in linears):
                yield linears


# the taps and the LM-head slice find their nodes through module paths
@graph_pass(after=("tap_hidden_states", "prune_logits"))
def fuse_projections(gm: torch.fx.GraphModule, ctx: GraphContext) -> PassResult:
    graph = gm.graph
    params = ctx.params or {}
    # linears whose weight (and bias) are parameters, by (input, has bias)
    groups: dict[tuple, list[torch.fx.Node]] = defaultdict(list)
    for node in graph.find_nodes(op="call_function", target=LINEAR):
        weight, bias = node.args[1], node.args[2] if len(node.args) > 2 else None
        if getattr(weight, "name", None) in params and (bias is None or getattr(bias, "name", None) in params):
            groups[(node.args[0], bias is not None)].append(node)
    fused = linears_fused = unfused = 0
    order = {node: i for i, node in enumerate(graph.nodes)}  # the linears' order; fusing only inserts before them
    for (x, has_bias), nodes in groups.items():
        if len(nodes) < 2:
            continue
        nodes.sort(key=lambda n: _place(params[n.args[1].name]))  # by storage, then offset: a parallel block's
        # q/k/v and gate/up read one input from two storages
        runs, run = [], [nodes[0]]
        for node in nodes[1:]:
            pieces = [run[-1], node]
            ok = _back_to_back([params[n.args[1].name] for n in pieces]) and (
                not has_bias or _back_to_back([params[n.args[2].name] for n in pieces]))
            if ok:
                run.append(node)
            else:
                runs.append(run)
                run = [node]
        runs.append(run)
        for run in runs:
            if len(run) < 2:
                unfused += 1
                continue
            first = min(run, key=order.__getitem__)
            args = [x]
            for arg in range(1, 3 if has_bias else 2):
                name = f"_fused_{fused}_{'weight' if arg == 1 else 'bias'}"
                gm.register_buffer(name, _joined([params[n.args[arg].name] for n in run]), persistent=False)
                with graph.inserting_before(first):
                    args.append(graph.get_attr(name))
                args[-1].meta["fused_from"] = [n.args[arg].name for n in run]  # placeholders it joins
                if all(val(n.args[arg]) is not None for n in run):  # the joined weight's fake value, as export's
                    args[-1].meta["val"] = torch.cat([val(n.args[arg]) for n in run])
            sizes = [params[n.args[1].name].shape[0] for n in run]
            with graph.inserting_before(first):
                product = graph.call_function(LINEAR, tuple(args))
                split = graph.call_function(SPLIT, (product, sizes, -1))
            product.meta["nn_module_stack"] = first.meta.get("nn_module_stack")
            for i, node in enumerate(run):
                with graph.inserting_before(first):
                    piece = graph.call_function(operator.getitem, (split, i))
                piece.meta = dict(node.meta)
                node.replace_all_uses_with(piece)
            for node in run:
                graph.erase_node(node)
            fused += 1
            linears_fused += len(run)
    graph.lint()
    recompile(gm)

    # Postcondition: no two parameter linears with back-to-back weights share an input.
    left: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for node in graph.find_nodes(op="call_function", target=LINEAR):
        if getattr(node.args[1], "name", None) in params:
            left[(node.args[0], len(node.args) > 2)].append(params[node.args[1].name])
    for weights in left.values():
        weights.sort(key=_place)
        ensure(not any(_back_to_back([a, b]) for a, b in zip(weights, weights[1:])), "fuse_projections",
               "fusable linears left")
    return PassResult(gm, fused > 0, {"groups_fused": fused, "linears_fused": linears_fused,
                                      "linears_unfused": unfused})
