"""runtime/budget.py: the speculation budget from a persisted step-cost table and observed acceptance;
lossless whatever it chooses."""
import json

import pytest
import torch

import specgraph
from specgraph import Chain
from specgraph.drafts import NGram
from specgraph.refusals import draft_tree
from specgraph.runtime.budget import CostPolicy, CostTable, chain_tau, confidence_taus, cost_key
from test_capture import tiny_model
from test_generate import hf_greedy, prompts

MODES = {"tree": None, "chain": 4, "plain": 0}


def drive(policy, batch, cost, tau, rates, calls):
    """Run ``calls`` calls where a mode's step costs ``cost[mode]`` and accepts ``tau[mode]`` per step."""
    chosen = []
    for _ in range(calls):
        mode = policy.choose(batch)
        policy.record(batch, mode, seconds=cost[mode] * 50, steps=50, tau=tau[mode], position_rate=rates)
        chosen.append(mode)
    return chosen


def test_the_table_persists_per_key_and_batch(tmp_path):
    path = tmp_path / "costs.json"
    table = CostTable(path, "gpu|model|dtype|eagle3|inductor")
    table.put(1, "tree", 0.004)
    table.put(64, "plain", 0.002)
    CostTable(path, "gpu|other-model|dtype|eagle3|inductor").put(1, "tree", 0.5)  # another key, same file
    again = CostTable(path, "gpu|model|dtype|eagle3|inductor")
    assert again.get(1, "tree") == 0.004 and again.get(64, "plain") == 0.002 and again.get(64, "tree") is None
    assert CostTable(path, "gpu|other-model|dtype|eagle3|inductor").get(1, "tree") == 0.5
    (tmp_path / "a-file").write_text("")
    unwritable = CostTable(tmp_path / "a-file" / "costs.json", "k")  # its folder cannot be made
    unwritable.put(1, "tree", 0.004)  # a warning; the table still serves this process
    assert unwritable.get(1, "tree") == 0.004
    path.write_text("{not json")  # a damaged file is measured again, not trusted and not fatal
    assert CostTable(path, "gpu|model|dtype|eagle3|inductor").get(1, "tree") is None


def test_the_key_separates_what_changes_a_step_cost():
    model = tiny_model("llama")
    other = tiny_model("llama")
    other.config.num_hidden_layers = 3  # another shape, same class
    key = lambda m=model, d=NGram(), backend="eager", tree=Chain(4): cost_key(m, d, backend, tree)  # noqa: E731
    assert key() == key(tiny_model("llama"))
    # a mode's name ("tree", "chain", "tree16") stands for a tree derived from the compiled one
    assert len({key(), key(other), key(backend="inductor"), key(d=NGram(max_ngram=2)), key(tree=Chain(3)),
                key(model.to(torch.bfloat16))}) == 6


def test_chain_tau_is_one_plus_the_accepted_share_per_depth():
    assert chain_tau((0.8, 0.6, 0.4, 0.2), 2) == 1 + 0.8 + 0.6
    assert chain_tau((0.8, 0.6), 4) == 1 + 0.8 + 0.6  # deeper than observed: nothing more predicted


def test_the_mode_with_the_most_tokens_per_second_runs(tmp_path):
    """A known table: one tree call to learn τ, then the argmax of τ / cost, no trial of the others."""
    table = CostTable(tmp_path / "c.json", "k")
    for mode, seconds in {"tree": 3.0, "chain": 2.0, "plain": 1.0}.items():
        table.put(1, mode, seconds)
    cost = {"tree": 3.0, "chain": 2.0, "plain": 1.0}
    rates = (0.9, 0.8, 0.7, 0.6, 0.5, 0.4)  # the tree's: a chain of 4 is predicted at 4.0 tokens a step
    # tree 4.5 / 3 = 1.5, chain 4.0 / 2 = 2.0, plain 1 / 1 = 1.0 tokens per second-unit: the chain
    chosen = drive(CostPolicy(dict(MODES), table), 1, cost, {"tree": 4.5, "chain": 4.0, "plain": 1}, rates, 6)
    assert chosen == ["tree", "chain", "chain", "chain", "chain", "chain"]
    # text the draft cannot predict: the tree accepts little, every speculating mode loses to plain decoding
    low = (0.2, 0.05, 0.0, 0.0, 0.0, 0.0)
    chosen = drive(CostPolicy(dict(MODES), table), 1, cost, {"tree": 1.3, "chain": 1.25, "plain": 1}, low, 6)
    assert chosen == ["tree"] + ["plain"] * 5


