"""EAGLE-1/2 and EAGLE-3 drafts in generate.

Oracle for the drafting itself: every node the session proposes (its lanes
run in the draft cache's 64-slot window under ancestor masks) carries the
token the draft picks when run on that node's root path alone, one committed
row at a time. Oracle for the output: the target's own greedy
``model.generate`` (token-exact with random heads, on three architectures,
batch 1 and 4) and plain sampling (chi-square)."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import specgraph
from specgraph import Chain, DynamicTree, StaticTree
from specgraph.capture import Capture
from specgraph.drafts import Eagle, Eagle3
from specgraph.drafts.autoregressive import chain_mask
from specgraph.runtime.generate import prefill
from specgraph.selection import expand_frontier, seed_frontier, select_tree
from test_capture import tiny_model
from test_generate import (_homogeneity_p, _marginals, _small_vocab_model, assert_batch_and_single_match_hf,
                           assert_one_compile_across_lengths,
                           generated_rows, hf_greedy, left_pad, prompts)

SMALL_STATIC = StaticTree(((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1)))
TREES = [Chain(3), SMALL_STATIC, DynamicTree(steps=3, topk=3, nodes=8)]
TREE_IDS = ["chain", "static", "dynamic"]


def make_draft(kind: str, model, **kwargs):
    torch.manual_seed(7)
    if kind == "eagle":
        draft = Eagle.for_target(model, **kwargs)
    else:
        layers = model.config.num_hidden_layers
        draft = Eagle3.for_target(model, aux_layer_ids=(0, layers // 2, layers - 1), aux_convention="layer_output",
                                  **kwargs)
    with torch.no_grad():  # random init attends almost uniformly: sharpen, so positions and masks matter
        for proj in (draft.layer.self_attn.q_proj, draft.layer.self_attn.k_proj):
            proj.weight.mul_(12.0)
        draft.fc.weight.mul_(5.0)  # EAGLE-1 has no norm before attention: its input scale sets the sharpness
    return draft


@torch.no_grad()
def oracle_logprobs(draft, features: torch.Tensor, prompt: list[int], path_tokens: list[int]) -> torch.Tensor:
    """The draft's log-probs after the prompt and ``path_tokens``, each row committed in turn. features [T-1, F]."""
    layers, h_kv, d = draft.kv_shape
    kv = torch.zeros(2 * layers, 1, h_kv, 160, d)
    t = len(prompt) - 1
    pairs = torch.arange(t).unsqueeze(0)
    h = draft(torch.tensor([prompt[1:]]), features[None, :t], True, pairs, kv, torch.zeros(1, dtype=torch.long), pairs,
              chain_mask(t, "cpu").unsqueeze(0))[:, -1:]
    for j, token in enumerate(path_tokens):
        at = torch.tensor([t + j])
        h = draft(torch.tensor([[token]]), h, False, at.view(1, 1), kv, at, torch.zeros(1, 1, dtype=torch.long),
                  torch.ones(1, 1, dtype=torch.long))
    return torch.log_softmax(draft.draft_logits(h[0, -1]).float(), -1)


def oracle_dynamic_tree(draft, features, prompt: list[int], spec: DynamicTree):
    """EAGLE-2 expansion with every lane's distribution from ``oracle_logprobs`` on its path."""
    k = spec.topk

    def top(path):
        best = oracle_logprobs(draft, features, prompt, path).topk(k)
        return best.values, draft.to_target(best.indices)

    values, tokens = top([])
    frontier = seed_frontier(values[None], tokens[None])
    paths = {c: [t] for c, t in enumerate(tokens.tolist())}
    parts, logprobs = [frontier], [values]
    for step in range(1, spec.steps):
        lanes = [top(paths[c]) for c in frontier.lane_ids[0].tolist()]
        logprobs.append(torch.stack([v for v, _ in lanes]))
        frontier = expand_frontier(frontier, torch.stack([v for v, _ in lanes])[None],
                                   torch.stack([t for _, t in lanes])[None], step)
        first = k + (step - 1) * k * k
        for j, (parent, token) in enumerate(zip(frontier.parents[0].tolist(), frontier.tokens[0].tolist())):
            paths[first + j] = paths[parent] + [token]
        parts.append(frontier)
    tree = select_tree(*(torch.cat([getattr(f, name) for f in parts], 1) for name in ("scores", "tokens", "parents")),
                       torch.tensor([prompt[-1]]), spec)
    return tree, logprobs


