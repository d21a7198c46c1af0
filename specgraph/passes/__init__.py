"""Graph passes over the captured tree-verify graph (invariants: README.md here).

A pass is ``(gm, info) -> PassResult``; its docstring states Requires /
Ensures and it asserts its own postcondition. ``PIPELINE`` is the one
linear sequence ``run_pipeline`` applies. ``SPECGRAPH_DEBUG=1`` (or
``debug=True``) prints each pass's counters; ``SPECGRAPH_DUMP=dir`` also
writes each pass's graph before and after as text. ``SPECGRAPH_SKIP_PASSES=a,b``
leaves out speed-up passes (``OPTIONAL``), for A/B measurements and bisection.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from .pass_result import GraphContext, HiddenTaps, PassResult
from .fold_cache_writes import fold_cache_writes
from .fold_norms import fold_norms
from .fold_norms_rows import fold_norms_rows
from .fold_rotary import fold_rotary
from .fuse_projections import fuse_projections, pack_projections
from .inplace_cache_writes import inplace_cache_writes
from .prune_logits import prune_logits
from .replace_attention import replace_attention
from .tap_hidden_states import tap_hidden_states
from .tensor_parallel import all_reduce_partial_sums

# A tensor-parallel target's all-reduces first (a no-op otherwise): after each row-parallel product,
# before fold_norms could fold the residual add into it. Taps next: they read layer boundaries from
# the module structure, before prune_logits puts a slice in front of the LM head. Cache writes become in-place ops late
# (replace_attention finds each layer's K/V through its scatter_ writes), then fold into the attention
# that reads them, and the RoPE of q and k folds into that attention. Projections fuse after the
# taps and the LM-head slice, which find their nodes through module paths; norms fold into the fused
# projections last: fold_norms in one-row steps, fold_norms_rows in steps of 2..16 rows (into the
# products' epilogues and their readers' row scaling: measured faster, fifteenth session).
PIPELINE = (all_reduce_partial_sums, replace_attention, tap_hidden_states, prune_logits, fuse_projections,
            inplace_cache_writes, fold_cache_writes, fold_rotary, fold_norms, fold_norms_rows)
# Passes that only make the graph faster: the graph is correct without them (SPECGRAPH_SKIP_PASSES).
OPTIONAL = ("fuse_projections", "fold_cache_writes", "fold_rotary", "fold_norms", "fold_norms_rows")


def skipped_passes() -> set[str]:
    """The passes ``SPECGRAPH_SKIP_PASSES`` (comma-separated) leaves out; only OPTIONAL ones may be."""
    names = {n.strip() for n in os.environ.get("SPECGRAPH_SKIP_PASSES", "").split(",") if n.strip()}
    if names - set(OPTIONAL):
        raise ValueError(f"SPECGRAPH_SKIP_PASSES names {sorted(names - set(OPTIONAL))}: only speed-up passes may "
                         f"be skipped, {', '.join(OPTIONAL)}; the others make the graph a tree-verify step")
    return names


def run_pipeline(gm: torch.fx.GraphModule, ctx: GraphContext, debug: bool | None = None) -> list[tuple[str, PassResult]]:
    """Apply PIPELINE in order to ``gm`` (in place). Returns each pass's result."""
    debug = os.environ.get("SPECGRAPH_DEBUG") == "1" if debug is None else debug
    dump = os.environ.get("SPECGRAPH_DUMP")
    results, skip = [], skipped_passes()
    for i, graph_pass in enumerate(PIPELINE):
        name = graph_pass.__name__
        if name in skip:
            continue
        if dump:
            Path(dump).mkdir(parents=True, exist_ok=True)
            (Path(dump) / f"{i:02d}_{name}_before.txt").write_text(str(gm.graph))
        result = graph_pass(gm, ctx)
        gm = result.graph_module
        results.append((name, result))
        if dump:
            (Path(dump) / f"{i:02d}_{name}_after.txt").write_text(str(gm.graph))
        if debug:
            counters = ", ".join(f"{k}={v}" for k, v in result.counters.items())
            print(f"[specgraph] pass {name}: modified={result.modified} {counters}")
    return results


__all__ = ["GraphContext", "HiddenTaps", "PassResult", "PIPELINE", "run_pipeline", "replace_attention",
           "tap_hidden_states", "prune_logits", "fuse_projections", "pack_projections", "inplace_cache_writes",
           "fold_cache_writes", "fold_rotary", "fold_norms", "fold_norms_rows", "all_reduce_partial_sums"]