def test_without_a_table_each_mode_is_compiled_then_timed_once(tmp_path):
    table = CostTable(tmp_path / "c.json", "k")
    policy = CostPolicy(dict(MODES), table)
    cost = {"tree": 2.0, "chain": 1.5, "plain": 1.0}
    chosen = drive(policy, 8, cost, {"tree": 3.0, "chain": 2.5, "plain": 1}, (0.8, 0.5, 0.4, 0.3), 10)
    assert chosen[:6] == ["tree", "tree", "chain", "chain", "plain", "plain"]  # first call of each compiles
    assert {m: table.get(8, m) for m in cost} == cost
    # tree 3 / 2 = 1.5, chain 2.5 / 1.5 = 1.67, plain 1: the chain; a new process reads the table
    assert chosen[6:] == ["chain"] * 4
    fresh = CostPolicy(dict(MODES), CostTable(tmp_path / "c.json", "k"))
    assert drive(fresh, 8, cost, {"tree": 3.0, "chain": 2.5, "plain": 1}, (0.8, 0.5, 0.4, 0.3), 3) == \
        ["tree", "chain", "chain"]


def test_a_never_run_mode_predicted_near_the_leader_runs_once(tmp_path):
    """The chain's τ predicted from the tree's per-depth acceptance can be low (a DynamicTree may drop the
    chain's deeper nodes; forced acceptance on the 8B shape: tree 3.05, chain 4): a chain predicted within
    trial_within of the leader runs once, then leads on its own τ. Predicted far below, it is not tried."""
    table = CostTable(tmp_path / "c.json", "k")
    cost = {"tree": 8.9, "tree8": 8.7, "chain": 9.5, "plain": 4.9}
    for mode, seconds in cost.items():
        table.put(1, mode, seconds)
    modes = {"tree": None, "tree8": None, "chain": 4, "plain": 0}
    tau = {"tree": 3.05, "tree8": 3.05, "chain": 4.0, "plain": 1}
    rates = (0.9, 0.7, 0.45, 0.0)  # the tree's: the chain is predicted at 3.05
    policy = CostPolicy(dict(modes), table, {"tree": 16, "tree8": 8})
    chosen = []
    for _ in range(6):
        mode = policy.choose(1)
        policy.record(1, mode, cost[mode] * 50, 50, tau[mode], rates, {8: 3.05} if mode == "tree" else None)
        chosen.append(mode)
    # chain predicted 3.05 / 9.5 = 0.321, tree8 3.05 / 8.7 = 0.351: within 0.9; observed 4 / 9.5 = 0.42
    assert chosen == ["tree", "chain"] + ["chain"] * 4
    never = CostPolicy(dict(modes), table, {"tree": 16, "tree8": 8}, trial_within=1.5)  # negative control
    for _ in range(6):
        mode = never.choose(1)
        never.record(1, mode, cost[mode] * 50, 50, tau[mode], rates, {8: 3.05} if mode == "tree" else None)
        chosen.append(mode)
    assert chosen[6:] == ["tree"] + ["tree8"] * 5
    far = (0.9, 0.2, 0.0, 0.0)  # chain predicted 2.1 / 9.5 = 0.22: not within 0.9 of tree8's 0.351
    policy = CostPolicy(dict(modes), table, {"tree": 16, "tree8": 8})
    assert drive(policy, 1, cost, tau, far, 1) == ["tree"]
    policy.record(1, "tree", cost["tree"] * 50, 50, 3.05, far, {8: 3.05})
    assert [policy.choose(1) for _ in range(5)] == ["tree8"] * 5