def propose_once(model, draft, tree):
    """Prefill two prompts and propose one tree, recording the top-k log-probs of every draft call
    (root first, then each level / step). returns (prompts, features, seen, proposed)."""
    rows = prompts(3, [6, 19])
    capture = Capture(model, 160)
    session = draft.session(tree, 2, 160, torch.device("cpu"))
    features = prefill(capture, rows, torch.device("cpu"), session.taps).features
    session.prefill(rows, features)
    seen = []
    session_top = session._top
    session._top = lambda hidden, k, depth: seen.append(session_top(hidden, k, depth)) or seen[-1]
    proposed = session.propose(torch.tensor([r[-1] for r in rows]))
    proposed.validate()
    return rows, features, seen, proposed


def check_dynamic_row(draft, features, prompt, tree, seen, proposed, b):
    """Row b's tree and every step's log-probs equal the EAGLE-2 expansion computed path by path."""
    want, logprobs = oracle_dynamic_tree(draft, features[b], prompt, tree)
    for step, values in enumerate(logprobs):
        torch.testing.assert_close(seen[step][0][b], values, atol=1e-5, rtol=1e-5)  # fp32, other summation order
    assert proposed.tokens[b].tolist() == want.tokens[0].tolist(), b
    assert proposed.parents[b].tolist() == want.parents[0].tolist(), b


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("tree", [SMALL_STATIC, DynamicTree(steps=4, topk=3, nodes=10)], ids=["static", "dynamic"])
def test_every_proposed_node_is_what_the_draft_picks_on_its_root_path(kind, tree):
    model = tiny_model("llama")
    draft = make_draft(kind, model)
    assert draft.bind(model) == []
    rows, features, seen, proposed = propose_once(model, draft, tree)
    for b, prompt in enumerate(rows):
        if isinstance(tree, DynamicTree):
            check_dynamic_row(draft, features, prompt, tree, seen, proposed, b)
            continue
        parents, tokens = proposed.parents[b].tolist(), proposed.tokens[b].tolist()
        for i in range(1, len(tokens)):  # node i is its parent's rank-r pick
            path, node = [], parents[i]
            while node > 0:
                path.append(tokens[node])
                node = parents[node]
            logprobs = oracle_logprobs(draft, features[b], prompt, path[::-1])
            target_ids = draft.to_target(torch.arange(logprobs.numel()))
            token_logprob = logprobs[target_ids == tokens[i]].max()
            assert torch.isclose(token_logprob, logprobs.topk(tree.topk).values[tree.ranks()[i]], atol=1e-5), (b, i)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("tree", TREES, ids=TREE_IDS)
def test_greedy_with_random_heads_is_token_exact(arch, kind, tree):
    model = tiny_model(arch)
    spec = specgraph.compile(model, make_draft(kind, model), tree=tree, max_batch=4, max_cache_len=200)
    assert_batch_and_single_match_hf(model, spec, prompts(4, [5, 17, 11, 8]), max_new_tokens=24)


def test_draft_vocab_takes_any_sequence_of_ids_and_names_the_bad_ones():
    model = tiny_model("llama")
    assert make_draft("eagle3", model, draft_vocab=torch.arange(model.config.vocab_size)).d2t is None  # all: none
    assert make_draft("eagle3", model, draft_vocab=[3, 4, 9]).to_target(torch.arange(3)).tolist() == [3, 4, 9]
    with pytest.raises(TypeError, match="integer target token ids"):
        make_draft("eagle3", model, draft_vocab=torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match=r"ids \[300\] lie outside"):
        make_draft("eagle3", model, draft_vocab=torch.tensor([300, 4]))


