"""Pure-Python oracles for tree tests: loops over nodes, no torch tricks."""
from __future__ import annotations

import math


def ancestors_or_self(parents: list[int], i: int) -> list[int]:
    out = [i]
    while parents[out[-1]] >= 0:
        out.append(parents[out[-1]])
    return out


def dfs_order_ok(parents: list[int]) -> bool:
    """True iff node numbers are a depth-first pre-order (children in index order)."""
    n = len(parents)
    children = {i: [j for j in range(n) if parents[j] == i] for i in range(n)}
    order = []

    def visit(i):
        order.append(i)
        for c in children[i]:
            visit(c)

    visit(0)
    return parents[0] == -1 and order == list(range(n))


def select_oracle(scores, tokens, parents, root_token, num_nodes):
    """EAGLE-2 selection by the letter of the rule, on one row of Python lists.

    Returns (node tokens, node parents, node -> candidate id) with node 0 the root.
    """
    e = len(scores)
    nan = [math.isnan(s) for s in scores]
    clamped = [float("-inf") if nan[c] else float(scores[c]) for c in range(e)]
    for c in range(e):  # parents[c] < c: parents are final before their children
        p = parents[c]
        if p >= 0:
            clamped[c] = min(clamped[c], clamped[p])
            nan[c] = nan[c] or nan[p]
    order = sorted(range(e), key=lambda c: (nan[c], -clamped[c], c))
    kept = order[: num_nodes - 1]
    rank = {c: r for r, c in enumerate(kept)}
    assert all(parents[c] < 0 or parents[c] in rank for c in kept), "oracle: kept set not closed"
    children = {}
    for c in kept:
        children.setdefault(parents[c], []).append(c)  # already best first
    node_tokens, node_parents, source = [root_token], [-1], [-1]

    def visit(c, parent_node):
        node = len(source)
        source.append(c)
        node_tokens.append(tokens[c])
        node_parents.append(parent_node)
        for child in children.get(c, []):
            visit(child, node)

    for c in children.get(-1, []):
        visit(c, 0)
    return node_tokens, node_parents, source, clamped, nan


def longest_accepted_path(tokens, parents, target_tokens):
    """Brute force: the deepest node whose every edge drafted the target's pick
    at its parent (ties to the lowest index), and that node's root path."""
    best, best_depth = 0, 0
    for i in range(len(tokens)):
        path = ancestors_or_self(parents, i)
        if all(tokens[j] == target_tokens[parents[j]] for j in path[:-1]):
            if len(path) - 1 > best_depth:
                best, best_depth = i, len(path) - 1
    return list(reversed(ancestors_or_self(parents, best)))
