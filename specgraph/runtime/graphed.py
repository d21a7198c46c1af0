"""The compiled decode step with its carried state in static buffers, replayed as one CUDA graph.

torch.compile's own CUDA graphs (``mode="reduce-overhead"``, CUDA-graph trees) cost host time on
every step: dynamo checks its guards over every input (the target's weights are graph inputs),
the trees check the address of every static input, and each output and each piece of session
state the step reassigns is cloned out of the graph's pool. ``StaticStep`` records the compiled
step once (by hand, ``torch.cuda.CUDAGraph``), together with the copies that carry its results
into the next step's inputs:

    replay:  out = step(tree*, cache_len*, active*)                  (* static buffers)
             session.<state>* <- the state the step reassigned        (in place, in the graph)
             cache_len* <- out.cache_len;  tree* <- out.next_tree
             emitted, accept_len (and scores, logits if kept): outputs in the graph's pool, valid
             until the next replay

The decode step makes those copies itself, inside its compiled frame (``DecodeStep.carried``), where
they fuse into the kernels that produce the values; ``StaticStep`` copies only what a step hands back
outside its buffers (``copies_after_step``: 0 for ``carried``).

On the host a step is then: copy in whatever input is not already the static buffer (the host
loop's ``active``; a new call's prefilled session state and first tree), one replay, one read.
The replay runs no guards: everything host-side the compiled step depends on (the session's
Python attributes, shapes) must stay fixed for the life of the bucket, as it does for every
session (prefill reassigns tensors only, and those are copied into the static buffers).

Without CUDA graphs (CPU; ``SPECGRAPH_CUDA_GRAPHS=0``) the same object runs the compiled step
eagerly each call, with the same in-place state handling, so the CPU tests exercise it.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Callable

import torch

from ..trees import Tree
from .step import TREE_TENSORS, StepOut, session_state


def _copy_in(static: torch.Tensor, value: torch.Tensor, what: str, owner: str = "the decode step") -> None:
    if static.shape != value.shape or static.dtype != value.dtype:
        raise RuntimeError(f"{what}: {owner} was recorded for {tuple(static.shape)} {static.dtype}, "
                           f"got {tuple(value.shape)} {value.dtype}")
    static.copy_(value)


_thread = threading.local()
# A recording marks the device's default CUDA generator as capturing for every thread, and a replay of a
# graph that draws random numbers (unseeded sampling) advances that generator: done by another thread
# meanwhile it raises "Offset increment outside graph capture". Recording and replay take turns.
_GENERATOR = threading.Lock()


def drawing_turn() -> threading.Lock:
    """Held around eager draws from the default generator (a call's first token, sampled without a seed), which
    must not run while another thread records a graph, as replays that draw."""
    return _GENERATOR


def _capture_stream() -> torch.cuda.Stream:
    """The stream this thread records CUDA graphs on (torch.cuda.graph's default is one stream for all)."""
    if getattr(_thread, "stream", None) is None:
        _thread.stream = torch.cuda.Stream()
    return _thread.stream


def _run_recorded(owner, body: Callable, first: bool):
    """``body()`` as a CUDA graph kept on ``owner`` (its ``graph``, ``outputs``, ``recordings``): the
    first call is a warm-up (it compiles, autotunes and is a real call) on a side stream, as capture
    needs; the second records, and since recording runs nothing, replays once; later calls replay."""
    if owner.graph is not None:
        with _GENERATOR:
            owner.graph.replay()
        return owner.outputs
    if first:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out = body()
        torch.cuda.current_stream().wait_stream(side)
        return out
    graph = torch.cuda.CUDAGraph()
    # this thread's own capture stream, and errors for unsafe calls from this thread only: a background
    # compile (runtime/fast_start.py) may launch, sync and allocate meanwhile
    with _GENERATOR:
        with torch.cuda.graph(graph, stream=_capture_stream(), capture_error_mode="thread_local"):
            owner.outputs = body()
        graph.replay()
    owner.graph = graph
    owner.recordings += 1
    return owner.outputs


class StaticStep:
    """``run(tree, cache_len, active) -> StepOut`` over static buffers; see the module docstring.

    ``fn``: the (compiled) ``DecodeStep.__call__``; ``session``: the draft session it reads and
    reassigns; ``cuda_graph``: warm up on the first call, record on the second, replay after.
    The returned ``cache_len`` and ``next_tree`` are the static buffers themselves (feeding them
    back costs nothing); ``emitted`` and ``accept_len`` are valid until the next call."""

    def __init__(self, fn: Callable[..., StepOut], session, cuda_graph: bool):
        self.fn, self.session, self.cuda_graph = fn, session, cuda_graph
        self.graph: torch.cuda.CUDAGraph | None = None
        # the session's tensors, adopted as static: (owner, attribute) -> buffer, owners from state_owners()
        self.state: dict[tuple[object, str], torch.Tensor] | None = None
        self.recordings = 0  # CUDA graphs recorded (1 for the life of the bucket)
        self.copies_after_step = 0  # copies the last step left to the recording (a launch each in a CUDA graph)

    def _bind(self, tree: Tree, cache_len: torch.Tensor, active: torch.Tensor) -> None:
        self.state = {(owner, name): value for owner, name, value in session_state(self.session)}
        self.tree = dataclasses.replace(tree, **{name: getattr(tree, name).clone() for name in TREE_TENSORS})
        self.cache_len, self.active = cache_len.clone(), active.clone()

    def _load(self, tree: Tree, cache_len: torch.Tensor, active: torch.Tensor) -> None:
        """Copy every input that is not its static buffer into it (session state reassigned on the host
        since the last step: prefill)."""
        for (owner, name), static in self.state.items():
            value = getattr(owner, name)
            if value is not static:
                where = "session" if owner is self.session else f"session.{type(owner).__name__}"
                _copy_in(static, value, f"{where}.{name}")
                setattr(owner, name, static)
        if tree is not self.tree:
            if tree.max_depth != self.tree.max_depth:
                raise RuntimeError(f"tree.max_depth: the decode step was recorded for {self.tree.max_depth}, "
                                   f"got {tree.max_depth}")
            for name in TREE_TENSORS:
                _copy_in(getattr(self.tree, name), getattr(tree, name), f"tree.{name}")
        for static, value, what in ((self.cache_len, cache_len, "cache_len"), (self.active, active, "active")):
            if value is not static:
                _copy_in(static, value, what)

    def _body(self) -> tuple[torch.Tensor | None, ...]:
        """One step and the copies that carry it into the next: the part a CUDA graph records. A step that
        wrote its results over its inputs itself (``DecodeStep.carried``) leaves no copy to make here."""
        out = self.fn(self.tree, self.cache_len, self.active)
        copies = [(static, getattr(owner, name)) for (owner, name), static in self.state.items()]
        for (owner, name), static in self.state.items():
            if getattr(owner, name) is not static:  # the step reassigned it: back into the static buffer
                setattr(owner, name, static)
        copies.append((self.cache_len, out.cache_len))
        self.next_tree = out.next_tree is not None  # the draft proposes inside the step
        if self.next_tree:
            copies += [(getattr(self.tree, name), getattr(out.next_tree, name)) for name in TREE_TENSORS]
        copies = [(static, value) for static, value in copies if value is not static]
        for static, value in copies:
            static.copy_(value)
        self.copies_after_step = len(copies)
        return out.emitted, out.accept_len, out.scores, out.logits, out.path_rank, out.confidence

    def __call__(self, tree: Tree, cache_len: torch.Tensor, active: torch.Tensor) -> StepOut:
        first = self.state is None
        if first:
            self._bind(tree, cache_len, active)
        self._load(tree, cache_len, active)
        out = _run_recorded(self, self._body, first) if self.cuda_graph else self._body()
        emitted, accept_len, scores, logits, path_rank, confidence = out
        return StepOut(emitted, accept_len, self.cache_len, self.tree if self.next_tree else None, scores, logits,
                       path_rank, confidence)


class GraphedCall:
    """``fn(*inputs)`` over static input buffers, recorded as one CUDA graph: what ``generate`` runs
    once per call outside the step (the compiled prefill bucket, the EAGLE drafts' pass over the
    prompt, the first propose), whose kernels would otherwise be launched one by one from the host
    (~420 per SmolLM2 prefill chunk: 17.6 ms of host time under the H200 profiler).

    Inputs are tensors of fixed shape and dtype (copied into dense static buffers taken from the
    first call), or None (passed on as None every call). The output is whatever ``fn`` returns
    (tensors, in tuples, lists or dataclasses); with ``cuda_graph`` they are the graph's own
    tensors, overwritten by the next call: the caller copies what it keeps. ``cuda_graph``: warm up
    on the first call, record on the second, replay after; without it (CPU) ``fn`` runs on the
    static buffers each call, so the CPU tests exercise them."""

    def __init__(self, fn: Callable, cuda_graph: bool, name: str = "the graphed call"):
        self.fn, self.cuda_graph, self.name = fn, cuda_graph, name
        self.inputs: list[torch.Tensor] | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.recordings = 0

    def __call__(self, *args: torch.Tensor | None):
        first = self.inputs is None
        if first:
            self.inputs = [None if a is None else a.clone(memory_format=torch.contiguous_format) for a in args]
        else:
            if len(args) != len(self.inputs):
                raise RuntimeError(f"{self.name} was recorded for {len(self.inputs)} inputs, got {len(args)}")
            for i, (static, value) in enumerate(zip(self.inputs, args)):
                if static is None or value is None:
                    if static is not value:
                        raise RuntimeError(f"input {i}: {self.name} was recorded with "
                                           f"{'None' if static is None else 'a tensor'} there")
                    continue
                _copy_in(static, value, f"input {i}", self.name)
        if not self.cuda_graph:
            return self.fn(*self.inputs)
        return _run_recorded(self, lambda: self.fn(*self.inputs), first)