def test_reduced_draft_vocabulary_maps_to_target_ids():
    model = tiny_model("llama")
    used = torch.tensor([2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71])
    draft = make_draft("eagle3", model, draft_vocab=used)
    assert torch.equal(draft.to_target(torch.arange(len(used))), used)
    assert draft.t2d.sum() == len(used) and bool(draft.t2d[used].all())
    spec = specgraph.compile(model, draft, tree=DynamicTree(steps=3, topk=2, nodes=6), max_batch=1, max_cache_len=128)
    row = prompts(5, [9])[0]
    out = spec.generate(torch.tensor([row]), max_new_tokens=20, eos_token_id=None)
    assert out[0, len(row):].tolist() == hf_greedy(model, row, max_new_tokens=20, eos_token_id=None)


def test_eos_and_rows_finishing_apart_with_a_dynamic_tree():
    model = tiny_model("qwen3")
    spec = specgraph.compile(model, make_draft("eagle3", model), tree=DynamicTree(steps=3, topk=2, nodes=6),
                             max_batch=3, max_cache_len=200)
    rows = prompts(6, [8, 15, 4])
    free = [hf_greedy(model, r, max_new_tokens=30, eos_token_id=None) for r in rows]
    eos = free[0][len(free[0]) // 2]
    ids, mask = left_pad(rows)
    out = spec.generate(ids, attention_mask=mask, max_new_tokens=30, eos_token_id=eos, pad_token_id=0)
    for row, got in zip(rows, generated_rows(out, ids.shape[1], eos=eos)):
        assert got == hf_greedy(model, row, max_new_tokens=30, eos_token_id=eos)


def test_trees_the_draft_window_cannot_hold_are_refused():
    model = tiny_model("llama")
    with pytest.raises(specgraph.CompileError, match="draft lanes"):
        specgraph.compile(model, make_draft("eagle", model), tree=DynamicTree(steps=9, topk=9, nodes=60))


def test_a_new_eagle3_head_refused_by_a_small_target_names_the_fix_and_stays_free():
    """EAGLE-3's default taps (2, L // 2, L - 3) need 4 layers: the refusal says to pass aux_layer_ids, and the
    head, left unbound, still compiles with a target it fits."""
    import transformers

    from test_capture import COMMON

    small, fits = (transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **COMMON, num_hidden_layers=n, num_attention_heads=4, num_key_value_heads=2)).eval() for n in (2, 4))
    draft = Eagle3.for_target(fits)
    with pytest.raises(specgraph.CompileError, match=r"pass aux_layer_ids=\(low, mid, high\)"):
        specgraph.compile(small, draft, tree=Chain(3), max_cache_len=64)
    assert draft.aux_layer_ids is None
    specgraph.compile(fits, draft, tree=Chain(3), max_cache_len=64)
    assert tuple(draft.aux_layer_ids) == (2, 2, 1)


