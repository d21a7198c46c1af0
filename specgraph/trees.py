"""Draft trees: what to speculate (TreeSpec) and the batched tree (Tree);
EAGLE-2 selection is ``selection.py``.

Numbering, for every kind of tree:
  node 0 is the root: the last committed token, whose K/V is not yet cached;
  nodes are numbered depth first, best child first, so ``parent[i] < i`` and
  the most likely path is 0, 1, 2, ...;
  node i has position ``cache_len + depth[i]`` and KV slot ``cache_len + i``;
  ``mask[i]`` has bit j set iff node j is an ancestor-or-self of node i.
A chain is the tree ``parent[i] = i - 1``. At most 64 nodes (one int64 mask).

Everything that runs per decode step is plain torch on ``[B, ...]`` tensors
with static shapes and no host synchronisation (it runs under CUDA graphs).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

import torch

from .kernels.bitmask import MAX_NODES, ancestor_masks, check_num_nodes, first_child_next_sibling, mask_to_matrix


# ----------------------------------------------------------------------------- specs
def _check_int(name: str, value, lo: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{name} must be an int >= {lo}; got {value!r}")


@dataclass(frozen=True)
class Chain:
    """``depth`` drafted tokens in a row (N = depth + 1 nodes with the root)."""

    depth: int

    def __post_init__(self):
        _check_int("Chain.depth", self.depth, 0)
        check_num_nodes(self.depth + 1, f"Chain({self.depth}) has {self.depth + 1} nodes; the number of tree nodes")

    @property
    def num_nodes(self) -> int:
        return self.depth + 1

    @property
    def max_depth(self) -> int:
        return self.depth

    def parents(self) -> list[int]:
        return list(range(-1, self.depth))


@dataclass(frozen=True)
class StaticTree:
    """A fixed tree given as paths of sibling ranks (Medusa / EAGLE-1 "choices").

    ``(0, 2)`` is the third-best child of the best depth-1 node. Every proper
    prefix of a path must itself be a path. Nodes are numbered depth first,
    lowest rank first, so the paths in lexicographic order are nodes 1.. N-1.
    """

    choices: tuple[tuple[int, ...], ...]

    def __post_init__(self):
        if isinstance(self.choices, (str, bytes)) or not isinstance(self.choices, Sequence):
            raise ValueError(f"StaticTree.choices must be a list of paths like [[0], [1], [0, 0]]; got {self.choices!r}")
        paths = []
        for path in self.choices:
            if isinstance(path, (str, bytes)) or not isinstance(path, Sequence) or len(path) == 0:
                raise ValueError(f"StaticTree.choices: each path is a non-empty list of sibling ranks; got {path!r}")
            for rank in path:
                if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
                    raise ValueError(f"StaticTree.choices: ranks are ints >= 0; path {list(path)} has {rank!r}")
            paths.append(tuple(path))
        seen = set(paths)
        if len(seen) != len(paths):
            dups = sorted({p for p in paths if paths.count(p) > 1})
            raise ValueError(f"StaticTree.choices: duplicate paths {[list(p) for p in dups]}")
        orphans = sorted(p for p in paths if len(p) > 1 and p[:-1] not in seen)
        if orphans:
            raise ValueError(
                "StaticTree.choices must be closed under prefixes; these paths lack their parent: "
                + ", ".join(f"{list(p)} (needs {list(p[:-1])})" for p in orphans)
            )
        check_num_nodes(len(paths) + 1, f"StaticTree with {len(paths)} paths has {len(paths) + 1} nodes; the number of tree nodes")
        object.__setattr__(self, "choices", tuple(sorted(paths)))

    @property
    def num_nodes(self) -> int:
        return len(self.choices) + 1

    @property
    def max_depth(self) -> int:
        return max([0] + [len(p) for p in self.choices])  # no max(default=): dynamo 2.11 cannot trace it

    @property
    def topk(self) -> int:
        """Candidates a draft must score per node: the largest sibling rank + 1."""
        return max([-1] + [p[-1] for p in self.choices]) + 1

    def parents(self) -> list[int]:
        node = {p: i + 1 for i, p in enumerate(self.choices)}
        return [-1] + [node.get(p[:-1], 0) for p in self.choices]

    def ranks(self) -> list[int]:
        """Sibling rank of every node (-1 for the root): which top-k candidate it is."""
        return [-1] + [p[-1] for p in self.choices]


@dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2: ``steps`` draft steps of ``topk`` lanes; keep the best ``nodes - 1``
    of the ``topk + (steps - 1) * topk**2`` candidates (``nodes`` counts the root)."""

    steps: int
    topk: int
    nodes: int

    def __post_init__(self):
        _check_int("DynamicTree.steps", self.steps, 1)
        _check_int("DynamicTree.topk", self.topk, 1)
        _check_int("DynamicTree.nodes", self.nodes, 2)
        check_num_nodes(self.nodes, "DynamicTree.nodes")
        if self.nodes - 1 > self.num_candidates:
            raise ValueError(
                f"DynamicTree(steps={self.steps}, topk={self.topk}, nodes={self.nodes}) keeps {self.nodes - 1} "
                f"drafted nodes but only scores {self.num_candidates} candidates (topk + (steps-1)*topk^2); "
                f"lower nodes or raise steps/topk"
            )

    @property
    def num_nodes(self) -> int:
        return self.nodes

    @property
    def num_candidates(self) -> int:
        return self.topk + (self.steps - 1) * self.topk**2

    @property
    def max_depth(self) -> int:
        return min(self.steps, self.nodes - 1)


