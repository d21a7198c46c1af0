"""fold_rotary: each layer's RoPE on q and k moves into its ``tree_attention_write``.

Requires: fold_cache_writes has run: per folded layer ``tree_attention_write(q, kv, l, key, value,
  cache_len, tree_mask, scale, window)`` whose q and key are HF's ``apply_rotary_pos_emb`` (rotate_half
  convention, whole head_dim) of two tensors with the same cos/sin: ``x * cos.unsqueeze(1) +
  cat(-x[..., D/2:], x[..., :D/2]) * sin.unsqueeze(1)``, up to a cast to the dtype it already has
  and a concatenation with an empty pass-through part (partial-rotary code, e.g. Phi-3, at factor 1).
  Only steps of one row per sequence (plain decoding) or of up to ``max_rows(head_dim)`` rows in all
  fold: 64 for heads of up to 64 dims (a verify step of up to 64 nodes at batch 1), 8 for wider heads.
Ensures: such a layer becomes ``tree_attention_write(q0, kv, l, k0, value, cache_len, tree_mask, scale,
  window, cos, sin)`` on the unrotated q0 / k0 (cos, sin [B, R, D]: the step's tables, shared by every
  layer that uses them); the kernel rotates q at load and the keys before it reads and stores them.
  Any other layer (partial rotary, another convention, no RoPE, more rows) keeps its rotated inputs,
  counted, not refused: this is a speed-up. The same tree_attention_write nodes remain, one per folded layer.
Why: inductor ran each layer's RoPE as launches of its own (q and k: 3.4 + 2.5 us per layer of the 8B
  step in a profile of 2026-11-30, docs/results/); in the kernel it is a second load of q and of the new keys.
  Folded, the 8B plain decode step measured 0.05-0.07 ms (1.1-1.4%) faster on the H200, the 64-node
  SmolLM2 verify step 0.18 ms (15%); the 64-node 8B one 0.34 ms slower (so wide heads stop at 8 rows).
"""
from __future__ import annotations

import logging

import torch

from .. import kernels  # noqa: F401  (registers the specgraph ops)
from .pass_result import GraphContext, PassResult, drop_dead_code, ensure, graph_pass, recompile, walk_back
from .pass_result import is_call as _call, val as _val
from .replace_attention import CASTS

log = logging.getLogger(__name__)
aten = torch.ops.aten
TREE_ATTENTION_WRITE = torch.ops.specgraph.tree_attention_write.default
# Rows of a step (B x R) up to which the fold is measured faster when R > 1 (R = 1 folds at any batch),
# by head width (H200, 1k context). R = 1, Llama-3.1-8B shape: the plain decode step 4.856 -> 4.789-4.804
# ms (2026-12-01). Heads of up to 64 dims (SmolLM2): the 64-node verify step 1.156 -> 0.977 ms of device
# time (2026-12-02; in its profile the attention kernel took 0.9 us more a layer, the two RoPE
# launches it replaces 6.6 us). Wider heads (8B's 128): the 64-node verify step 5.46-5.49 -> 5.83 ms, 1.27x
# -> 1.36x its plain step (2026-12-02; in the profile the attention kernel took 25.7 us a layer
# with the rotation against 9.8 without, the RoPE launches 6.1 us), the 8-node one folded 4.46 ms either
# way; a one-launch kernel benchmark at the same shape saw only +3.3 us. The rotating kernel spills
# registers at that tile (ptxas: 2292 bytes a thread against 316 without RoPE); a half-by-half rotation
# that spilled 440 brought the folded step to 5.455 ms, still no faster than unfolded (5.430 in the same
# run, 2026-12-02), so it went. Not measured at batch > 1 with R > 1 (those fold up to the same
# rows in all).
MAX_ROWS = 64  # heads of up to NARROW_HEAD_DIM dims
MAX_ROWS_WIDE_HEADS = 8
NARROW_HEAD_DIM = 64


def max_rows(head_dim: int) -> int:
    """The most rows a step of ``head_dim``-wide heads may have for its RoPE to fold (MAX_ROWS or
    MAX_ROWS_WIDE_HEADS): measured speed limits, not correctness ones."""
    return MAX_ROWS if head_dim <= NARROW_HEAD_DIM else MAX_ROWS_WIDE_HEADS


def _no_op_cast(node) -> bool:
    """A cast to the dtype the tensor already has (export keeps ``x.to(kv.dtype)`` when equal)."""
    return (_val(node) is not None and _val(node.args[0]) is not None
            and _val(node).dtype == _val(node.args[0]).dtype)


def _last_dim(dim, rank: int) -> bool:
    return dim in (-1, rank - 1)


def _table(node):
    """``t`` when node is ``t.unsqueeze(1)``, t [B, R, D]; else None."""
    if _call(node, aten.unsqueeze.default) and node.args[1] == 1 and _val(node.args[0]) is not None:
        return node.args[0] if _val(node.args[0]).dim() == 3 else None
    return None


