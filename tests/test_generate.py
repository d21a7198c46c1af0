"""specgraph.compile(model, NGram()).generate is token-exact with the target's
own greedy model.generate: tiny Llama/Qwen3/Gemma3 and real SmolLM2, batch 1
and batch 3 with different prompt lengths, eos inside an accepted chunk,
max_new_tokens mid-chunk; bad input is refused by name."""
import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.utils import GenerateDecoderOnlyOutput

import specgraph
from specgraph.runtime import step as step_module
from specgraph import Chain, CompileError, DynamicTree
from specgraph.drafts import Eagle, NGram
from test_capture import tiny_model


def hf_greedy(model, prompt: list[int], **kw) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, **kw)
    return out[0, len(prompt):].tolist()


def generated_rows(sequences: torch.Tensor, input_len: int, eos=None, pad=0) -> list[list[int]]:
    rows = []
    for row in sequences[:, input_len:].tolist():
        if eos is not None and eos in row:
            row = row[: row.index(eos) + 1]
        rows.append(row)
    return rows


def prompts(seed: int, lengths) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(3, 101, (8,), generator=g).tolist()
    return [(base * 10)[:n] if i % 2 else torch.randint(3, 101, (n,), generator=g).tolist() for i, n in enumerate(lengths)]


def assert_greedy_matches_hf(model, spec, rows: list[list[int]], max_new_tokens: int) -> None:
    """``rows`` left-padded into one batch through ``spec.generate``: each row's tokens are HF greedy's."""
    ids, mask = left_pad(rows)
    out = spec.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, eos_token_id=None)
    for row, got in zip(rows, generated_rows(out, ids.shape[1])):
        assert got == hf_greedy(model, row, max_new_tokens=max_new_tokens, eos_token_id=None)


def assert_batch_and_single_match_hf(model, spec, rows: list[list[int]], max_new_tokens: int) -> dict:
    """``rows`` as one left-padded batch, then ``rows[0]`` alone: every row's tokens are HF greedy's.
    Returns the batch's ``return_dict_in_generate`` output (accept_lens for the caller's checks)."""
    ids, mask = left_pad(rows)
    out = spec.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, eos_token_id=None,
                        return_dict_in_generate=True)
    for row, got in zip(rows, generated_rows(out["sequences"], ids.shape[1])):
        assert got == hf_greedy(model, row, max_new_tokens=max_new_tokens, eos_token_id=None)
    single = spec.generate(torch.tensor([rows[0]]), max_new_tokens=max_new_tokens, eos_token_id=None)
    assert single[0, len(rows[0]):].tolist() == hf_greedy(model, rows[0], max_new_tokens=max_new_tokens,
                                                          eos_token_id=None)
    return out


def left_pad(rows: list[list[int]]):
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("tree", [Chain(1), Chain(4)], ids=["chain1", "chain4"])
def test_greedy_is_token_exact(arch, tree):
    model = tiny_model(arch)
    spec = specgraph.compile(model, NGram(), tree=tree, max_batch=3, max_cache_len=256)
    rows = prompts(0, [5, 47, 11])  # lengths more than a prefill chunk (32) apart
    ids, mask = left_pad(rows)
    out = spec.generate(ids, attention_mask=mask, max_new_tokens=37, eos_token_id=None, return_dict_in_generate=True)
    assert out["sequences"].shape == (3, ids.shape[1] + 37)
    assert isinstance(out, GenerateDecoderOnlyOutput) and out.sequences is out["sequences"]  # as model.generate
    assert torch.equal(out["sequences"][:, : ids.shape[1]], ids)
    for row, got in zip(rows, generated_rows(out["sequences"], ids.shape[1])):
        assert got == hf_greedy(model, row, max_new_tokens=37, eos_token_id=None)
    single = spec.generate(torch.tensor([rows[1]]), max_new_tokens=37, eos_token_id=None)
    assert single[0, len(rows[1]):].tolist() == hf_greedy(model, rows[1], max_new_tokens=37, eos_token_id=None)
    if tree.depth > 1:  # the n-gram draft did speculate somewhere
        assert max(max(step) for step in out["accept_lens"]) > 1


