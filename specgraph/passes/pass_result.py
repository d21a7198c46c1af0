"""What every pass returns, and what it is given."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PassResult:
    graph_module: torch.fx.GraphModule
    modified: bool
    counters: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class GraphContext:
    """The captured graph's placeholders by role, and the target's facts."""

    info: object  # capture.TargetInfo
    kv: str  # placeholder of the stacked cache buffer [2L, B, H_kv, S_max, D]
    cache_len: str
    tree_mask: str

    def placeholder(self, gm: torch.fx.GraphModule, role: str) -> torch.fx.Node:
        name = getattr(self, role)
        for node in gm.graph.find_nodes(op="placeholder"):
            if node.name == name:
                return node
        raise KeyError(f"graph has no placeholder {name!r} ({role})")
