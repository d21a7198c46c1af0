"""capture_cache.py: a captured step kept on disk and loaded by a later Capture (a new process's) runs
the same graph over the live model's tensors: no torch.export, no passes, the same logits, greedy
token-exact with HF; anything the graph depends on changes the key; a torn file is captured afresh."""
import pytest
import torch

import specgraph
from capture_harness import Driver
from specgraph import capture_cache
from specgraph.capture import Capture
from specgraph.drafts import NGram
from test_capture import tiny_model
from test_generate import assert_greedy_matches_hf, prompts


@pytest.fixture
def cache_on(settings, tmp_path):
    settings(capture_cache=True, cache=tmp_path)  # the suite captures afresh (conftest); these tests keep them
    return tmp_path / "captures"


def no_export(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("torch.export ran: the step was not loaded from the cache")
    monkeypatch.setattr(torch.export, "export", refuse)


def logits_of(capture: Capture, batch: int, nodes: int):
    """The (batch, nodes) bucket's logits for fixed tokens on a chain after 3 cached slots."""
    torch.manual_seed(1)
    ids = torch.randint(3, 100, (batch, nodes))
    positions = torch.arange(nodes).expand(batch, nodes).contiguous() + 3
    chain = torch.tensor([(1 << (i + 1)) - 1 for i in range(nodes)]).expand(batch, nodes).contiguous()
    return capture.step(batch, nodes)(ids, positions, torch.tensor([3] * batch), chain)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_later_capture_loads_the_step_and_computes_the_same(arch, cache_on, monkeypatch, settings):
    model = tiny_model(arch)
    with torch.no_grad():
        cold = logits_of(Capture(model, 64), 2, 4)
    files = list(cache_on.glob("*.pt"))
    assert len(files) == 1
    with torch.no_grad():
        settings(capture_cache=False)
        fresh = logits_of(Capture(model, 64), 2, 4)  # never cached: export and passes as before
        settings(capture_cache=True)
        no_export(monkeypatch)
        warm_capture = Capture(model, 64)
        warm = logits_of(warm_capture, 2, 4)
    torch.testing.assert_close(cold, fresh, rtol=0, atol=0)
    torch.testing.assert_close(warm, fresh, rtol=0, atol=0)
    step = warm_capture.step(2, 4)
    assert dict(step.pass_results)["replace_attention"].counters["sdpa_replaced"] > 0  # the counters came along
    params = {p.data_ptr() for p in model.parameters()}
    assert sum(t.data_ptr() in params for t in step._state) >= len(list(model.parameters())) - 1  # by reference
    assert step.kv is warm_capture.kv(2)


def test_the_loaded_step_reads_the_live_weights_not_a_copy(cache_on, monkeypatch):
    """Weights changed in place after the step was written: the loaded step sees them (negative control: the
    logits differ from before the change, so the comparison can fail)."""
    model = tiny_model("llama")
    with torch.no_grad():
        before = logits_of(Capture(model, 64), 1, 3)
        model.model.layers[0].self_attn.q_proj.weight.mul_(1.5)  # a joined (fused q/k/v) weight's rows
        model.model.layers[1].mlp.down_proj.weight.mul_(0.5)
        with specgraph.config.patch(capture_cache=False):
            want = logits_of(Capture(model, 64), 1, 3)
        no_export(monkeypatch)
        got = logits_of(Capture(model, 64), 1, 3)
    assert not torch.allclose(before, want)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_generate_from_a_warm_cache_is_token_exact(backend, cache_on, monkeypatch, aot_eager_compile):
    """Eager, and the whole step compiled (dynamo over the loaded graph; aot_eager stands in for inductor)."""
    model = tiny_model("qwen3")
    rows = prompts(3, [9, 30])
    spec = specgraph.compile(model, NGram(), tree=specgraph.Chain(3), max_batch=2, max_cache_len=128, backend=backend)
    assert_greedy_matches_hf(model, spec, rows, 16)
    Capture.release(model)  # a new process: nothing of the first compile's captures in memory
    torch._dynamo.reset()
    no_export(monkeypatch)
    spec = specgraph.compile(model, NGram(), tree=specgraph.Chain(3), max_batch=2, max_cache_len=128, backend=backend)
    assert_greedy_matches_hf(model, spec, rows, 16)


def test_the_key_follows_the_bucket_the_settings_and_the_layout(settings):
    model = tiny_model("llama")
    capture = Capture(model, 64)  # lays out q/k/v and gate/up back to back, as every capture does
    from specgraph.capture import TreeStep

    module = TreeStep(model, capture.info, 1, 64)
    key = lambda *bucket, m=module: capture_cache.key(model, m, *bucket, None, None)  # noqa: E731
    base = key(1, 4, 64)
    assert key(1, 4, 64) == base
    assert len({base, key(1, 5, 64), key(1, 4, 80), capture_cache.key(model, module, 1, 4, 64, None, (0, 1))}) == 4
    settings(skip_passes="fold_norms")
    assert key(1, 4, 64) != base
    settings(skip_passes="")
    assert key(1, 4, 64) == base
    other = tiny_model("llama")  # same shapes, no packed projections: another layout, another graph
    assert capture_cache.key(other, TreeStep(other, capture.info, 1, 64), 1, 4, 64, None, None) != base
    model.config._name_or_path = "/elsewhere/converted"  # the same model loaded from another folder
    assert key(1, 4, 64) == base
    model.config.rms_norm_eps *= 2  # a constant of the graph
    assert key(1, 4, 64) != base


def test_a_torn_file_is_captured_afresh_and_rewritten(cache_on, caplog):
    model = tiny_model("llama")
    with torch.no_grad():
        want = logits_of(Capture(model, 64), 1, 2)
        (path,) = cache_on.glob("*.pt")
        path.write_bytes(path.read_bytes()[:100])
        got = logits_of(Capture(model, 64), 1, 2)
    assert "unreadable" in caplog.text
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert path.stat().st_size > 100


def test_debugging_captures_afresh(cache_on, settings):
    model = tiny_model("llama")
    settings(debug=True)
    Capture(model, 64).step(1, 2)
    assert not cache_on.exists()


def test_onnx_export_of_a_loaded_step_still_unjoins_the_weights(cache_on, tmp_path, monkeypatch):
    """export.py replaces fuse_projections' joined weights by their parts (node meta "fused_from"), which a
    loaded graph carries too."""
    from specgraph.export import export_onnx

    model = tiny_model("llama")
    Driver(model, batch=1, max_length=64, seed=3).capture.step(1, 4)  # written
    driver = Driver(model, batch=1, max_length=64, seed=3)
    step = driver.capture.step(1, 4)
    assert any("fused_from" in n.meta for n in step.graph.graph.find_nodes(op="get_attr"))
    export_onnx(driver.capture, specgraph.Chain(3), tmp_path / "step.onnx", batch=1)


def test_a_second_process_loads_every_bucket(tmp_path):
    """Across processes (benchmarks/first_token.py --tiny: each run a fresh Python, sharing the cache folders):
    the first captures its buckets, the second loads all of them and captures none. With ``--bytecode kept`` the
    processes write and read Python's bytecode though this environment says not to."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "first_token.py"
    done = subprocess.run([sys.executable, str(script), "--tiny", "--runs", "2", "--calls", "2", "--max-new-tokens", "8",
                           "--bytecode", "kept", "--out", str(tmp_path / "ft.json")], capture_output=True, text=True,
                          timeout=600, env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))
    assert done.returncode == 0, done.stderr[-2000:]
    cold, warm = json.loads((tmp_path / "ft.json").read_text())["runs"]
    assert cold["dont_write_bytecode"] == warm["dont_write_bytecode"] == 0
    assert [len(cold["first_calls"]), len(warm["steady_calls"])] == [2, 2] and cold["first_calls_tok_s"] > 0
    assert len(cold["capture_s"]) >= 2 and cold["capture_loaded_s"] == []
    assert warm["capture_s"] == [] and len(warm["capture_loaded_s"]) == len(cold["capture_s"])


def test_only_the_most_recently_used_files_are_kept(cache_on, monkeypatch):
    monkeypatch.setattr(capture_cache, "KEEP", 2)
    model = tiny_model("llama")
    capture = Capture(model, 64)
    for nodes in (1, 2, 3):
        capture.step(1, nodes)
    assert len(list(cache_on.glob("*.pt"))) == 2
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: pytest.fail("the newest file was deleted"))
    Capture(model, 64).step(1, 3)


def test_a_load_traces_nothing_so_other_threads_module_calls_are_safe(cache_on, monkeypatch):
    """fx's Tracer patches nn.Module.__call__ for every thread while it traces (a user's eager call in another
    thread then fails: "module is not installed as a submodule"), and unpickling a GraphModule traces its
    code. A load rebuilds the graph from its node table instead: no Tracer runs, the same code comes back."""
    import pickle

    model = tiny_model("llama")
    with torch.no_grad():
        kept = Capture(model, 64).step(2, 4)
    traced = []
    real_trace = torch.fx.Tracer.trace
    monkeypatch.setattr(torch.fx.Tracer, "trace", lambda self, *a, **k: traced.append(type(self)) or real_trace(self, *a, **k))
    pickle.loads(pickle.dumps(kept.graph))
    assert traced  # negative control: the pickled GraphModule is re-traced
    traced.clear()
    no_export(monkeypatch)
    with torch.no_grad():
        loaded = Capture(model, 64).step(2, 4)
    assert not traced
    assert loaded.graph.code == kept.graph.code


class _Scaled(torch.nn.Module):
    """An activation another class than the model's own (the same parameters: the layout key cannot tell)."""

    def forward(self, x):
        return -3.0 * torch.nn.functional.silu(x)