def _turned_source(node):
    """``x`` when node is rotate_half(x) = ``cat([-x[..., D/2:], x[..., :D/2]], -1)``; else None."""
    if not (_call(node, aten.cat.default) and len(node.args[0]) == 2 and _val(node) is not None):
        return None
    rank = _val(node).dim()
    if len(node.args) > 1 and not _last_dim(node.args[1], rank):
        return None
    neg, low = node.args[0]
    if not (_call(neg, aten.neg.default) and _call(low, aten.slice.Tensor) and _call(neg.args[0], aten.slice.Tensor)):
        return None
    high = neg.args[0]
    x = low.args[0]
    if high.args[0] is not x or _val(x) is None or any(len(s.args) > 4 and s.args[4] != 1 for s in (low, high)):
        return None  # another tensor, or a strided slice
    d = _val(x).shape[-1]
    low_ok = _last_dim(low.args[1], rank) and tuple(low.args[2:4]) == (0, d // 2)
    high_ok = _last_dim(high.args[1], rank) and high.args[2] == d // 2 and (len(high.args) < 4 or high.args[3] >= d)
    return x if d % 2 == 0 and low_ok and high_ok else None


def _rope_parts(node):
    """(x, cos, sin, the rotated node) when ``node`` is HF's ``x * cos.unsqueeze(1) + rotate_half(x) *
    sin.unsqueeze(1)`` in x's own dtype; else None."""
    node = rotated_out = walk_back(node, CASTS, keep=_no_op_cast)
    if _call(node, aten.cat.default) and len(node.args[0]) == 2 and _val(node.args[0][1]) is not None \
            and _val(node.args[0][1]).shape[-1] == 0:  # partial-rotary code at factor 1: nothing passes through
        node = node.args[0][0]
    if not (_call(node, aten.add.Tensor) and len(node.args) == 2):
        return None
    if not all(_call(m, aten.mul.Tensor) and len(m.args) == 2 for m in node.args):
        return None
    for plain, turned in (node.args, node.args[::-1]):
        for x, cos_u in (plain.args, plain.args[::-1]):
            for rotated, sin_u in (turned.args, turned.args[::-1]):
                cos, sin = _table(cos_u), _table(sin_u)
                if cos is None or sin is None or _turned_source(rotated) is not x:
                    continue
                out, x_val = _val(node), _val(x)
                if x_val is None or out is None or out.dtype != x_val.dtype or out.shape != x_val.shape:
                    continue
                b, _, r, d = x_val.shape
                if tuple(_val(cos).shape) == tuple(_val(sin).shape) == (b, r, d):
                    return x, cos, sin, rotated_out
    return None


@graph_pass(after=("fold_cache_writes",))  # it folds the RoPE into tree_attention_write
def fold_rotary(gm: torch.fx.GraphModule, ctx: GraphContext) -> PassResult:
    graph = gm.graph
    writes = list(graph.find_nodes(op="call_function", target=TREE_ATTENTION_WRITE))
    folded, unfolded, bypassed = 0, [], []
    for node in writes:
        q, kv, layer, key = node.args[:4]
        if len(node.args) > 9 or node.kwargs:
            unfolded.append(f"layer {layer}: already given cos/sin")
            continue
        if _val(q) is None:
            unfolded.append(f"layer {layer}: q's shape is unknown")
            continue
        batch, _, rows, head_dim = _val(q).shape
        limit = max_rows(head_dim)
        if rows > 1 and batch * rows > limit:
            unfolded.append(f"layer {layer}: {batch} x {rows} rows; the fold is measured faster at one row per "
                            f"sequence, or up to {limit} rows in all at head_dim {head_dim} "
                            f"(MAX_ROWS, MAX_ROWS_WIDE_HEADS)")
            continue
        q_parts, k_parts = _rope_parts(q), _rope_parts(key)
        if q_parts is None or k_parts is None:
            unfolded.append(f"layer {layer}: its {'q' if q_parts is None else 'key'} is not HF's rotate_half RoPE")
            continue
        if q_parts[1:3] != k_parts[1:3]:
            unfolded.append(f"layer {layer}: q and key are rotated by different cos/sin")
            continue
        if _val(q_parts[0]).dtype != _val(q).dtype or _val(k_parts[0]).dtype != _val(key).dtype:
            unfolded.append(f"layer {layer}: RoPE changes the dtype")
            continue
        node.args = (q_parts[0], kv, layer, k_parts[0], *node.args[4:9], *q_parts[1:3])
        bypassed += [q_parts[3], k_parts[3]]
        folded += 1
    drop_dead_code(graph, bypassed)  # the rotations only the attention read, their casts and dtype asserts
    recompile(gm)

    # Postconditions: the same attention nodes, each folded one holding two [B, R, D] tables.
    after = graph.find_nodes(op="call_function", target=TREE_ATTENTION_WRITE)
    ensure(after == writes, "fold_rotary", "attention nodes added, dropped or reordered")
    with_rope = [n for n in after if len(n.args) == 11]
    ensure(len(with_rope) == folded, "fold_rotary", f"{len(with_rope)} attention nodes hold cos/sin, {folded} folded")
    ensure(all(tuple(_val(n.args[9]).shape) == (*_val(n.args[0]).shape[:1], *_val(n.args[0]).shape[2:])
               for n in with_rope), "fold_rotary", "a cos/sin table is not [B, R, D]")
    if unfolded:
        log.debug("fold_rotary left these layers' RoPE apart:\n  %s", "\n  ".join(unfolded))
    return PassResult(gm, folded > 0, {"rotary_folded": folded, "rotary_unfolded": len(unfolded)})
