"""Greedy, typical and sampling-parameter parts of reference verification."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specgraph import Chain, StaticTree, Tree
from specgraph.kernels.verify import (greedy_tokens, sampling_probs, verify_forced, verify_greedy, verify_sample,
                                      verify_typical)
from oracles import longest_accepted_path
from strategies import dfs_parents


def _args(tree):
    return tree.tokens, tree.parents, tree.mask


@st.composite
def tree_and_targets(draw):
    """A depth-first tree over a 3-token vocabulary (so matches and duplicate
    siblings are common) and the target's pick at every node, B rows."""
    parents = draw(dfs_parents())
    n, b = len(parents), draw(st.integers(1, 3))
    tokens = [[draw(st.integers(0, 2)) for _ in range(n)] for _ in range(b)]
    targets = [[draw(st.integers(0, 2)) for _ in range(n)] for _ in range(b)]
    return parents, torch.tensor(tokens), torch.tensor(targets)


@given(tree_and_targets())
def test_greedy_is_the_longest_accepted_root_path(case):
    parents, tokens, targets = case
    b, n = tokens.shape
    tree = Tree.from_parents(tokens, torch.tensor(parents).expand(b, n))
    acc = verify_greedy(*_args(tree), targets, tree.max_depth)
    d = tree.max_depth
    assert acc.path.shape == (b, d + 1) and acc.emitted.shape == (b, d + 1)
    for row in range(b):
        want = longest_accepted_path(tokens[row].tolist(), parents, targets[row].tolist())
        assert acc.path[row].tolist() == want + [-1] * (d + 1 - len(want))
        assert acc.accept_len[row].item() == len(want)
        assert acc.bonus[row].item() == targets[row, want[-1]].item()
        emitted = [tokens[row, j].item() for j in want[1:]] + [targets[row, want[-1]].item()]
        assert acc.emitted[row].tolist() == emitted + [-1] * (d + 1 - len(emitted))


@given(st.integers(0, 10), st.data())
def test_greedy_on_a_chain_accepts_the_matching_prefix(depth, data):
    tokens = torch.tensor([data.draw(st.lists(st.integers(0, 1), min_size=depth + 1, max_size=depth + 1))])
    targets = torch.tensor([data.draw(st.lists(st.integers(0, 1), min_size=depth + 1, max_size=depth + 1))])
    tree = Tree.from_spec(Chain(depth), tokens)
    acc = verify_greedy(*_args(tree), targets, depth)
    matched = 0
    while matched < depth and tokens[0, matched + 1] == targets[0, matched]:
        matched += 1
    assert acc.accept_len.item() == matched + 1
    assert acc.path[0, : matched + 1].tolist() == list(range(matched + 1))
    assert acc.bonus.item() == targets[0, matched].item()


def test_greedy_walk_example():
    #        0(root)
    #      /    \
    #    1:a    4:b
    #    / \      \
    #  2:c 3:d    5:e
    spec = StaticTree([[0], [0, 0], [0, 1], [1], [1, 0]])
    tokens = torch.tensor([[9, 10, 12, 13, 11, 14]])
    tree = Tree.from_spec(spec, tokens)
    target = torch.tensor([[11, 0, 0, 0, 14, 99]])  # root picks b, b picks e, e picks 99
    acc = verify_greedy(*_args(tree), target, tree.max_depth)
    assert acc.path.tolist() == [[0, 4, 5]] and acc.accept_len.tolist() == [3]
    assert acc.emitted.tolist() == [[11, 14, 99]] and acc.bonus.tolist() == [99]


