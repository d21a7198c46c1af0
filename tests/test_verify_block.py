"""Block verification (kernels/verify_block.py) is exact, and accepts at least as much as token-wise.

Exactness by exact enumeration: a context-dependent target and stochastic draft over V = 4 tokens,
chains of depth 2 and 3; every draft block, every stopping point and the correction token are summed
with their probabilities, then the target continues to depth + 1 tokens: the joint distribution must
be the target's autoregressive one (to float32 rounding). A deliberately wrong residual or stopping
rule must fail. The full sampler (coins, correction draw) by chi-square (tests/test_verify_sampling).
"""
import itertools

import pytest
import torch

from specgraph.kernels.verify_block import block_reference, block_weights, verify_block
from test_verify_sampling import run

V = 4


def model_tables(seed: int, depth: int, spread: float):
    """table[prefix tuple] -> next-token distribution [V], for every prefix up to ``depth`` tokens."""
    g = torch.Generator().manual_seed(seed)
    return {prefix: (torch.randn(V, generator=g, dtype=torch.float64) * spread).softmax(-1)
            for k in range(depth + 1) for prefix in itertools.product(range(V), repeat=k)}


def chain_inputs(target, draft, depth):
    """Every draft block [V**depth, depth + 1] (root token 0), its probability under the draft, and the
    per-node target / draft distributions the verifier takes."""
    blocks = list(itertools.product(range(V), repeat=depth))
    tokens = torch.tensor([[0, *x] for x in blocks])
    target_probs = torch.stack([torch.stack([target[x[:i]] for i in range(depth + 1)]) for x in blocks])
    draft_probs = torch.stack([torch.stack([torch.zeros(V, dtype=torch.float64)] + [draft[x[:i - 1]]
                                           for i in range(1, depth + 1)]) for x in blocks])
    q = torch.tensor([float(torch.prod(torch.stack([draft[x[:i]][x[i]] for i in range(depth)]))) for x in blocks],
                     dtype=torch.float64)
    return blocks, tokens, target_probs, draft_probs, q


def output_distribution(target, draft, depth, weights=block_weights, point_mass=False):
    """Exact P(first depth + 1 emitted tokens) under block verification then target sampling."""
    blocks, tokens, target_probs, draft_probs, q = chain_inputs(target, draft, depth)
    if point_mass:  # the draft is its argmax: deterministic
        blocks = [tuple(int(t) for t in greedy_block(draft, depth))]
        tokens = torch.tensor([[0, *blocks[0]]])
        target_probs = torch.stack([torch.stack([target[blocks[0][:i]] for i in range(depth + 1)])])
        q = torch.ones(1, dtype=torch.float64)
    _, residual, h = weights(tokens, target_probs, None if point_mass else draft_probs)
    out = {}
    for row, x in enumerate(blocks):
        for tau in range(depth + 1):
            p_tau = float(h[row, tau]) * float(torch.prod(1 - h[row, tau + 1:]))
            if p_tau == 0:
                continue
            y_dist = target[x] if tau == depth else residual[row, tau].double() / residual[row, tau].sum()
            for rest in itertools.product(range(V), repeat=depth + 1 - tau):
                seq = x[:tau] + rest
                prob = float(q[row]) * p_tau * float(y_dist[rest[0]])
                for i in range(tau + 1, depth + 1):
                    prob *= float(target[seq[:i]][seq[i]])
                out[seq] = out.get(seq, 0.0) + prob
    return out


def greedy_block(draft, depth):
    x = ()
    for _ in range(depth):
        x = x + (int(draft[x].argmax()),)
    return x


def target_distribution(target, depth):
    out = {}
    for seq in itertools.product(range(V), repeat=depth + 1):
        prob = 1.0
        for i in range(depth + 1):
            prob *= float(target[seq[:i]][seq[i]])
        out[seq] = prob
    return out


def tv(a, b):
    return 0.5 * sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


