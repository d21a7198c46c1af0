"""WithLookup: a prompt-lookup branch beside a draft's tree (trees.WithLookup, drafts/lookup.py).
The joined tree keeps the numbering invariants; greedy output is token-exact with HF ``generate`` for
every draft kind and tree shape, batch 1 and 3; steps accept past the draft tree's own depth (the
branch did the work); sampling stays exact in distribution (chi-square against HF, with a negative
control); seeded sampling equals plain sampling (test_seeded_sampling); bad trees are refused by name."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import specgraph
from specgraph import Chain, CompileError, DynamicTree, StaticTree, WithLookup
from specgraph.drafts import Eagle3, Medusa, NGram
from specgraph.trees import Tree, join_lookup, parse_tree, random_parents
from test_capture import tiny_model
from test_generate import (_homogeneity_p, _marginals, _small_vocab_model, assert_batch_and_single_match_hf,
                           assert_greedy_matches_hf, hf_greedy, left_pad, prompts)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.integers(1, 20), st.integers(0, 2**31 - 1))
def test_the_joined_tree_keeps_the_numbering(n, k, seed):
    """Depth-first numbering with the branch as the root's last subtree: parent[i] < i, depths, masks,
    first-child / next-sibling links all as if built from the joined parents; ranks: the tree's, 0 after."""
    import random

    rng = random.Random(seed)
    parents = torch.tensor([random_parents(rng, n), random_parents(rng, n)])
    tokens = torch.randint(0, 50, (2, n))
    tree = Tree.from_parents(tokens, parents)
    tree.rank = torch.arange(-1, n - 1).expand(2, n)
    lookup = torch.randint(0, 50, (2, k))
    joined = join_lookup(tree, lookup)
    joined.validate()
    want = Tree.from_parents(torch.cat([tokens, lookup], 1),
                             torch.cat([parents, torch.tensor([0] + list(range(n, n + k - 1))).expand(2, k)], 1))
    for field in ("tokens", "parents", "depth", "mask", "first_child", "next_sibling"):
        assert torch.equal(getattr(joined, field), getattr(want, field)), field
    assert joined.max_depth == max(tree.max_depth, k) and int(joined.depth.max()) <= joined.max_depth
    assert torch.equal(joined.rank, torch.cat([tree.rank, torch.zeros(2, k, dtype=torch.int64)], 1))


def test_specs_and_spellings():
    spec = WithLookup(DynamicTree(4, 4, 16), 8)
    assert (spec.num_nodes, spec.max_depth) == (24, 8)
    assert WithLookup(Chain(6), 2).max_depth == 6
    assert parse_tree("dynamic:4,4,16+lookup8") == spec
    assert parse_tree("eagle1+lookup4") == WithLookup(specgraph.EAGLE1_MC_SIM_7B_63, 4)
    assert spec.with_tree(DynamicTree(4, 4, 8)) == WithLookup(DynamicTree(4, 4, 8), 8)
    for bad, says in [("chain60+lookup8", "69 nodes"), ("chain4+lookup0", "depth must be an int >= 1"),
                      ("chain4+lookupx", "not a whole number"), ("nope+lookup2", "expected chainK")]:
        with pytest.raises(ValueError, match=says):
            parse_tree(bad)
    with pytest.raises(ValueError, match="max_ngram"):
        WithLookup(Chain(2), 3, max_ngram=1, min_ngram=2)
    shared = parse_tree("dynamic:2,8,16+lookup12:shared")
    assert shared == WithLookup(DynamicTree(2, 8, 16), 12, shared=True)
    assert (shared.num_nodes, shared.max_depth) == (16, 12)  # the branch takes some of the tree's 16 rows
    assert shared.with_tree(DynamicTree(2, 8, 8)) == WithLookup(DynamicTree(2, 8, 8), 7, shared=True)
    for bad, says in [("chain4+lookup2:shared", "needs a DynamicTree"), ("dynamic:2,4,8+lookup8:shared", "depth=8"),
                      ("dynamic:2,4,8+lookup2:sharedx", "lookupK:shared")]:
        with pytest.raises(ValueError, match=says):
            parse_tree(bad)


