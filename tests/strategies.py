"""Hypothesis strategies for trees."""
from __future__ import annotations

from hypothesis import strategies as st

from oracles import ancestors_or_self


@st.composite
def dfs_parents(draw, min_nodes=1, max_nodes=64):
    """Parents of a random tree numbered depth first: node i hangs off the
    root path of node i-1 (the only places a pre-order allows)."""
    n = draw(st.integers(min_nodes, max_nodes))
    parents = [-1]
    for i in range(1, n):
        parents.append(draw(st.sampled_from(ancestors_or_self(parents, i - 1))))
    return parents


@st.composite
def topological_parents(draw, min_nodes=1, max_nodes=64):
    """Parents with parent[i] < i but no depth-first promise."""
    n = draw(st.integers(min_nodes, max_nodes))
    return [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
