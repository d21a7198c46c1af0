"""runtime/policy.py: speculate or decode plainly by measured cost; lossless either way."""
import pytest
import torch

import specgraph
from specgraph import Chain, CompileError
from specgraph.drafts import NGram
from specgraph.runtime.policy import MeasuredPolicy
from test_capture import tiny_model
from test_generate import hf_greedy, prompts


def run(policy, batch, cost_of, calls):
    """Drive ``policy`` with a fixed cost per mode; returns the modes chosen."""
    modes = []
    for _ in range(calls):
        mode = policy.choose(batch)
        policy.record(batch, mode, seconds=cost_of[mode] * 10, tokens=10)
        modes.append(mode)
    return modes


def test_the_cheaper_mode_wins_and_the_other_is_retried_less_and_less():
    policy = MeasuredPolicy(explore_every=8, max_explore_every=64)
    modes = run(policy, 64, {"tree": 2.0, "plain": 1.0}, 400)
    assert modes[:4] == ["tree", "tree", "plain", "plain"]  # each mode's first call compiles: measured on its second
    retries = [i for i, mode in enumerate(modes) if mode == "tree" and i >= 4]
    # the first retry explore_every calls after the leader is known (call 4), then each interval twice the last
    # while the leader holds, up to max_explore_every
    assert retries == [12, 28, 60, 124, 188, 252, 316, 380]
    assert run(policy, 1, {"tree": 0.5, "plain": 1.0}, 13)[4:].count("plain") == 1  # batch sizes apart


def test_a_change_in_cost_is_followed():
    policy = MeasuredPolicy(explore_every=4)
    run(policy, 8, {"tree": 1.0, "plain": 2.0}, 8)
    modes = run(policy, 8, {"tree": 3.0, "plain": 2.0}, 12)  # acceptance dropped: the tree got dearer
    assert modes[-4:].count("plain") >= 3


def test_a_retry_that_finds_a_new_leader_starts_the_intervals_over():
    policy = MeasuredPolicy(explore_every=4, max_explore_every=32)
    run(policy, 2, {"tree": 2.0, "plain": 1.0}, 100)  # plain leads; the retries back off to every 32 calls
    assert policy.interval[2] == 32
    modes = run(policy, 2, {"tree": 0.5, "plain": 1.0}, 100)  # acceptance rose: the tree is cheaper now
    tree_calls = [i for i, mode in enumerate(modes) if mode == "tree"]
    # two retries 32 calls apart: the first averages the tree's cost to 1.25 (plain still leads), the second
    # to 0.875 (the tree leads); from then on the tree runs, and plain's retries start over from explore_every
    assert tree_calls[1] - tree_calls[0] == 32 and tree_calls[2] == tree_calls[1] + 1
    found = tree_calls[1]
    assert [i - found for i, mode in enumerate(modes) if mode == "plain" and i > found][:3] == [4, 12, 28]
    assert policy.leader[2] == "tree"


def test_with_three_modes_the_cheapest_leads_and_the_others_are_retried_in_turn():
    policy = MeasuredPolicy(modes=("tree", "chain", "plain"), explore_every=4, max_explore_every=8)
    modes = run(policy, 64, {"tree": 2.0, "chain": 0.8, "plain": 1.0}, 40)
    assert modes[:6] == ["tree", "tree", "chain", "chain", "plain", "plain"]  # compile, then measure, each
    retries = [(i, mode) for i, mode in enumerate(modes) if i >= 6 and mode != "chain"]
    assert retries == [(10, "tree"), (18, "plain"), (26, "tree"), (34, "plain")]  # 4, then 8 (the cap) apart


def test_measured_policy_offers_a_chain_as_deep_as_the_tree():
    from specgraph.drafts import Eagle3

    model = tiny_model("llama")
    torch.manual_seed(0)
    head = Eagle3.for_target(model, aux_layer_ids=(0, 1, 1))
    spec = specgraph.compile(model, head, tree=specgraph.DynamicTree(steps=3, topk=2, nodes=6), max_cache_len=128,
                             policy="measured")
    assert list(spec.modes) == ["tree", "chain", "plain"] and spec.modes["chain"][1] == Chain(3)
    row = prompts(4, [20])[0]
    want = hf_greedy(model, row, max_new_tokens=10, eos_token_id=None)
    for _ in range(7):
        out = spec.generate(torch.tensor([row]), max_new_tokens=10, eos_token_id=None)
        assert out[0, len(row):].tolist() == want
    assert {mode for _, mode in spec.policy.cost} == {"tree", "chain", "plain"}  # each ran and was measured
    chained = specgraph.compile(model, NGram(), tree=Chain(4), max_cache_len=128, policy="measured")
    assert list(chained.modes) == ["tree", "plain"]  # a chain is its own smaller tree


def test_measured_policy_is_lossless_in_both_modes():
    model = tiny_model("llama")
    spec = specgraph.compile(model, NGram(), tree=Chain(4), max_cache_len=128, policy="measured")
    row = prompts(2, [10, 24])[1]  # repetitive: the tree accepts long chunks
    ids = torch.tensor([row])
    want = hf_greedy(model, row, max_new_tokens=12, eos_token_id=None)
    seen = set()
    for _ in range(6):
        out = spec.generate(ids, max_new_tokens=12, eos_token_id=None, return_dict_in_generate=True)
        assert out.sequences[0, len(row):].tolist() == want
        seen.add("tree" if max(max(s) for s in out.accept_lens) > 1 else "plain")
    assert seen == {"tree", "plain"}  # both modes ran (each is measured), both token-exact
    assert set(spec.policy.cost) == {(1, "tree"), (1, "plain")}


def test_policy_is_checked_at_compile():
    model = tiny_model("llama")
    with pytest.raises(CompileError, match="policy='sometimes'"):
        specgraph.compile(model, NGram(), tree=Chain(2), max_cache_len=64, policy="sometimes")
