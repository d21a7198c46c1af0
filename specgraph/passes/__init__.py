"""Graph passes over the captured tree-verify graph (invariants: README.md here).

A pass is ``(gm, info) -> PassResult`` declared with ``@graph_pass(after=...)`` (the passes it must
follow); its docstring states Requires / Ensures and it checks its own postcondition with ``ensure``
(``PassContractError``, never ``assert``). ``PIPELINE`` is the one linear sequence ``run_pipeline``
applies, its order checked at import (``check_order``). With ``config.check_graph`` (on in the tests) or
``config.debug`` the invariants are checked after every pass (``invariants.py``). Each pass's counters are
logged at DEBUG on this package's logger; ``config.debug`` turns that logger on. ``config.dump`` writes each
pass's graph before and after as text; ``config.skip_passes`` leaves out speed-up passes (``OPTIONAL``),
for A/B measurements and bisection.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from .. import config
from ..errors import SettingError
from .invariants import check_invariants
from .pass_result import (GraphContext, HiddenTaps, PassContractError, PassResult, PipelineOrderError, one_recompile,
                          check_order, ensure, graph_pass)
from .fold_cache_writes import fold_cache_writes
from .fold_norms import fold_norms
from .fold_norms_rows import fold_norms_rows
from .fold_rotary import fold_rotary
from .fuse_projections import fuse_projections, pack_projections
from .inplace_cache_writes import inplace_cache_writes
from .outer_products import outer_products
from .prune_logits import prune_logits
from .replace_attention import replace_attention
from .tap_hidden_states import tap_hidden_states
from .tensor_parallel import all_reduce_partial_sums

# The order each pass needs is declared on it (@graph_pass(after=...), with the reason) and checked here.
# A tensor-parallel target's all-reduces come first (a no-op otherwise): after each row-parallel product,
# before fold_norms could fold the residual add into it. Norms fold into the fused projections last:
# fold_norms in one-row steps, fold_norms_rows in steps of 2..16 rows (into the products' epilogues and
# their readers' row scaling: measured faster on the H200, docs/benchmarks.md).
PIPELINE = check_order((all_reduce_partial_sums, replace_attention, tap_hidden_states, prune_logits,
                        outer_products, fuse_projections, inplace_cache_writes, fold_cache_writes, fold_rotary,
                        fold_norms, fold_norms_rows))
# Passes that only make the graph faster: the graph is correct without them (config.skip_passes).
OPTIONAL = ("outer_products", "fuse_projections", "fold_cache_writes", "fold_rotary", "fold_norms",
            "fold_norms_rows")


def skipped_passes() -> set[str]:
    """The passes ``config.skip_passes`` (``SPECGRAPH_SKIP_PASSES``) leaves out; only OPTIONAL ones may be."""
    names = set(config.skip_passes)
    if names - set(OPTIONAL):
        raise ValueError(f"SPECGRAPH_SKIP_PASSES names {sorted(names - set(OPTIONAL))}: only speed-up passes may "
                         f"be skipped, {', '.join(OPTIONAL)}; the others make the graph a tree-verify step")
    return names


log = logging.getLogger(__name__)


def _debug_logging() -> None:
    """``config.debug``: this package's DEBUG records shown, on stderr unless the application set up logging."""
    log.setLevel(logging.DEBUG)
    if not log.hasHandlers():
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
        log.addHandler(handler)


def run_pipeline(gm: torch.fx.GraphModule, ctx: GraphContext, debug: bool | None = None,
                 passes=None) -> list[tuple[str, PassResult]]:
    """Apply ``passes`` (default PIPELINE; another order is checked first) in order to ``gm`` (in place),
    checking the invariants after each one under ``config.check_graph`` or debug. Returns each pass's result."""
    debug = config.debug if debug is None else debug
    check = debug or config.check_graph
    passes = PIPELINE if passes is None else check_order(passes)
    if debug:
        _debug_logging()
    dump = config.dump
    if dump:
        try:
            Path(dump).mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise SettingError(f"SPECGRAPH_DUMP={str(dump)!r}: cannot make that directory ({err.strerror}); name "
                               f"a writable one, or unset it") from err
    results, skip = [], skipped_passes()
    with one_recompile():  # no pass runs the module: its code is made once, after the last pass
        for i, each in enumerate(passes):
            name = each.__name__
            if name in skip:
                continue
            if dump:
                (Path(dump) / f"{i:02d}_{name}_before.txt").write_text(str(gm.graph))
            result = each(gm, ctx)
            gm = result.graph_module
            results.append((name, result))
            if dump:
                (Path(dump) / f"{i:02d}_{name}_after.txt").write_text(str(gm.graph))
            if check:
                check_invariants(gm, ctx, after=name)
            log.debug("pass %s: modified=%s %s", name, result.modified,
                      ", ".join(f"{k}={v}" for k, v in result.counters.items()))
    gm.recompile()
    return results


__all__ = ["GraphContext", "HiddenTaps", "PassContractError", "PassResult", "PipelineOrderError", "PIPELINE",
           "check_invariants", "check_order", "ensure", "graph_pass", "run_pipeline", "replace_attention",
           "tap_hidden_states", "prune_logits", "fuse_projections", "pack_projections", "inplace_cache_writes",
           "fold_cache_writes", "fold_rotary", "fold_norms", "fold_norms_rows", "all_reduce_partial_sums",
           "outer_products"]