def test_a_shared_branch_takes_rows_where_its_ngram_matched():
    """The shared selection (drafts/lookup.py): with the last 3 tokens seen before, the branch's tokens
    outrank an untrained head's and fill the rows under the root; with nothing matched, none is kept."""
    from specgraph.drafts.lookup import LookupSession

    model = tiny_model("llama")
    draft = Eagle3.for_target(model, aux_layer_ids=(0, 1, 1))
    tree = WithLookup(DynamicTree(3, 2, 8), 4, shared=True)
    session = LookupSession(draft.session(tree.tree, 2, 64, "cpu"), tree, 2, 64, "cpu")
    rows = [[5, 6, 7, 8, 9, 10, 5, 6, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19]]  # row 0 repeats 5 6 7 -> 8 9 10 5
    hidden = torch.randn(2, 9, 3 * model.config.hidden_size)
    with torch.no_grad():
        session.prefill(rows, hidden)
        proposed = session.propose(torch.tensor([7, 19]))
    assert proposed.tokens.shape == (2, 8)
    chain = [8, 9, 10, 5]
    row0 = proposed.tokens[0].tolist()
    assert all(t in row0 for t in chain[:3])  # 0.78, 0.70, 0.63 (a 3-gram's) beat an untrained head's
    path = [i for i, t in enumerate(row0) if t in chain]
    assert all(proposed.depth[0, i] == chain.index(row0[i]) + 1 for i in path)
    assert not any(t in (11, 12, 13) for t in proposed.tokens[1, 1:].tolist())  # row 1: no match, no branch


@pytest.mark.parametrize("shared", [False, True])
def test_the_shared_branch_is_token_exact_in_batches(shared):
    """Rows with and without matches in one batch, compiled with the whole step: HF greedy per row."""
    model = tiny_model("llama")
    draft, _ = drafts(model)["eagle3-shared"]
    spec = specgraph.compile(model, draft, tree=WithLookup(DynamicTree(3, 2, 8), 6, shared=shared), max_batch=3,
                             max_cache_len=256)
    assert_batch_and_single_match_hf(model, spec, prompts(6, [9, 40, 17]), max_new_tokens=30)


def drafts(model):
    torch.manual_seed(0)
    h, v = model.config.hidden_size, model.config.vocab_size
    return {
        "eagle3-dynamic": (Eagle3.for_target(model, aux_layer_ids=(0, 1, 1)), WithLookup(DynamicTree(3, 2, 5), 6)),
        "eagle3-chain": (Eagle3.for_target(model, aux_layer_ids=(0, 1, 1)), WithLookup(Chain(1), 6)),
        "medusa-static": (Medusa(h, v, num_heads=2), WithLookup(StaticTree([[0], [1], [0, 0]]), 5)),
        "eagle3-shared": (Eagle3.for_target(model, aux_layer_ids=(0, 1, 1)), WithLookup(DynamicTree(3, 2, 8), 6,
                                                                                         shared=True)),
    }


@pytest.mark.parametrize("name", ["eagle3-dynamic", "eagle3-chain", "medusa-static", "eagle3-shared"])
def test_greedy_is_token_exact_and_the_branch_is_used(name):
    model = tiny_model("llama")
    draft, tree = drafts(model)[name]
    spec = specgraph.compile(model, draft, tree=tree, max_batch=3, max_cache_len=256)
    rows = prompts(4, [9, 40, 17])  # rows 1 repeats a pattern: lookup finds it
    out = assert_batch_and_single_match_hf(model, spec, rows, max_new_tokens=30)
    # an untrained head rarely gets past its own tree's depth: steps that did came through the branch
    assert max(max(step) for step in out["accept_lens"]) > tree.tree.max_depth + 1