def test_tree_none_takes_the_drafts_default_for_the_device_and_batch(monkeypatch):
    """EAGLE-3 on one CUDA row: the measured best, DynamicTree(3, 8, 32) with a 16-deep lookup chain competing
    for its nodes where 32-row steps fold (PDL), DynamicTree(2, 8, 16) with a 12-deep chain where they do not
    (trees the head can fill); more rows, a CPU, or another draft: Chain(4). compile(tree=None) takes it."""
    from specgraph import WithLookup
    from specgraph.api import draft_tree
    from specgraph.drafts import eagle3 as eagle3_module

    model = tiny_model("llama")
    eagle3, eagle = make_draft("eagle3", model), make_draft("eagle", model)
    for pdl, best in ((True, WithLookup(DynamicTree(3, 8, 32), 16, shared=True)),
                      (False, WithLookup(DynamicTree(2, 8, 16), 12, shared=True))):
        monkeypatch.setattr(eagle3_module, "pdl_launch", lambda device, pdl=pdl: pdl)
        assert eagle3.default_tree(torch.device("cuda"), 1) == best
        assert eagle3.tree_problems(draft_tree(best)) == []
        assert eagle3.default_tree(torch.device("cuda"), 4) == Chain(4)
    assert eagle3.default_tree(torch.device("cpu"), 1) == Chain(4)
    assert eagle.default_tree(torch.device("cuda"), 1) == Chain(4)
    assert specgraph.compile(model, eagle3, max_cache_len=64).config.tree == Chain(4)  # the model is on the CPU


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_sampling_with_a_dynamic_tree_matches_plain_sampling(kind):
    model = _small_vocab_model()
    rows, positions, prompt = 1500, 4, [3, 4, 5, 3, 4, 5, 3, 4]
    spec = specgraph.compile(model, make_draft(kind, model), tree=DynamicTree(steps=2, topk=3, nodes=6),
                             max_batch=rows, max_cache_len=64)
    ids = torch.tensor([prompt] * rows)
    torch.manual_seed(20)
    out = spec.generate(ids, do_sample=True, temperature=0.8, max_new_tokens=positions, eos_token_id=None,
                        return_dict_in_generate=True)
    torch.manual_seed(21)
    plain = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=0.8,
                           max_new_tokens=positions, eos_token_id=None, pad_token_id=0)
    ours, theirs = _marginals(out["sequences"], len(prompt), positions, 12), _marginals(plain, len(prompt), positions, 12)
    for i in range(positions):
        assert _homogeneity_p(ours[i], theirs[i]) > 0.01, (i, ours[i], theirs[i])
    assert max(max(step) for step in out["accept_lens"]) > 1  # some drafts were accepted: verification mattered


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "medusa"])
def test_one_token_prompts_start_from_an_empty_cache(kind):
    """A 1-token prompt prefills nothing: the draft has no context for its first tree, output stays exact."""
    model = tiny_model("llama")
    if kind == "medusa":
        torch.manual_seed(7)
        draft, tree = specgraph.drafts.Medusa(64, 101, num_heads=3), SMALL_STATIC
    else:
        draft, tree = make_draft(kind, model), DynamicTree(steps=3, topk=2, nodes=6)
    spec = specgraph.compile(model, draft, tree=tree, max_batch=2, max_cache_len=128)
    rows = [[7], prompts(8, [12])[0]]
    ids, mask = left_pad(rows)
    out = spec.generate(ids, attention_mask=mask, max_new_tokens=15, eos_token_id=None)
    for row, got in zip(rows, generated_rows(out, ids.shape[1])):
        assert got == hf_greedy(model, row, max_new_tokens=15, eos_token_id=None)
    alone = spec.generate(torch.tensor([[7]]), max_new_tokens=15, eos_token_id=None)
    assert alone[0, 1:].tolist() == hf_greedy(model, [7], max_new_tokens=15, eos_token_id=None)


def test_eagle1_compiles_once_across_prompt_lengths(aot_eager_compile):
    """backend="inductor" (dynamo's decisions; aot_eager in place of inductor's code generation): EAGLE-1's
    prompt pass, first tree and whole step compile once; prompts of new lengths (one to three prompt-pass
    chunks) reuse them, token-exact."""
    model = tiny_model("llama")
    spec = specgraph.compile(model, make_draft("eagle", model), tree=DynamicTree(steps=3, topk=2, nodes=6),
                             max_cache_len=128, backend="inductor")
    assert_one_compile_across_lengths(spec, model, [[6], [40], [75]])


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_fused_projections_compute_the_same_draft_layer(kind):
    """fuse_projections (a draft fast path): with the weights packed, a no-grad pass of the draft
    reads q/k/v and gate/up as one product each (the separate modules never run) and gives the separate
    products' output; a pass with grad runs them separately (the fused views carry no gradient)."""
    from specgraph.drafts.layer import fuse_projections

    model = tiny_model("llama")
    draft = make_draft(kind, model)
    assert not draft.bind(model)
    session = draft.session(Chain(3), 2, 64, "cpu")
    width = draft.fc.in_features if kind == "eagle3" else model.config.hidden_size
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.config.vocab_size, (2, 5), generator=g)
    features, start = torch.randn(2, 5, width, generator=g), torch.tensor([0, 3])
    with torch.no_grad():
        want = session._chain(tokens, features, start)
    separate = []
    for name in ("q_proj", "k_proj", "v_proj"):
        getattr(draft.layer.self_attn, name).register_forward_hook(lambda *_: separate.append(1))
    for name in ("gate_proj", "up_proj"):
        getattr(draft.layer.mlp, name).register_forward_hook(lambda *_: separate.append(1))
    assert fuse_projections(draft) == 1
    with torch.no_grad():
        got = session._chain(tokens, features, start)
    assert not separate  # the fused products ran
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    session.kv = [session.kv[0].clone(), session.kv[1].clone()]  # K and V apart: writes with grad, no views
    torch.testing.assert_close(session._chain(tokens, features, start).detach(), want, rtol=1e-5, atol=1e-6)
    assert len(separate) == 5  # with grad: the separate products (the fused weights are detached views)
    fuse_projections(draft, on=False)
    with torch.no_grad():
        torch.testing.assert_close(session._chain(tokens, features, start), want, rtol=1e-5, atol=1e-6)
    assert len(separate) == 10


