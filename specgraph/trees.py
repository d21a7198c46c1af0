"""Draft trees: what to speculate (TreeSpec), the batched tree (Tree), and
EAGLE-2 selection.

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
from typing import NamedTuple, Sequence, Union

import torch

from .fast_paths import draft_fast_paths
from .kernels.bitmask import MAX_NODES, ancestor_masks, check_num_nodes, first_child_next_sibling, mask_to_matrix
from .kernels.topk import MAX_K as TOPK_KERNEL_MAX_K


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
        return max((len(p) for p in self.choices), default=0)

    @property
    def topk(self) -> int:
        """Candidates a draft must score per node: the largest sibling rank + 1."""
        return max((p[-1] for p in self.choices), default=-1) + 1

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

    def __post_init__(self):
        if not isinstance(self.tree, (Chain, StaticTree, DynamicTree)):
            raise ValueError(f"WithLookup.tree must be a Chain, StaticTree or DynamicTree; got {self.tree!r}")
        _check_int("WithLookup.depth", self.depth, 1)
        _check_int("WithLookup.min_ngram", self.min_ngram, 1)
        _check_int("WithLookup.max_ngram", self.max_ngram, self.min_ngram)
        check_num_nodes(self.num_nodes, f"{self.tree} ({self.tree.num_nodes} nodes) with a {self.depth}-token lookup "
                                        f"branch has {self.num_nodes} nodes; the number of tree nodes")

    @property
    def num_nodes(self) -> int:
        return self.tree.num_nodes + self.depth

    @property
    def max_depth(self) -> int:
        return max(self.tree.max_depth, self.depth)

    def with_tree(self, tree) -> "WithLookup":
        """The same lookup branch beside another tree (a smaller budget of the draft's)."""
        return WithLookup(tree, self.depth, self.max_ngram, self.min_ngram)


def join_lookup(tree: "Tree", lookup: torch.Tensor) -> "Tree":
    """``tree`` [B, N] with ``lookup`` [B, K] as the root's last branch (a chain): [B, N + K] nodes.
    Ranks: the draft tree's, and 0 for the branch (every node budget of the draft keeps it)."""
    b, n = tree.tokens.shape
    k = lookup.shape[1]
    chain_parents = torch.tensor([0] + list(range(n, n + k - 1)), device=lookup.device)  # the root, then a chain
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
    ``+lookupK`` (``WithLookup(tree, K)``: a K-token prompt-lookup branch beside it)."""
    base, plus, lookup = text.partition("+lookup")
    if plus:
        try:
            return WithLookup(parse_tree(base), int(lookup))
        except ValueError as err:
            raise ValueError(f"tree {text!r}: {err}") from None
    if text in NAMED_TREES:
        return NAMED_TREES[text]
    try:
        if text.startswith("chain"):
            return Chain(int(text[5:]))
        if text.startswith("dynamic:"):
            steps, topk, nodes = map(int, text[8:].split(","))
            return DynamicTree(steps, topk, nodes)
    except ValueError as err:
        raise ValueError(f"tree {text!r}: {err}") from None
    raise ValueError(f"tree {text!r}: expected chainK, dynamic:STEPS,TOPK,NODES, eagle1 or medusa (+lookupK)")

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
    def from_spec(cls, spec: Chain | StaticTree, tokens: torch.Tensor) -> "Tree":
        """The fixed topology of a Chain or StaticTree with ``tokens [B, N]``."""
        if isinstance(spec, DynamicTree):
            raise TypeError("a DynamicTree has no fixed topology; build it with select_tree()")
        if tokens.dim() != 2 or tokens.shape[1] != spec.num_nodes:
            raise ValueError(f"tokens must be [B, {spec.num_nodes}] for {spec}; got {tuple(tokens.shape)}")
        parents = torch.tensor(spec.parents(), dtype=torch.int64, device=tokens.device).expand_as(tokens)
        return cls.from_parents(tokens, parents, spec.max_depth, validate=False)

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


# ----------------------------------------------------------------------------- a draft's top k
TOPK_CHUNK = 256  # a long row's top k is taken per chunk of this many, then over the chunks' winners


def _topk_kernel_takes(x: torch.Tensor, k: int) -> bool:
    """The fast path ``topk`` is on and ``specgraph::topk`` takes x (float32/16, k <= 64)."""
    return "topk" in draft_fast_paths() and k <= TOPK_KERNEL_MAX_K and x.dtype != torch.float64


def top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x.topk(k, -1)`` (values best first, indices) for a long last dimension (a vocabulary).

    k = 1 is a max. A longer row is cut into chunks of TOPK_CHUNK (padded with -inf), each chunk's
    top k kept, and the top k of those taken: the same values as one topk (a row's k best are
    among its chunks' k bests); equal values may come back in another index order. Why: on CUDA
    one topk over a few long rows runs one block per row (47 us for 8 rows of 8,192 on the H200,
    15% of an EAGLE-2 tree step); chunked, the first round spreads over rows x chunks.
    By default (fast path ``topk``) k ≤ 64 of a float32/16 row come from ``specgraph::topk`` instead: one
    launch, ties to the lower index (``rank_order`` too).
    x: [..., V] float -> values [..., k], indices [..., k] int64.
    """
    v = x.shape[-1]
    if k == 1:
        return x.max(-1, keepdim=True)
    if _topk_kernel_takes(x, k):
        return torch.ops.specgraph.topk(x, k)  # ties to the lower index
    if k > TOPK_CHUNK or v < 4 * TOPK_CHUNK:
        return x.topk(k, -1)
    chunks = -(-v // TOPK_CHUNK)
    if v % TOPK_CHUNK:
        x = torch.nn.functional.pad(x, (0, chunks * TOPK_CHUNK - v), value=float("-inf"))
    part = x.unflatten(-1, (chunks, TOPK_CHUNK)).topk(k, -1)  # [..., C, k]
    offset = torch.arange(chunks, device=x.device).unsqueeze(-1) * TOPK_CHUNK  # [C, 1]
    best = part.values.flatten(-2).topk(k, -1)  # [..., k] over the C*k winners
    return best.values, (part.indices + offset).flatten(-2).gather(-1, best.indices)


# ----------------------------------------------------------------------------- EAGLE-2 selection
def rank_order(scores: torch.Tensor, nan: torch.Tensor, k: int | None = None) -> torch.Tensor:
    """Candidate ids best first (the first ``k``, or all): higher score first, ties to the lower id, NaN last.

    scores: [B, E] float (NaN already replaced), nan: [B, E] bool -> [B, k or E] int64.
    Because a child's score never exceeds its parent's and a parent's id is
    lower, a parent always ranks before its child: any prefix is ancestor-closed.
    By default (fast path ``topk``) the first k come from ``specgraph::topk`` (one launch, not
    two stable sorts): NaN as -inf and -inf as the lowest finite float, the same order unless a
    score is exactly that float (no sum of a few log-probabilities is).
    """
    if k is not None and _topk_kernel_takes(scores, k):
        key = torch.where(nan, float("-inf"), scores.clamp(min=torch.finfo(scores.dtype).min))
        return torch.ops.specgraph.topk(key, k)[1]
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    nan_last = torch.sort(nan.gather(-1, order).to(torch.uint8), dim=-1, stable=True).indices
    return order.gather(-1, nan_last)[..., :k]


class Frontier(NamedTuple):
    """One draft step's candidates and the lanes that expand next.

    scores, tokens, parents: [B, C] candidates of this step (C = K at step 0,
    K*K later); ``parents`` are candidate ids (-1: the root). lane_scores,
    lane_ids: [B, K] the best K candidates; lane_rows: [B, K] which of this
    step's C candidates each lane is (its parent lane is ``lane_rows // K``).
    """

    scores: torch.Tensor
    tokens: torch.Tensor
    parents: torch.Tensor
    lane_scores: torch.Tensor
    lane_ids: torch.Tensor
    lane_rows: torch.Tensor


def _nan_to_neg_inf(scores: torch.Tensor) -> torch.Tensor:
    return torch.where(scores.isnan(), float("-inf"), scores)  # nan_to_num would also turn -inf finite


def _frontier(scores, tokens, parents, ids, k) -> Frontier:
    clean = _nan_to_neg_inf(scores)
    rows = rank_order(clean, scores.isnan(), k)
    return Frontier(scores, tokens, parents, clean.gather(1, rows), ids.gather(1, rows), rows)


def seed_frontier(logprobs: torch.Tensor, tokens: torch.Tensor) -> Frontier:
    """Step 0: the root's top-K. logprobs, tokens: [B, K] -> candidate ids 0..K-1."""
    b, k = logprobs.shape
    ids = torch.arange(k, device=logprobs.device).expand(b, k)
    return _frontier(logprobs.float().clamp(max=0), tokens, torch.full_like(ids, -1), ids, k)


def expand_frontier(lanes: Frontier, logprobs: torch.Tensor, tokens: torch.Tensor, step: int) -> Frontier:
    """Step ``step >= 1``: each of K lanes proposes its top-K children.

    logprobs, tokens: [B, K, K] (lane, child). A child's cumulative score is
    its lane's plus ``min(logprob, 0)``, so it never exceeds its parent's.
    Candidate ids are ``K + (step-1)*K*K + lane*K + child``.
    """
    b, k, _ = logprobs.shape
    scores = (lanes.lane_scores.unsqueeze(-1) + logprobs.float().clamp(max=0)).view(b, k * k)
    ids = k + (step - 1) * k * k + torch.arange(k * k, device=logprobs.device).expand(b, k * k)
    parents = lanes.lane_ids.unsqueeze(-1).expand(b, k, k).reshape(b, k * k)
    return _frontier(scores, tokens.reshape(b, k * k), parents, ids, k)


def select_tree(scores: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                root_tokens: torch.Tensor, spec: DynamicTree) -> Tree:
    """EAGLE-2 re-ranking: the best ``N-1`` candidates, numbered depth first.

    scores:  [B, E] cumulative log-probabilities (E = spec.num_candidates)
    tokens:  [B, E] candidate tokens
    parents: [B, E] parent candidate id, -1 for the root; parents[c] < c
    root_tokens: [B]
    Scores are clamped to their ancestors' (a child never outranks its
    parent), NaN marks a candidate and its descendants worst, ties go to the
    lower id; the kept set is therefore closed under ancestors for every
    input. Children are numbered best first, so the best path is 0, 1, 2, ...
    """
    b, e = scores.shape
    n = spec.num_nodes
    if e != spec.num_candidates or tokens.shape != scores.shape or parents.shape != scores.shape:
        raise ValueError(
            f"scores, tokens and parents must be [B, {spec.num_candidates}] for {spec}; got "
            f"{tuple(scores.shape)}, {tuple(tokens.shape)}, {tuple(parents.shape)}"
        )
    if root_tokens.shape != (b,):
        raise ValueError(f"root_tokens must be [B] = [{b}]; got {tuple(root_tokens.shape)}")
    device = scores.device
    # Clamp to the ancestors' minimum and inherit NaN, by pointer doubling
    # (candidate chains are at most `steps` long). Column e is the root.
    nan = scores.isnan()
    clean = _nan_to_neg_inf(scores.float())
    up = torch.where(parents >= 0, parents, e).to(torch.int64)
    for _ in range((spec.steps - 1).bit_length()):
        clean = torch.minimum(clean, torch.cat([clean, clean.new_full((b, 1), float("inf"))], 1).gather(1, up))
        nan = nan | torch.cat([nan, nan.new_zeros(b, 1)], 1).gather(1, up)
        up = torch.cat([up, up.new_full((b, 1), e)], 1).gather(1, up)
    kept = rank_order(clean, nan, n - 1)  # [B, N-1] candidate ids, best first
    # The kept tree in rank space: rank r's parent is a better rank (or -1, the root).
    rank_of = torch.full((b, e + 1), -1, dtype=torch.int64, device=device)
    rank_of = rank_of.scatter(1, kept, torch.arange(n - 1, device=device).expand(b, n - 1))
    parent_rank = rank_of.gather(1, torch.where(parents >= 0, parents, e).gather(1, kept))
    node = _depth_first_numbers(parent_rank)  # [B, N-1], values 1 .. N-1
    root = torch.zeros(b, 1, dtype=torch.int64, device=device)
    parent_node = torch.where(parent_rank >= 0, node.gather(1, parent_rank.clamp(min=0)), 0)
    out_tokens = torch.cat([root_tokens.view(b, 1).to(torch.int64), torch.zeros_like(node)], 1)
    out_tokens = out_tokens.scatter(1, node, tokens.gather(1, kept).to(torch.int64))
    out_parents = torch.cat([root - 1, torch.zeros_like(node)], 1).scatter(1, node, parent_node)
    tree = Tree.from_parents(out_tokens, out_parents, spec.max_depth, validate=False)
    tree.rank = (root - 1).expand(b, n).scatter(1, node, torch.arange(n - 1, device=device).expand(b, n - 1))
    tree.confidence = budget_confidence(clean)
    return tree


def budget_confidence(clean: torch.Tensor) -> torch.Tensor:
    """[B, E] clamped cumulative log-probabilities (-inf for NaN) -> [B, len(CONFIDENCE_BUDGETS)]: the
    expected accepted drafted nodes of each budget n if the draft's probabilities were the target's
    (a node is accepted iff its whole root path is: the product of the path's probabilities), over
    the best n - 1 candidates (an ancestor-closed set, as the tree a budget keeps)."""
    e = clean.shape[1]
    best = clean.exp().sort(dim=1, descending=True).values.cumsum(1)  # [B, E]
    return best[:, [min(n - 1, e) - 1 for n in CONFIDENCE_BUDGETS]]


def _depth_first_numbers(parent_rank: torch.Tensor) -> torch.Tensor:
    """Pre-order numbers (root = 0) of nodes given in rank order.

    parent_rank: [B, M] with parent_rank[r] < r or -1 (a child of the root).
    A node's number is the sum over its root path of 1 + the sizes of the
    subtrees of its better-ranked siblings. returns [B, M] in 1 .. M.
    """
    m = parent_rank.shape[1]
    mask, _ = ancestor_masks(parent_rank)
    anc = mask_to_matrix(mask, m).to(torch.int64)  # [B, r, a]: a ancestor-or-self of r
    size = anc.sum(1)  # [B, a] subtree sizes
    idx = torch.arange(m, device=parent_rank.device)
    better_sibling = (parent_rank.unsqueeze(-1) == parent_rank.unsqueeze(-2)) & (idx.view(1, 1, m) < idx.view(1, m, 1))
    offset = 1 + (better_sibling.to(torch.int64) * size.unsqueeze(1)).sum(-1)  # [B, a]
    return (anc * offset.unsqueeze(1)).sum(-1)
