"""Sampled verification is exact in distribution: chi-square tests.

A toy target and draft are Markov chains over V tokens (the next-token
distribution depends on the last token). Every row drafts a tree, verifies
it, then continues with plain target sampling up to L tokens; the joint
distribution of those L tokens must be the target chain's. Fixed seeds;
p > 0.01. Negative controls show the test rejects a wrong verifier.
"""
import pytest
import torch

from specgraph import Chain, StaticTree, Tree
from specgraph.kernels.verify import _accept_deepest, _with_bonus, sample_categorical, sampling_probs, verify_sample

V, L, ROWS, ROOT = 3, 3, 30_000, 0
BRANCHING = StaticTree([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1]])
TREES = {"chain": Chain(3), "branching": BRANCHING}


def markov(seed: int, spread: float = 1.0) -> torch.Tensor:
    """A random transition matrix [V, V]: row t is the next-token distribution after t."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(V, V, generator=g) * spread).softmax(-1)


def draft_tree(spec, draft, mode, g):
    """Tokens [ROWS, N] drafted from the draft chain, and each node's proposal distribution."""
    parents = spec.parents()
    n = len(parents)
    ranks = spec.ranks() if isinstance(spec, StaticTree) else [-1] + [0] * (n - 1)
    tokens = torch.full((ROWS, n), ROOT, dtype=torch.long)
    proposal = torch.zeros(ROWS, n, V)
    taken = {}  # parent -> tokens of earlier siblings (without-replacement drafts)
    for i in range(1, n):
        q = draft[tokens[:, parents[i]]]  # [ROWS, V]
        if mode == "iid":
            proposal[:, i] = q
        elif mode == "without_replacement":
            seen = taken.setdefault(parents[i], torch.zeros(ROWS, V, dtype=torch.bool))
            q = torch.where(seen, 0.0, q)
            q = q / q.sum(-1, keepdim=True)
            proposal[:, i] = q
        if mode == "topk":
            tokens[:, i] = torch.sort(q, dim=-1, descending=True, stable=True).indices[:, ranks[i]]
        elif mode == "duplicates":
            tokens[:, i] = q.argmax(-1)  # every sibling drafts the same token
        else:
            tokens[:, i] = sample_categorical(q, g)
            if mode == "without_replacement":
                taken[parents[i]] = taken[parents[i]] | torch.nn.functional.one_hot(tokens[:, i], V).bool()
    tree = Tree.from_spec(spec, tokens)
    return tree, (proposal if mode in ("iid", "without_replacement") else None)


def continue_with_target(emitted, accept_len, target, g):
    """First L tokens: the verified ones, then plain sampling from the target chain."""
    seq = torch.zeros(ROWS, L, dtype=torch.long)
    prev = torch.full((ROWS,), ROOT)
    for t in range(L):
        have = accept_len > t
        drawn = sample_categorical(target[prev], g)
        tok = torch.where(have, emitted[:, min(t, emitted.shape[1] - 1)], drawn)
        seq[:, t] = tok
        prev = tok
    return seq


def chi_square_p(seq, target):
    codes = (seq * torch.tensor([V * V, V, 1])).sum(-1)
    observed = torch.bincount(codes, minlength=V**L).double()
    x = torch.cartesian_prod(*[torch.arange(V)] * L)
    prev = torch.cat([torch.full((V**L, 1), ROOT), x[:, :-1]], 1)
    expected = target.double()[prev, x].prod(-1) * ROWS
    keep = expected > 0
    assert observed[~keep].sum() == 0, "emitted a token the target gives probability 0"
    stat = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    dof = int(keep.sum()) - 1
    return torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2).item()


def run(tree_name, mode, target_filter=None, verifier=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    target, draft = markov(100 + seed), markov(200 + seed, spread=2.0)
    if target_filter is not None:  # the target distribution after temperature / top-k / top-p
        target = sampling_probs(target.log().unsqueeze(0), *target_filter)[0]
    tree, proposal = draft_tree(TREES[tree_name], draft, mode, g)
    target_probs = target[tree.tokens]  # [ROWS, N, V]
    verify = verifier or verify_sample
    acc = verify(tree.tokens, tree.parents, tree.mask, target_probs, tree.max_depth, draft_probs=proposal, generator=g)
    return chi_square_p(continue_with_target(acc.emitted, acc.accept_len, target, g), target), acc


CASES = [(t, m) for t in TREES for m in ("iid", "without_replacement", "topk", "duplicates")
         if (t, m) != ("chain", "without_replacement")]  # a chain has no siblings


@pytest.mark.parametrize("tree_name, mode", CASES)
def test_emitted_tokens_follow_the_target(tree_name, mode):
    p, acc = run(tree_name, mode)
    assert p > 0.01, f"chi-square p = {p:.2e}"
    assert acc.accept_len.float().mean() > 1.2  # the draft is accepted often enough to matter


def test_filtered_target_with_per_row_parameters():
    # temperature 0.7, top-k 2, top-p 0.9: zero-probability tokens must never appear
    p, _ = run("branching", "iid", target_filter=(torch.tensor(0.7), torch.tensor(2), torch.tensor(0.9)))
    assert p > 0.01, f"chi-square p = {p:.2e}"


def test_chi_square_rejects_a_verifier_that_trusts_the_draft():
    def accept_first_children(tokens, parents, mask, target_probs, max_depth, draft_probs=None, generator=None):
        _, acc = _accept_deepest(tokens, parents, mask, torch.ones_like(tokens, dtype=torch.bool), max_depth)
        best = acc.path.gather(1, (acc.accept_len - 1).unsqueeze(1)).squeeze(1)
        return _with_bonus(tokens, acc, sample_categorical(target_probs[torch.arange(tokens.shape[0]), best], generator))

    p, _ = run("branching", "iid", verifier=accept_first_children)
    assert p < 1e-6


def test_chi_square_rejects_choosing_among_duplicate_siblings_by_outcome():
    """With duplicate sibling tokens, picking whichever sibling leads deeper
    (rather than the first) biases the output: the walk must be fixed."""

    def deepest_match(tokens, parents, mask, target_probs, max_depth, draft_probs=None, generator=None):
        draws = sample_categorical(target_probs, generator)
        match = tokens == draws.gather(1, parents.clamp(min=0))
        best, acc = _accept_deepest(tokens, parents, mask, match, max_depth)
        return _with_bonus(tokens, acc, draws.gather(1, best.unsqueeze(1)).squeeze(1))

    p, _ = run("branching", "duplicates", verifier=deepest_match)
    assert p < 1e-6


def test_same_generator_seed_same_verdict():
    _, a = run("branching", "iid", seed=3)
    _, b = run("branching", "iid", seed=3)
    assert torch.equal(a.emitted, b.emitted)
