"""Compiled frames kept on disk: a new process skips dynamo's tracing of the step.

With the capture cache a warm process no longer exports the target, but ``torch.compile`` still
traces every compiled frame (the decode step, the first propose, the draft's pass over the prompt)
with dynamo in every process: most of a warm process's first ``generate`` (docs/benchmarks.md, time
to first token). Dynamo's precompile (``torch.compile(fn).aot_compile``) keeps a traced and
compiled frame as bytes: its bytecode and its backend's compiled graph. ``compile_frame(method,
key)`` returns a callable that on its first call loads the frame kept under ``key``, or compiles it
ahead of time and keeps it, then runs it.

How, and why so:
  - The frame compiled is the method's *function*, with its object passed as the first argument on
    every call: the kept bytes then hold no object of the session (a bound method would be pickled
    with its object, whose tensors a loaded frame would read instead of the live ones). The function
    itself travels as external data (``own_code`` clones cannot be pickled by reference).
  - No guards are kept (``guard_filter_fn`` drops them; a GraphModule's class cannot be pickled for
    them either): a bucket's frame is only ever called with the inputs it was built for, which its
    CUDA-graph replay assumes already, and what it depends on is in the key instead — its target
    bucket's capture-cache key (specgraph's source, versions, model config and layout, device,
    settings) and the frame's own description (the tree, the draft's class, source, tensor shapes
    and settings, the sampling rule).
  - A fresh compile runs the same ahead-of-time artifact a loaded one is, so a cold and a warm
    process run the same code.
  - Any failure (a torch without ``aot_compile``, a frame that cannot be kept, a torn file) falls
    back to plain ``torch.compile`` with a warning: the cache costs speed, never a compile.

On wherever the target bucket is in the capture cache (``SPECGRAPH_CAPTURE_CACHE=0`` turns both
off); files under ``<cache>/compiled``, the ``capture_cache.KEEP`` most recently used kept.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Callable

import torch

from . import capture_cache, config

log = logging.getLogger(__name__)


def key(target_key: str | None, frame: str, **parts) -> str | None:
    """The file key of ``frame`` (a name) compiled over the target bucket whose capture-cache key is
    ``target_key`` (it covers specgraph's source, the versions, the model, its config and layout, the
    device and the settings), described by ``parts`` (JSON-able values, or objects such as the draft:
    ``describe``); None where the bucket is not cached (the capture cache off, debugging, TP)."""
    if target_key is None:
        return None
    return capture_cache.digest(dict(target=target_key, frame=frame,
                                     parts={name: _plain(value) for name, value in parts.items()}))


def _plain(value):
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return describe(value)


def describe(obj) -> dict:
    """An object (a draft) by what compiled code can depend on: its class and that class's source, its
    tensors' names, shapes and dtypes, and the plain attributes of it and of every submodule (numbers,
    strings, configs: a norm's eps is a constant of the graph); tensor values are read at run time, never
    kept. An attribute whose repr names an address is left out (its key would never match again)."""
    cls = type(obj)
    parts = [("", obj)]
    tensors = {}
    if isinstance(obj, torch.nn.Module):
        parts = list(obj.named_modules(remove_duplicate=False))
        named = [*obj.named_parameters(remove_duplicate=False), *obj.named_buffers(remove_duplicate=False)]
        tensors = {name: [list(t.shape), str(t.dtype)] for name, t in named}
    plain = {}
    for prefix, part in parts:
        for name, value in sorted(vars(part).items()):
            qualified = f"{prefix}.{name}" if prefix else name  # as named_parameters spells it
            if isinstance(value, torch.Tensor):
                tensors.setdefault(qualified, [list(value.shape), str(value.dtype)])
            elif not name.startswith("_") and not isinstance(value, torch.nn.Module):
                text = value if isinstance(value, (bool, int, float, str, type(None))) else repr(value)
                if " at 0x" not in str(text):
                    plain[qualified] = text
    return dict(cls=f"{cls.__module__}.{cls.__qualname__}", source=capture_cache.file_digest(cls.__module__),
                tensors=tensors, plain=plain)


def _path(cache_key: str) -> Path:
    return config.cache / "compiled" / f"{cache_key}.bin"


def _no_guards(entries) -> list[bool]:
    return [False] * len(entries)


def compile_frame(method, cache_key: str | None, name: str) -> Callable:
    """``torch.compile(method, fullgraph=True, dynamic=False)``; with a ``cache_key``, compiled ahead of
    time and kept (``method``: a bound method)."""
    if cache_key is None:
        return torch.compile(method, fullgraph=True, dynamic=False)
    return _Kept(method.__self__, method.__func__, cache_key, name)


class _Kept:
    """The frame of ``func(owner, *args)``, loaded or compiled on the first call."""

    def __init__(self, owner, func, cache_key: str, name: str):
        self.owner, self.func, self.key, self.name = owner, func, cache_key, name
        self.fn: Callable | None = None  # takes (owner, *args)

    def __call__(self, *args):
        if self.fn is None:
            self.fn = self._load() or self._compile(args)
        return self.fn(self.owner, *args)

    def _load(self) -> Callable | None:
        path = _path(self.key)
        if not path.exists():
            return None
        start = time.perf_counter()
        try:
            from torch._dynamo.aot_compile import AOTCompiledFunction

            loaded = AOTCompiledFunction.deserialize(path.read_bytes(), f_globals=self.func.__globals__,
                                                     external_closure_data={"fn": self.func})
            loaded.disable_guard_check()
        except Exception as err:  # noqa: BLE001  (a stale or torn file: compile afresh, and overwrite it)
            log.warning("compiled-frame cache: %s unreadable (%s: %s); compiling afresh", path.name,
                        type(err).__name__, err)
            return None
        path.touch()  # recently used: kept the longest
        log.info("%s loaded from the compiled-frame cache in %.1f s", self.name, time.perf_counter() - start)
        return loaded

    def _compile(self, args) -> Callable:
        try:
            with torch._dynamo.config.patch(enable_aot_compile=True):  # off by default before torch 2.13
                compiled = torch.compile(self.func, fullgraph=True, dynamic=False,
                                         options={"guard_filter_fn": _no_guards})
            ahead = compiled.aot_compile(((self.owner, *args), {}))
            ahead.disable_guard_check()
        except Exception as err:  # noqa: BLE001  (an older torch, or a frame precompile cannot take)
            log.warning("compiled-frame cache: %s not compiled ahead of time (%s: %s); compiling it the usual "
                        "way", self.name, type(err).__name__, err)
            return torch.compile(self.func, fullgraph=True, dynamic=False)
        try:
            blob = type(ahead).serialize(ahead, external_data={"fn": self.func}).serialized_data
            capture_cache.write_kept(_path(self.key), blob, "compiled-frame cache")
        except Exception as err:  # noqa: BLE001  (kept or not, this process runs the compiled frame)
            log.warning("compiled-frame cache: %s not kept (%s: %s)", self.name, type(err).__name__, err)
        return ahead