def _hooked(model):
    shift = torch.full((model.config.hidden_size,), 2.0)
    model.model.layers[0].register_forward_hook(lambda module, inputs, out: out + shift)  # a steering hook
    return model


def _patched(model):
    for layer in model.model.layers:
        layer.mlp.act_fn = _Scaled()
    return model


@pytest.mark.parametrize("change", [_hooked, _patched], ids=["forward-hook", "swapped-module"])
def test_a_hooked_or_patched_model_never_gets_the_plain_models_graph(change, cache_on):
    """Two copies of one model in one cache (a later process's view): a forward hook or a swapped module
    changes what the trace runs but no tensor; the changed copy must not load the plain copy's graph, nor
    the reverse. Oracle: each copy's own model.generate."""
    row = prompts(11, [9])[0]
    from test_generate import hf_greedy
    assert hf_greedy(change(tiny_model("llama")), row, max_new_tokens=8, eos_token_id=None) != \
        hf_greedy(tiny_model("llama"), row, max_new_tokens=8, eos_token_id=None)  # the change changes the tokens
    for first, second in ((lambda m: m, change), (change, lambda m: m)):
        for make in (first, second):
            model = make(tiny_model("llama"))
            spec = specgraph.compile(model, NGram(), tree=specgraph.Chain(3), max_cache_len=64)
            assert_greedy_matches_hf(model, spec, [row], max_new_tokens=8)
        for path in cache_on.glob("*.pt"):
            path.unlink()
    model = _hooked(tiny_model("llama"))
    assert not capture_cache.enabled(None, None, model) and capture_cache.enabled(None, None, tiny_model("llama"))


def test_the_key_names_each_modules_class_and_the_callables_modules_keep():
    plain, patched = tiny_model("llama"), _patched(tiny_model("llama"))
    assert capture_cache.code_fingerprint(plain)[0] == capture_cache.code_fingerprint(tiny_model("llama"))[0]
    assert capture_cache.code_fingerprint(plain)[0] != capture_cache.code_fingerprint(patched)[0]
    gemma = tiny_model("gemma3")  # HF keeps a partial activation on its modules: named, so still cached
    assert capture_cache.code_fingerprint(gemma)[1] == []
    plain.model.layers[1].mlp.forward = lambda x: x  # a patched forward on the instance: cannot be named
    assert any("layers.1.mlp.forward" in b for b in capture_cache.code_fingerprint(plain)[1])