def expected_accepted(h):
    """E[tau] for each row of h [B, gamma + 1] (tau = the largest i >= 1 with eta_i < h_i, else 0)."""
    gamma = h.shape[1] - 1
    return sum(i * h[:, i] * torch.prod(1 - h[:, i + 1:], -1) for i in range(1, gamma + 1))


CASES = [(depth, seed, spread) for depth in (2, 3) for seed in (0, 1) for spread in (1.0, 2.5)]


@pytest.mark.parametrize("depth, seed, spread", CASES)
def test_block_verification_is_exact_by_enumeration(depth, seed, spread):
    target, draft = model_tables(100 + seed, depth, spread), model_tables(200 + seed, depth, spread)
    want = target_distribution(target, depth)
    assert tv(output_distribution(target, draft, depth), want) < 1e-5
    assert tv(output_distribution(target, draft, depth, point_mass=True), want) < 1e-5


def test_enumeration_rejects_a_wrong_residual_or_stopping_rule():
    """Negative controls: the residual without its weight p_tau (token-wise's max(M_b - M_s, 0)), and
    stopping with probability p_i instead of h_i, are not the target's distribution."""
    target, draft, depth = model_tables(102, 2, 1.0), model_tables(202, 2, 1.0), 2

    def unweighted_residual(tokens, target_probs, draft_probs):
        p, _, h = block_weights(tokens, target_probs, draft_probs)
        return p, (target_probs[:, :-1].float() - draft_probs[:, 1:].float()).clamp(min=0), h

    def stop_with_p(tokens, target_probs, draft_probs):
        p, residual, _ = block_weights(tokens, target_probs, draft_probs)
        return p, residual, torch.cat([torch.ones_like(p[:, :1]), p[:, 1:]], 1)

    want = target_distribution(target, depth)
    assert tv(output_distribution(target, draft, depth), want) < 1e-5  # the real rule, on these tables
    assert tv(output_distribution(target, draft, depth, unweighted_residual), want) > 5e-3  # 0.013
    assert tv(output_distribution(target, draft, depth, stop_with_p), want) > 5e-3  # 0.076


def test_weights_match_the_scalar_reference():
    target, draft, depth = model_tables(7, 3, 2.0), model_tables(8, 3, 2.0), 3
    _, tokens, target_probs, draft_probs, _ = chain_inputs(target, draft, depth)
    for probs in (draft_probs, None):
        _, residual, h = block_weights(tokens, target_probs, probs)
        for row in range(0, tokens.shape[0], 5):
            d = None if probs is None else probs[row].tolist()
            ref_h, ref_r = block_reference(tokens[row].tolist(), target_probs[row].tolist(), d)
            assert torch.allclose(h[row].double(), torch.tensor(ref_h, dtype=torch.float64), atol=1e-6)
            assert torch.allclose(residual[row].double(), torch.tensor(ref_r, dtype=torch.float64), atol=1e-6)


def test_accepted_length_is_the_last_passing_coin():
    target, draft, depth = model_tables(3, 3, 2.0), model_tables(4, 3, 2.0), 3
    _, tokens, target_probs, draft_probs, _ = chain_inputs(target, draft, depth)
    coins = torch.rand(tokens.shape[0], depth, generator=torch.Generator().manual_seed(0))
    acc = verify_block(tokens, target_probs, depth, draft_probs, coins=coins)
    _, _, h = block_weights(tokens, target_probs, draft_probs)
    want = [max([0] + [i for i in range(1, depth + 1) if coins[r, i - 1] < h[r, i]]) for r in range(tokens.shape[0])]
    assert (acc.accept_len - 1).tolist() == want
    for r, tau in enumerate(want):  # the accepted drafts, then the correction, then -1
        assert acc.path[r].tolist() == list(range(tau + 1)) + [-1] * (depth - tau)
        assert acc.emitted[r].tolist() == tokens[r, 1:tau + 1].tolist() + [int(acc.bonus[r])] + [-1] * (depth - tau)


def _block(tokens, parents, mask, target_probs, max_depth, draft_probs=None, generator=None):
    return verify_block(tokens, target_probs, max_depth, draft_probs, generator)


