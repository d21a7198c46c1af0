"""runtime/fast_start.py: calls run uncompiled while inductor compiles the bucket in a background thread,
then compiled; the same tokens throughout."""
import contextlib
import sys
import threading
import warnings

import pytest
import torch

import specgraph
from specgraph import Chain, CompileError
from specgraph.capture import TRACE_LOCK
from specgraph.drafts import NGram
from specgraph.refusals import fast_start_default
from specgraph.runtime.fast_start import SWITCH_INTERVAL_S
from test_capture import tiny_model
from test_generate import hf_greedy, prompts


@contextlib.contextmanager
def _held_elsewhere(lock):
    """``lock`` held by another thread for the block (as a background compile holds TRACE_LOCK)."""
    held, release = threading.Event(), threading.Event()

    def hold():
        with lock:
            held.set()
            release.wait(timeout=60)

    thread = threading.Thread(target=hold)
    thread.start()
    held.wait(timeout=60)
    try:
        yield
    finally:
        release.set()
        thread.join()


def _spy_captures(monkeypatch):
    """The Capture each generate call ran on, in order."""
    import specgraph.api as api

    used, real = [], api.speculative_generate

    def spy(capture, *args, **kwargs):
        used.append(capture)
        return real(capture, *args, **kwargs)

    monkeypatch.setattr(api, "speculative_generate", spy)
    return used


def test_the_first_call_runs_uncompiled_and_a_later_one_compiled(aot_eager_compile, monkeypatch):
    """The worker is held back (the compiled Capture's lock taken here), so the first call must be served
    uncompiled; a call made while the worker compiles is exact either way (on a CPU it waits for the
    compile: it runs modules eagerly); once the worker is done calls run compiled. Oracle: HF greedy."""
    interval = sys.getswitchinterval()
    model = tiny_model("llama")
    row = prompts(3, [20])[0]
    want = hf_greedy(model, row, max_new_tokens=16, eos_token_id=None)
    spec = specgraph.compile(model, NGram(), tree=Chain(3), backend="inductor", max_cache_len=128, fast_start=True)
    fast, compiled = spec.fast_start.fast, spec.capture
    assert fast is not compiled and fast.backend == "cudagraphs"
    used = _spy_captures(monkeypatch)
    ids = torch.tensor([row])
    with compiled.lock:  # the worker waits for it: nothing compiles before the first call returns
        out = spec.generate(ids, max_new_tokens=16, eos_token_id=None)
        assert out[0, len(row):].tolist() == want
        assert used[-1] is fast and not spec.fast_start.ready
        assert not spec.wait_compiled(timeout=0.2)
        assert sys.getswitchinterval() == pytest.approx(min(interval, SWITCH_INTERVAL_S))  # while the worker runs
    out = spec.generate(ids, max_new_tokens=16, eos_token_id=None)  # the worker compiles meanwhile
    assert out[0, len(row):].tolist() == want
    assert spec.wait_compiled(timeout=600) and not spec.fast_start.failed
    out = spec.generate(ids, max_new_tokens=16, eos_token_id=None)
    assert out[0, len(row):].tolist() == want
    assert used[-1] is compiled and compiled.decode_steps  # compiled by the worker, run here
    assert sys.getswitchinterval() == interval  # given back when the worker stopped


def test_a_call_that_runs_modules_eagerly_waits_while_another_thread_traces():
    """fx's tracer patches nn.Module.__call__ for every thread while it traces: an eager call beside it
    would be traced into the wrong graph (NameError: module is not installed as a submodule). A call on
    the uncompiled Capture holds TRACE_LOCK, as tracing does, so it waits and then runs exact."""
    from specgraph.capture import TRACE_LOCK

    model = tiny_model("llama")
    row = prompts(6, [12])[0]
    want = hf_greedy(model, row, max_new_tokens=8, eos_token_id=None)
    spec = specgraph.compile(model, NGram(), tree=Chain(3), backend="inductor", max_cache_len=64, fast_start=True)
    spec.fast_start.after_call = lambda *args, **kwargs: None  # no background compile: the tracer below stands in for it
    spec.generate(torch.tensor([row]), max_new_tokens=8, eos_token_id=None)  # captured: no torch.export below
    inside, release = threading.Event(), threading.Event()

    class Blocking(torch.nn.Module):
        def forward(self, x):
            inside.set()  # traced now: nn.Module.__call__ is patched until forward returns
            release.wait(60)
            return x + 1

    def trace():
        with TRACE_LOCK:
            torch.fx.symbolic_trace(Blocking())

    tracer = threading.Thread(target=trace)
    tracer.start()
    assert inside.wait(60)
    result = {}
    call = threading.Thread(target=lambda: result.update(out=spec.generate(torch.tensor([row]), max_new_tokens=8,
                                                                           eos_token_id=None)))
    call.start()
    call.join(1.0)
    assert call.is_alive()  # waiting for the tracer
    release.set()
    tracer.join(60)
    call.join(120)
    assert result["out"][0, len(row):].tolist() == want