@pytest.mark.parametrize("name", ["eagle3-dynamic", "eagle3-shared"])
def test_the_whole_step_compiles_as_one_graph(aot_eager_compile, name):
    """backend="inductor" (dynamo with fullgraph=True: no graph break, no host sync in the joined propose
    and the two commits; aot_eager stands in for inductor's CPU codegen): the same tokens."""
    model = tiny_model("llama")
    draft, tree = drafts(model)[name]
    spec = specgraph.compile(model, draft, tree=tree, max_batch=2, max_cache_len=128, backend="inductor")
    assert_greedy_matches_hf(model, spec, prompts(5, [12, 40]), 20)


def test_without_the_branch_the_same_head_accepts_less():
    """Negative control for the test above: the head alone, same prompts, never passes its depth."""
    model = tiny_model("llama")
    draft, tree = drafts(model)["eagle3-chain"]
    spec = specgraph.compile(model, draft, tree=tree.tree, max_batch=3, max_cache_len=256)
    ids, mask = left_pad(prompts(4, [9, 40, 17]))
    out = spec.generate(ids, attention_mask=mask, max_new_tokens=30, eos_token_id=None, return_dict_in_generate=True)
    assert max(max(step) for step in out["accept_lens"]) <= tree.tree.max_depth + 1


@pytest.mark.parametrize("name", ["medusa-static", "eagle-shared"])
def test_sampling_is_exact_in_distribution(name):
    """Token-wise rejection over the joined tree (its branch may repeat a sibling's token) samples the
    target's distribution per position (chi-square against HF sampling; a hotter HF run must differ). A
    shared branch changes which nodes are verified, not how (the repetitive prompt's 3-gram matches rank
    its chain high)."""
    from specgraph.drafts import Eagle

    model = _small_vocab_model()
    rows, positions, prompt = 2000, 4, [3, 4, 5, 3, 4, 5, 3, 4]
    torch.manual_seed(0)
    draft, tree, accepted = {  # accepted: the longest step must be past this (verification mattered)
        "medusa-static": lambda: (Medusa(model.config.hidden_size, 12, num_heads=2),
                                  WithLookup(StaticTree([[0], [1], [0, 0]]), 3), 3),  # the static depth 2 + bonus
        "eagle-shared": lambda: (Eagle.for_target(model), WithLookup(DynamicTree(3, 2, 6), 4, shared=True), 1),
    }[name]()
    spec = specgraph.compile(model, draft, tree=tree, max_batch=rows, max_cache_len=64)
    ids = torch.tensor([prompt] * rows)
    params = dict(temperature=0.8, top_k=0)
    torch.manual_seed(10)
    out = spec.generate(ids, do_sample=True, max_new_tokens=positions, eos_token_id=None, return_dict_in_generate=True,
                        **params)
    torch.manual_seed(11)
    plain = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=positions,
                           eos_token_id=None, pad_token_id=0, **params)
    ours, theirs = _marginals(out["sequences"], len(prompt), positions, 12), _marginals(plain, len(prompt), positions, 12)
    for i in range(positions):
        assert _homogeneity_p(ours[i], theirs[i]) > 0.01, (i, ours[i], theirs[i])
    assert max(max(step) for step in out["accept_lens"]) > accepted
    torch.manual_seed(12)
    hotter = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=positions,
                            eos_token_id=None, pad_token_id=0, temperature=1.6, top_k=0)
    assert min(_homogeneity_p(theirs[i], _marginals(hotter, len(prompt), positions, 12)[i])
               for i in range(positions)) < 1e-3


def test_bad_combinations_are_refused_at_compile():
    model = tiny_model("llama")
    with pytest.raises(CompileError) as err:
        specgraph.compile(model, NGram(), tree=WithLookup(Chain(2), 4))
    assert "an NGram draft proposes one continuation" in str(err.value)
    with pytest.raises(CompileError) as err:  # the draft's own check sees its own tree
        specgraph.compile(model, Medusa(model.config.hidden_size, model.config.vocab_size, num_heads=2),
                          tree=WithLookup(DynamicTree(2, 2, 4), 4))
    assert "DynamicTree" in str(err.value)
    with pytest.raises(CompileError, match="with draft=None"):
        specgraph.compile(model, None, tree=WithLookup(Chain(2), 4))
    assert specgraph.compile(model, None).config.tree == Chain(0)