@pytest.mark.parametrize("mode", ["iid", "topk"])
def test_full_sampler_follows_the_target_by_chi_square(mode):
    p, acc = run("chain", mode, verifier=_block)
    assert p > 0.01, f"chi-square p = {p:.2e}"
    assert acc.accept_len.float().mean() > 1.2


def test_paper_example_eleven_ninths():
    """Sun et al.'s motivating example: M_b = (1/3, 2/3), M_s = (2/3, 1/3) context-free, two drafted tokens:
    token-wise accepts 10/9 tokens on average, block verification 11/9."""
    target = {p: torch.tensor([1 / 3, 2 / 3], dtype=torch.float64) for k in range(3)
              for p in itertools.product(range(2), repeat=k)}
    draft = {p: torch.tensor([2 / 3, 1 / 3], dtype=torch.float64) for p in target}
    blocks = list(itertools.product(range(2), repeat=2))
    tokens = torch.tensor([[0, *x] for x in blocks])
    target_probs = torch.stack([torch.stack([target[x[:i]] for i in range(3)]) for x in blocks])
    draft_probs = torch.stack([torch.stack([torch.zeros(2, dtype=torch.float64), draft[()], draft[x[:1]]])
                               for x in blocks])
    q = torch.tensor([(2 / 3 if a == 0 else 1 / 3) * (2 / 3 if b == 0 else 1 / 3) for a, b in blocks])
    _, _, h = block_weights(tokens, target_probs, draft_probs)
    assert float((q * expected_accepted(h).double()).sum()) == pytest.approx(11 / 9, abs=1e-6)
    accept = torch.tensor([[min(1, (1 / 3) / (2 / 3)) if t == 0 else 1.0 for t in x] for x in blocks])
    tokenwise = accept[:, 0] + accept[:, 0] * accept[:, 1]
    assert float((q * tokenwise.double()).sum()) == pytest.approx(10 / 9, abs=1e-6)


@pytest.mark.parametrize("seed", range(4))
def test_block_accepts_at_least_token_wise_in_expectation(seed):
    """Exact expectations over every draft block, and on the same coins a Monte Carlo mean; point-mass
    drafts accept the same in expectation (both reach prod M_b(X_i))."""
    depth = 3
    target, draft = model_tables(300 + seed, depth, 1.5), model_tables(400 + seed, depth, 1.5)
    _, tokens, target_probs, draft_probs, q = chain_inputs(target, draft, depth)
    _, _, h = block_weights(tokens, target_probs, draft_probs)
    ratio = (target_probs[:, :-1].gather(-1, tokens[:, 1:, None]) / draft_probs[:, 1:].gather(-1, tokens[:, 1:, None]))
    accept = ratio.squeeze(-1).clamp(max=1)  # token-wise: accept X_i with probability min(1, M_b / M_s)
    token_exact = (q * accept.cumprod(-1).sum(-1)).sum()
    block_exact = (q * expected_accepted(h).double()).sum()
    assert block_exact >= token_exact - 1e-6
    # the same coins, drafts sampled from the draft: block's mean accepted length >= token-wise's
    g = torch.Generator().manual_seed(seed)
    rows = torch.multinomial(q, 20_000, replacement=True, generator=g)
    coins = torch.rand(rows.shape[0], depth, generator=g)
    block = verify_block(tokens[rows], target_probs[rows], depth, draft_probs[rows], coins=coins, generator=g)
    token = (coins < accept[rows]).int().cumprod(-1).sum(-1)
    assert (block.accept_len - 1).float().mean() >= token.float().mean()
    assert abs((block.accept_len - 1).float().mean() - block_exact) < 0.03
    # point-mass drafts: P(tau >= i) = prod of M_b(X_j) for both rules
    _, _, h = block_weights(tokens, target_probs, None)
    pm = target_probs[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1).cumprod(-1).sum(-1)
    assert torch.allclose(expected_accepted(h).double(), pm.double(), atol=1e-5)