@dataclass(frozen=True)
class WithLookup:
    """``tree`` (what the draft proposes) plus a prompt-lookup branch: one more child of the root and a
    chain below it, ``depth`` tokens in all, proposed by n-gram lookup over the row's own sequence
    (``drafts.NGram(max_ngram, min_ngram)``). The two win on different steps: a head predicts new text a
    few tokens deep, lookup accepts a repeat whole. The branch is numbered last (the root's last subtree):
    nodes ``tree.num_nodes`` .. N - 1. Spelled ``TREE+lookupK`` (e.g. ``dynamic:4,4,16+lookup8``)."""

    tree: Union[Chain, StaticTree, DynamicTree]
    depth: int
    max_ngram: int = 3
    min_ngram: int = 1
    # shared: the branch's tokens compete with the DynamicTree's candidates for its ``nodes`` (EAGLE-2's
    # selection over both, the lookup scored by its match length: drafts/lookup.py), instead of adding rows
    shared: bool = False

    def __post_init__(self):
        if not isinstance(self.tree, (Chain, StaticTree, DynamicTree)):
            raise ValueError(f"WithLookup.tree must be a Chain, StaticTree or DynamicTree; got {self.tree!r}")
        _check_int("WithLookup.depth", self.depth, 1)
        _check_int("WithLookup.min_ngram", self.min_ngram, 1)
        _check_int("WithLookup.max_ngram", self.max_ngram, self.min_ngram)
        if not isinstance(self.shared, bool):
            raise ValueError(f"WithLookup.shared={self.shared!r}: True or False")
        if self.shared and not (isinstance(self.tree, DynamicTree) and self.depth <= self.tree.nodes - 1):
            raise ValueError(f"WithLookup(shared=True) needs a DynamicTree whose nodes - 1 >= depth={self.depth} (the "
                             f"branch competes for its nodes); got {self.tree!r}")
        check_num_nodes(self.num_nodes, f"{self.tree} ({self.tree.num_nodes} nodes) with a {self.depth}-token lookup "
                                        f"branch has {self.num_nodes} nodes; the number of tree nodes")

    @property
    def num_nodes(self) -> int:
        return self.tree.num_nodes if self.shared else self.tree.num_nodes + self.depth

    @property
    def max_depth(self) -> int:
        return max(self.tree.max_depth, self.depth)

    def with_tree(self, tree) -> "WithLookup":
        """The same lookup branch beside another tree (a smaller budget of the draft's; shared: at most
        the smaller tree's nodes - 1 deep)."""
        depth = min(self.depth, tree.nodes - 1) if self.shared else self.depth
        return WithLookup(tree, depth, self.max_ngram, self.min_ngram, self.shared)