def test_eos_inside_an_accepted_chunk_and_rows_finishing_apart():
    model = tiny_model("llama")
    spec = specgraph.compile(model, NGram(), tree=Chain(4), max_batch=3, max_cache_len=256)
    rows = prompts(1, [9, 16, 6])
    free = [hf_greedy(model, r, max_new_tokens=40, eos_token_id=None) for r in rows]
    eos = free[1][len(free[1]) // 2]  # a token row 1 emits mid-way: rows stop at different steps
    ids, mask = left_pad(rows)
    out = spec.generate(ids, attention_mask=mask, max_new_tokens=40, eos_token_id=eos, pad_token_id=0)
    for row, got in zip(rows, generated_rows(out, ids.shape[1], eos=eos)):
        assert got == hf_greedy(model, row, max_new_tokens=40, eos_token_id=eos)
    width = max(len(hf_greedy(model, r, max_new_tokens=40, eos_token_id=eos)) for r in rows)
    assert out.shape[1] == ids.shape[1] + width  # as long as the longest row, like model.generate


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("seed", [5, 8, 9])
def test_rows_finishing_apart_fit_an_exact_cache(seed, overlap, settings):
    """max_length exactly prompt + max_new_tokens + tree: a row that finished (its cache_len ran
    ahead by the tokens it accepted but did not need) keeps riding along while another row decodes;
    its tree once went past the cache's end (an out-of-bounds scatter). With the next step launched
    before the last is read (config.overlap, on by default on CUDA), the same tokens."""
    settings(overlap=overlap)
    model = tiny_model("llama")
    rep, rand = prompts(seed, [30, 9])[1], prompts(seed, [30, 9])[0]
    rows = [rep * 3, rand[:7]]  # the long repetitive row accepts long chunks and finishes first
    max_new, tree = 20, Chain(4)
    spec = specgraph.compile(model, NGram(), tree=tree, max_batch=2, max_cache_len=len(rows[0]) + max_new + 5)
    ids, mask = left_pad(rows)
    out = spec.generate(ids, attention_mask=mask, max_new_tokens=max_new, eos_token_id=None,
                        return_dict_in_generate=True)
    for row, got in zip(rows, generated_rows(out.sequences, ids.shape[1])):
        assert got == hf_greedy(model, row, max_new_tokens=max_new, eos_token_id=None)
    assert [steps[0] for steps in out.accept_lens][-1] == 0  # row 0 finished before row 1


@pytest.mark.parametrize("max_new", [1, 2, 7, 13])
def test_max_new_tokens_cut_mid_chunk(max_new):
    model = tiny_model("llama")
    spec = specgraph.compile(model, NGram(), tree=Chain(6), max_batch=1, max_cache_len=128)
    row = prompts(2, [10, 24])[1]  # repetitive: long accepted chunks
    out = spec.generate(torch.tensor([row]), max_new_tokens=max_new, eos_token_id=None)
    assert out[0, len(row):].tolist() == hf_greedy(model, row, max_new_tokens=max_new, eos_token_id=None)


def test_bad_input_is_refused_by_name():
    model = tiny_model("llama")
    spec = specgraph.compile(model, NGram(), tree=Chain(2), max_batch=2, max_cache_len=64)
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(TypeError, match="num_beams"):
        spec.generate(ids, num_beams=2)
    with pytest.raises(ValueError, match="temperature=0.0 with do_sample=True"):
        spec.generate(ids, do_sample=True, temperature=0.0)
    with pytest.raises(ValueError, match="max_batch=2"):
        spec.generate(torch.zeros(3, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="exceeds max_cache_len=64"):
        spec.generate(ids, max_new_tokens=62)
    with pytest.raises(ValueError, match="pad on the left"):
        spec.generate(torch.tensor([[5, 6, 0]]), attention_mask=torch.tensor([[1, 1, 0]]))
    with pytest.raises(ValueError, match="all padding"):
        spec.generate(torch.tensor([[5, 6], [0, 0]]), attention_mask=torch.tensor([[1, 1], [0, 0]]), max_new_tokens=3)


def test_compile_lists_every_blocker():
    model = tiny_model("llama")
    with pytest.raises(CompileError) as err:
        specgraph.compile(model, NGram(), tree=specgraph.EAGLE1_MC_SIM_7B_63, backend="tensorrt", max_cache_len=8)
    text = str(err.value)
    assert "backend='tensorrt'" in text and "NGram draft proposes one continuation" in text
    assert "max_cache_len=8" in text
    assert len(err.value.blockers) == 3


def test_a_model_moved_after_compile_is_refused():
    """The captured graphs (and a recorded CUDA graph) read the parameters' storage as it was at
    compile: after model.to(dtype) the old SpecModel raises instead of reading freed memory; a new
    compile serves the moved model."""
    model = tiny_model("llama")
    spec = specgraph.compile(model, NGram(), tree=Chain(2), max_cache_len=64)
    ids = torch.tensor([[5, 6, 7, 8]])
    spec.generate(ids, max_new_tokens=3)
    model.to(torch.float64)
    with pytest.raises(RuntimeError, match="moved or replaced"):
        spec.generate(ids, max_new_tokens=3)
    again = specgraph.compile(model, NGram(), tree=Chain(2), max_cache_len=64)
    out = again.generate(ids, max_new_tokens=3, eos_token_id=None)
    assert out[0, 4:].tolist() == hf_greedy(model, [5, 6, 7, 8], max_new_tokens=3, eos_token_id=None)


def test_a_hook_or_a_module_swapped_after_compile_is_refused():
    """The captured graph ran the modules and hooks of compile time: a forward hook added (or removed) or
    a module swapped since raises instead of silently running the old code; the same modules again run."""
    model = tiny_model("llama")
    spec = specgraph.compile(model, NGram(), tree=Chain(2), max_cache_len=64)
    ids = torch.tensor([[5, 6, 7, 8]])
    spec.generate(ids, max_new_tokens=3)
    handle = model.model.layers[0].register_forward_hook(lambda module, inputs, out: out * 2)
    with pytest.raises(RuntimeError, match="forward hooks changed"):
        spec.generate(ids, max_new_tokens=3)
    handle.remove()
    spec.generate(ids, max_new_tokens=3)  # as at compile again
    act = model.model.layers[1].mlp.act_fn
    model.model.layers[1].mlp.act_fn = torch.nn.Tanh()
    with pytest.raises(RuntimeError, match="modules or"):
        spec.generate(ids, max_new_tokens=3)
    model.model.layers[1].mlp.act_fn = act
    out = spec.generate(ids, max_new_tokens=3, eos_token_id=None)
    assert out[0, 4:].tolist() == hf_greedy(model, [5, 6, 7, 8], max_new_tokens=3, eos_token_id=None)


@pytest.mark.parametrize("first", ["inference_mode", "no_grad"])
def test_calls_inside_and_outside_inference_mode_in_either_order(first):
    """A first call under torch.inference_mode() makes the caches; a later call outside it (or the reverse)
    still writes them: both token-exact with model.generate."""
    model = tiny_model("llama")
    spec = specgraph.compile(model, NGram(), tree=Chain(3), max_cache_len=64)
    row = prompts(12, [7])[0]
    want = hf_greedy(model, row, max_new_tokens=6, eos_token_id=None)
    modes = [torch.inference_mode, torch.no_grad]
    for mode in (modes if first == "inference_mode" else modes[::-1]) + [torch.enable_grad]:
        with mode():
            out = spec.generate(torch.tensor([row]), max_new_tokens=6, eos_token_id=None)
        assert out[0, len(row):].tolist() == want, mode


def test_compile_and_generate_leave_the_models_training_mode_as_it_was():
    """As model.generate: a model in training mode stays so (the step is traced in eval mode regardless)."""
    model = tiny_model("llama").train()
    spec = specgraph.compile(model, NGram(), tree=Chain(3), max_cache_len=64)
    out = spec.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=4, eos_token_id=None)
    assert model.training and all(m.training for m in model.modules())
    assert out[0, 4:].tolist() == hf_greedy(model.eval(), [5, 6, 7, 8], max_new_tokens=4, eos_token_id=None)


def test_ngram_proposes_the_continuation_of_the_latest_match():
    draft = NGram(max_ngram=2)
    assert draft.propose([1, 2, 3, 4, 1, 2, 9, 9, 1, 2], 3) == [9, 9, 1]  # the latest "1 2" is followed by 9 9 1
    assert draft.propose([5, 6, 7], 2) == [7, 7]  # no match: repeat the last token
    with pytest.raises(ValueError, match="min_ngram"):
        NGram(max_ngram=1, min_ngram=2)


def _marginals(sequences: torch.Tensor, start: int, positions: int, vocab: int) -> torch.Tensor:
    return torch.stack([torch.bincount(sequences[:, start + i], minlength=vocab) for i in range(positions)]).double()


def _homogeneity_p(a: torch.Tensor, b: torch.Tensor) -> float:
    """Two-sample chi-square test that counts a and b come from one distribution."""
    keep = (a + b) > 0
    a, b = a[keep], b[keep]
    total = a + b
    ea, eb = total * a.sum() / total.sum(), total * b.sum() / total.sum()
    stat = (((a - ea) ** 2) / ea + ((b - eb) ** 2) / eb).sum()
    dof = torch.tensor((keep.sum().item() - 1) / 2, dtype=torch.float64)
    return torch.special.gammaincc(dof, stat / 2).item()


def _small_vocab_model():
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, vocab_size=12, max_position_embeddings=128,
                                      attn_implementation="sdpa", pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)
    return model