def test_while_plain_leads_the_speculating_modes_are_refreshed_and_win_back(tmp_path):
    cost = {"tree": 2.0, "plain": 1.0}

    def run(share):
        policy = CostPolicy({"tree": None, "plain": 0}, CostTable(tmp_path / f"{share}.json", "k"),
                            explore_every=4, max_explore_every=16, explore_share=share)
        chosen = drive(policy, 1, cost, {"tree": 1.5, "plain": 1}, (0.5,), 40)  # 1.5 / 2 < 1: plain
        return policy, [i for i, m in enumerate(chosen) if m == "tree" and i >= 4]

    # a refresh of the tree costs a quarter of a call (its rate 0.75 of plain's)
    assert run(1.0)[1] == [8, 16, 32]  # explore_every after plain first leads, then doubling up to the cap
    policy, refreshes = run(0.02)
    assert refreshes == [17, 30]  # at most 2% of the time: every ceil(0.25 / 0.02) = 13 calls, then the cap, 16
    chosen = drive(policy, 1, cost, {"tree": 5.0, "plain": 1}, (0.9,), 40)  # the text became predictable
    assert chosen[-10:] == ["tree"] * 10


def test_refreshes_of_a_far_loser_cost_at_most_the_explore_share(tmp_path):
    """The 8B shape at B = 16 under forced acceptance (step costs and τ measured on the H200, 2026-12-04):
    the chain leads; the 8-node tree, at 0.63 of its rate, is refreshed seldom enough that the refreshes
    cost at most explore_share of the time. A near-tie is refreshed at the doubling interval."""
    cost = {"tree": 12.27e-3, "tree8": 9.86e-3, "chain": 8.89e-3, "plain": 4.92e-3}
    tau = {"tree": 3.05, "tree8": 2.8, "chain": 4.0, "plain": 1.0}
    modes = {"tree": None, "tree8": None, "chain": 4, "plain": 0}
    deepest = {"tree": 5, "tree8": 5, "chain": 5, "plain": 1}

    def run(tau, calls):
        table = CostTable(tmp_path / "c.json", "k")
        for mode, seconds in cost.items():
            table.put(16, mode, seconds, persist=False)
        policy = CostPolicy(dict(modes), table, {"tree": 16, "tree8": 8}, deepest)
        chosen = []
        for _ in range(calls):
            mode = policy.choose(16)
            other = {8: tau["tree8"]} if mode == "tree" else {16: tau["tree"]} if mode == "tree8" else None
            policy.record(16, mode, cost[mode] * 50, 50, tau[mode], (0.9, 0.7, 0.5, 0.3), other)
            chosen.append(mode)
        return chosen

    chosen = run(tau, 300)
    # the 16-node tree cannot beat the chain even accepting every node (5 / 12.27 < 4 / 8.89): never run;
    # the 8-node one (upper bound 5 / 9.86) runs once to learn its τ, then only as a refresh
    assert chosen[:12] == ["chain", "tree8"] + ["chain"] * 10 and "tree" not in chosen
    rate = {m: tau[m] / cost[m] for m in cost}
    lost = sum(1 - rate[m] / rate["chain"] for m in chosen[2:])  # calls' worth of time, after learning
    assert 0 < lost <= 0.02 * len(chosen[2:])
    near = dict(tau, tree8=3.9)  # 0.87 of the chain's rate: refreshed every explore_every, then doubling
    refreshes = [i for i, m in enumerate(run(near, 60)) if m == "tree8" and i > 1]
    assert refreshes[0] == 10 and refreshes[1] - refreshes[0] == 16