def test_verify_errors_name_the_argument():
    tree = Tree.from_spec(Chain(3), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[B, N\]"):
        verify_greedy(tree.tokens, tree.parents[:, :3], tree.mask, tree.tokens, 3)
    with pytest.raises(ValueError, match="max_depth is 4"):
        verify_greedy(*_args(tree), tree.tokens, 4)
    with pytest.raises(ValueError, match=r"target_probs must be \[B, N, V\]"):
        verify_sample(*_args(tree), torch.rand(2, 3, 5), 3)
    with pytest.raises(ValueError, match="draft_probs must match"):
        verify_sample(*_args(tree), torch.rand(2, 4, 5), 3, draft_probs=torch.rand(2, 4, 6))


# ----------------------------------------------------------------------------- sampling parameters
def _hf_warped(logits, temperature, top_k, top_p, min_p=0.0, nucleus=None):
    """transformers' warpers in generate's order; ``nucleus``: a top-p step to use instead of TopPLogitsWarper."""
    from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    x = TemperatureLogitsWarper(temperature)(None, logits)
    if top_k > 0:
        x = TopKLogitsWarper(top_k)(None, x)
    if top_p < 1.0:
        x = TopPLogitsWarper(top_p)(None, x) if nucleus is None else nucleus(x, top_p)
    if min_p > 0:
        x = MinPLogitsWarper(min_p)(None, x)
    return x.softmax(-1)


def _nucleus_float64(x, top_p):
    """Top-p by its definition, token by token in float64: a token stays iff the tokens strictly more
    likely than it hold less than top_p of the mass (ties at the edge stay together)."""
    probs = x.double().softmax(-1)  # [..., V]
    more_likely = probs.unsqueeze(-2) > probs.unsqueeze(-1)  # [..., V, V]: [i, j] token j more likely than i
    above = (more_likely * probs.unsqueeze(-2)).sum(-1)  # [..., V]
    return torch.where(above < top_p, x, float("-inf"))


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_sampling_probs_match_transformers_warpers(data):
    """Without ties every filter is transformers' own; with a tie at the nucleus' edge (logit 0 = logit 1
    now and then) top-p is the float64 definition: the tied tokens stay together."""
    b, n, v = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 4)), data.draw(st.integers(2, 40))
    seed = data.draw(st.integers(0, 2**31))
    logits = torch.randn(b, n, v, generator=torch.Generator().manual_seed(seed)) * 3
    tied = data.draw(st.booleans())
    if tied:
        logits[..., 0] = logits[..., 1]  # a tie at the top-k / top-p boundary now and then
    temperature = [data.draw(st.sampled_from([0.0, 0.3, 0.7, 1.0, 1.5])) for _ in range(b)]
    top_k = [data.draw(st.sampled_from([0, 1, 2, 5, v, v + 3])) for _ in range(b)]
    top_p = [data.draw(st.sampled_from([1.0, 0.95, 0.8, 0.5, 0.1])) for _ in range(b)]
    min_p = [data.draw(st.sampled_from([0.0, 0.05, 0.2, 0.6, 1.0])) for _ in range(b)]
    probs = sampling_probs(logits, torch.tensor(temperature), torch.tensor(top_k), torch.tensor(top_p),
                           torch.tensor(min_p))
    for row in range(b):
        if temperature[row] == 0:
            want = torch.nn.functional.one_hot(logits[row].argmax(-1), v).float()
        else:
            want = _hf_warped(logits[row], temperature[row], top_k[row], top_p[row], min_p[row],
                              nucleus=_nucleus_float64 if tied else None)
        torch.testing.assert_close(probs[row], want, atol=1e-6, rtol=1e-5)


def test_tied_tokens_at_the_nucleus_edge_stay_together():
    """Two tokens tied at the edge: transformers keeps one (whichever its sort puts last), top-p here both."""
    from transformers.generation.logits_process import TopPLogitsWarper

    logits = torch.tensor([[[2.0, 1.0, 1.0, 0.0]]])  # mass 0.53, 0.20, 0.20, 0.07
    kept = sampling_probs(logits, 1.0, top_p=torch.tensor(0.6)) > 0
    assert kept.tolist() == [[[True, True, True, False]]]
    assert (TopPLogitsWarper(0.6)(None, logits[0]) > float("-inf")).sum() == 2  # one of the tied pair goes


def test_sampling_with_greedy_targets_is_the_greedy_walk():
    """temperature 0 makes every target draw the argmax: sampled verify == greedy verify."""
    g = torch.Generator().manual_seed(0)
    tree = Tree.from_spec(StaticTree([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]), torch.randint(0, 4, (64, 7), generator=g))
    logits = torch.randn(64, 7, 4, generator=g)
    greedy = verify_greedy(*_args(tree), logits.argmax(-1), tree.max_depth)
    sampled = verify_sample(*_args(tree), sampling_probs(logits, 0.0), tree.max_depth, generator=g)
    distinct = torch.stack([tree.tokens[:, 1] != tree.tokens[:, 4], tree.tokens[:, 2] != tree.tokens[:, 3]]).all(0)
    for name in ("path", "accept_len", "bonus", "emitted"):  # equal where siblings differ (walk == longest)
        assert torch.equal(getattr(greedy, name)[distinct], getattr(sampled, name)[distinct])