def spec_parents(spec: "Chain | StaticTree", device) -> torch.Tensor:
    """[N] int64: each node's parent (-1 for the root) of a fixed topology."""
    if isinstance(spec, Chain):
        return torch.arange(-1, spec.depth, device=device)
    return torch.tensor(spec.parents(), dtype=torch.int64, device=device)


def chain_mask(n: int, device) -> torch.Tensor:
    """[n] int64 mask words of a chain: row i sees slots 0..i (-1: every bit, from row 63 on). From
    arange, not a list: a tensor constant would be baked into compiled frames."""
    i = torch.arange(n, device=device)
    low = torch.bitwise_left_shift(torch.ones_like(i), i.clamp(max=62)) - 1  # 2**i - 1 without overflow
    return torch.where(i < 63, low * 2 + 1, -1)


def join_lookup(tree: "Tree", lookup: torch.Tensor) -> "Tree":
    """``tree`` [B, N] with ``lookup`` [B, K] as the root's last branch (a chain): [B, N + K] nodes.
    Ranks: the draft tree's, and 0 for the branch (every node budget of the draft keeps it)."""
    b, n = tree.tokens.shape
    k = lookup.shape[1]
    # the root, then a chain; from arange, not a list: a tensor constant would be baked into compiled frames
    chain_parents = torch.arange(n - 1, n + k - 1, device=lookup.device)
    chain_parents = chain_parents.masked_fill(chain_parents == n - 1, 0)
    parents = torch.cat([tree.parents, chain_parents.expand(b, k)], 1)
    joined = Tree.from_parents(torch.cat([tree.tokens, lookup.to(torch.int64)], 1), parents,
                               max(tree.max_depth, k), validate=False)
    if tree.rank is not None:
        joined.rank = torch.cat([tree.rank, torch.zeros_like(lookup, dtype=torch.int64)], 1)
    joined.confidence = tree.confidence  # the draft's own: the branch is in every budget
    return joined


TreeSpec = Union[Chain, StaticTree, DynamicTree, WithLookup]

# node budgets whose expected acceptance a DynamicTree reports with each tree (``Tree.confidence``)
CONFIDENCE_BUDGETS = (4, 8, 16, 24, 32, 48, 64)


# ----------------------------------------------------------------------------- the shipped trees
# EAGLE-1's default (SafeAILab/EAGLE eagle/model/choices.py, ``mc_sim_7b_63``): 25 nodes + root.
EAGLE1_MC_SIM_7B_63 = StaticTree((
    (0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0),
    (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 0), (0, 1, 1), (0, 2, 0), (0, 2, 1), (1, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 0, 2), (0, 0, 0, 0, 0), (0, 0, 0, 0, 1),
))

# Medusa's default (FasterDecoding/Medusa medusa/model/medusa_choices.py, also named
# ``mc_sim_7b_63``, a different tree): 63 nodes + root = 64, the most a tree holds.
MEDUSA_MC_SIM_7B_63 = StaticTree((
    (0,), (0, 0), (1,), (0, 1), (2,), (0, 0, 0), (1, 0), (0, 2), (3,), (0, 3), (4,), (0, 4), (2, 0),
    (0, 5), (0, 0, 1), (5,), (0, 6), (6,), (0, 7), (0, 1, 0), (1, 1), (7,), (0, 8), (0, 0, 2), (3, 0),
    (0, 9), (8,), (9,), (1, 0, 0), (0, 2, 0), (1, 2), (0, 0, 3), (4, 0), (2, 1), (0, 0, 4), (0, 0, 5),
    (0, 0, 0, 0), (0, 1, 1), (0, 0, 6), (0, 3, 0), (5, 0), (1, 3), (0, 0, 7), (0, 0, 8), (0, 0, 9),
    (6, 0), (0, 4, 0), (1, 4), (7, 0), (0, 1, 2), (2, 0, 0), (3, 1), (2, 2), (8, 0), (0, 5, 0), (1, 5),
    (1, 0, 1), (0, 2, 1), (9, 0), (0, 6, 0), (0, 0, 0, 1), (1, 6), (0, 7, 0),
))