def test_cost_policy_is_lossless_and_persists_across_spec_models(tmp_path, settings):
    settings(cache=tmp_path)
    from specgraph.models import cache_root

    model = tiny_model("llama")
    row = prompts(2, [10, 24])[1]
    want = hf_greedy(model, row, max_new_tokens=12, eos_token_id=None)
    spec = specgraph.compile(model, NGram(), tree=Chain(4), max_cache_len=128, policy="cost")
    assert list(spec.policy.modes) == ["tree", "chain2", "plain"]
    for _ in range(6):  # each mode: a first call (it may compile), then a measured one
        out = spec.generate(torch.tensor([row]), max_new_tokens=12, eos_token_id=None)
        assert out[0, len(row):].tolist() == want
    saved = json.loads((cache_root() / "step-costs.json").read_text())
    assert set(next(iter(saved.values()))) == {"1/tree", "1/chain2", "1/plain"}
    again = specgraph.compile(model, NGram(), tree=Chain(4), max_cache_len=128, policy="cost")
    assert again.policy.table.get(1, "tree") == next(iter(saved.values()))["1/tree"] > 0
    out = again.generate(torch.tensor([row]), max_new_tokens=12, eos_token_id=None)
    assert out[0, len(row):].tolist() == want


def test_a_call_is_costed_by_its_steps_not_its_prefill(tmp_path, settings, monkeypatch):
    """The prefill is the same for every mode; spread over a call's steps it would make the modes with
    fewer steps (the deep ones) look dearer per step. A prefill slowed by 0.3 s must not reach the table."""
    import time

    from specgraph.runtime import generate as runtime_generate

    settings(cache=tmp_path)
    model = tiny_model("llama")
    row = prompts(2, [10, 24])[1]
    spec = specgraph.compile(model, NGram(), tree=Chain(4), max_cache_len=128, policy="cost")
    spec.warmup()
    slow_prefill = runtime_generate.prefill

    def prefill(*args, **kwargs):
        time.sleep(0.3)
        return slow_prefill(*args, **kwargs)

    monkeypatch.setattr(runtime_generate, "prefill", prefill)
    recorded, record = [], spec.policy.record
    monkeypatch.setattr(spec.policy, "record", lambda b, mode, seconds, *rest: (recorded.append(seconds),
                                                                                 record(b, mode, seconds, *rest)))
    start = time.perf_counter()
    spec.generate(torch.tensor([row]), max_new_tokens=12, eos_token_id=None)
    call = time.perf_counter() - start
    assert len(recorded) == 1 and 0 < recorded[0] < call - 0.3


def test_warmup_compiles_every_mode_and_fills_the_cost_table(tmp_path, settings):
    """After warmup the calls compile no decode step of their own, and the cost policy knows every
    mode's step cost before the first user call; output stays token-exact."""
    settings(cache=tmp_path)
    model = tiny_model("llama")
    row = prompts(2, [10, 24])[1]
    want = hf_greedy(model, row, max_new_tokens=12, eos_token_id=None)
    spec = specgraph.compile(model, NGram(), tree=Chain(4), max_cache_len=128, max_batch=2, policy="cost")
    first = spec.warmup(batch_sizes=(1, 2), sampling=True)
    assert set(first) == {(b, m) for b in (1, 2) for m in ("tree", "chain2", "plain")}
    assert all(spec.policy.table.get(b, m) > 0 for b, m in first)
    steps = set(spec.capture.decode_steps)
    assert len(steps) == 2 * 3 * 2  # batch sizes x modes x (greedy, sampled)
    for _ in range(3):
        out = spec.generate(torch.tensor([row]), max_new_tokens=12, eos_token_id=None)
        assert out[0, len(row):].tolist() == want
    assert set(spec.capture.decode_steps) == steps
    with pytest.raises(ValueError, match="batch_sizes"):
        spec.warmup(batch_sizes=(3,))