def test_typical_acceptance_is_greedy_at_temperature_zero_and_lossy_above():
    spec = StaticTree([[0], [0, 0]])
    tokens = torch.tensor([[0, 1, 2]])
    tree = Tree.from_spec(spec, tokens)
    # at the root the target prefers 2 (p ~ .55) over the drafted 1 (p ~ .45)
    logits = torch.tensor([[[-9.0, 0.0, 0.2], [-9.0, -9.0, 5.0], [0.0, 0.0, 0.0]]])
    greedy = verify_greedy(*_args(tree), logits.argmax(-1), tree.max_depth)
    typical0 = verify_typical(*_args(tree), sampling_probs(logits, 0.0), tree.max_depth)
    assert greedy.path.tolist() == typical0.path.tolist() == [[0, -1, -1]]
    typical = verify_typical(*_args(tree), sampling_probs(logits, 1.0), tree.max_depth)
    assert typical.path.tolist() == [[0, 1, 2]]  # accepts the non-argmax draft: lossy by design
    assert typical.accept_len.tolist() == [3]


@given(tree_and_targets(), st.integers(1, 8))
def test_forced_acceptance_walks_the_first_child_chain(case, accept):
    """Benchmarks' synthetic acceptance: the root, then first children (the lowest-numbered
    child), ``accept`` nodes or until a leaf; drafted tokens along it, then the target's bonus."""
    parents, tokens, targets = case
    b, n = tokens.shape
    tree = Tree.from_parents(tokens, torch.tensor(parents).expand(b, n))
    acc = verify_forced(tree.tokens, tree.first_child, targets, accept, tree.max_depth)
    chain = [0]
    while len(chain) < accept and any(p == chain[-1] for p in parents):
        chain.append(parents.index(chain[-1]))  # depth-first numbering: the first child is the lowest index
    for row in range(b):
        k = int(acc.accept_len[row])
        assert k == len(chain) and acc.path[row, :k].tolist() == chain
        assert (acc.path[row, k:] == -1).all()
        want = [int(tokens[row, i]) for i in chain[1:]] + [int(targets[row, chain[-1]])]
        assert acc.emitted[row, :k].tolist() == want and int(acc.bonus[row]) == want[-1]


@given(st.data())
def test_greedy_tokens_in_chunks_is_argmax(data):
    """The two-stage argmax is torch.argmax bit for bit: the first index of the maximum, NaN the maximum,
    rows of -inf index 0; a 3-value range makes ties (within and across chunks) common; V not a
    multiple of the chunk pads the last one."""
    vocab, chunk = data.draw(st.integers(1, 300)), data.draw(st.integers(1, 64))
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16]))
    seed = data.draw(st.integers(0, 2**16))
    logits = torch.randint(-1, 2, (2, 3, vocab), generator=torch.Generator().manual_seed(seed)).to(dtype)
    specials = data.draw(st.lists(st.tuples(st.integers(0, 1), st.integers(0, 2), st.integers(0, vocab - 1),
                                            st.sampled_from([float("nan"), float("inf"), float("-inf")])), max_size=4))
    for b, n, v, value in specials:
        logits[b, n, v] = value
    logits[1, 2] = float("-inf")
    assert torch.equal(greedy_tokens(logits, chunk), logits.argmax(-1))


def test_greedy_tokens_in_chunks_compiled():
    """Through inductor (CPU codegen) at a real vocabulary's width (SmolLM2's 49152 plus a partial chunk),
    bf16 with ties across chunks: the same indices as eager argmax."""
    logits = torch.randint(-2, 3, (8, 49152 + 77), generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    logits[3, 40000] = logits[3, 70] = 9  # the same maximum in two chunks: the first wins
    compiled = torch.compile(lambda x: greedy_tokens(x, 2048), fullgraph=True)
    assert torch.equal(compiled(logits), logits.argmax(-1))
    assert compiled(logits)[3].item() == 70
