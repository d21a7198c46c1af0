"""Draft-side fast paths: on by default (measured faster on the H200, docs/benchmarks.md), each one
switched off by naming it in ``config.skip_fast_paths`` (``SPECGRAPH_SKIP_FAST_PATHS``, comma-separated), as
``config.skip_passes`` does for the target's graph passes: for A/B runs (``benchmarks/investigations/draft_ab.sh``) and to
rule one out when hunting a problem. Imports nothing of specgraph but its settings.
"""
from __future__ import annotations

from . import config

DRAFT_FAST_PATHS = {
    "topk": "a draft level's top k, and EAGLE-2's candidate ranking, through specgraph::topk (one Triton "
            "launch) instead of torch.topk and two stable sorts",
    "fuse_projections": "each draft layer's q/k/v and gate/up weights laid out back to back and read as one "
                        "product each (what the target's fuse_projections pass does), in no-grad calls",
}


def draft_fast_paths() -> frozenset[str]:
    """The fast paths in use: all but those ``config.skip_fast_paths`` names; an unknown name is refused."""
    skip = config.skip_fast_paths
    unknown = sorted(skip - set(DRAFT_FAST_PATHS))
    if unknown:
        raise ValueError(f"SPECGRAPH_SKIP_FAST_PATHS names {unknown}: the draft fast paths are "
                         f"{', '.join(DRAFT_FAST_PATHS)}")
    return frozenset(DRAFT_FAST_PATHS) - skip


def skipped_fast_paths() -> str:
    """``config.skip_fast_paths`` as benchmarks record it: the skipped names, sorted, comma-joined."""
    return ",".join(sorted(set(DRAFT_FAST_PATHS) - draft_fast_paths()))
