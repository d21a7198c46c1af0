"""Block verification of a chain draft (Sun et al., "Block Verification Accelerates Speculative
Decoding", arXiv 2403.10444, ICLR 2025): lossless sampled verification that decides the accepted
prefix jointly; never fewer accepted tokens in expectation than token-wise rejection, more when the
draft is stochastic.

Contract (B rows, a chain of N = gamma + 1 nodes, node 0 the root, node i drafted X_i):
  tokens:       [B, N] int64
  target_probs: [B, N, V]  row i: M_b(. | X^i), the target's (filtered) distribution after node i
  draft_probs:  [B, N, V] or None  row i (i >= 1): M_s(. | X^{i-1}), the distribution X_i was drawn
                from (row 0 unused); None: point-mass drafts (every shipped draft), M_s = one-hot(X_i)
  coins:        [B, gamma] or None  the uniforms eta_i (drawn from ``generator`` when None)
  -> Acceptance (kernels/verify.py): accepted nodes 0..tau, then the correction token Y.
No host sync, fixed shapes, a loop of gamma steps over [B] tensors: it can sit in the compiled step.

The algorithm (the paper's Algorithm 2), with p_0 = 1:
  p_i   = min(1, p_{i-1} * M_b(X_i | X^{i-1}) / M_s(X_i | X^{i-1}))                   i = 1..gamma
  r_i   = max(p_i * M_b(. | X^i) - M_s(. | X^i), 0)       (unnormalised residual)      i = 0..gamma-1
  h_i   = |r_i| / (|r_i| + 1 - p_i) for i < gamma,  h_gamma = p_gamma
  tau   = the largest i in 1..gamma with eta_i < h_i, else 0     (the backward pass: from the end, the
                                                                 first position whose coin passes)
  Y     ~ M_b(. | X^gamma) if tau = gamma, else r_tau / |r_tau|
Derivation (sketch of the paper's proof): p_i is the largest weight with which the prefix X^i can
be "kept alive" so that, summed over drafts, the kept mass of every prefix never exceeds its target
probability: P(prefix X^i alive) = q(X^i) p_i <= M_b(X^i). Stopping at i and emitting Y ~ r_i tops
up exactly the target mass of the continuations X^i y that the alive draft mass under-covers
(p_i M_b(y | X^i) - M_s(y | X^i) where positive); h_i is the probability of stopping at i given that
no later position was kept, which makes P(tau >= i, X^i) = q(X^i) p_i and the emitted prefix
distribution M_b. Token-wise rejection is the same scheme with p_i reset to 1 at every position
(accept X_i with probability min(1, M_b/M_s) alone), which is why it never accepts more. With
point-mass drafts p_i = prod_j M_b(X_j | X^{j-1}) and P(tau >= i) = p_i for both rules: equal in
expectation, block verification only gains with stochastic (``draft_probs``) drafts.
Tested by exact enumeration against autoregressive target sampling (tests/test_verify_block.py).
"""
from __future__ import annotations

import torch

from .verify import Acceptance, _with_bonus, sample_categorical


def block_weights(tokens: torch.Tensor, target_probs: torch.Tensor, draft_probs: torch.Tensor | None = None):
    """p [B, gamma + 1], residuals r [B, gamma, V] (unnormalised, row i = r_i) and h [B, gamma + 1]
    (h[:, 0] = 1: tau = 0 always qualifies) of the module docstring."""
    b, n = tokens.shape
    gamma = n - 1
    target = target_probs.float()
    drafted = tokens[:, 1:]  # [B, gamma]: X_1 .. X_gamma
    if draft_probs is None:
        draft = torch.zeros_like(target[:, 1:]).scatter(-1, drafted.unsqueeze(-1), 1.0)
    else:
        draft = draft_probs[:, 1:].float()  # [B, gamma, V]: row i-1 = M_s(. | X^{i-1})
    b_x = target[:, :-1].gather(-1, drafted.unsqueeze(-1)).squeeze(-1)  # [B, gamma]: M_b(X_i | X^{i-1})
    s_x = draft.gather(-1, drafted.unsqueeze(-1)).squeeze(-1)
    ratio = torch.where(s_x > 0, b_x / s_x.clamp(min=1e-30), 0.0)  # a draft its own draft gives 0 is never kept
    p = [torch.ones(b, dtype=target.dtype, device=target.device)]
    for i in range(gamma):
        p.append(torch.clamp(p[-1] * ratio[:, i], max=1.0))
    p = torch.stack(p, 1)  # [B, gamma + 1]
    residual = (p[:, :-1].unsqueeze(-1) * target[:, :-1] - draft).clamp(min=0)  # [B, gamma, V]
    mass = residual.sum(-1)
    denominator = mass + 1 - p[:, :-1]
    h = torch.where(denominator > 0, mass / denominator.clamp(min=1e-30), 0.0)
    h = torch.cat([torch.ones_like(p[:, :1]), h[:, 1:], p[:, -1:]], 1) if gamma else p  # [B, gamma + 1]
    return p, residual, h