def test_a_compiled_buckets_first_call_waits_for_another_threads_compile(aot_eager_compile, monkeypatch):
    """Two compiles at once in one process are not safe (dynamo's and AOTAutograd's tracing state is partly
    process-wide), and another SpecModel's background compile holds TRACE_LOCK: a SpecModel without a fast
    start holds it through a bucket's first call (it compiles); its later calls (compiled) run beside
    another thread holding it. Oracle: HF greedy."""
    import specgraph.api as api

    model = tiny_model("llama")
    row = prompts(7, [10])[0]
    want = hf_greedy(model, row, max_new_tokens=8, eos_token_id=None)
    spec = specgraph.compile(model, NGram(), tree=Chain(3), backend="inductor", max_cache_len=64, fast_start=False)
    held, real = [], api.speculative_generate
    monkeypatch.setattr(api, "speculative_generate", lambda *a, **k: held.append(TRACE_LOCK._is_owned()) or real(*a, **k))
    out = spec.generate(torch.tensor([row]), max_new_tokens=8, eos_token_id=None)
    assert out[0, len(row):].tolist() == want and held == [True]  # the first call compiled under the lock
    result = {}
    with _held_elsewhere(TRACE_LOCK):
        call = threading.Thread(target=lambda: result.update(out=spec.generate(torch.tensor([row]), max_new_tokens=8,
                                                                               eos_token_id=None)))
        call.start()
        call.join(120)
        assert not call.is_alive()  # compiled: it ran beside the lock's holder
    assert result["out"][0, len(row):].tolist() == want and held == [True, False]


def test_a_failed_background_compile_keeps_serving_uncompiled(monkeypatch, caplog):
    model = tiny_model("llama")
    row = prompts(4, [12])[0]
    want = hf_greedy(model, row, max_new_tokens=8, eos_token_id=None)
    spec = specgraph.compile(model, NGram(), tree=Chain(3), backend="inductor", max_cache_len=64, fast_start=True)
    used = _spy_captures(monkeypatch)

    def broken(*args):
        raise RuntimeError("an inductor bug")

    monkeypatch.setattr(spec, "_bucket_warmup", lambda b, *rest: ((b, "key"), broken))
    for _ in range(2):
        out = spec.generate(torch.tensor([row]), max_new_tokens=8, eos_token_id=None)
        assert out[0, len(row):].tolist() == want
        assert spec.wait_compiled(timeout=60)
    assert spec.fast_start.failed == {(1, "key")} and not spec.fast_start.ready
    assert all(capture is spec.fast_start.fast for capture in used)
    assert "an inductor bug" in caplog.text


def test_warmup_compiles_in_the_foreground_and_marks_the_bucket_ready(aot_eager_compile, monkeypatch):
    model = tiny_model("llama")
    row = prompts(5, [10])[0]
    spec = specgraph.compile(model, NGram(), tree=Chain(3), backend="inductor", max_cache_len=64, fast_start=True)
    spec.warmup()
    used = _spy_captures(monkeypatch)
    out = spec.generate(torch.tensor([row]), max_new_tokens=8, eos_token_id=None)
    assert out[0, len(row):].tolist() == hf_greedy(model, row, max_new_tokens=8, eos_token_id=None)
    assert used == [spec.capture] and spec.fast_start._worker is None  # nothing queued