def test_cost_policy_keeps_the_branch_on_every_budget(tmp_path):
    from specgraph import config

    with config.patch(cache=tmp_path):  # a step-cost table of its own: another test's costs change what runs first
        run_every_budget_of_one_lookup_tree()


def run_every_budget_of_one_lookup_tree():
    model = tiny_model("llama")
    draft = Eagle3.for_target(model, aux_layer_ids=(0, 1, 1))
    spec = specgraph.compile(model, draft, tree=WithLookup(DynamicTree(4, 4, 24), 6), policy="cost", max_cache_len=128)
    trees = {mode: tree for mode, (_, tree) in spec.modes.items()}
    assert trees == {"tree": WithLookup(DynamicTree(4, 4, 24), 6), "chain": Chain(4),
                     "tree8": WithLookup(DynamicTree(4, 4, 8), 6), "tree16": WithLookup(DynamicTree(4, 4, 16), 6),
                     "plain": Chain(0)}
    assert spec.policy.budgets == {"tree": 24, "tree8": 8, "tree16": 16}
    ids = torch.tensor([prompts(4, [40])[0]])
    want = hf_greedy(model, ids[0].tolist(), max_new_tokens=12, eos_token_id=None)
    assert spec.generate(ids, max_new_tokens=12, eos_token_id=None)[0, 40:].tolist() == want
    assert spec.policy.history[0]["mode"] == "tree"  # no cost known yet: the largest budget runs first
    assert set(spec.policy.budget_tau) == {8, 16}  # the tree's smaller budgets, read off its ranks
    for _ in range(2):  # the next calls measure the other modes: token-exact whichever runs
        assert spec.generate(ids, max_new_tokens=12, eos_token_id=None)[0, 40:].tolist() == want


def test_one_row_calls_take_the_one_row_default_under_a_larger_max_batch(monkeypatch):
    """compile(tree=None, max_batch=3) keeps the draft's one-row default for B = 1 calls and its batch default
    for more rows (the one-row tree here stands in for CUDA's, where Eagle3 returns it): both token-exact, and the
    one-row call ran the lookup tree (accepted past what Chain(4) can) where the batch ran Chain(4)."""
    model = tiny_model("llama")
    draft, one_row = drafts(model)["eagle3-dynamic"]
    monkeypatch.setattr(Eagle3, "default_tree", lambda self, device, max_batch: one_row if max_batch == 1 else Chain(4))
    spec = specgraph.compile(model, draft, max_batch=3, max_cache_len=256)
    assert spec.config.tree == Chain(4) and spec.config.one_row_tree == one_row
    assert spec.config.tree_for(1) == one_row and spec.config.tree_for(2) == Chain(4)
    rows = prompts(4, [9, 40, 17])
    batch = assert_batch_and_single_match_hf(model, spec, rows, max_new_tokens=30)
    assert len(batch["acceptance"].position_rate) == Chain(4).max_depth  # rates per depth of the tree it ran
    single = spec.generate(torch.tensor([rows[1]]), max_new_tokens=30, eos_token_id=None, return_dict_in_generate=True)
    assert single["sequences"][0, len(rows[1]):].tolist() == hf_greedy(model, rows[1], max_new_tokens=30,
                                                                      eos_token_id=None)
    assert len(single["acceptance"].position_rate) == one_row.max_depth
    assert max(max(step) for step in single["accept_lens"]) > Chain(4).max_depth + 1  # only the lookup branch reaches
    # a tree named by the user is every call's; so is the one a policy's modes derive from
    assert specgraph.compile(model, draft, tree=Chain(4), max_batch=3, max_cache_len=256).config.tree_for(1) == Chain(4)
    assert specgraph.compile(model, draft, max_batch=3, max_cache_len=256, policy="cost").config.one_row_tree is None
    # a default the cache cannot hold is dropped, not refused (the user asked for neither tree)
    small = specgraph.compile(model, draft, max_batch=3, max_cache_len=one_row.num_nodes)
    assert small.config.one_row_tree is None and small.config.tree_for(1) == Chain(4)