def test_a_smaller_budgets_tau_is_what_its_own_tree_accepts():
    """budget_taus against verification of the smaller tree itself: random candidates, a target whose
    greedy token at a node is a function of the node's root path, per step the larger tree's accepted
    ranks give the smaller tree's accept length exactly (greedy)."""
    from specgraph import DynamicTree, select_tree
    from specgraph.kernels.verify import verify_greedy
    from specgraph.runtime.budget import budget_taus

    def target_tokens(tree):  # the target's argmax after each node's root path: 1000 + (hash of the path) % 9
        out = torch.zeros_like(tree.tokens)
        for b in range(tree.batch_size):
            for i in range(tree.num_nodes):
                path, node = [], i
                while node >= 0:
                    path.append(tree.tokens[b, node].item())
                    node = tree.parents[b, node].item()
                out[b, i] = 1000 + hash(tuple(path)) % 9  # candidates carry 1000 + id: ~1 in 9 accepted
        return out

    spec = DynamicTree(4, 3, 24)
    g = torch.Generator().manual_seed(0)
    e, k = spec.num_candidates, spec.topk
    rows, lens, ranks, small_lens = 64, [], [], {8: [], 16: []}
    for _ in range(rows):
        parents = [-1] * k
        prev = list(range(k))
        for s in range(1, spec.steps):  # a step-s candidate's parent: any step-(s-1) candidate
            base = k + (s - 1) * k * k
            parents += [prev[int(torch.randint(len(prev), (1,), generator=g))] for _ in range(k * k)]
            prev = list(range(base, base + k * k))
        parents_t = torch.tensor([parents])
        scores = -torch.rand(1, e, generator=g) * 3
        tokens = 1000 + torch.randint(0, 9, (1, e), generator=g)
        root = torch.tensor([5])
        big = select_tree(scores, tokens, parents_t, root, spec)
        acc = verify_greedy(big.tokens, big.parents, big.mask, target_tokens(big), big.max_depth)
        n = int(acc.accept_len[0])
        lens.append([n])
        ranks.append([big.rank[0].gather(0, acc.path[0, 1:n]).tolist()])
        for nodes in small_lens:
            small = select_tree(scores, tokens, parents_t, root, DynamicTree(spec.steps, spec.topk, nodes))
            small_lens[nodes].append(int(verify_greedy(small.tokens, small.parents, small.mask, target_tokens(small),
                                                       small.max_depth).accept_len[0]))
    tau = sum(n for (n,) in lens) / rows
    got = budget_taus(ranks, lens, tau, [8, 16, 24])
    assert got[24] == pytest.approx(tau)
    for nodes, own in small_lens.items():
        assert got[nodes] == pytest.approx(sum(own) / rows)
    assert got[8] < got[24] and sum(small_lens[8]) < sum(n for (n,) in lens)  # the case is not degenerate


def test_a_smaller_budget_wins_from_the_larger_trees_steps_without_a_run(tmp_path):
    """A DynamicTree at 32 nodes and its budgets of 8 and 16 (one draft): after one run of the tree, the budget
    with the most τ per step cost runs, though it never ran; a budget's own runs update the smaller ones."""
    table = CostTable(tmp_path / "c.json", "k")
    cost = {"tree": 2.0, "tree16": 1.2, "tree8": 1.0, "plain": 0.7}
    for mode, seconds in cost.items():
        table.put(1, mode, seconds)
    modes = {"tree": None, "tree16": None, "tree8": None, "plain": 0}
    policy = CostPolicy(modes, table, {"tree": 32, "tree16": 16, "tree8": 8})
    assert policy.choose(1) == "tree"  # nothing known of τ: the tree runs first
    policy.record(1, "tree", 100.0, 50, 2.8, (0.6, 0.5), {16: 2.5, 8: 2.0})
    # tree 2.8 / 2 = 1.40, tree16 2.5 / 1.2 = 2.08, tree8 2.0 / 1 = 2.0, plain 1 / 0.7 = 1.43
    assert policy.choose(1) == "tree16"
    policy.record(1, "tree16", 60.0, 50, 1.9, (0.5, 0.3), {8: 1.8})  # harder text: tree16 1.58, tree8 1.8
    assert policy.choose(1) == "tree8"
    # negative control: without the budgets' figures the smaller trees are unknown and run to be measured
    blind = CostPolicy(dict(modes), table, {"tree": 32, "tree16": 16, "tree8": 8})
    blind.record(1, "tree", 100.0, 50, 2.8, (0.6, 0.5))
    assert blind.choose(1) in ("tree16", "tree8")
    assert blind.expected_tau("tree16") is None


