"""Captured steps kept on disk: a new process skips torch.export and the passes.

A captured bucket (``capture.CapturedStep``) is the exported step rewritten by the pass pipeline:
a flat ``torch.fx.GraphModule`` whose state (parameters, buffers, the KV cache) is passed in by
position. What is kept is the graph, node by node (``_graph_rows``), and, for that state, where each
tensor comes from:

  - a tensor of the exported module (``capture.TreeStep``: the model's parameters and buffers, the
    KV cache) by its qualified name, looked up again on the live model;
  - a buffer a pass registered on the graph as a view of state (``fuse_projections``' joined
    weights) by (state index, storage offset, size, stride), rebuilt over the live storage;
  - anything else (a constant torch.export lifted) by value.

The key covers what the graph depends on: specgraph's and the model class's source, every submodule's
class (its file's digest) and the callables a module instance keeps (``code_fingerprint``; a model with
forward hooks or a closure kept on a module is never cached: the key could not tell it apart), torch and
transformers versions, the model's config, the bucket, every state tensor's shape, dtype, stride and
storage layout (the passes read the layout ``pack_projections`` made, never the values), the device
with its index (an exported graph names it) and the settings. Whatever changes, the key does, and
the step is captured afresh. Files are written atomically; one that cannot be read is ignored and
rewritten; the ``KEEP`` most recently used stay. ``config.capture_cache``
(``SPECGRAPH_CAPTURE_CACHE=0``) turns it off. A graph always goes through the same save / load
round trip when the cache is on, so a cold and a warm process run the same code (and hit the same
inductor cache entries).

The graph is kept as a table of nodes (op, name, target, arguments), not as a pickled GraphModule:
unpickling one re-traces its code with an fx Tracer, and fx patches ``nn.Module.__call__`` and
``__getattr__`` for every thread while it traces, so a load in a background compile (fast start)
broke the user's own eager module calls in other threads ("module is not installed as a
submodule"). Rebuilding the table traces nothing.
"""
from __future__ import annotations

import functools
import hashlib
import io
import json
import logging
import os
import pickle
import sys
import types
from pathlib import Path

import torch
import transformers

from . import config
from .model_state import forward_hooks

log = logging.getLogger(__name__)
FORMAT = 3  # bump when what is stored changes
KEEP = 256  # files kept (the least recently used go): a few hundred kB each, and any code change makes new keys


def enabled(debug: bool | None, tp, model=None) -> bool:
    """On unless switched off, debugging (each pass's log and dumps are wanted), tensor-parallel (the
    graph holds a rank's collectives) or ``model`` runs code the key cannot name (``code_fingerprint``)."""
    if not config.capture_cache or debug or config.debug or config.dump is not None or tp is not None:
        return False
    blockers = code_fingerprint(model)[1] if model is not None else []
    if blockers:
        log.info("capture cache skipped (the trace would depend on code the key cannot name): %s", "; ".join(blockers))
    return not blockers


def code_fingerprint(model: torch.nn.Module) -> tuple[list, list[str]]:
    """What a trace of ``model`` runs besides its tensors, named so that another process can compare it:
    every submodule's class and its file's digest, and every callable a module instance holds (HF keeps
    some, e.g. a partial activation); and why it cannot be named: forward hooks (a steering hook's
    closure), a closure, lambda or bound method kept on a module (a patched ``forward``)."""
    parts, blockers = [], []
    if torch.nn.modules.module._global_forward_hooks or torch.nn.modules.module._global_forward_pre_hooks:
        blockers.append("global module forward hooks")
    for name, module in model.named_modules(remove_duplicate=False):
        cls = type(module)
        parts.append((name, f"{cls.__module__}.{cls.__qualname__}", file_digest(cls.__module__)))
        if forward_hooks(module):
            blockers.append(f"forward hooks on {name or 'the model'}")
        for attr, value in vars(module).items():
            if callable(value) and not isinstance(value, (torch.nn.Module, torch.Tensor, type)):
                ident = _callable_name(value)
                if ident is None:
                    blockers.append(f"{name or 'the model'}.{attr} = {value!r} (a closure, lambda or bound method)")
                else:
                    parts.append((name, attr, ident))
    return parts, blockers


def _callable_name(fn) -> list | None:
    """A callable kept on a module, named across processes (None: it cannot be)."""
    if isinstance(fn, functools.partial):
        inner = _callable_name(fn.func)
        return None if inner is None else ["partial", inner, repr(fn.args), repr(sorted(fn.keywords.items()))]
    if isinstance(fn, types.BuiltinFunctionType):
        return ["builtin", getattr(fn, "__module__", None), fn.__qualname__]
    if isinstance(fn, types.FunctionType) and fn.__closure__ is None and "<" not in fn.__qualname__:
        return [fn.__module__, fn.__qualname__, file_digest(fn.__module__ or "")]
    return None  # a closure, lambda, local function, bound method or callable object: its state is not in its name