@pytest.mark.parametrize("draft", ["ngram", "eagle"])
@pytest.mark.parametrize("params", [dict(temperature=1.0, top_k=0), dict(temperature=0.7, top_k=5, top_p=0.9),
                                    dict(temperature=1.0, top_k=0, min_p=0.2)], ids=["plain", "filtered", "min_p"])
def test_sampling_matches_plain_sampling_in_distribution(params, draft):
    """Per position, speculative and plain sampling give the same token distribution (chi-square): an n-gram
    chain (block verification) and an EAGLE tree whose candidates are coupled to the target's draws (a random
    seed per call, kernels/gumbel.py)."""
    model = _small_vocab_model()
    rows, positions, prompt = 2000, 4, [3, 4, 5, 3, 4, 5, 3, 4]  # repetitive: the n-gram draft gets accepted
    torch.manual_seed(0)
    draft, tree = (NGram(), Chain(3)) if draft == "ngram" else (Eagle.for_target(model), DynamicTree(3, 2, 4))
    spec = specgraph.compile(model, draft, tree=tree, max_batch=rows, max_cache_len=64)
    ids = torch.tensor([prompt] * rows)
    # the bucket first samples with other values of the same filters: it is reused below, ``params`` set in place
    other = dict(temperature=3.0, top_k=2 if params["top_k"] else 0, top_p=0.5 if "top_p" in params else 1.0,
                 min_p=0.5 if "min_p" in params else 0.0)
    spec.generate(ids, do_sample=True, max_new_tokens=2, eos_token_id=None, **other)
    torch.manual_seed(10)
    out = spec.generate(ids, do_sample=True, max_new_tokens=positions, eos_token_id=None, return_dict_in_generate=True,
                        **params)
    torch.manual_seed(11)
    plain = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=positions,
                           eos_token_id=None, pad_token_id=0, **params)
    assert len(spec.capture.decode_steps) == 1
    ours, theirs = _marginals(out["sequences"], len(prompt), positions, 12), _marginals(plain, len(prompt), positions, 12)
    for i in range(positions):
        assert _homogeneity_p(ours[i], theirs[i]) > 0.01, (i, ours[i], theirs[i])
    assert max(max(step) for step in out["accept_lens"]) > 1  # drafts were accepted, so verification mattered
    # the test can tell distributions apart: plain sampling at another temperature differs
    torch.manual_seed(12)
    hotter = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=positions,
                            eos_token_id=None, pad_token_id=0, **{**params, "temperature": params["temperature"] * 2})
    assert min(_homogeneity_p(theirs[i], _marginals(hotter, len(prompt), positions, 12)[i]) for i in range(positions)) < 1e-3