def test_cost_policy_runs_a_dynamic_trees_smaller_budgets_losslessly(tmp_path, settings):
    """policy="cost" with a DynamicTree: its budgets below the tree's own nodes are modes; every one is
    token-exact, and a call's accepted ranks give its own τ back at its own budget."""
    from specgraph.api import BUDGET_LADDER
    from specgraph.drafts import Eagle3
    from specgraph.runtime.budget import budget_taus

    settings(cache=tmp_path)
    model = tiny_model("llama")
    torch.manual_seed(0)
    draft = Eagle3.for_target(model, aux_layer_ids=(0, 1, 1))
    tree = specgraph.DynamicTree(steps=3, topk=4, nodes=20)
    spec = specgraph.compile(model, draft, tree=tree, max_cache_len=160, policy="cost")
    assert list(spec.modes) == ["tree", "chain"] + [f"tree{n}" for n in BUDGET_LADDER if n < 20] + ["plain"]
    assert spec.policy.budgets == {"tree": 20, "tree8": 8, "tree16": 16}
    row = prompts(3, [12])[0]
    want = hf_greedy(model, row, max_new_tokens=16, eos_token_id=None)
    first_confidence = {}
    for mode, (d, t) in spec.modes.items():
        result = specgraph.runtime.generate.speculative_generate(spec.capture, d, t, [row], 16, set(), 160)
        assert result.sequences[0] == want, mode
        if isinstance(t, specgraph.DynamicTree):
            tau = (sum(map(len, result.sequences)) - result.prefill_tokens) / sum(n > 0 for s in result.accept_lens for n in s)
            assert budget_taus(result.accepted_ranks, result.accept_lens, tau, [t.nodes])[t.nodes] == pytest.approx(tau)
            first_confidence[mode] = result.confidence[0][0]  # the first tree: the same drafting in every budget
            assert all(len(c) == 7 for step in result.confidence for c in step)
        else:
            assert all(c == [] for step in result.confidence for c in step)
    assert len(first_confidence) == 3 and all(c == first_confidence["tree"] for c in first_confidence.values())
    conf = first_confidence["tree"]
    assert all(a <= b + 1e-4 for a, b in zip(conf, conf[1:])) and 0 < conf[0]  # more nodes, more expected
    for _ in range(4):  # through generate: whatever the policy picks
        out = spec.generate(torch.tensor([row]), max_new_tokens=16, eos_token_id=None)
        assert out[0, len(row):].tolist() == want
    history = list(spec.policy.history)  # per call: the mode, τ and (a DynamicTree's) draft confidence
    assert len(history) == 4 and all(h["mode"] in spec.modes for h in history)
    for h in history:
        trees = isinstance(draft_tree(spec.modes[h["mode"]][1]), specgraph.DynamicTree)
        assert (h["confidence"] is not None) is trees and (not trees or 0 < h["confidence"] < 63)


def test_a_larger_budget_is_predicted_from_the_drafts_confidence():
    """confidence_taus: τ(N') = 1 + (τ - 1) · conf(N') / conf(running), conf averaged over live row-steps
    and interpolated between CONFIDENCE_BUDGETS (4, 8, 16, 24, 32, ...)."""
    conf = [[[0.5, 1.0, 1.5, 1.8, 2.0, 2.2, 2.3], []], [[1.5, 2.0, 2.5, 2.8, 3.0, 3.2, 3.3], [9.0] * 7]]
    lens = [[2, 0], [3, 0]]  # row 1 finished: its confidence is not counted
    got = confidence_taus(conf, lens, 2.0, 8, [16, 20, 32])
    assert got == pytest.approx({16: 1 + 2.0 / 1.5, 20: 1 + 2.15 / 1.5, 32: 1 + 2.5 / 1.5})
    assert confidence_taus(conf, [[0, 0], [0, 0]], 2.0, 8, [16]) == {}


