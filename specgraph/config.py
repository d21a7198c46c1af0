"""specgraph's settings: one typed field each, read from the environment once (at first use).

The only module of specgraph that reads ``os.environ``. Read a setting as an
attribute (``config.debug``); tests and benchmarks change settings for a
block with ``config.patch(debug=True)``, never through the environment, which
is read once. Each field names its variable (``SPECGRAPH_<NAME>``) and says
what it does; docs/api.md lists the user-facing ones, docs/design.md the
developer knobs.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .errors import SettingError


def _flag(name: str, text: str) -> bool:
    if text not in ("0", "1"):
        raise SettingError(f"{name}={text!r}: use 1 (on) or 0 (off)")
    return text == "1"


def _auto_flag(name: str, text: str) -> bool | None:
    if text == "auto":
        return None
    if text not in ("0", "1"):
        raise SettingError(f"{name}={text!r}: use auto (the default), 1 (on) or 0 (off)")
    return text == "1"


def _names(name: str, text: str) -> frozenset[str]:
    return frozenset(n.strip() for n in text.split(",") if n.strip())


PDL_MODES = ("off", "on", "prefetch")


def _pdl_mode(name: str, text: str) -> str:
    if text not in PDL_MODES:
        raise SettingError(f"{name}={text!r}: use one of {', '.join(PDL_MODES)}")
    return text


def _path(name: str, text: str) -> Path:
    return Path(text).expanduser()


def _setting(default, parse, doc: str, developer: bool = False, factory=None):
    """A field whose variable is ``SPECGRAPH_<NAME>``, parsed by ``parse(variable, text)``."""
    meta = dict(parse=parse, doc=doc, developer=developer)
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class Settings:
    """Every setting with its default; ``from_environ`` fills them from the variables that are set."""

    gguf: Path | None = _setting(None, _path, "GGUF file used instead of the embedded SmolLM2")
    cache: Path = _setting(None, _path, "where gemma3_gguf assembles its file and load_gguf keeps converted "
                           "models", factory=lambda: Path.home() / ".cache" / "specgraph")
    capture_cache: bool = _setting(True, _flag, "keep each captured step (the exported graph after the passes) "
                                   "under <cache>/captures, so that a new process skips torch.export and the "
                                   "passes, and each compiled frame of a bucket under <cache>/compiled, so that "
                                   "it skips dynamo's tracing (0: capture and trace every time)")
    cuda_graphs: bool = _setting(True, _flag, "inductor and cudagraphs backends on CUDA: replay the whole step "
                                 "as one hand-recorded CUDA graph (0: no graphs)")
    overlap: bool | None = _setting(None, _auto_flag, "launch step k+1 before reading step k's tokens "
                                    "(same outputs); None (auto): on for CUDA")
    whole_step: bool = _setting(True, _flag, "inductor backend: compile the whole step as one graph "
                                "(0: the target bucket alone, the rest eager; a fallback for inductor bugs)")
    debug: bool = _setting(False, _flag, "check the graph invariants after every pass, log each pass's "
                           "counters and what it left unfolded, keep torch.fx stack traces")
    dump: Path | None = _setting(None, _path, "directory for each pass's graph before and after, as text")
    check_graph: bool = _setting(False, _flag, "check the graph invariants (passes/invariants.py) after every "
                                 "pass; on in the tests, and with debug", developer=True)
    skip_passes: frozenset[str] = _setting(frozenset(), _names, "speed-up passes to leave out (comma-separated; "
                                           "A/B runs, bisection)", developer=True)
    skip_fast_paths: frozenset[str] = _setting(frozenset(), _names, "draft-side fast paths to switch off "
                                               "(comma-separated; specgraph/fast_paths.py)", developer=True)
    reference_kernels: bool = _setting(False, _flag, "CUDA: plain-torch tree_attention and fused_linear instead "
                                       "of the Triton kernels (bisection)", developer=True)

    pdl: str = _setting("prefetch", _pdl_mode, "CUDA, Hopper and later: launch fused_linear and tree attention "
                        "with programmatic dependent launch, each kernel waiting in-kernel for the one before (on), "
                        "and with fused_linear asking L2 for its first weight lines before it waits (prefetch, the "
                        "fastest measured end to end: docs/benchmarks.md); off: plain launches", developer=True)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> Settings:
        """The settings ``environ`` gives (unset or empty: the default); a bad value is refused naming
        its variable and what it accepts."""
        values = {}
        for f in dataclasses.fields(cls):
            name = variable(f.name)
            text = environ.get(name, "").strip()
            if text:
                values[f.name] = f.metadata["parse"](name, text)
        return cls(**values)


def variable(name: str) -> str:
    """The environment variable of setting ``name``."""
    return f"SPECGRAPH_{name.upper()}"


FIELDS = {f.name: f for f in dataclasses.fields(Settings)}
_current: Settings | None = None


def settings() -> Settings:
    """The settings in force: the environment's, read on the first call, as ``patch`` changes them."""
    global _current
    if _current is None:
        _current = Settings.from_environ(os.environ)
    return _current


def __getattr__(name: str):
    if name in FIELDS:
        return getattr(settings(), name)
    raise AttributeError(f"specgraph.config has no setting {name!r}; settings: {', '.join(FIELDS)}")


def _checked(name: str, value):
    """``value`` as setting ``name`` holds it (a set of names from a comma string or an iterable)."""
    if name not in FIELDS:
        raise TypeError(f"config.patch({name}=...): no such setting; settings: {', '.join(FIELDS)}")
    if name in ("skip_passes", "skip_fast_paths"):
        return _names(name, value) if isinstance(value, str) else frozenset(value)
    if name in ("gguf", "cache", "dump") and value is not None:
        return Path(value)
    if name == "overlap" and value is not None and not isinstance(value, bool):
        raise TypeError(f"config.patch(overlap={value!r}): True, False or None (auto)")
    if name == "pdl" and value not in PDL_MODES:
        raise TypeError(f"config.patch(pdl={value!r}): one of {', '.join(PDL_MODES)}")
    if FIELDS[name].type == "bool" and not isinstance(value, bool):
        raise TypeError(f"config.patch({name}={value!r}): True or False")
    return value


@contextlib.contextmanager
def patch(**overrides):
    """Change settings for the ``with`` block (tests, benchmarks); the previous ones come back after."""
    global _current
    before = settings()
    _current = dataclasses.replace(before, **{k: _checked(k, v) for k, v in overrides.items()})
    try:
        yield _current
    finally:
        _current = before