@functools.cache
def _package_digest() -> str:
    """sha256 over specgraph's own source files: any code change makes new keys."""
    root, digest = Path(__file__).parent, hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


@functools.lru_cache(maxsize=None)
def file_digest(module_name: str) -> str:
    path = getattr(sys.modules.get(module_name), "__file__", None)
    return hashlib.sha256(Path(path).read_bytes()).hexdigest() if path and os.path.exists(path) else ""


def key(model, module: torch.nn.Module, batch: int, nodes: int, max_length: int, taps, logits_rows) -> str:
    """The cache key of one bucket of ``model`` (``module``: the TreeStep that would be exported)."""
    tensors = _named_tensors(module).items()
    storages: dict[int, int] = {}  # which tensors share a storage, numbered by first appearance
    layout = [(name, tuple(t.shape), tuple(t.stride()), t.storage_offset(), str(t.dtype),
               storages.setdefault(t.untyped_storage().data_ptr(), len(storages))) for name, t in tensors]
    device = next(model.parameters()).device
    settings = {k: sorted(v) if isinstance(v, frozenset) else str(v) for k, v in vars(config.settings()).items()
                if k not in ("gguf", "cache", "dump")}
    parts = dict(format=FORMAT, specgraph=_package_digest(), model_source=file_digest(type(model).__module__),
                 code=code_fingerprint(model)[0],
                 torch=torch.__version__, transformers=transformers.__version__, model=type(model).__name__,
                 config=_config_text(model.config), bucket=[batch, nodes, max_length],
                 taps=repr(taps), logits_rows=repr(logits_rows), layout=layout, device=str(device),
                 capability=torch.cuda.get_device_capability(device) if device.type == "cuda" else None,
                 settings=settings)
    return digest(parts)


def _config_text(model_config) -> str:
    """The config as the graph depends on it: where it was loaded from is left out (a model loaded from a
    converted copy or another folder captures the same graph)."""
    values = json.loads(model_config.to_json_string(use_diff=False))
    values.pop("_name_or_path", None)
    return json.dumps(values, sort_keys=True)