def test_the_policy_moves_up_the_ladder_on_the_drafts_confidence(tmp_path):
    """A fake cost table and fake confidences give the expected budget: after one call of the 8-node budget,
    the 32-node one (never run) is predicted to accept enough more to pay for its cost and is chosen; with
    flat confidence it is not."""
    for flat, want in ((False, "tree32"), (True, "tree8")):
        table = CostTable(tmp_path / f"{flat}.json", "key")
        for mode, ms in {"tree": 1.6, "tree32": 1.3, "tree16": 1.2, "tree8": 1.0, "plain": 0.6}.items():
            table.put(1, mode, ms / 1e3)
        policy = CostPolicy({"tree": None, "tree32": None, "tree16": None, "tree8": None, "plain": 0}, table,
                            {"tree": 64, "tree32": 32, "tree16": 16, "tree8": 8})
        confidence = [[[1.0] * 7]] if flat else [[[0.6, 1.0, 1.6, 2.0, 2.3, 2.6, 2.8]]]
        figures = confidence_taus(confidence, [[3]], 2.0, 8, [16, 32, 64])
        policy.record(1, "tree8", 1e-3, 1, 2.0, (0.7,), figures)
        assert policy.expected_tau("tree32") == pytest.approx(1 + (2.3 if not flat else 1.0))
        # tree8 runs at 2.0 / 1.0 ms; tree32 at 3.3 / 1.3 ms predicted (flat: 2.0 / 1.3); plain 1 / 0.6
        assert policy.choose(1) == want


def test_cost_policy_runs_a_chains_shallower_depths_losslessly(tmp_path, settings):
    """policy="cost" with a chain: its depths below its own (CHAIN_LADDER) are modes, every one token-exact;
    until one runs, its τ is the chain's: 1 + the share of the chain's steps that accepted each depth."""
    settings(cache=tmp_path)
    model = tiny_model("llama")
    spec = specgraph.compile(model, NGram(), tree=Chain(8), max_cache_len=160, policy="cost")
    assert list(spec.modes) == ["tree", "chain2", "chain4", "plain"]
    assert {m: t for m, (_, t) in spec.modes.items()} == {"tree": Chain(8), "chain2": Chain(2), "chain4": Chain(4),
                                                          "plain": Chain(0)}
    row = prompts(3, [40])[0]  # a repeating prompt: lookup gets accepted
    want = hf_greedy(model, row, max_new_tokens=24, eos_token_id=None)
    out = spec.generate(torch.tensor([row]), max_new_tokens=24, eos_token_id=None, return_dict_in_generate=True)
    assert out.sequences[0, len(row):].tolist() == want
    assert spec.policy.calls == {(1, "tree"): 1}  # the speculating modes first, the tree first among them
    rates = out.acceptance.position_rate
    assert max(rates) > 0
    for depth in (2, 4):
        assert spec.policy.expected_tau(f"chain{depth}") == pytest.approx(chain_tau(rates, depth))
    for _ in range(4):  # whatever the policy runs next
        assert spec.generate(torch.tensor([row]), max_new_tokens=24, eos_token_id=None)[0, len(row):].tolist() == want