def test_under_policy_cost_uncompiled_calls_teach_tau_not_cost(aot_eager_compile, monkeypatch, settings, tmp_path):
    """policy="cost" with a fast start: a call served uncompiled counts for τ (the same tokens either way) but
    puts no step cost in the table; every mode's bucket is queued for the worker; once compiled, calls are
    timed. Output exact throughout."""
    settings(cache=tmp_path)  # the step-cost table: this test's own
    model = tiny_model("llama")
    row = prompts(8, [16])[0]
    want = hf_greedy(model, row, max_new_tokens=12, eos_token_id=None)
    spec = specgraph.compile(model, NGram(), tree=Chain(3), backend="inductor", max_cache_len=64, policy="cost",
                             fast_start=True)
    used = _spy_captures(monkeypatch)
    ids = torch.tensor([row])
    with spec.capture.lock:  # the worker waits: these calls are served uncompiled
        for _ in range(3):  # past a mode's first call, which never counts as a timing
            out = spec.generate(ids, max_new_tokens=12, eos_token_id=None)
            assert out[0, len(row):].tolist() == want and used[-1] is spec.fast_start.fast
        assert all(spec.policy.table.get(1, m) is None for m in spec.modes)  # no uncompiled timing kept
        assert spec.policy.tau  # but τ was learnt
        assert spec.fast_start._queued == {spec._bucket_warmup(1, m, None, None, (False, False))[0] for m in spec.modes}
    assert spec.wait_compiled(timeout=600) and len(spec.fast_start.ready) == len(spec.modes)
    for _ in range(2 * len(spec.modes)):
        out = spec.generate(ids, max_new_tokens=12, eos_token_id=None)
        assert out[0, len(row):].tolist() == want and used[-1] is spec.capture
    assert any(spec.policy.table.get(1, m) is not None for m in spec.modes)  # compiled calls are timed


@pytest.mark.parametrize("kwargs, expected", [
    (dict(backend="eager"), "backend='eager'"),
    (dict(backend="auto"), "backend='auto'"),  # on a CPU: auto is eager
    (dict(backend="inductor", policy="measured"), "policy='measured'"),
])
def test_fast_start_refusals_name_the_argument(kwargs, expected):
    model = tiny_model("llama")
    with pytest.raises(CompileError, match=expected):
        specgraph.compile(model, NGram(), tree=Chain(3), max_cache_len=64, fast_start=True, **kwargs)
    with pytest.raises(CompileError, match="fast_start='yes'"):
        specgraph.compile(model, NGram(), tree=Chain(3), max_cache_len=64, backend="inductor", fast_start="yes")


def test_attach_takes_fast_start(aot_eager_compile):
    """The HF drop-in: model.generate runs uncompiled at once, compiled once the worker is done; exact."""
    model = tiny_model("llama")
    row = prompts(7, [10])[0]
    ids = torch.tensor([row])
    want = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8,
                          eos_token_id=None, pad_token_id=0)
    spec = specgraph.attach(model, NGram(), tree=Chain(3), backend="inductor", max_batch=1, max_cache_len=64,
                            fast_start=True)
    try:
        for _ in range(2):
            got = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8,
                                 eos_token_id=None, pad_token_id=0)
            assert torch.equal(got, want)
            assert spec.wait_compiled(timeout=600)
        assert spec.fast_start.ready and not spec.fast_start.failed
    finally:
        specgraph.detach(model)


@pytest.mark.parametrize("backend, on_cuda, policy, tp, cache, on", [
    ("auto", True, "fixed", None, True, True), ("auto", True, "cost", None, True, False),
    ("auto", False, "fixed", None, True, False), ("inductor", True, "fixed", None, True, False),
    ("cudagraphs", True, "fixed", None, True, False), ("auto", True, "measured", None, True, False),
    ("auto", True, "fixed", object(), True, False), ("auto", True, "fixed", None, False, False)])
def test_fast_start_is_on_by_default_only_where_its_worker_never_traces_the_model(backend, on_cuda, policy, tp,
                                                                                 cache, on):
    """On where specgraph picks inductor, the policy is fixed and the capture cache lets the worker load
    what the serving thread captured (torch.export in the worker would hook every thread's module calls)."""
    assert fast_start_default(backend, on_cuda, policy, tp, cache) is on


def test_by_default_on_a_cpu_nothing_runs_in_the_background():
    spec = specgraph.compile(tiny_model("llama"), NGram(), tree=Chain(3), max_cache_len=64)
    assert spec.fast_start is None and spec.config.fast_start is False


