"""EAGLE-2 selection: closure, depth-first numbering, ties, NaN, probability-one edges."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import specgraph.selection as selection
import specgraph.trees as trees
from specgraph import Chain, DynamicTree, Tree, config, select_tree
from specgraph.selection import expand_frontier, seed_frontier
from oracles import dfs_order_ok, select_oracle

@pytest.fixture(scope="module", params=["", "topk"], autouse=True)
def skip_fast_paths(request):
    """Every test twice: candidates ranked by specgraph::topk (the default), and by stable sorts
    (config.skip_fast_paths={"topk"})."""
    with config.patch(skip_fast_paths=request.param):
        yield request.param


# Log-probabilities that make selection hard: exact ties, probability-one
# edges (0.0), tiny positive overshoot (low-precision log-softmax), underflow
# to -inf, NaN from a padded row's garbage logits.
HARD = [0.0, -0.0, 1e-7, -0.5, -0.5, -1.0, -2.0, -30.0, float("-inf"), float("nan")]
logprob = st.one_of(st.sampled_from(HARD), st.floats(-20.0, 0.0))


@st.composite
def draft_steps(draw):
    """A DynamicTree and the per-step draft outputs of B rows."""
    steps, topk = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    spec = DynamicTree(steps, topk, draw(st.integers(2, min(64, topk + (steps - 1) * topk * topk + 1))))
    b = draw(st.integers(1, 3))
    seed = [[draw(logprob) for _ in range(topk)] for _ in range(b)]
    later = [[[[draw(logprob) for _ in range(topk)] for _ in range(topk)] for _ in range(b)] for _ in range(steps - 1)]
    return spec, torch.tensor(seed), [torch.tensor(x) for x in later]


def run_draft(spec, seed, later):
    """Drive the draft loop helpers; candidate c gets token 1000 + c (so a token names its candidate)."""
    b, k = seed.shape
    frontier = seed_frontier(seed, 1000 + torch.arange(k).expand(b, k))
    steps = [frontier]
    for s, logprobs in enumerate(later, start=1):
        base = 1000 + k + (s - 1) * k * k
        frontier = expand_frontier(frontier, logprobs, base + torch.arange(k * k).view(k, k).expand(b, k, k), s)
        steps.append(frontier)
    cat = lambda name: torch.cat([getattr(f, name) for f in steps], 1)  # noqa: E731
    return cat("scores"), cat("tokens"), cat("parents")


def check_selection(tree, scores, tokens, parents, spec):
    """The properties every selection must have, row by row, against the oracle."""
    tree.validate()  # root, parent < i, depth-first numbering
    for b in range(tree.batch_size):
        got_tokens, got_parents = tree.tokens[b].tolist(), tree.parents[b].tolist()
        source = [-1] + [t - 1000 for t in got_tokens[1:]]
        # closure: a node's parent is its candidate's parent candidate (the root for -1)
        for i in range(1, spec.num_nodes):
            assert source[got_parents[i]] == parents[b, source[i]].item(), f"row {b}: node {i}'s parent was not kept"
        assert dfs_order_ok(got_parents)
        want_tokens, want_parents, _, clamped, nan = select_oracle(
            scores[b].tolist(), tokens[b].tolist(), parents[b].tolist(), got_tokens[0], spec.num_nodes)
        assert got_tokens == want_tokens and got_parents == want_parents
        # the best child comes first, so following first children from the root is 0, 1, 2, ...
        node, walk = 0, [0]
        while tree.first_child[b, node].item() >= 0:
            node = tree.first_child[b, node].item()
            walk.append(node)
        assert walk == list(range(len(walk)))
        for i in range(spec.num_nodes):  # siblings in rank order
            j = tree.next_sibling[b, i].item()
            if j > 0:
                ki, kj = (nan[source[i]], -clamped[source[i]], source[i]), (nan[source[j]], -clamped[source[j]], source[j])
                assert ki < kj


@given(draft_steps())
def test_selection_from_the_draft_loop(case):
    spec, seed, later = case
    scores, tokens, parents = run_draft(spec, seed, later)
    root = torch.full((seed.shape[0],), 7)
    check_selection(select_tree(scores, tokens, parents, root, spec), scores, tokens, parents, spec)


@st.composite
def candidate_lists(draw):
    """Arbitrary candidate lists with the step structure (a step-s candidate's
    parent is any step-(s-1) candidate), not only the lanes' children."""
    steps, topk = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    spec = DynamicTree(steps, topk, draw(st.integers(2, min(64, topk + (steps - 1) * topk * topk + 1))))
    b = draw(st.integers(1, 2))
    rows = []
    for _ in range(b):
        parents, prev = [-1] * topk, list(range(topk))
        for s in range(1, steps):
            base = topk + (s - 1) * topk * topk
            parents += [draw(st.sampled_from(prev)) for _ in range(topk * topk)]
            prev = list(range(base, base + topk * topk))
        rows.append(parents)
    e = spec.num_candidates
    scores = torch.tensor([[draw(logprob) for _ in range(e)] for _ in range(b)])
    return spec, scores, torch.tensor(rows)


