"""Tree verification: the reference implementations (plain torch, batched).

The decode step (runtime/step.py) calls these plain-torch functions on every
device, compiled with the rest of the step; no custom op wraps them.
Medusa's lossy ``verify_typical`` runs only on ``compile(..., verify="typical")``, when sampling:
its output is not the target's distribution.

The tree (shared by every verifier), B rows of N nodes:
  tokens:  [B, N] int64   drafted token of each node (node 0 = the root)
  parents: [B, N] int64   parent node, -1 for the root; parent[i] < i
  mask:    [B, N] int64   ancestor-or-self bitmask (see kernels/bitmask.py)
  max_depth D: int        static bound on the tree depth

The verdict (``Acceptance``), all fixed-width:
  path:       [B, D+1] accepted node indices, root first, -1 past the end
  accept_len: [B]      entries of ``path`` in use, >= 1 (the root is committed)
  bonus:      [B]      the target's token after the last accepted node
  emitted:    [B, D+1] this step's new tokens: the accepted drafts, then the
                       bonus, then -1; exactly ``accept_len`` of them

Widths: path arrays are D+1 wide, node arrays N wide; never mix the two.
Greedy and deterministic-draft sampling are loop-free; recursive rejection
sampling with draft distributions walks at most N-1 candidates per row.
No function here synchronises with the host.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .bitmask import first_child_next_sibling, mask_to_matrix


class Acceptance(NamedTuple):
    path: torch.Tensor  # [B, D+1]
    accept_len: torch.Tensor  # [B]
    bonus: torch.Tensor  # [B]
    emitted: torch.Tensor  # [B, D+1]


# ----------------------------------------------------------------------------- references
def _arange(n: int, like: torch.Tensor) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int64, device=like.device)


def positions(seq: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Where each of ``values [B, M']`` sits in ``seq [B, M]`` (the matched entries distinct), -1 where it is
    absent: every pair compared, a reduction inductor fuses, where inverting a map by a scatter is a launch of
    its own on a GPU. For trees' small M and M' (at most 64)."""
    hit = seq.unsqueeze(1) == values.unsqueeze(2)  # [B, M', M]
    # a sum, not a max of where(hit, j, -1): inductor (torch 2.11) pads a fused max with int64's least value in
    # rows past the tensor and checks a gather's index there unmasked (a device assert); a sum pads with 0 -> -1
    return (hit * (_arange(seq.shape[1], seq) + 1)).sum(-1) - 1