def test_streamer_and_stopping_criteria_match_model_generate():
    from transformers import StoppingCriteria, StoppingCriteriaList

    class StopAfterToken(StoppingCriteria):
        def __init__(self, token):
            self.token = token

        def __call__(self, input_ids, scores, **kwargs):
            return input_ids[:, -1] == self.token

    class Collect:
        def __init__(self):
            self.calls = []

        def put(self, value):
            self.calls.append(value.flatten().tolist())

        def end(self):
            self.calls.append("end")

    model = tiny_model("llama")
    spec = specgraph.compile(model, NGram(), tree=Chain(4), max_cache_len=128)
    row = prompts(3, [6, 20])[1]
    free = hf_greedy(model, row, max_new_tokens=30, eos_token_id=None)
    stop_token = free[12]
    criteria = StoppingCriteriaList([StopAfterToken(stop_token)])
    streamer = Collect()
    out = spec.generate(torch.tensor([row]), max_new_tokens=30, eos_token_id=None, stopping_criteria=criteria,
                        streamer=streamer)
    want = hf_greedy(model, row, max_new_tokens=30, eos_token_id=None, stopping_criteria=criteria)
    assert out[0, len(row):].tolist() == want
    assert streamer.calls[0] == row and streamer.calls[-1] == "end"
    assert [c[0] for c in streamer.calls[1:-1]] == want  # one put per accepted token, in order


def assert_one_compile_across_lengths(spec, model, batches, max_new_tokens: int = 16) -> None:
    """Generate each batch of prompt lengths in turn: token-exact with HF greedy, and after the first
    batch no new compiled graph (a new prompt length must recompile nothing)."""
    graphs, before = None, torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for seed, lengths in enumerate(batches):
        rows = prompts(20 + seed, lengths)
        ids, mask = left_pad(rows)
        out = spec.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, eos_token_id=None)
        for row, got in zip(rows, generated_rows(out, ids.shape[1])):
            assert got == hf_greedy(model, row, max_new_tokens=max_new_tokens, eos_token_id=None)
        now = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        assert graphs is None or now == graphs, f"prompt lengths {lengths}: {now - graphs} new compiled graph(s)"
        assert now > before, "nothing was compiled"
        graphs = now


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=30), min_size=1, max_size=4),
       st.integers(1, 6), st.integers(1, 4), st.integers(1, 4))