def test_under_forced_acceptance_the_policy_sees_each_modes_forced_tau(tmp_path, settings, monkeypatch):
    """synthetic_accept with policy="cost" (the 8B-shape batch sweep of benchmarks/e2e.py): every mode
    accepts as deep as it reaches, up to k: the policy learns τ = k for the modes at least k - 1 deep,
    the shallower chain's depth + 1 and plain decoding's 1; warmup compiles the buckets generate runs.
    The step costs are pinned equal after warmup: which modes run must not hang on this machine's timings."""
    settings(cache=tmp_path)
    model = tiny_model("llama")
    row = prompts(2, [10, 24])[1]
    with pytest.warns(UserWarning, match="synthetic_accept"):
        spec = specgraph.compile(model, NGram(), tree=Chain(4), max_cache_len=128, policy="cost", synthetic_accept=4)
        spec.warmup((1,))
        for mode in spec.policy.modes:
            spec.policy.table.put(1, mode, 1e-3)
        monkeypatch.setattr(spec.policy.table, "put", lambda *args, **kwargs: None)
        steps = set(spec.capture.decode_steps)
        with pytest.raises(ValueError, match="sampling=True with synthetic_accept"):
            spec.warmup((1,), sampling=True)
        for _ in range(8):
            out = spec.generate(torch.tensor([row]), max_new_tokens=24, eos_token_id=None, return_dict_in_generate=True)
            assert out.sequences.shape[1] == len(row) + 24
    assert set(spec.capture.decode_steps) == steps  # the warmed-up buckets, nothing new
    assert spec.policy.expected_tau("tree") == pytest.approx(4, abs=0.3)  # the last step may stop short
    assert spec.policy.expected_tau("chain2") == pytest.approx(3, abs=0.3)
    assert spec.policy.expected_tau("plain") == 1


def _run_policy(policy, taus: dict, calls: int) -> list[str]:
    """``calls`` decisions, each mode reaching the τ given (as forced acceptance does): the modes chosen."""
    chosen = []
    for _ in range(calls):
        mode = policy.choose(16)
        chosen.append(mode)
        tau = taus[mode]
        policy.record(16, mode, None, 4, tau, (1.0,) * (int(tau) - 1))
    return chosen


def test_a_mode_that_cannot_win_even_accepting_every_node_is_never_run(tmp_path):
    """At a large batch the 16-node tree costs 2.5x the chain for no more tokens per step than the chain's
    depth allows: once the chain has run at its bound, the tree's best possible rate is below it, so the
    policy never spends a call on it. Negative control: without the bound (max_tau unknown) it does."""
    costs = {"tree": 3.0e-3, "chain": 1.2e-3, "plain": 1.0e-3}
    taus = {"tree": 5.0, "chain": 5.0, "plain": 1.0}  # forced acceptance: both reach depth 4
    for bounded in (True, False):
        table = CostTable(tmp_path / f"{bounded}.json", "key")
        for mode, seconds in costs.items():
            table.put(16, mode, seconds)
        policy = CostPolicy({"tree": None, "chain": 4, "plain": 0}, table, {},
                            {"tree": 5, "chain": 5, "plain": 1} if bounded else {})
        chosen = _run_policy(policy, taus, 40)
        if bounded:
            assert chosen == ["chain"] * 40  # the most promising first: 5 / 1.2 ms against the tree's 5 / 3 ms
        else:
            assert chosen[0] == "tree" and chosen[1:].count("chain") >= 35


def test_the_bound_prunes_nothing_a_real_head_could_win_with(tmp_path):
    """Where the tree costs little more than the chain and accepts more (a real head at batch 1), the tree
    is explored and leads; the chain, whose bound beats the tree's rate, is still refreshed now and then."""
    table = CostTable(tmp_path / "c.json", "key")
    for mode, seconds in {"tree": 1.1e-3, "chain": 1.0e-3, "plain": 0.6e-3}.items():
        table.put(16, mode, seconds)
    policy = CostPolicy({"tree": None, "chain": 8, "plain": 0}, table, {}, {"tree": 9, "chain": 9, "plain": 1})
    chosen = _run_policy(policy, {"tree": 3.0, "chain": 2.0, "plain": 1.0}, 40)
    assert chosen[:2] == ["chain", "tree"] and chosen[-1] == "tree" and chosen.count("tree") >= 35
    assert chosen[2:].count("chain") >= 1  # refreshed: 9 / 1.0 ms could beat 3 / 1.1 ms