def test_the_moved_weights_check_does_not_read_modules_another_thread_traces():
    """torch.export swaps fake tensors into the modules while it traces (a background compile); a call
    made meanwhile on a replay-only bucket (CUDA) must not read them. Negative control: with no trace
    running, the same fake parameter is read (an error, or a false "moved")."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = tiny_model("llama")
    spec = specgraph.compile(model, NGram(), tree=Chain(3), max_cache_len=64)
    assert not spec._moved()
    norm = model.model.norm
    real = norm._parameters["weight"]
    norm._parameters["weight"] = FakeTensorMode().from_tensor(real)  # as export's reparametrisation does
    try:
        with warnings.catch_warnings():  # torch 2.11 raises at a fake data pointer; later ones warn and read 0
            warnings.simplefilter("ignore")
            try:
                misread = spec._moved()
            except RuntimeError:
                misread = True
        assert misread
        with _held_elsewhere(TRACE_LOCK):
            assert spec._moved() is False
    finally:
        norm._parameters["weight"] = real
    assert not spec._moved()


def test_drain_drops_the_queued_warmups_and_waits_for_the_running_one():
    """At interpreter exit (atexit) a worker stopped inside inductor's compile would abort the process."""
    from specgraph.runtime.fast_start import FastStart

    class Stand:  # a Capture as FastStart uses it
        def __init__(self):
            self.lock, self.kv_device = threading.Lock(), torch.device("cpu")

    fast_start = FastStart(Stand(), Stand())
    started, release, ran = threading.Event(), threading.Event(), []

    def running(capture):
        started.set()
        release.wait(timeout=60)
        ran.append("running")

    fast_start.after_call("a", running, record_fast=False)
    assert started.wait(timeout=60)
    fast_start.after_call("b", lambda capture: ran.append("queued"), record_fast=False)
    threading.Timer(0.2, release.set).start()
    fast_start.drain()
    assert ran == ["running", "running"] and fast_start._worker is None  # warmed up twice; "b" dropped


def test_an_attached_fallback_waits_out_a_background_trace(aot_eager_compile):
    """HF's own generate (a fallback: beam search) runs the model's modules eagerly, which a trace in another
    thread would hook: it waits for TRACE_LOCK, with a fast start (a background compile) and without (another
    thread's capture; test_generate_args.py's thread test fails without the wait), then runs."""
    model = tiny_model("llama")
    ids = torch.tensor([prompts(7, [10])[0]])
    kwargs = dict(attention_mask=torch.ones_like(ids), num_beams=2, do_sample=False, max_new_tokens=4,
                  eos_token_id=None, pad_token_id=0)
    want = model.generate(ids, **kwargs)
    for fast_start in (True, False):
        spec = specgraph.attach(model, NGram(), tree=Chain(3), backend="inductor", max_batch=1, max_cache_len=64,
                                fast_start=fast_start)
        got = []
        caller = threading.Thread(target=lambda: got.append(model.generate(ids, **kwargs)))
        try:
            with _held_elsewhere(TRACE_LOCK):
                with pytest.warns(UserWarning, match="falling back"):
                    caller.start()
                    caller.join(timeout=5)
                assert not got  # held while the "trace" runs
        finally:
            caller.join(timeout=60)
            specgraph.detach(model)
        assert torch.equal(got[0], want) and spec.wait_compiled(timeout=600)


@pytest.mark.parametrize("cache_on", [True, False])
def test_with_the_capture_cache_the_worker_runs_no_torch_export(aot_eager_compile, settings, tmp_path, monkeypatch,
                                                                cache_on):
    """What the default rests on (refusals.fast_start_default): the serving thread captures, the worker loads
    from the capture cache. Negative control: with the cache off the worker exports."""
    import specgraph.capture as capture

    settings(capture_cache=cache_on, cache=tmp_path)
    threads, real = [], capture.export_tree_step

    def spy(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(capture, "export_tree_step", spy)
    spec = specgraph.compile(tiny_model("llama"), NGram(), tree=Chain(3), backend="inductor", max_cache_len=64,
                             fast_start=True)
    spec.generate(torch.tensor([prompts(9, [12])[0]]), max_new_tokens=8)
    assert spec.wait_compiled(timeout=600) and spec.fast_start.ready
    assert "MainThread" in threads and ("specgraph-compile" in threads) is not cache_on


def test_the_users_own_eager_calls_run_beside_the_background_compile(aot_eager_compile, settings, tmp_path):
    """With the capture cache on (the default's condition) the worker loads the bucket (no tracing) and
    compiles it (AOTAutograd's trace patches nn.Module.__call__ for every thread, and passes calls of modules
    outside its graph through): the user's eager forward passes of the same model in this thread, made while
    the worker holds TRACE_LOCK, run and give the model's own logits."""
    settings(capture_cache=True, cache=tmp_path)
    model = tiny_model("llama")
    ids = torch.tensor([prompts(12, [10])[0]])
    with torch.no_grad():
        want = model(ids).logits
    spec = specgraph.compile(model, NGram(), tree=Chain(3), backend="inductor", max_cache_len=64, fast_start=True)
    spec.generate(ids, max_new_tokens=8)  # captured here; the worker loads and compiles from now
    beside = 0
    while not spec.fast_start.ready and not spec.fast_start.failed:
        held = not TRACE_LOCK.acquire(blocking=False)  # by the worker
        if not held:
            TRACE_LOCK.release()
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, want, rtol=0, atol=0)
        beside += held
    assert spec.wait_compiled(timeout=600) and not spec.fast_start.failed
    assert beside > 0  # some calls ran while the worker traced and compiled


