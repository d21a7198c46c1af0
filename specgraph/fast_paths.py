"""Draft-side fast paths: on by default (measured faster on the H200, docs/benchmarks.md), each one
switched off by naming it in ``SPECGRAPH_SKIP_FAST_PATHS`` (comma-separated), as ``SPECGRAPH_SKIP_PASSES``
does for the target's graph passes: for A/B runs (``benchmarks/draft_ab.sh``) and to rule one out when
hunting a problem. Imports nothing of specgraph.
"""
from __future__ import annotations

import os

DRAFT_FAST_PATHS = {
    "topk": "a draft level's top k, and EAGLE-2's candidate ranking, through specgraph::topk (one Triton "
            "launch) instead of torch.topk and two stable sorts",
    "fuse_projections": "each draft layer's q/k/v and gate/up weights laid out back to back and read as one "
                        "product each (what the target's fuse_projections pass does), in no-grad calls",
}


def draft_fast_paths() -> frozenset[str]:
    """The fast paths in use: all but those ``SPECGRAPH_SKIP_FAST_PATHS`` names; an unknown name is refused."""
    skip = {n.strip() for n in os.environ.get("SPECGRAPH_SKIP_FAST_PATHS", "").split(",") if n.strip()}
    unknown = sorted(skip - set(DRAFT_FAST_PATHS))
    if unknown:
        raise ValueError(f"SPECGRAPH_SKIP_FAST_PATHS names {unknown}: the draft fast paths are "
                         f"{', '.join(DRAFT_FAST_PATHS)}")
    return frozenset(DRAFT_FAST_PATHS) - skip


def skipped_fast_paths() -> str:
    """``SPECGRAPH_SKIP_FAST_PATHS`` as benchmarks record it: the skipped names, sorted, comma-joined."""
    return ",".join(sorted(set(DRAFT_FAST_PATHS) - draft_fast_paths()))