NAMED_TREES = {"eagle1": EAGLE1_MC_SIM_7B_63, "medusa": MEDUSA_MC_SIM_7B_63}


def parse_tree(text: str) -> TreeSpec:
    """A tree from its command-line spelling: ``chainK`` (``Chain(K)``), ``dynamic:STEPS,TOPK,NODES``
    (``DynamicTree``), ``eagle1`` or ``medusa`` (the shipped ``mc_sim_7b_63`` trees); any of them
    ``+lookupK`` (``WithLookup(tree, K)``: a K-token prompt-lookup branch beside it); a DynamicTree also
    ``+lookupK:shared`` (``WithLookup(tree, K, shared=True)``: the branch competes for the tree's nodes)."""
    def count(digits: str) -> int:  # ASCII digits only: int() also reads "+4", " 4" and other scripts' digits
        if not (digits.isascii() and digits.isdigit()):
            raise ValueError(f"{digits!r} is not a whole number")
        return int(digits)

    base, plus, lookup = text.partition("+lookup")
    if plus:
        depth, shared, rest = lookup.partition(":shared")
        try:
            if shared and rest:
                raise ValueError(f"{lookup!r}: +lookupK or +lookupK:shared")
            return WithLookup(parse_tree(base), count(depth), shared=bool(shared))
        except ValueError as err:
            raise ValueError(f"tree {text!r}: {err}") from None
    if text in NAMED_TREES:
        return NAMED_TREES[text]
    try:
        if text.startswith("chain"):
            return Chain(count(text[5:]))
        if text.startswith("dynamic:"):
            steps, topk, nodes = map(count, text[8:].split(","))
            return DynamicTree(steps, topk, nodes)
    except ValueError as err:
        raise ValueError(f"tree {text!r}: {err}") from None
    raise ValueError(f"tree {text!r}: expected chainK, dynamic:STEPS,TOPK,NODES, eagle1 or medusa (+lookupK, "
                     f"+lookupK:shared)")

