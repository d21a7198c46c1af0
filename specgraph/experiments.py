"""Draft-side speed-ups that are correct and tested but not yet measured faster on the GPU.

Off unless ``SPECGRAPH_DRAFT_EXPERIMENTS`` (comma-separated) names them, as ``SPECGRAPH_EXTRA_PASSES``
does for the target's graph; each becomes the default, or goes, once the H200 has measured it
(``benchmarks/draft_ab.sh``, docs/benchmarks.md). Imports nothing of specgraph.
"""
from __future__ import annotations

import os

DRAFT_EXPERIMENTS = {
    "topk": "a draft level's top k, and EAGLE-2's candidate ranking, through specgraph::topk (one Triton "
            "launch) instead of torch.topk and two stable sorts",
    "fuse_projections": "each draft layer's q/k/v and gate/up weights laid out back to back and read as one "
                        "product each (what the target's fuse_projections pass does), in no-grad calls",
}


def draft_experiments() -> frozenset[str]:
    """The experiments ``SPECGRAPH_DRAFT_EXPERIMENTS`` turns on; an unknown name is refused."""
    names = {n.strip() for n in os.environ.get("SPECGRAPH_DRAFT_EXPERIMENTS", "").split(",") if n.strip()}
    unknown = sorted(names - set(DRAFT_EXPERIMENTS))
    if unknown:
        raise ValueError(f"SPECGRAPH_DRAFT_EXPERIMENTS names {unknown}: the draft experiments are "
                         f"{', '.join(DRAFT_EXPERIMENTS)}")
    return frozenset(names)