def _take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows of ``x [B, N, V]`` at ``index [B]`` -> ``[B, V]``."""
    return x.gather(1, index.view(-1, 1, 1).expand(-1, 1, x.shape[-1])).squeeze(1)


def _check_tree(tokens: torch.Tensor, parents: torch.Tensor, mask: torch.Tensor, max_depth: int) -> None:
    if tokens.dim() != 2 or tokens.shape != parents.shape or tokens.shape != mask.shape:
        raise ValueError(
            f"tokens, parents and mask must all be [B, N]; got {tuple(tokens.shape)}, "
            f"{tuple(parents.shape)}, {tuple(mask.shape)}"
        )
    if not 0 <= max_depth < tokens.shape[1]:
        raise ValueError(f"max_depth is {max_depth}; a tree of {tokens.shape[1]} nodes has depth 0..{tokens.shape[1] - 1}")


def _accept_deepest(tokens, parents, mask, match, max_depth) -> tuple[torch.Tensor, Acceptance]:
    """Accept the deepest node whose whole root path matches (ties: lowest index).

    match: [B, N] bool, whether node j's edge from its parent is accepted (the
    root's value is ignored). returns (best node [B], Acceptance without bonus).
    """
    b, n = tokens.shape
    idx = _arange(n, tokens)
    anc = mask_to_matrix(mask, n)  # [B, N, N]: anc[b, i, j] = j is an ancestor-or-self of i
    depth = anc.sum(-1) - 1  # [B, N]
    match = match | (idx == 0)
    path_ok = ~(anc & ~match.unsqueeze(1)).any(-1)  # [B, N]
    key = torch.where(path_ok, depth * n + (n - 1 - idx), -1)
    best = key.argmax(-1)  # [B]
    on_path = anc.gather(1, best.view(b, 1, 1).expand(b, 1, n)).squeeze(1)  # [B, N]
    # path[d]: the path's node at depth d, -1 past it (off-path nodes sit at depth -1, which no d matches)
    path = positions(torch.where(on_path, depth, -1), _arange(max_depth + 1, tokens).expand(b, -1))  # [B, D+1]
    accept_len = depth.gather(1, best.unsqueeze(1)).squeeze(1) + 1
    return best, Acceptance(path, accept_len, None, None)


def verify_forced(tokens: torch.Tensor, first_child: torch.Tensor, target_tokens: torch.Tensor, accept: int,
                  max_depth: int) -> Acceptance:
    """BENCHMARKS ONLY, NOT LOSSLESS (SGLang's simulated acceptance): accept ``accept`` nodes down
    the first-child chain from the root (fewer where the tree is shallower) whatever the target
    says, then its bonus token there, so an untrained draft exercises the accepted lengths a
    trained one would. first_child: [B, N] (trees.Tree.first_child)."""
    b = tokens.shape[0]
    node = torch.zeros(b, dtype=torch.int64, device=tokens.device)
    nodes = [node]
    for _ in range(max_depth):
        node = torch.where(node >= 0, first_child.gather(1, node.clamp(min=0).unsqueeze(1)).squeeze(1), -1)
        nodes.append(node)
    path = torch.stack(nodes, 1)  # [B, D+1], -1 past the chain's leaf
    accept_len = (path >= 0).sum(1).clamp(max=accept)
    path = torch.where(_arange(max_depth + 1, path) < accept_len.unsqueeze(1), path, -1)
    bonus = target_tokens.gather(1, path.gather(1, (accept_len - 1).unsqueeze(1))).squeeze(1)
    return _with_bonus(tokens, Acceptance(path, accept_len, None, None), bonus)


def _with_bonus(tokens: torch.Tensor, acc: Acceptance, bonus: torch.Tensor) -> Acceptance:
    """Fill in ``bonus`` and ``emitted`` (accepted drafts, then the bonus)."""
    after_root = torch.cat([acc.path[:, 1:], torch.full_like(acc.path[:, :1], -1)], 1)  # [B, D+1]
    real = after_root >= 0  # gathered at where(real, ., 0), not a clamp: TensorRT's Clip is float-only
    emitted = torch.where(real, tokens.gather(1, torch.where(real, after_root, 0)), -1)
    last = _arange(emitted.shape[1], emitted) == (acc.accept_len - 1).unsqueeze(1)  # the bonus's slot
    emitted = torch.where(last, bonus.unsqueeze(1), emitted)
    return Acceptance(acc.path, acc.accept_len, bonus, emitted)


def verify_greedy(tokens, parents, mask, target_tokens, max_depth: int) -> Acceptance:
    """Greedy tree verification.

    target_tokens: [B, N] the target's argmax at every node.
    A node is accepted iff every node on its root path drafted the target's
    argmax at its parent. Returns the deepest accepted node's path (ties to
    the lowest node index; siblings with distinct tokens -- every top-k
    draft -- make this exactly the walk from the root), with the bonus
    ``target_tokens`` at that node.
    """
    _check_tree(tokens, parents, mask, max_depth)
    at_parent = torch.where(parents >= 0, parents, 0)  # not clamp: TensorRT's Clip is float-only
    drafted_target = tokens == target_tokens.gather(1, at_parent)
    best, acc = _accept_deepest(tokens, parents, mask, drafted_target, max_depth)
    return _with_bonus(tokens, acc, target_tokens.gather(1, best.unsqueeze(1)).squeeze(1))


def greedy_tokens(logits: torch.Tensor, chunk: int = 0) -> torch.Tensor:
    """``logits [..., V] -> [...]``: ``logits.argmax(-1)``, the first index of the maximum (NaN counts as the
    maximum), bit for bit. With ``chunk`` > 0 and V > 2 * chunk, in two stages: the maximum and its first
    index in each chunk of ``chunk`` entries (the last padded with -inf), then the first chunk holding the
    overall maximum. Inductor never splits an arg reduction across programs, so a step's few rows of a
    128k vocabulary reduce in as many programs (29 us a step on the H200 at one row, in a profile of
    2026-12-01, docs/benchmarks.md); chunks give it rows * V / chunk programs."""
    vocab = logits.shape[-1]
    if chunk <= 0 or vocab <= 2 * chunk:
        return logits.argmax(-1)
    chunks = -(-vocab // chunk)
    if chunks * chunk != vocab:
        logits = torch.nn.functional.pad(logits, (0, chunks * chunk - vocab), value=float("-inf"))
    best, where = logits.unflatten(-1, (chunks, chunk)).max(-1)  # [..., chunks] each chunk's first maximum
    first = best.argmax(-1, keepdim=True)  # [..., 1] the first chunk holding the overall maximum
    return (first * chunk + where.gather(-1, first)).squeeze(-1)


def sample_categorical(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row of ``probs [..., V]`` (need not be normalised), no host sync.

    Exponential race: argmax_v p_v / E_v with E_v ~ Exp(1) picks v with
    probability p_v / sum(p). float64 keeps ties and underflow out of the way.
    """
    race = torch.empty(probs.shape, dtype=torch.float64, device=probs.device).exponential_(generator=generator)
    return (probs.to(torch.float64) / race.clamp(min=torch.finfo(torch.float64).tiny)).argmax(-1)