# ----------------------------------------------------------------------------- the batched tree
@dataclass
class Tree:
    """B trees of N nodes as ``[B, N]`` int64 tensors (see the module docstring)."""

    tokens: torch.Tensor  # [B, N] drafted token per node; tokens[:, 0] is the root
    parents: torch.Tensor  # [B, N] parent node, -1 for the root
    depth: torch.Tensor  # [B, N] root = 0; also the position relative to cache_len
    mask: torch.Tensor  # [B, N] ancestor-or-self bitmask
    first_child: torch.Tensor  # [B, N] best child, -1 for a leaf
    next_sibling: torch.Tensor  # [B, N] next-best sibling, -1 for the last
    max_depth: int  # static bound D: accepted-path arrays are D + 1 wide
    # [B, N] the order a budget keeps nodes in: a DynamicTree's top N' - 1 ranks (0 = best) are the tree that
    # DynamicTree(steps, topk, N') selects from the same candidates; elsewhere node order (i - 1); root -1
    rank: torch.Tensor | None = None
    # [B, len(CONFIDENCE_BUDGETS)] fp32: a DynamicTree's own estimate of the drafted nodes a step accepts at
    # each node budget n of the same drafting (EAGLE-2's: the sum of exp(cumulative log-probability) over
    # its best n - 1 candidates, budgets past the candidates capped at all of them); [B, 0] for other trees
    confidence: torch.Tensor | None = None

    @classmethod
    def from_parents(cls, tokens: torch.Tensor, parents: torch.Tensor, max_depth: int | None = None,
                     validate: bool = True) -> "Tree":
        """Build the bundle from tokens and parents ``[B, N]``.

        ``max_depth=None`` reads the depth back from the device (a host sync);
        pass the spec's bound on the hot path. ``validate`` checks the
        numbering invariants (also a host sync).
        """
        if tokens.dim() != 2 or tokens.shape != parents.shape:
            raise ValueError(f"tokens and parents must both be [B, N]; got {tuple(tokens.shape)} and {tuple(parents.shape)}")
        check_num_nodes(tokens.shape[1])
        parents = parents.to(torch.int64)
        mask, depth = ancestor_masks(parents)
        first_child, next_sibling = first_child_next_sibling(parents)
        if max_depth is None:
            max_depth = int(depth.max())
        order = torch.arange(-1, tokens.shape[1] - 1, device=tokens.device).expand_as(parents)
        tree = cls(tokens.to(torch.int64), parents, depth, mask, first_child, next_sibling, max_depth, order,
                   tokens.new_zeros(tokens.shape[0], 0, dtype=torch.float32))
        if validate:
            tree.validate()
        return tree

    @classmethod
    def from_spec(cls, spec: Chain | StaticTree, tokens: torch.Tensor, parents: torch.Tensor | None = None) -> "Tree":
        """The fixed topology of a Chain or StaticTree with ``tokens [B, N]``; ``parents``: the spec's
        ``spec_parents`` built once outside a compiled frame (a StaticTree's list would be baked in as a
        tensor constant, which dynamo's precompile cannot keep on CUDA)."""
        if isinstance(spec, DynamicTree):
            raise TypeError("a DynamicTree has no fixed topology; build it with select_tree()")
        if tokens.dim() != 2 or tokens.shape[1] != spec.num_nodes:
            raise ValueError(f"tokens must be [B, {spec.num_nodes}] for {spec}; got {tuple(tokens.shape)}")
        if parents is None:
            parents = spec_parents(spec, tokens.device)
        return cls.from_parents(tokens, parents.expand_as(tokens), spec.max_depth, validate=False)

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    def positions(self, cache_len: torch.Tensor) -> torch.Tensor:
        """Absolute positions ``[B, N]``: ``cache_len[b] + depth``."""
        return cache_len.to(torch.int64).unsqueeze(1) + self.depth

    def validate(self) -> None:
        """Check the numbering invariants (host sync; for tests and debugging)."""
        n = self.num_nodes
        idx = torch.arange(n, device=self.parents.device)
        problems = []
        if bool((self.parents[:, 0] != -1).any()):
            problems.append("node 0 must be the root (parent -1)")
        if n > 1 and bool(((self.parents[:, 1:] < 0) | (self.parents[:, 1:] >= idx[1:])).any()):
            problems.append("every node i > 0 needs a parent in 0 .. i-1")
        if not problems and bool((self.depth > self.max_depth).any()):
            problems.append(f"depth {int(self.depth.max())} exceeds max_depth {self.max_depth}")
        if not problems:
            # Depth-first numbering: node i's subtree is exactly the nodes i .. i + size - 1.
            anc = mask_to_matrix(self.mask, n)  # [B, i, j]: j ancestor-or-self of i
            size = anc.sum(1)  # [B, j]
            in_subtree = anc.transpose(1, 2)  # [B, j, i]: i in subtree(j)
            expected = (idx.view(1, 1, n) >= idx.view(1, n, 1)) & (idx.view(1, 1, n) < (idx + size).unsqueeze(-1))
            if not bool((in_subtree == expected).all()):
                problems.append("nodes are not numbered depth first")
        if problems:
            raise ValueError("malformed tree: " + "; ".join(problems))


def random_parents(rng, n: int) -> list[int]:
    """Parents of a random n-node tree numbered depth first (tests, benchmarks).

    ``rng`` is a ``random.Random``; node i hangs off some node on node i-1's
    root path, the only places a pre-order allows.
    """
    parents = [-1]
    for i in range(1, n):
        path = [i - 1]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        parents.append(rng.choice(path))
    return parents