def test_inductors_own_first_trace_is_made_in_the_calling_thread(aot_eager_compile, monkeypatch):
    """Inductor traces a tiny function of its own with fx's plain tracer the first time a process lowers a
    graph; that tracer patches nn.Module.__call__ for every thread while it traces (on an H100 the user's
    own HF generate beside the worker failed so), so the call that queues the first background compile makes
    that trace in its own thread, and the worker never does."""
    loop_body = pytest.importorskip("torch._inductor.loop_body")
    made = loop_body.InterpreterShim._dummy_gm
    made.cache_clear()
    traced_in, real = [], torch.fx.Tracer.trace

    def spy(self, *args, **kwargs):
        if type(self) is torch.fx.Tracer:  # the plain tracer (make_fx's subclasses pass foreign calls through)
            traced_in.append(threading.current_thread())
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.fx.Tracer, "trace", spy)
    spec = specgraph.compile(tiny_model("llama"), NGram(), tree=Chain(3), backend="inductor", max_cache_len=64,
                             fast_start=True)
    spec.generate(torch.tensor([prompts(12, [10])[0]]), max_new_tokens=4)
    assert spec.wait_compiled(timeout=600) and not spec.fast_start.failed
    assert made.cache_info().currsize == 1
    assert traced_in and all(thread is threading.main_thread() for thread in traced_in), traced_in


def test_the_uncompiled_capture_is_let_go_once_everything_it_served_runs_compiled(aot_eager_compile):
    """Its KV cache and graphs are a second copy. A failed warm-up keeps it (that bucket serves uncompiled)."""
    import gc
    import weakref

    model = tiny_model("llama")
    row = prompts(11, [14])[0]
    want = hf_greedy(model, row, max_new_tokens=8, eos_token_id=None)
    spec = specgraph.compile(model, NGram(), tree=Chain(3), backend="inductor", max_cache_len=64, fast_start=True)
    fast = weakref.ref(spec.fast_start.fast)
    assert spec.generate(torch.tensor([row]), max_new_tokens=8, eos_token_id=None)[0, len(row):].tolist() == want
    assert spec.wait_compiled(timeout=600) and spec.fast_start.ready  # (the worker lets it go before it is idle)
    gc.collect()
    assert spec.fast_start._fast is None and fast() is None
    assert spec.generate(torch.tensor([row]), max_new_tokens=8, eos_token_id=None)[0, len(row):].tolist() == want


def test_a_bucket_recorded_on_a_capture_let_go_meanwhile_is_not_called_replaying(monkeypatch):
    """If the worker lets the uncompiled Capture go while a bucket's recording call runs on it, that bucket is
    not marked replay-only: its next call runs on a new Capture that has recorded nothing (and would trace),
    so it must take TRACE_LOCK. Control: a bucket recorded on the kept Capture is marked."""
    import specgraph.runtime.fast_start as module

    monkeypatch.setattr(module, "cuda_graphs_on", lambda device: True)

    class Stand:  # a CUDA Capture as FastStart uses it
        def __init__(self):
            self.lock, self.kv_device = threading.Lock(), torch.device("cuda")

    fast_start = module.FastStart(Stand, Stand())
    fast_start._work = lambda: sys.setswitchinterval(fast_start._switch)  # no compile: only what after_call marks

    def let_go(capture):
        fast_start._fast = None  # as the worker's idle branch does

    fast_start.after_call("a", let_go)
    fast_start.after_call("b", lambda capture: None)
    assert "a" not in fast_start.replaying and "b" in fast_start.replaying