def verify_block(tokens, target_probs, max_depth: int, draft_probs=None, generator=None, coins=None) -> Acceptance:
    """Block verification of the chain ``tokens [B, N]`` (module docstring); max_depth = N - 1."""
    b, n = tokens.shape
    if target_probs.shape[:2] != (b, n) or max_depth != n - 1:
        raise ValueError(f"verify_block takes a chain: tokens [B, N], target_probs [B, N, V], max_depth = N - 1; got "
                         f"{tuple(tokens.shape)}, {tuple(target_probs.shape)}, max_depth={max_depth}")
    if draft_probs is not None and draft_probs.shape != target_probs.shape:
        raise ValueError(f"draft_probs must match target_probs {tuple(target_probs.shape)}; got {tuple(draft_probs.shape)}")
    gamma = n - 1
    _, residual, h = block_weights(tokens, target_probs, draft_probs)
    if coins is None:
        coins = torch.rand(b, gamma, generator=generator, device=tokens.device)
    steps = torch.arange(1, gamma + 1, device=tokens.device)
    tau = torch.where(coins < h[:, 1:], steps, 0).amax(-1) if gamma else torch.zeros(b, dtype=torch.int64,
                                                                                      device=tokens.device)
    target = target_probs.float()
    last = target[:, gamma]  # tau = gamma: the target after the whole block
    if gamma:
        at = tau.clamp(max=gamma - 1).view(b, 1, 1).expand(b, 1, target.shape[-1])
        r = residual.gather(1, at).squeeze(1)
        fallback = target.gather(1, at).squeeze(1)  # an empty residual (rounding): the target itself
        r = torch.where(r.sum(-1, keepdim=True) > 0, r, fallback)
        last = torch.where((tau == gamma).unsqueeze(-1), last, r)
    correction = sample_categorical(last, generator)
    idx = torch.arange(n, device=tokens.device).expand(b, n)
    path = torch.where(idx <= tau.unsqueeze(1), idx, -1)
    return _with_bonus(tokens, Acceptance(path, tau + 1, None, None), correction)


# ----------------------------------------------------------------------------- reference (one row, Python floats)
def block_reference(tokens: list[int], target: list[list[float]], draft: list[list[float]] | None):
    """(h, residuals) of one chain with Python floats: the tests' oracle. target[i] = M_b(. | X^i),
    draft[i] = M_s(. | X^{i-1}) for i >= 1 (None: point masses)."""
    gamma, v = len(tokens) - 1, len(target[0])
    if draft is None:
        draft = [None] + [[1.0 if t == tokens[i] else 0.0 for t in range(v)] for i in range(1, gamma + 1)]
    p, h, residuals = 1.0, [1.0], []
    for i in range(1, gamma + 1):
        r = [max(p * target[i - 1][t] - draft[i][t], 0.0) for t in range(v)]
        if i > 1:
            h.append(sum(r) / (sum(r) + 1 - p) if sum(r) + 1 - p > 0 else 0.0)
        residuals.append(r)
        x = tokens[i]
        p = min(1.0, p * target[i - 1][x] / draft[i][x]) if draft[i][x] > 0 else 0.0
    h.append(p)
    return h, residuals