@given(candidate_lists())
def test_selection_from_raw_candidates(case):
    spec, scores, parents = case
    tokens = 1000 + torch.arange(spec.num_candidates).expand_as(parents)
    tree = select_tree(scores, tokens, parents, torch.zeros(parents.shape[0], dtype=torch.long), spec)
    check_selection(tree, scores, tokens, parents, spec)


@given(draft_steps())
def test_lanes_are_the_best_k_of_each_step(case):
    spec, seed, later = case
    b, k = seed.shape
    frontier = seed_frontier(seed, torch.zeros(b, k, dtype=torch.long))
    for s, logprobs in enumerate(later, start=1):
        parent = frontier
        frontier = expand_frontier(parent, logprobs, torch.zeros(b, k, k, dtype=torch.long), s)
        # a child never scores above its lane (its parent)
        children = frontier.scores.view(b, k, k)
        assert ((children <= parent.lane_scores.unsqueeze(-1)) | children.isnan()).all()
        for row in range(b):
            sc = frontier.scores[row].tolist()
            key = sorted(range(k * k), key=lambda c: (math.isnan(sc[c]), -(float("-inf") if math.isnan(sc[c]) else sc[c]), c))
            assert frontier.lane_rows[row].tolist() == key[:k]


@given(st.integers(1, 20), st.lists(logprob, min_size=20 * 1 + 1, max_size=21))
def test_topk_one_is_the_chain(steps, values):
    spec = DynamicTree(steps=steps, topk=1, nodes=steps + 1)
    scores = torch.tensor(values[:steps]).unsqueeze(0)
    parents = torch.arange(-1, steps - 1).unsqueeze(0)
    tree = select_tree(scores, torch.arange(steps).unsqueeze(0), parents, torch.tensor([5]), spec)
    chain = Tree.from_spec(Chain(steps), torch.zeros(1, steps + 1, dtype=torch.long))
    assert torch.equal(tree.parents, chain.parents) and torch.equal(tree.mask, chain.mask)
    assert tree.tokens[0].tolist() == [5] + list(range(steps))


def test_probability_one_edge_keeps_parent_before_child():
    # Two roots' children tie at -1; candidate 0's child (id 2) has log-prob 0:
    # child and parent tie exactly, and only one node fits.
    spec = DynamicTree(steps=2, topk=2, nodes=2)
    scores = torch.tensor([[-1.0, -1.0, -1.0, -5.0, -5.0, -5.0]])
    parents = torch.tensor([[-1, -1, 0, 0, 1, 1]])
    tree = select_tree(scores, 1000 + torch.arange(6).unsqueeze(0), parents, torch.tensor([0]), spec)
    assert tree.tokens[0].tolist() == [0, 1000]