def digest(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _named_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``module`` by qualified name, tied ones under each of their names."""
    return dict([*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)])


def _path(cache_key: str) -> Path:
    return config.cache / "captures" / f"{cache_key}.pt"


def store(cache_key: str, graph: torch.fx.GraphModule, targets: list[str], state: list[torch.Tensor],
          module: torch.nn.Module, pass_results) -> tuple:
    """Write the bucket (``graph``'s node table, the sources of its state, ``targets[i]`` naming ``state[i]``,
    and the passes' counters) and return what a load of it gives: (graph, state, pass_results). A graph
    that cannot be kept, or a file that cannot be written, costs a later start its speed (logged), no
    more: the graph comes back as it was."""
    try:
        blob = _dumps(graph, targets, state, module, pass_results)
        loaded = _loads(blob, module, module.kv.device)
    except Exception as err:  # noqa: BLE001  (the cache may cost speed, never a compile)
        log.warning("capture cache: this graph cannot be kept (%s: %s)", type(err).__name__, err)
        return graph, state, pass_results
    write_kept(_path(cache_key), blob, "capture cache")
    return loaded


def write_kept(path: Path, blob: bytes, what: str) -> None:
    """``blob`` to ``path`` atomically; of the files with its suffix in its folder the ``KEEP`` most recently
    used stay. A file that cannot be written is logged, no more."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(blob)
        os.replace(tmp, path)
        others = sorted((p for p in path.parent.glob(f"*{path.suffix}") if p != path),
                        key=lambda p: p.stat().st_mtime)
        for old in others[: max(0, len(others) - (KEEP - 1))]:  # this one stays, whatever the clock says
            old.unlink(missing_ok=True)
    except OSError as err:
        log.warning("%s: not written (%s)", what, err)


def load(cache_key: str, module: torch.nn.Module) -> tuple | None:
    """(graph, state, pass_results) of the bucket, or None if it is not on disk or not readable."""
    path = _path(cache_key)
    if not path.exists():
        return None
    try:
        loaded = _loads(path.read_bytes(), module, module.kv.device)
        os.utime(path)  # recently used: kept the longest
        return loaded
    except Exception as err:  # noqa: BLE001  (a stale or torn file: capture afresh, and overwrite it)
        log.warning("capture cache: %s unreadable (%s: %s); capturing afresh", path.name, type(err).__name__, err)
        return None


def _dumps(graph, targets, state, module, pass_results) -> bytes:
    named = _named_tensors(module)
    sources = [("module", target) if target in named and same_tensor(named[target], tensor) else ("value", tensor.cpu())
               for target, tensor in zip(targets, state)]
    by_storage = {t.untyped_storage().data_ptr(): i for i, t in enumerate(state)}
    views, fused_from = {}, {}
    for name, buffer in graph.named_buffers():
        base = by_storage.get(buffer.untyped_storage().data_ptr())
        if base is None:
            raise TypeError(f"graph buffer {name} is no view of the step's state")
        views[name] = (base, buffer.storage_offset(), tuple(buffer.shape), tuple(buffer.stride()))
    for node in graph.graph.find_nodes(op="get_attr"):
        if node.target not in views:
            raise TypeError(f"get_attr {node.target}: not a buffer over the step's state")
        if "fused_from" in node.meta:  # export.py reads it to un-join the weights
            fused_from[node.target] = list(node.meta["fused_from"])
    rows = pickle.dumps(_graph_rows(graph.graph))
    counters = [(name, r.modified, dict(r.counters)) for name, r in pass_results]
    out = io.BytesIO()
    torch.save(dict(format=FORMAT, rows=rows, sources=sources, views=views, fused_from=fused_from,
                    counters=counters), out)
    return out.getvalue()


class _Ref:
    """A node's argument that is another node, by name."""
    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __reduce__(self):
        return _Ref, (self.name,)


def _graph_rows(graph: torch.fx.Graph) -> list[tuple]:
    """``graph`` as rows (op, name, target, args, kwargs) that pickle without the graph: an operator by
    (namespace, name, overload), a node argument as a ``_Ref``. Flat graphs only (no submodules)."""
    if type(graph._codegen) is not torch.fx.graph.CodeGen:
        raise TypeError(f"graph with {type(graph._codegen).__name__}: only plain CodeGen graphs are kept")
    rows, refs = [], functools.partial(torch.fx.node.map_arg, fn=lambda n: _Ref(n.name))
    for node in graph.nodes:
        target = node.target
        if node.op == "call_module" or isinstance(target, torch._ops.HigherOrderOperator):
            raise TypeError(f"{node.format_node()}: a graph with submodules is not kept")
        if isinstance(target, torch._ops.OpOverload):
            target = ("op", target.namespace, target._opname, target._overloadname)
        elif isinstance(target, torch._ops.OpOverloadPacket):
            target = ("packet", *target._qualified_op_name.split("::"))
        elif node.op == "call_function":
            target = ("fn", target)  # by reference (operator.getitem): pickle checks it
        rows.append((node.op, node.name, target, refs(node.args), refs(node.kwargs)))
    return rows


def _graph_of(rows: list[tuple], views: dict) -> torch.fx.GraphModule:
    """The GraphModule of ``_graph_rows``; its ``get_attr`` targets (``views``) stand in empty until the
    caller registers them. Nothing is traced."""
    graph, nodes = torch.fx.Graph(), {}

    def node_of(value):
        return nodes[value.name] if isinstance(value, _Ref) else value

    for op, name, target, args, kwargs in rows:
        if isinstance(target, tuple):
            kind, *where = target
            if kind == "fn":
                target = where[0]
            else:
                packet = getattr(getattr(torch.ops, where[0]), where[1])
                target = getattr(packet, where[2]) if kind == "op" else packet
        args = torch.fx.node.map_aggregate(args, node_of)
        kwargs = torch.fx.node.map_aggregate(kwargs, node_of)
        nodes[name] = graph.create_node(op, target, args, kwargs, name=name)
        if nodes[name].name != name:
            raise ValueError(f"node {name} came back as {nodes[name].name}")
    return torch.fx.GraphModule({name: torch.empty(0) for name in views}, graph)


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same tensor, maybe through another Python object (export's state dict holds its own)."""
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride()


def _loads(blob: bytes, module, device) -> tuple:
    from .passes.pass_result import PassResult

    stored = torch.load(io.BytesIO(blob), weights_only=False)
    if stored["format"] != FORMAT:
        raise ValueError(f"format {stored['format']} != {FORMAT}")
    named = _named_tensors(module)
    state = [named[ref] if kind == "module" else ref.to(device) for kind, ref in stored["sources"]]
    graph = _graph_of(pickle.loads(stored["rows"]), stored["views"])
    for name, (base, offset, size, stride) in stored["views"].items():
        graph.register_buffer(name, torch.as_strided(state[base], size, stride, offset), persistent=False)
    for node in graph.graph.find_nodes(op="get_attr"):
        if node.target in stored["fused_from"]:
            node.meta["fused_from"] = stored["fused_from"][node.target]
    pass_results = [(name, PassResult(graph, modified, counters)) for name, modified, counters in stored["counters"]]
    return graph, state, pass_results