SCAN_BLOCK = 256


def _cumsum_in_blocks(x: torch.Tensor) -> torch.Tensor:
    """``x.cumsum(-1)`` as two short scans (within blocks of SCAN_BLOCK, then over the blocks' totals):
    inductor splits one long scan over a vocabulary (SplitScan), whose code generation failed on the
    H200 for a [256, 1, 49152] cumsum in the sampled decode step (torch 2.11)."""
    v = x.shape[-1]
    pad = -v % SCAN_BLOCK
    blocks = torch.nn.functional.pad(x, (0, pad)).unflatten(-1, (-1, SCAN_BLOCK))  # [..., V / block, block]
    within = blocks.cumsum(-1)
    before = within[..., -1].cumsum(-1) - within[..., -1]  # [..., V / block]: the sum of earlier blocks
    return (within + before.unsqueeze(-1)).flatten(-2)[..., :v]


TOP_K_CAP = 256  # a top_k up to this is found by torch.topk: a sort of 49k-150k logits costs tens of µs a step


def sampling_probs(logits, temperature, top_k=None, top_p=None, min_p=None, top_k_cap: int | None = None,
                   greedy_rows: bool = True) -> torch.Tensor:
    """Per-row target distribution after temperature, top-k, top-p, then min-p.

    logits: [B, N, V]; temperature, top_k, top_p, min_p: [B] (or scalars).
    temperature <= 0 means greedy (one-hot argmax); top_k <= 0, top_p >= 1 and
    min_p <= 0 disable their filter, None skips it (no work). Semantics match
    transformers' Temperature, TopK, TopP and MinP logits warpers applied in that
    order (its generate's order), but for ties at the nucleus' edge: top-p keeps a
    token iff the tokens strictly more likely hold less than top_p of the mass, so
    tokens tied at the edge stay together (transformers keeps those its unstable
    sort happens to put last). ``top_k_cap``: every row's top_k is in 1..cap (the
    k-th largest logit, and the nucleus inside the top k, are then found by
    torch.topk, not a sort of the vocabulary). ``greedy_rows=False``: every
    temperature is > 0 (no argmax pass).
    returns float32 [B, N, V].
    """
    x, greedy = _warp(logits, temperature, top_k, top_p, min_p, top_k_cap)
    probs = x.softmax(-1)
    if not greedy_rows:
        return probs
    one_hot = torch.zeros_like(probs).scatter(-1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where(greedy, one_hot, probs)


def warped_logits(logits, temperature, top_k=None, top_p=None, min_p=None,
                  top_k_cap: int | None = None) -> torch.Tensor:
    """The scores ``sampling_probs`` takes the softmax of: fp32 logits / temperature, -inf where
    top-k, top-p or min-p filter a token (transformers' warpers' output, what ``model.generate``
    returns as ``scores``). temperature > 0."""
    return _warp(logits, temperature, top_k, top_p, min_p, top_k_cap)[0]


def _warp(logits, temperature, top_k, top_p, min_p, top_k_cap=None) -> tuple[torch.Tensor, torch.Tensor]:
    b, _, v = logits.shape

    def per_row(x, dtype):
        return torch.as_tensor(x, dtype=dtype, device=logits.device).expand(b).view(b, 1, 1)

    temperature = per_row(temperature, torch.float32)
    greedy = temperature <= 0
    x = logits.float() / torch.where(greedy, 1.0, temperature)
    descending = None  # [B, N, S] the S largest of x after top-k, descending: the nucleus lies among them
    if top_k is not None:
        k = per_row(top_k, torch.int64).clamp(max=v)
        if top_k_cap is not None and top_k_cap < v:  # k <= cap: the k-th of the cap largest, no full sort
            largest = x.topk(top_k_cap, -1).values  # [B, N, cap], descending
        else:
            largest = x.sort(-1, descending=True).values
        kth = largest.gather(-1, (k - 1).clamp(min=0, max=largest.shape[-1] - 1).expand(b, x.shape[1], 1))
        x = torch.where((k > 0) & (x < kth), float("-inf"), x)
        if top_p is not None:  # top-p's nucleus lies among them
            descending = torch.where((k > 0) & (largest < kth), float("-inf"), largest)
    if top_p is not None:
        p = per_row(top_p, torch.float32)
        if descending is None:
            descending = x.sort(-1, descending=True).values
        mass = (descending - x.logsumexp(-1, keepdim=True)).exp()
        above = _cumsum_in_blocks(mass) - mass  # [B, N, S] the mass strictly before each place
        # the last place holding less than top_p above it; every later place is in a later tie group. All
        # S places: the rest of x is -inf or ties the last (top-k's k-th), so the kept set is the same
        edge = descending.gather(-1, ((above < p).sum(-1, keepdim=True) - 1).clamp(min=0))
        x = torch.where((x < edge) & (p < 1), float("-inf"), x)
    if min_p is not None:  # tokens less likely than min_p times the most likely one go
        probs = x.softmax(-1)
        x = torch.where(probs < per_row(min_p, torch.float32) * probs.amax(-1, keepdim=True), float("-inf"), x)
    return x, greedy


def verify_sample(tokens, parents, mask, target_probs, max_depth: int, draft_probs=None, generator=None) -> Acceptance:
    """Lossless sampled verification: the emitted tokens are distributed exactly
    as sampling from the target, for any tree.

    target_probs: [B, N, V] the target's (filtered) distribution at every node.
    draft_probs:  [B, N, V] or None. Row j is the distribution node j's token
        was drawn from, given its earlier siblings (i.i.d. drafts: the parent's
        draft distribution; drafts without replacement: that distribution with
        the earlier siblings removed). None means deterministic drafts (top-k):
        every node then draws its own target sample and a child is accepted
        iff it drafted its parent's sample (lowest index among equal tokens),
        which is what recursive rejection reduces to for point-mass drafts.
    With draft_probs, recursive rejection sampling (SpecInfer): at each accepted
    node try the children best first, accept child x with probability
    min(1, r(x) / q(x)) against the residual r, on rejection set
    r <- norm(max(r - q, 0)); the bonus is drawn from the final residual.
    """
    _check_tree(tokens, parents, mask, max_depth)
    b, n = tokens.shape
    if target_probs.shape[:2] != (b, n):
        raise ValueError(f"target_probs must be [B, N, V] = [{b}, {n}, V]; got {tuple(target_probs.shape)}")
    if draft_probs is None:
        return verify_draws(tokens, parents, mask, sample_categorical(target_probs, generator), max_depth)
    if draft_probs.shape != target_probs.shape:
        raise ValueError(f"draft_probs must match target_probs {tuple(target_probs.shape)}; got {tuple(draft_probs.shape)}")
    return _rejection_walk(tokens, parents, target_probs.float(), draft_probs.float(), max_depth, generator)


def verify_draws(tokens, parents, mask, draws, max_depth: int) -> Acceptance:
    """Every node's own target draw given (``draws [B, N]``): a child is accepted iff it drafted its
    parent's draw (the lowest index among equal sibling tokens); the bonus is the draw at the
    deepest accepted node. ``verify_sample``'s point-mass-draft rule; kernels/gumbel.py's seeded
    rule with keyed draws."""
    n = tokens.shape[1]
    drafted_draw = tokens == draws.gather(1, parents.clamp(min=0))
    idx = _arange(n, tokens)
    earlier_sibling = (parents.unsqueeze(-1) == parents.unsqueeze(-2)) & (idx.view(1, n, 1) > idx.view(1, 1, n))
    first_match = drafted_draw & ~(earlier_sibling & drafted_draw.unsqueeze(1)).any(-1)
    best, acc = _accept_deepest(tokens, parents, mask, first_match, max_depth)
    return _with_bonus(tokens, acc, draws.gather(1, best.unsqueeze(1)).squeeze(1))


def _rejection_walk(tokens, parents, target_probs, draft_probs, max_depth, generator) -> Acceptance:
    b, n = tokens.shape
    first_child, next_sibling = first_child_next_sibling(parents)
    rows = _arange(b, tokens)
    path = torch.full((b, max_depth + 1), -1, dtype=torch.int64, device=tokens.device)
    path[:, 0] = 0
    slots = _arange(max_depth + 1, tokens)
    accept_len = torch.ones(b, dtype=torch.int64, device=tokens.device)
    candidate = first_child[:, 0]  # next child to try at the current node, -1: walk over
    residual = target_probs[:, 0]  # [B, V]
    for _ in range(n - 1):  # each node is tried at most once per row
        active = candidate >= 0
        child = candidate.clamp(min=0)
        token = tokens[rows, child]
        proposal = _take(draft_probs, child)  # [B, V]
        r_x = residual[rows, token]
        q_x = proposal[rows, token]
        coin = torch.rand(b, generator=generator, device=tokens.device)
        accept = active & (coin * q_x < r_x)  # probability min(1, r/q)
        reject = active & ~accept
        leftover = (residual - proposal).clamp(min=0)
        total = leftover.sum(-1, keepdim=True)
        rejected = torch.where(total > 0, leftover / total.clamp(min=1e-30), residual)
        residual = torch.where(accept.unsqueeze(1), _take(target_probs, child),
                               torch.where(reject.unsqueeze(1), rejected, residual))
        path = torch.where(accept.unsqueeze(1) & (slots == accept_len.unsqueeze(1)), child.unsqueeze(1), path)
        accept_len = accept_len + accept.to(torch.int64)
        candidate = torch.where(accept, first_child[rows, child],
                                torch.where(reject, next_sibling[rows, child], candidate))
    acc = Acceptance(path, accept_len, None, None)
    return _with_bonus(tokens, acc, sample_categorical(residual, generator))


def verify_typical(tokens, parents, mask, target_probs, max_depth: int, posterior_threshold=0.09,
                   posterior_alpha=0.3, generator=None) -> Acceptance:
    """Medusa's typical acceptance -- LOSSY: the output is not the target's distribution.

    target_probs: [B, N, V] the target's distribution at every node (``sampling_probs``).
    A child is accepted iff the target's probability of its token at the parent exceeds
    min(posterior_threshold, posterior_alpha * exp(-H)), H = -sum p log(p + 1e-5) there
    (FasterDecoding/Medusa ``evaluate_posterior``; the thresholds may be 0-d tensors).
    The deepest fully accepted node wins (ties to the lowest index; Medusa breaks them by
    path likelihood); the bonus is sampled from the target at that node (Medusa's default
    ``fast=True`` takes its argmax). A one-hot target (temperature 0) makes this the greedy
    verdict. Use ``verify_sample`` for lossless sampling.
    """
    _check_tree(tokens, parents, mask, max_depth)
    probs = target_probs.float()  # [B, N, V]
    entropy = -(probs * (probs + 1e-5).log()).sum(-1)  # [B, N]
    cap = torch.as_tensor(posterior_threshold, dtype=probs.dtype, device=probs.device)
    threshold = torch.minimum(posterior_alpha * (-entropy).exp(), cap)
    at_parent = parents.clamp(min=0)
    p_token = probs.gather(1, at_parent.unsqueeze(-1).expand_as(probs)).gather(2, tokens.unsqueeze(-1)).squeeze(-1)
    typical = p_token > threshold.gather(1, at_parent)
    best, acc = _accept_deepest(tokens, parents, mask, typical, max_depth)
    return _with_bonus(tokens, acc, sample_categorical(_take(probs, best), generator))