def test_device_ngram_proposes_what_the_host_search_does(rows, k, max_ngram, min_ngram):
    """The on-device n-gram matcher (part of the decode step) against the plain Python search."""
    from specgraph.drafts.ngram import propose_on_device

    min_ngram = min(min_ngram, max_ngram)
    draft = NGram(max_ngram=max_ngram, min_ngram=min_ngram)
    seq = torch.zeros(len(rows), 40, dtype=torch.int64)
    for i, row in enumerate(rows):
        seq[i, : len(row)] = torch.tensor(row)
    got = propose_on_device(seq, torch.tensor([len(r) for r in rows]), k, max_ngram, min_ngram)
    assert got.tolist() == [draft.propose(row, k) for row in rows]


def test_plain_decoding_on_the_same_engine():
    """draft=None: one node per step (the root), token-exact, every step commits exactly one token."""
    model = tiny_model("qwen3")
    spec = specgraph.compile(model, None, max_batch=2, max_cache_len=128)
    assert spec.config.tree == Chain(0)
    rows = prompts(4, [7, 12])
    ids, mask = left_pad(rows)
    out = spec.generate(ids, attention_mask=mask, max_new_tokens=15, eos_token_id=None, return_dict_in_generate=True)
    for row, got in zip(rows, generated_rows(out["sequences"], ids.shape[1])):
        assert got == hf_greedy(model, row, max_new_tokens=15, eos_token_id=None)
    assert all(lens == [1, 1] for lens in out["accept_lens"])
    with pytest.raises(CompileError, match="draft=None"):
        specgraph.compile(model, None, tree=Chain(3))


@pytest.mark.parametrize("chunk", [16, 0])
def test_argmax_in_chunks_is_token_exact(monkeypatch, chunk):
    """step.ARGMAX_CHUNK: the greedy argmax of every step in two stages, chunks of 16 of the 101 logits
    (the last one partial), or in one (0): the same tokens as HF greedy."""
    monkeypatch.setattr(step_module, "ARGMAX_CHUNK", chunk)
    model = tiny_model("llama")
    spec = specgraph.compile(model, NGram(), tree=Chain(4), max_batch=2, max_cache_len=128)
    assert_greedy_matches_hf(model, spec, prompts(6, [9, 30]), 25)


def test_synthetic_acceptance_is_forced_and_labelled():
    """Benchmarks only: every step commits exactly k tokens (the last may be cut by max_new_tokens),
    with a warning on every call; sampling and out-of-range k are refused."""
    model = tiny_model("llama")
    spec = specgraph.compile(model, NGram(), tree=Chain(4), max_cache_len=128, synthetic_accept=3)
    with pytest.warns(UserWarning, match="NOT the model's"):
        out = spec.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=20, eos_token_id=None,
                            return_dict_in_generate=True)
    lens = [step[0] for step in out["accept_lens"]]
    assert lens[:-1] == [3] * (len(lens) - 1) and sum(lens) >= 19  # the first of the 20 is the prefill's
    with pytest.raises(ValueError, match="greedy only"):
        spec.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=5, do_sample=True)
    with pytest.raises(CompileError, match="synthetic_accept=6"):
        specgraph.compile(model, NGram(), tree=Chain(4), synthetic_accept=6)


@pytest.mark.parametrize("kind", ["ngram", "eagle3"])
def test_a_cache_exactly_as_long_as_needed(kind):
    """max_length = prompt + max_new_tokens + tree nodes, with the prompt not a multiple of the
    prefill chunk: nothing is written past the cache, the draft's features line up, and the output
    is the target's."""
    from specgraph.drafts import Eagle3

    model = tiny_model("llama")
    torch.manual_seed(0)
    draft, tree = (NGram(), Chain(3)) if kind == "ngram" else (Eagle3.for_target(model, aux_layer_ids=(0, 1, 1)),
                                                              specgraph.DynamicTree(steps=3, topk=2, nodes=6))
    rows = prompts(5, [41, 20])
    spec = specgraph.compile(model, draft, tree=tree, max_batch=2, max_cache_len=41 + 12 + tree.num_nodes)
    ids, mask = left_pad(rows)
    out = spec.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=None)
    for row, got in zip(rows, generated_rows(out, ids.shape[1])):
        assert got == hf_greedy(model, row, max_new_tokens=12, eos_token_id=None)


