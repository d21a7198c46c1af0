"""EAGLE-2 selection: a draft's top k, the lanes of a DynamicTree's draft steps (``Frontier``), and
``select_tree``, which keeps the best N - 1 scored candidates as a depth-first ``Tree``.

Everything here runs per decode step as plain torch on ``[B, ...]`` tensors with static shapes and no
host synchronisation (it runs under CUDA graphs); numbering as in ``trees.py``.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .fast_paths import draft_fast_paths
from .kernels.bitmask import ancestor_masks, mask_to_matrix
from .kernels.topk import MAX_K as TOPK_KERNEL_MAX_K
from .kernels.verify import positions
from .trees import CONFIDENCE_BUDGETS, DynamicTree, Tree


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


def top_log_probs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``top_k(log_softmax(logits.float()), k)``: a draft step's k best children with their log-probabilities
    (float32). By default (fast path ``topk``) from ``specgraph::top_log_probs``: the ranking of the logits
    themselves (the log-softmax is monotone), the log-softmax at the k best only, in one launch on CUDA up to
    8,192 entries. logits: [..., V] -> values [..., k] float32, indices [..., k] int64."""
    if _topk_kernel_takes(logits, k):
        return torch.ops.specgraph.top_log_probs(logits, k)
    return top_k(torch.log_softmax(logits.float(), -1), k)


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
                root_tokens: torch.Tensor, spec: DynamicTree, extra: int = 0) -> Tree:
    """EAGLE-2 re-ranking: the best ``N-1`` candidates, numbered depth first.

    scores:  [B, E] cumulative log-probabilities (E = spec.num_candidates)
    tokens:  [B, E] candidate tokens
    parents: [B, E] parent candidate id, -1 for the root; parents[c] < c
    root_tokens: [B]
    extra: candidates appended after the draft's (a lookup chain of that many: ``drafts/lookup.py``),
    the kept tree then up to ``max(spec.max_depth, extra)`` deep.
    Scores are clamped to their ancestors' (a child never outranks its
    parent), NaN marks a candidate and its descendants worst, ties go to the
    lower id; the kept set is therefore closed under ancestors for every
    input. Children are numbered best first, so the best path is 0, 1, 2, ...
    """
    b, e = scores.shape
    n = spec.num_nodes
    if e != spec.num_candidates + extra or tokens.shape != scores.shape or parents.shape != scores.shape:
        raise ValueError(
            f"scores, tokens and parents must be [B, {spec.num_candidates + extra}] for {spec} (+{extra}); got "
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
    for _ in range((max(spec.steps, extra) - 1).bit_length()):
        clean = torch.minimum(clean, torch.cat([clean, clean.new_full((b, 1), float("inf"))], 1).gather(1, up))
        nan = nan | torch.cat([nan, nan.new_zeros(b, 1)], 1).gather(1, up)
        up = torch.cat([up, up.new_full((b, 1), e)], 1).gather(1, up)
    kept = rank_order(clean, nan, n - 1)  # [B, N-1] candidate ids, best first
    # The kept tree in rank space: rank r's parent is a better rank (or -1, the root). The maps between ranks,
    # ids and node numbers are inverted by comparing the N-1 kept pairwise (gathers and reductions that inductor
    # fuses), not by scatters (a launch each, and a cast after it)
    parent_rank = positions(kept, parents.gather(1, kept))  # [B, N-1]; a root's child: -1 (no id is -1)
    node = _depth_first_numbers(parent_rank)  # [B, N-1], values 1 .. N-1, each once
    root = torch.zeros(b, 1, dtype=torch.int64, device=device)
    parent_node = torch.where(parent_rank >= 0, node.gather(1, parent_rank.clamp(min=0)), 0)
    numbered = positions(node, torch.arange(1, n, device=device).expand(b, n - 1))  # [B, N-1]: node 1 + i's rank
    out_tokens = torch.cat([root_tokens.view(b, 1).to(torch.int64), tokens.gather(1, kept).gather(1, numbered)], 1)
    out_parents = torch.cat([root - 1, parent_node.gather(1, numbered)], 1)
    tree = Tree.from_parents(out_tokens, out_parents, max(spec.max_depth, min(extra, n - 1)), validate=False)
    tree.rank = torch.cat([root - 1, numbered], 1)
    tree.confidence = budget_confidence(clean)
    return tree


def budget_confidence(clean: torch.Tensor) -> torch.Tensor:
    """[B, E] clamped cumulative log-probabilities (-inf for NaN) -> [B, len(CONFIDENCE_BUDGETS)]: the
    expected accepted drafted nodes of each budget n if the draft's probabilities were the target's
    (a node is accepted iff its whole root path is: the product of the path's probabilities), over
    the best n - 1 candidates (an ancestor-closed set, as the tree a budget keeps)."""
    e = clean.shape[1]
    k = min(max(CONFIDENCE_BUDGETS) - 1, e)
    best = top_k(clean.exp(), k)[0]  # [B, k] best first (a sort and a cumsum stayed aten fallbacks in the step)
    ranks = torch.arange(k, device=clean.device)
    # [C, k]: which of the best each budget sums (built from Python ints: a list made a tensor would be copied
    # to the device, a host sync), then one reduction for every budget
    within = torch.stack([ranks < min(n - 1, e) for n in CONFIDENCE_BUDGETS])
    return (best.unsqueeze(1) * within).sum(-1)


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
