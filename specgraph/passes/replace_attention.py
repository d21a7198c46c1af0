"""replace_attention: every causal SDPA of the captured target becomes
``specgraph::tree_attention``.

Requires: a graph from ``capture.export_tree_step`` (export IR, before
  decompositions): placeholders ``cache_len``, ``tree_mask`` and the stacked
  cache buffer ``kv``; in each attention layer one
  ``aten.scaled_dot_product_attention`` whose key/value are the results of
  the layer's cache writes (``scatter_`` into ``kv[2l]`` / ``kv[2l+1]``),
  possibly expanded by HF's ``repeat_kv`` or used with ``enable_gqa``, and
  whose mask is a ``specgraph::tree_attention_mask(cache_len, tree_mask, S,
  window)`` node (possibly sliced), with no dropout and ``is_causal=False``.
Ensures: no SDPA node is left; exactly one ``tree_attention`` per attention
  layer, reading the cache-write nodes directly (un-expanded: the kernel does
  GQA) with the layer's window; the dense masks and ``repeat_kv`` expansions
  are dead and eliminated; all 2L cache writes remain.
Anything else (another mask or bias — ALiBi, sinks —, causal SDPA without our
mask, keys not from the cache — cross-attention —, dropout, other SDPA ops)
is refused with a CompileError listing every blocker by layer and node.
"""
from __future__ import annotations

import torch

from .. import kernels  # noqa: F401  (registers the specgraph ops)
from .pass_result import GraphContext, PassResult, ensure, graph_pass, recompile, walk_back

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default
TREE_ATTENTION = torch.ops.specgraph.tree_attention.default
TREE_MASK = torch.ops.specgraph.tree_attention_mask.default
CACHE_WRITE = aten.scatter_.src
# Shape-only ops between a cache write and SDPA (HF's repeat_kv; mask slicing).
VIEW_OPS = {aten.expand.default, aten.reshape.default, aten.view.default, aten.unsqueeze.default,
            aten.slice.Tensor, aten._unsafe_view.default, aten.contiguous.default, aten.alias.default}
CASTS = {aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default}  # integer no-op casts of inputs
OTHER_SDPA = {name for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                                "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
                                "_scaled_dot_product_attention_math", "_flash_attention_forward")}
SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _layer_name(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else node.name


def _cache_slot(node, kv: torch.fx.Node):
    """(write node, cache index) if ``node`` is, up to views, a write into kv[index]."""
    write = walk_back(node, VIEW_OPS)
    if isinstance(write, torch.fx.Node) and write.op == "call_function" and write.target == CACHE_WRITE:
        select = write.args[0]
        if (isinstance(select, torch.fx.Node) and select.target == aten.select.int and select.args[0] is kv
                and select.args[1] == 0):
            return write, int(select.args[2])
    return None, None


def _sdpa_args(node: torch.fx.Node) -> dict:
    args = dict(zip(SDPA_ARGS, node.args))
    args.update(node.kwargs)
    return args


@graph_pass()
def replace_attention(gm: torch.fx.GraphModule, ctx: GraphContext) -> PassResult:
    graph = gm.graph
    info = ctx.info
    kv, cache_len, tree_mask = (ctx.placeholder(gm, role) for role in ("kv", "cache_len", "tree_mask"))
    nodes_before = len(graph.nodes)
    blockers, plans = [], []
    for node in graph.nodes:
        if node.op == "call_function" and getattr(node.target, "__name__", "").split(".")[0] in OTHER_SDPA:
            blockers.append(f"{_layer_name(node)}: node {node.name} calls {node.target}, an attention op the passes "
                            f"do not rewrite (capture with attn_implementation='sdpa')")
    for node in graph.find_nodes(op="call_function", target=SDPA):
        where = f"{_layer_name(node)} (node {node.name})"
        a = _sdpa_args(node)
        problems = []
        k_write, k_slot = _cache_slot(a["key"], kv)
        v_write, v_slot = _cache_slot(a["value"], kv)
        if k_write is None or v_write is None:
            problems.append("keys/values do not come from the KV cache (cross-attention or precomputed keys)")
        elif k_slot % 2 or v_slot != k_slot + 1:
            problems.append(f"keys from cache {k_slot} and values from cache {v_slot} are not one layer's K and V")
        mask = walk_back(a.get("attn_mask"), VIEW_OPS)
        if a.get("is_causal"):
            problems.append("is_causal=True: causal attention without the tree mask")
        if not (isinstance(mask, torch.fx.Node) and mask.target == TREE_MASK):
            problems.append("the attention mask is not the tree mask alone (an added bias such as ALiBi or "
                            "attention sinks, or a mask the model built itself)")
        elif walk_back(mask.args[0], CASTS) is not cache_len or walk_back(mask.args[1], CASTS) is not tree_mask:
            problems.append("the tree mask is not built from the step's cache_len and tree_mask")
        if a.get("dropout_p", 0.0) not in (0, 0.0):
            problems.append(f"dropout_p={a['dropout_p']} (put the model in eval mode)")
        layer = None if k_slot is None else k_slot // 2
        if not problems:
            window = int(mask.args[3])
            expected = info.layer_windows[layer]
            if window != expected:
                problems.append(f"layer {layer} attends with window {window} but its config says {expected}")
        if problems:
            blockers += [f"{where}: {p}" for p in problems]
            continue
        head_dim = a["query"].meta["val"].shape[-1]
        scale = a.get("scale") or head_dim**-0.5
        plans.append((node, layer, a["query"], k_write, v_write, float(scale), int(mask.args[3])))
    layers = sorted(p[1] for p in plans)
    if not blockers:
        missing = sorted(set(range(info.num_layers)) - set(layers))
        repeated = sorted({l for l in layers if layers.count(l) > 1})
        if missing:
            blockers.append(f"layers {missing}: no SDPA over the KV cache found (attention implemented another way, "
                            f"e.g. eager softmax or a custom kernel; capture with attn_implementation='sdpa')")
        if repeated:
            blockers.append(f"layers {repeated}: more than one SDPA per layer")
    if blockers:
        from ..errors import CompileError

        raise CompileError("replace_attention cannot prove these attention calls are causal tree attention", blockers)

    for node, layer, query, k_write, v_write, scale, window in plans:
        with graph.inserting_before(node):
            new = graph.call_function(TREE_ATTENTION, (query, k_write, v_write, cache_len, tree_mask, scale, window))
        val = node.meta.get("val")
        if val is not None:
            new.meta["val"] = val.new_empty(val.shape)  # contiguous, like the kernel's output
        new.meta["nn_module_stack"] = node.meta.get("nn_module_stack", {})
        node.replace_all_uses_with(new)
        graph.erase_node(node)
    masks_before = len(graph.find_nodes(op="call_function", target=TREE_MASK))
    graph.eliminate_dead_code()
    recompile(gm)

    # Postconditions.
    ensure(not graph.find_nodes(op="call_function", target=SDPA), "replace_attention",
           "SDPA left after replace_attention")
    rewritten = graph.find_nodes(op="call_function", target=TREE_ATTENTION)
    ensure(len(rewritten) == info.num_layers, "replace_attention",
           f"{len(rewritten)} tree_attention nodes for {info.num_layers} layers")
    writes = graph.find_nodes(op="call_function", target=CACHE_WRITE)
    ensure(len(writes) == 2 * info.num_layers, "replace_attention",
           f"{len(writes)} cache writes kept, expected {2 * info.num_layers}")
    ensure(not graph.find_nodes(op="call_function", target=TREE_MASK), "replace_attention",
           "a dense tree mask is still used")
    return PassResult(gm, True, {
        "sdpa_replaced": len(plans),
        "sliding_window_layers": sum(1 for p in plans if p[6] > 0),
        "dense_masks_removed": masks_before,
        "cache_writes_kept": len(writes),
        "nodes_before": nodes_before,
        "nodes_after": len(graph.nodes),
    })