def test_ties_to_the_higher_id_break_closure(monkeypatch):
    """Keep the suite honest: break the tie rule and the closure check must fail."""

    real_rule = selection.rank_order

    def ties_to_higher_id(scores, nan, k=None):  # rank the reversed ids, then map back
        return (scores.shape[-1] - 1 - real_rule(scores.flip(-1), nan.flip(-1)))[..., :k]

    monkeypatch.setattr(selection, "rank_order", ties_to_higher_id)
    spec = DynamicTree(steps=2, topk=2, nodes=2)
    scores = torch.tensor([[-1.0, -1.0, -1.0, -5.0, -5.0, -5.0]])
    parents = torch.tensor([[-1, -1, 0, 0, 1, 1]])
    tokens = 1000 + torch.arange(6).unsqueeze(0)
    tree = select_tree(scores, tokens, parents, torch.tensor([0]), spec)
    with pytest.raises(AssertionError, match="parent was not kept"):
        check_selection(tree, scores, tokens, parents, spec)


def test_nan_ranks_last_and_taints_descendants():
    spec = DynamicTree(steps=2, topk=2, nodes=4)
    nan = float("nan")
    # candidate 0 is NaN (its children 2, 3 look great but inherit NaN); 1 is -inf
    scores = torch.tensor([[nan, float("-inf"), -0.1, -0.2, -1.0, -2.0]])
    parents = torch.tensor([[-1, -1, 0, 0, 1, 1]])
    tokens = 1000 + torch.arange(6).unsqueeze(0)
    tree = select_tree(scores, tokens, parents, torch.tensor([0]), spec)
    check_selection(tree, scores, tokens, parents, spec)
    # -inf candidate 1 and its children (clamped to -inf) first, then NaN candidate 0
    assert tree.tokens[0].tolist() == [0, 1001, 1004, 1005]


def test_select_errors_name_the_argument():
    spec = DynamicTree(steps=2, topk=2, nodes=4)
    ok = torch.zeros(1, 6)
    with pytest.raises(ValueError, match=r"must be \[B, 6\]"):
        select_tree(torch.zeros(1, 5), ok.long(), ok.long(), torch.zeros(1, dtype=torch.long), spec)
    with pytest.raises(ValueError, match="root_tokens must be"):
        select_tree(ok, ok.long(), ok.long(), torch.zeros(2, dtype=torch.long), spec)


def test_selection_and_ancestry_run_on_the_meta_device():
    """Meta tensors have no values: any host sync (.item(), nonzero, boolean
    indexing, data-dependent shapes) would raise. Proof the hot path has none."""
    spec = DynamicTree(steps=5, topk=4, nodes=16)
    meta = dict(device="meta")
    seed = seed_frontier(torch.empty(2, 4, **meta), torch.empty(2, 4, dtype=torch.long, **meta))
    frontier, steps = seed, [seed]
    for s in range(1, 5):
        frontier = expand_frontier(frontier, torch.empty(2, 4, 4, **meta), torch.empty(2, 4, 4, dtype=torch.long, **meta), s)
        steps.append(frontier)
    cat = lambda name: torch.cat([getattr(f, name) for f in steps], 1)  # noqa: E731
    tree = select_tree(cat("scores"), cat("tokens"), cat("parents"), torch.empty(2, dtype=torch.long, **meta), spec)
    assert tree.mask.shape == (2, 16) and tree.mask.device.type == "meta"


@pytest.mark.parametrize("v,k", [(8192, 8), (1000, 3), (1031, 4), (49152, 10), (300, 5), (8192, 1), (2048, 256)])
def test_top_k_matches_torch_topk(v, k):
    """The chunked top k: torch.topk's values, best first; the indices point at them."""
    g = torch.Generator().manual_seed(v + k)
    x = torch.randn(2, 3, v, generator=g)
    x[0, 0, :: 7] = x[0, 0, 5]  # many exact ties
    x[1, 2, 17] = float("inf")
    values, indices = selection.top_k(x, k)
    want = x.topk(k, -1)
    assert values.shape == indices.shape == (2, 3, k) and indices.dtype == torch.int64
    assert torch.equal(values, want.values)
    assert torch.equal(x.gather(-1, indices), values)
    assert (indices.sort(-1).values.diff(dim=-1) > 0).all()  # k distinct entries of the row


