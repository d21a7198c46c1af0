"""compiled_cache.py: the compiled frames of a bucket (the decode step, the first propose, the draft's pass
over the prompt, the target's prefill bucket) kept on disk and loaded by a later compile without dynamo's
tracing, reading the live session and weights: greedy token-exact with HF; a torn file is compiled afresh;
anything the frame depends on changes its key. aot_eager stands in for inductor (conftest); the real
backend across processes: benchmarks/first_token.py."""
import logging

import pytest
import torch

import specgraph
from specgraph import WithLookup, compiled_cache
from specgraph.capture import Capture
from specgraph.drafts import Eagle3, NGram
from test_capture import tiny_model
from test_generate import assert_greedy_matches_hf, prompts


@pytest.fixture
def cache_on(settings, tmp_path):
    settings(capture_cache=True, cache=tmp_path)  # the suite keeps no caches (conftest); these tests do
    return tmp_path / "compiled"


def a_new_process(model):
    """Nothing of earlier compiles in memory: the model's captures released, dynamo's caches reset."""
    Capture.release(model)
    torch._dynamo.reset()


def no_tracing(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("dynamo traced a frame: it was not loaded from the compiled-frame cache")
    monkeypatch.setattr(torch._dynamo.convert_frame, "fullgraph_capture", refuse)
    monkeypatch.setattr(torch._dynamo.convert_frame, "_compile", refuse)


def eagle3(model):
    torch.manual_seed(7)
    layers = model.config.num_hidden_layers
    return Eagle3.for_target(model, aux_layer_ids=(0, layers // 2, layers - 1), aux_convention="layer_output")


@pytest.mark.parametrize("kind", ["ngram", "eagle3-lookup"])
def test_a_later_compile_loads_every_frame_and_is_token_exact(kind, cache_on, monkeypatch, aot_eager_compile, caplog):
    model = tiny_model("llama")
    draft, tree = ((NGram(), specgraph.Chain(3)) if kind == "ngram" else
                   (eagle3(model), WithLookup(specgraph.DynamicTree(2, 3, 5), 3)))
    rows = prompts(5, [9, 30])
    spec = specgraph.compile(model, draft, tree=tree, max_batch=2, max_cache_len=128, backend="inductor")
    assert_greedy_matches_hf(model, spec, rows, 16)
    kept = sorted(cache_on.glob("*.bin"))
    assert len(kept) >= 3  # the decode step, the first propose, the prefill bucket (and the EAGLE draft's pass)
    a_new_process(model)
    no_tracing(monkeypatch)
    with caplog.at_level(logging.INFO, logger="specgraph.compiled_cache"):
        spec = specgraph.compile(model, draft, tree=tree, max_batch=2, max_cache_len=128, backend="inductor")
        assert_greedy_matches_hf(model, spec, rows, 16)
        assert_greedy_matches_hf(model, spec, prompts(6, [12, 5]), 16)  # the loaded frames read the live session
    loaded = [r.getMessage() for r in caplog.records if "loaded from the compiled-frame cache" in r.getMessage()]
    assert len(loaded) == len(kept)
    (bucket,) = spec.capture.decode_steps.values()  # a loaded step still writes over its buffers itself
    assert bucket.run.copies_after_step == 0


def test_the_loaded_frames_read_the_live_weights(cache_on, monkeypatch, aot_eager_compile):
    """Weights changed in place after the frames were kept: a loaded step follows them (negative control:
    the tokens differ from the unchanged model's, so the comparison can fail)."""
    model = tiny_model("llama")
    rows = prompts(7, [10])
    spec = specgraph.compile(model, NGram(), tree=specgraph.Chain(3), max_cache_len=128, backend="inductor")
    before = spec.generate(torch.tensor(rows), max_new_tokens=12, eos_token_id=None)
    a_new_process(model)
    with torch.no_grad():
        model.lm_head.weight.mul_(-1.0)
    no_tracing(monkeypatch)
    spec = specgraph.compile(model, NGram(), tree=specgraph.Chain(3), max_cache_len=128, backend="inductor")
    assert not torch.equal(spec.generate(torch.tensor(rows), max_new_tokens=12, eos_token_id=None), before)
    assert_greedy_matches_hf(model, spec, rows, 12)


def test_a_torn_file_is_compiled_afresh(cache_on, aot_eager_compile, caplog):
    model = tiny_model("llama")
    rows = prompts(8, [9])
    spec = specgraph.compile(model, NGram(), tree=specgraph.Chain(3), max_cache_len=128, backend="inductor")
    assert_greedy_matches_hf(model, spec, rows, 8)
    for path in cache_on.glob("*.bin"):
        path.write_bytes(path.read_bytes()[:100])
    a_new_process(model)
    with caplog.at_level(logging.WARNING, logger="specgraph.compiled_cache"):
        spec = specgraph.compile(model, NGram(), tree=specgraph.Chain(3), max_cache_len=128, backend="inductor")
        assert_greedy_matches_hf(model, spec, rows, 8)
    assert any("unreadable" in r.getMessage() for r in caplog.records)
    assert all(path.stat().st_size > 100 for path in cache_on.glob("*.bin"))  # rewritten


def test_the_key_follows_the_target_bucket_and_the_frame():
    model = tiny_model("llama")
    base = dict(draft=NGram(), tree="Chain(3)", verify=None)
    key = compiled_cache.key("bucket", "decode step", **base)
    assert compiled_cache.key(None, "decode step", **base) is None  # the bucket is not cached: neither is the frame
    assert compiled_cache.key("bucket", "decode step", **base) == key
    assert compiled_cache.key("other bucket", "decode step", **base) != key
    assert compiled_cache.key("bucket", "first propose", **base) != key
    assert compiled_cache.key("bucket", "decode step", **{**base, "tree": "Chain(4)"}) != key
    assert compiled_cache.key("bucket", "decode step", **{**base, "draft": NGram(max_ngram=2)}) != key
    head = eagle3(model)
    head_key = compiled_cache.key("bucket", "decode step", **{**base, "draft": head})
    assert head_key != key
    assert compiled_cache.key("bucket", "decode step", **{**base, "draft": eagle3(model)}) == head_key  # stable
    head.layer.input_layernorm.variance_epsilon = 1e-3  # a constant of the graph, in a submodule
    assert compiled_cache.key("bucket", "decode step", **{**base, "draft": head}) != head_key


@pytest.mark.parametrize("kind", ["eagle3-lookup", "eagle3-static", "medusa"])
def test_no_frame_bakes_in_a_tensor_constant(kind, cache_on, monkeypatch):
    """A tensor made from a Python list inside a frame becomes a constant of the graph, which dynamo's
    precompile cannot keep on CUDA (torch 2.11: FakeTensorMode refuses to copy it to the host): such
    tensors are built once outside (the session's) and read. Every frame's graph after AOTAutograd, checked."""
    from torch._dynamo.backends.common import aot_autograd

    from specgraph.drafts import Medusa

    constants = []

    def fw_compiler(gm, example_inputs):
        constants.extend(n.target for n in gm.graph.nodes if n.op == "get_attr" and "_tensor_constant" in n.target)
        return gm.forward

    backend = aot_autograd(fw_compiler=fw_compiler)
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model=None, **kwargs: real(model, **{**kwargs, "backend": backend,
                                                                                     "mode": None}))
    model = tiny_model("llama")
    static = specgraph.StaticTree([(0,), (1,), (0, 0), (0, 1), (0, 0, 0)])
    draft, tree = {"eagle3-lookup": (eagle3(model), WithLookup(specgraph.DynamicTree(2, 3, 5), 3)),
                   "eagle3-static": (eagle3(model), static),
                   "medusa": (Medusa(model.config.hidden_size, model.config.vocab_size, 3), static)}[kind]
    spec = specgraph.compile(model, draft, tree=tree, max_cache_len=128, backend="inductor")
    assert_greedy_matches_hf(model, spec, prompts(9, [11]), 8)
    assert constants == []
