"""A fast start: serve with the uncompiled static step while inductor compiles it in the background.

``compile(..., fast_start=True)``; on by default with backend "auto" on CUDA, policy "fixed" and the
capture cache on (``refusals.fast_start_default``). A bucket's first call under inductor compiles
its frames (the prefill chunk, the first propose, the draft's pass over the prompt, the decode
step): about a minute on a GPU, before the first token. With a fast start the calls of a bucket not
compiled yet run on a second Capture of the same model with ``backend="cudagraphs"`` (the same
static step recorded as CUDA graphs without compiling: seconds to its first token, each step
slower), while one background thread runs a short warm-up ``generate`` of that bucket on the
inductor Capture, which compiles it and records its graphs. The first call that starts after the
warm-up has finished runs compiled. Both are the same lossless step: only the speed differs.

Why the two may run at once, and where they may not:
  - The two Captures share the model's weights only (read by both): each has its own KV cache,
    static buffers, draft sessions, pinned readback buffers and lock. The uncompiled one is the
    FastStart's own and is let go (its second KV cache and CUDA graphs freed) once every bucket it
    served runs compiled; a later new bucket makes it again (its graph from the capture cache).
  - Tracing is process-wide: fx's tracer (under torch.export and AOTAutograd) patches
    ``nn.Module.__call__`` and ``__getattr__`` for every thread while it traces, and torch.export's
    pre-dispatch mode stack is global. So the worker holds ``capture.TRACE_LOCK`` for a warm-up, a
    capture (torch.export) takes it, and so does every serving call that may run a module eagerly.
    A SpecModel without a fast start takes it too for a bucket's first call (it compiles): two
    compiles at once in one process are not safe. With the capture cache on, the worker loads the
    graphs the serving thread captured (from a node table: nothing traced) and exports nothing, so
    the user's own eager module calls in other threads run safely beside it (its AOTAutograd trace
    passes foreign modules' calls through); where it must export (cache off, policy "cost") they are
    not safe until ``wait_compiled()`` (torch.export also swaps fake tensors into the modules while
    it traces), nor is the user's own torch.compile in another thread while the worker compiles.
    Inductor's own first trace with fx's plain tracer (a tiny function, once a process) is made in the
    serving thread before the worker starts (``trace_inductors_own_graph``).
    A served call runs no module once its bucket's CUDA graphs are recorded (every part is a
    replay): after a bucket's first call serves uncompiled, one more short call records the rest
    (the prefill chunk, the first propose), and from then on its calls run beside the worker. On
    a CPU (no CUDA graphs) every uncompiled call waits for the worker's warm-up instead.
  - CUDA graphs are recorded with ``capture_error_mode="thread_local"`` on a stream of the recording
    thread (``graphed.py``), so the worker's recording is not broken by the serving thread's replays,
    syncs and allocations. The worker warms a bucket up twice (the second call records what the first
    warmed up), so the serving thread never records a compiled bucket; it launches on its own stream
    and finishes it before it marks a bucket ready. A recording marks the device's default generator as
    capturing for every thread, so recording and replay take turns (``graphed._GENERATOR``): a serving
    thread's unseeded sampling replays draw from that generator.
  - While the worker runs, the interpreter switches threads every 0.05 ms instead of 5: the serving
    loop needs the GIL a few times a step and waits up to an interval behind the compiler each time
    (on the H200 a cold process's first 10 calls ran at 205 tok/s with 0.5 ms, 965 with 0.05 ms,
    the compile no slower; docs/benchmarks.md).

At interpreter exit the queued warm-ups are dropped and the running one is waited for (a daemon
thread stopped inside inductor's compile may abort the process); inductor then fails it quickly
(it cannot register its atexit hooks), which is logged at debug level only.

A warm-up that fails is logged and its bucket keeps serving uncompiled (the cache costs speed, never
the call). ``SpecModel.warmup`` compiles in the foreground and marks what it compiled ready.
Unseeded sampled calls served meanwhile stay exact in distribution, but the worker's warm-up draws
from the same global generator: pass ``seed=`` for sampling that repeats.
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import queue
import sys
import threading
import weakref
from typing import Callable, Hashable

import torch

from ..capture import TRACE_LOCK
from .generate import cuda_graphs_on

log = logging.getLogger(__name__)

SWITCH_INTERVAL_S = 5e-5  # while the worker compiles (the interpreter's default: 5 ms)
_LIVE: "weakref.WeakSet[FastStart]" = weakref.WeakSet()


@atexit.register
def _drain_all() -> None:
    for fast_start in list(_LIVE):
        fast_start.drain()


def trace_inductors_own_graph() -> None:
    """Inductor symbolically traces one tiny function of its own the first time a process lowers a graph
    (``torch._inductor.loop_body.InterpreterShim._dummy_gm``, cached). fx's plain tracer patches
    ``nn.Module.__call__`` for every thread while it traces, so made by the worker it broke the user's own
    module calls in another thread ("module is not installed as a submodule", an H100 run of HF's generate
    beside the default fast start). Made here, in the calling thread under TRACE_LOCK, once a process. A torch
    without it traces nothing of the kind."""
    try:
        from torch._inductor.loop_body import InterpreterShim
        made = InterpreterShim._dummy_gm
    except (ImportError, AttributeError):
        return
    if getattr(made, "cache_info", None) is None or made.cache_info().currsize:
        return
    with TRACE_LOCK:
        made()


class FastStart:
    """Which Capture serves a bucket, and how. ``serving(key)``: ``compiled`` once the bucket's background
    warm-up has finished, ``fast`` (backend="cudagraphs") until then; ``guard(key)``: what a call on
    ``fast`` holds (``TRACE_LOCK`` until the bucket runs as replays only); ``after_call(key, warm)``:
    after a call served uncompiled, record the rest of its graphs and queue ``warm(compiled)``."""

    def __init__(self, make_fast: Callable[[], object], compiled):
        self._make_fast, self._fast, self.compiled = make_fast, None, compiled
        self.ready: set[Hashable] = set()
        self.failed: set[Hashable] = set()
        self.replaying: set[Hashable] = set()  # fast buckets whose calls are CUDA-graph replays only
        self._queued: set[Hashable] = set()
        self._jobs: queue.Queue = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()
        self._worker: threading.Thread | None = None
        self._lock = threading.Lock()  # guards _queued, _worker, _fast and the switch interval
        self._closing = False  # at interpreter exit a warm-up fails (inductor cannot register atexit then)
        _LIVE.add(self)

    @property
    def fast(self):
        """The uncompiled Capture: made on first use, let go once every bucket it served runs compiled
        (its KV cache and CUDA graphs are a second copy; a later new bucket makes it again)."""
        with self._lock:
            if self._fast is None:
                self._fast = self._make_fast()
            return self._fast

    def serving(self, key: Hashable):
        """The Capture to run this call on."""
        return self.compiled if key in self.ready else self.fast

    def guard(self, key: Hashable):
        """What a call of ``key`` on ``fast`` holds while it runs (after ``fast.lock``)."""
        return contextlib.nullcontext() if key in self.replaying else TRACE_LOCK

    def after_call(self, key: Hashable, warm: Callable[[object], object], record_fast: bool = True) -> None:
        """After a call of ``key`` served uncompiled (``record_fast``; or a bucket queued beside it): on CUDA,
        one more short call on ``fast`` records the graphs its first call only warmed up (from then on it
        replays beside the worker); then queue ``warm(compiled)`` for the worker, unless done, queued or
        failed already."""
        if key in self.ready or key in self._queued or key in self.failed:
            return
        if record_fast and self.compiled.kv_device.type == "cuda" and cuda_graphs_on(self.compiled.kv_device):
            fast = self.fast
            with fast.lock, TRACE_LOCK:
                warm(fast)
            with self._lock:
                if self._fast is fast:  # not let go meanwhile (a new one has recorded nothing: calls take TRACE_LOCK)
                    self.replaying.add(key)
        trace_inductors_own_graph()
        with self._lock:
            self._queued.add(key)
            self._idle.clear()
            self._jobs.put((key, warm))
            if self._worker is None:
                log.info("calls run uncompiled while inductor compiles in the background (SpecModel.wait_compiled() "
                         "waits for it; compile(..., fast_start=False) compiles before the first token instead)")
                self._switch = sys.getswitchinterval()
                sys.setswitchinterval(min(self._switch, SWITCH_INTERVAL_S))
                self._worker = threading.Thread(target=self._work, name="specgraph-compile", daemon=True)
                self._worker.start()

    def mark_ready(self, key: Hashable) -> None:
        """``key`` was compiled on ``compiled`` in the foreground (``SpecModel.warmup``)."""
        self.ready.add(key)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every queued warm-up has finished (True) or ``timeout`` seconds passed (False)."""
        return self._idle.wait(timeout)

    def drain(self) -> None:
        """Drop the queued warm-ups and wait for the running one (called at interpreter exit)."""
        self._closing = True
        with self._lock:
            while not self._jobs.empty():
                self._jobs.get_nowait()
            worker = self._worker
        if worker is not None:
            worker.join()

    def _work(self) -> None:
        device = self.compiled.kv_device
        stream = None
        if device.type == "cuda":  # a thread's current device and stream are its own
            torch.cuda.set_device(device)
            stream = torch.cuda.Stream(device)
        with torch.no_grad(), (torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()):
            while True:
                try:
                    key, warm = self._jobs.get(timeout=0.1)
                except queue.Empty:
                    with self._lock:
                        if self._jobs.empty():  # nothing came in meanwhile: stop, and give the GIL back its pace
                            if not self.failed:  # every bucket served uncompiled runs compiled now
                                self._fast = None
                                self.replaying.clear()
                            self._worker = None
                            sys.setswitchinterval(self._switch)
                            self._idle.set()
                            return
                    continue
                try:
                    with self.compiled.lock, TRACE_LOCK:  # that order, as a serving call takes them
                        for _ in range(2):  # the second records what the first compiled and warmed up (prefill
                            warm(self.compiled)  # chunk, first propose): the serving thread then only replays
                    if stream is not None:
                        stream.synchronize()
                    self.ready.add(key)
                    log.info("compiled in the background: %s (the next call of it runs compiled)", key)
                except Exception as err:  # noqa: BLE001  (serving goes on uncompiled; the call never fails for it)
                    self.failed.add(key)
                    report = log.debug if self._closing else log.warning
                    report("background compile of %s failed (%s: %s); that bucket keeps running uncompiled",
                           key, type(err).__name__, err)