@settings(max_examples=60)  # drawing 1,000+ element rows dominates: 0.14 s an example
@given(st.lists(st.sampled_from(HARD), min_size=1024, max_size=1300), st.integers(1, 12))
def test_top_k_on_hard_rows(row, k):
    """Ties, infinities and NaN (torch.topk ranks NaN first): same values as torch.topk."""
    x = torch.tensor(row).view(1, -1)
    values, indices = selection.top_k(x, k)
    torch.testing.assert_close(values, x.topk(k, -1).values, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(x.gather(-1, indices), values, rtol=0, atol=0, equal_nan=True)


def _root_paths(tree: Tree, b: int, keep) -> set[tuple[int, ...]]:
    """Row b's nodes that ``keep(i)`` holds, each as its root path's tokens (a token names its candidate)."""
    paths = set()
    for i in range(tree.num_nodes):
        if not keep(i):
            continue
        path, node = [], i
        while node >= 0:
            path.append(tree.tokens[b, node].item())
            node = tree.parents[b, node].item()
        paths.add(tuple(reversed(path)))
    return paths


@given(draft_steps(), st.integers(2, 64))
def test_a_smaller_budget_is_the_best_ranks_of_the_same_candidates(case, smaller):
    """Tree.rank: DynamicTree(steps, topk, N') selects exactly the nodes of rank < N' - 1 of the N-node tree
    built from the same candidates (so a step of the larger tree tells what the smaller would accept)."""
    spec, seed, later = case
    smaller = min(smaller, spec.nodes)
    scores, tokens, parents = run_draft(spec, seed, later)
    root = torch.full((seed.shape[0],), 7)
    big = select_tree(scores, tokens, parents, root, spec)
    small = select_tree(scores, tokens, parents, root, DynamicTree(spec.steps, spec.topk, smaller))
    for b in range(seed.shape[0]):
        ranks = big.rank[b].tolist()
        assert sorted(ranks) == list(range(-1, spec.nodes - 1))  # a permutation; the root -1
        assert all(ranks[i] > ranks[big.parents[b, i].item()] for i in range(1, spec.nodes))  # parents rank better
        assert _root_paths(big, b, lambda i: ranks[i] < smaller - 1) == _root_paths(small, b, lambda i: True)


@given(draft_steps())
@settings(max_examples=40, deadline=None)
def test_confidence_is_the_expected_acceptance_of_every_budget(case):
    """Tree.confidence[:, j]: sum of exp(clamped score) over the best CONFIDENCE_BUDGETS[j] - 1 candidates
    (all of them past the candidate count), by the letter of the rule on Python lists; the same for any
    node budget of the same candidates (the confidence does not depend on the tree kept)."""
    spec, seed, later = case
    scores, tokens, parents = run_draft(spec, seed, later)
    root = torch.full((seed.shape[0],), 7)
    trees_ = [select_tree(scores, tokens, parents, root, DynamicTree(spec.steps, spec.topk, n)) for n in (2, spec.nodes)]
    for b in range(seed.shape[0]):
        clamped = [float("-inf") if math.isnan(x) else x for x in scores[b].tolist()]  # NaN: worst, with its subtree
        for c, p in enumerate(parents[b].tolist()):
            if p >= 0:
                clamped[c] = min(clamped[c], clamped[p])
        probs = sorted((math.exp(s) for s in clamped), reverse=True)
        want = [sum(probs[: n - 1]) for n in trees.CONFIDENCE_BUDGETS]
        for tree in trees_:
            assert tree.confidence[b].tolist() == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert Tree.from_spec(Chain(3), torch.zeros(2, 4, dtype=torch.long)).confidence.shape == (2, 0)


def test_top_log_probs_is_the_log_softmax_then_top_k():
    """A draft step's ranking (``selection.top_log_probs``), under both settings: the k best log-probabilities,
    float32, best first. By default ``specgraph::top_log_probs`` ranks the logits themselves (the log-softmax is
    monotone) and takes the log-softmax at those k only."""
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.float16):
        logits = (torch.randn(2, 3, 700, generator=g) * 4).to(dtype)
        values, indices = selection.top_log_probs(logits, 8)
        want = torch.log_softmax(logits.float(), -1).topk(8, -1)
        assert values.dtype == torch.float32 and torch.equal(indices, want.indices)
        torch.testing.assert_close(values, want.values, rtol=1e-6, atol=2e-6)