class _OpsSeen(TorchDispatchMode):
    """The ops a block dispatches (custom ops first, then what their CPU bodies call)."""

    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("first", [0, 3])
def test_consecutive_slots_write_and_attend_in_one_op(first):
    """A draft call whose rows sit at consecutive window slots (an int ``slots``) runs one
    tree_attention_write (RoPE in it): the output and the cache as the separate RoPE, scatters and
    tree_attention of the same rows at the same slots given as a tensor; earlier window slots are read."""
    model = tiny_model("llama")
    draft = make_draft("eagle3", model)
    assert not draft.bind(model)
    g = torch.Generator().manual_seed(1)
    b, r = 2, 4
    tokens = torch.randint(0, model.config.vocab_size, (b, r), generator=g)
    features = torch.randn(b, r, draft.fc.in_features, generator=g)
    cache_len = torch.tensor([5, 9])
    kv = draft.new_cache(b, 80, "cpu")
    kv.normal_(generator=g)  # earlier window slots hold keys the rows may name
    mask = (chain_mask(r, "cpu") << first).expand(b, r)
    if first:
        mask = mask | (1 << (first - 1))  # every row also names the window slot before the call's own
    positions = cache_len.view(-1, 1) + torch.arange(r)
    with torch.no_grad(), _OpsSeen() as separate:
        want_kv = kv.clone()
        want = draft(tokens, features, True, positions, want_kv, cache_len, first + torch.arange(r).expand(b, r), mask)
    with torch.no_grad(), _OpsSeen() as joined:
        got_kv = kv.clone()
        got = draft(tokens, features, True, positions, got_kv, cache_len, first, mask)
    write, attend = torch.ops.specgraph.tree_attention_write.default, torch.ops.specgraph.tree_attention.default
    assert write in joined.ops and attend not in joined.ops and write not in separate.ops
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_kv, want_kv, rtol=1e-5, atol=1e-5)
    assert not torch.equal(got_kv, kv)  # the rows were written


@pytest.mark.parametrize("rope", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
                                  {"rope_type": "dynamic", "factor": 2.0}], ids=["default", "llama3", "dynamic"])
def test_the_drafts_rope_is_hfs_bit_for_bit(rope):
    """eagle.llama_rope (the angles by a multiply) against HF's forward and against the matmul over a
    contraction of length 1 that transformers before 5.2x computes them with: the same bits."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from specgraph.drafts.eagle import llama_rope
    from test_outer_products import older_rope

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=64, rope_theta=10000.0,
                         rope_scaling=rope)
    rotary = LlamaRotaryEmbedding(config)
    x, positions = torch.randn(2, 5, 64, dtype=torch.bfloat16), torch.randint(0, 4000, (2, 5))
    got = llama_rope(rotary, x, positions)
    for want in (rotary(x, positions), older_rope(rotary, x, positions)):
        assert all(torch.equal(a, b) for a, b in zip(got, want))
