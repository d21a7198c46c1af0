"""Capture: the user's HF causal LM -> an exported tree-verify graph over a
specgraph-owned static KV cache.

The captured step takes
  input_ids [B, N]   the tree's tokens (node 0 = root)
  positions [B, N]   cache_len + depth (RoPE follows depth)
  cache_len [B]      committed length per row
  tree_mask [B, N]   ancestor-or-self bitmask per node
and returns logits [B, N, V]. Node i's K/V are written at slot
``cache_len + i`` of every layer. All caches live in one buffer
``kv [2L, B, H_kv, S_max, D]`` (K of layer l at 2l, V at 2l+1): the
tree_attention and compact_kv contracts.

How: ``torch.export`` (non-strict) of a wrapper that hands the model
``cache=`` (``past_key_values=`` on older 5.x) a duck-typed cache writing
into the buffer, and ``attention_mask=`` the dense tree mask made by the
``specgraph::tree_attention_mask`` op (a dict per layer type for models with
sliding-window layers: HF passes 4D masks through unchanged). The exported
graph is already a correct tree-verify graph with the model's own SDPA; the
passes then rewrite it (specgraph/passes/). HF's export helpers are not used
(feasibility §3: they freeze the cache as constants).
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import threading
import time
from dataclasses import dataclass

import torch

from . import capture_cache, compiled_cache, config, kernels  # noqa: F401  (kernels registers the specgraph ops)
from .errors import CompileError
from .kernels.bitmask import MAX_NODES
from .passes.fuse_projections import pack_projections
from .trees import chain_mask


log = logging.getLogger(__name__)
ALIBI_MODEL_TYPES = ("bloom",)  # ALiBi built into the architecture, no config flag to read
# tracing is process-wide (fx patches nn.Module.__call__ for every thread; torch.export's pre-dispatch mode stack
# is global): one thread traces at a time, and no other runs a module meanwhile (runtime/fast_start.py). Taken
# after a Capture's lock, never before it
TRACE_LOCK = threading.RLock()


@dataclass(frozen=True)
class TargetInfo:
    """What the passes need to know about the target, read from its config."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    layer_windows: tuple[int, ...]  # per layer: 0 = full attention, else the sliding window
    dtype: torch.dtype

    def narrow_windows(self, nodes: int) -> list[tuple[int, int]]:
        """(layer, window) of every sliding window too narrow for a tree of ``nodes`` nodes (a
        node's ancestors must lie inside its window)."""
        return [(i, w) for i, w in enumerate(self.layer_windows) if 0 < w < nodes]

    @classmethod
    def from_model(cls, model) -> "TargetInfo":
        config = getattr(model.config, "text_config", None) or model.config
        blockers = []
        if getattr(config, "is_encoder_decoder", False):
            blockers.append("encoder-decoder models are not causal decoders (cross-attention)")
        for flag in ("attn_logit_softcapping", "alibi", "use_alibi", "position_embedding_type"):
            value = getattr(config, flag, None)
            if value not in (None, False, "rope", "rotary"):
                blockers.append(f"config.{flag}={value!r}: attention with logit soft-capping, ALiBi or absolute-"
                                f"position variants is not tree_attention's contract")
        for rope_type in _rope_types(config):
            if "dynamic" in rope_type or rope_type == "longrope":
                blockers.append(f"rope_type={rope_type!r} recomputes the rotary frequencies from the sequence length "
                                f"as it runs; the captured step keeps one set: use a static rope_type ('default', "
                                f"'linear', 'yarn', 'llama3') in config.rope_parameters")
        if getattr(config, "model_type", None) in ALIBI_MODEL_TYPES:
            blockers.append(f"model_type={config.model_type!r} biases attention by position (ALiBi) without a config "
                            f"flag: not tree_attention's contract")
        if hasattr(model, "can_generate") and not model.can_generate():
            blockers.append(f"{type(model).__name__} is not a generative causal LM (model.can_generate() is False); "
                            f"load it with AutoModelForCausalLM")
        else:
            head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
            paths = [name for name, module in model.named_modules() if head is not None and module is head]
            if not isinstance(head, torch.nn.Linear) or not any(p.split(".")[-1] == "lm_head" for p in paths):
                blockers.append(f"the LM head is {paths[0] if paths else type(head).__name__!r}: the passes find the "
                                f"vocabulary projection as a Linear module named 'lm_head' (a causal LM's layout)")
        if getattr(config, "kv_lora_rank", None):
            blockers.append(f"config.kv_lora_rank={config.kv_lora_rank}: multi-head latent attention (DeepSeek-V2/V3) "
                            f"caches keys and values of different widths; tree_attention's cache has one head_dim")
        windows_on = getattr(config, "use_sliding_window", True) is not False  # Qwen2 carries a window it does not use
        layers = config.num_hidden_layers
        types = getattr(config, "layer_types", None) or ["full_attention"] * layers
        unknown = sorted({t for t in types if t not in ("full_attention", "sliding_attention")})
        if unknown:
            blockers.append(f"config.layer_types has {unknown}: only full and sliding attention layers are supported")
        window = int(getattr(config, "sliding_window", None) or 0) if windows_on else 0
        if window and "sliding_attention" not in types:  # Mistral-style: every layer slides
            types = ["sliding_attention"] * layers
        if blockers:
            raise CompileError(f"cannot capture {type(model).__name__}", blockers)
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        if getattr(config, "multi_query", False) and not getattr(config, "new_decoder_architecture", False):
            kv_heads = 1  # Falcon's multi-query layout: one K/V head, whatever its num_kv_heads field says
        tp = model.__dict__.get("_specgraph_tp")  # sharded by compile(tp=...): this rank's heads only
        if tp is not None:
            heads, kv_heads = heads // tp.world_size, kv_heads // tp.world_size
        return cls(
            num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
            vocab_size=config.vocab_size,
            layer_windows=tuple(window if t == "sliding_attention" else 0 for t in types),
            dtype=next(model.parameters()).dtype,
        )


def _rope_types(config) -> list[str]:
    """Every rope_type the config names (rope_parameters, or the older rope_scaling; per layer type too)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    tables = [v for v in params.values() if isinstance(v, dict)] or [params]  # {layer type: parameters} or one
    return [str(t.get("rope_type", t.get("type", "default"))) for t in tables]


class _TreeCache:
    """Duck-typed transformers Cache: writes node i of row b at slot cache_len[b] + i."""

    is_compileable = True

    def __init__(self, kv: torch.Tensor, slots: torch.Tensor):
        self.kv, self.slots = kv, slots  # kv [2L, B, H_kv, S_max, D]; slots [B, N]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # key_states, value_states: [B, H_kv, N, D]
        index = self.slots.view(self.slots.shape[0], 1, -1, 1).expand_as(key_states)
        keys = self.kv[2 * layer_idx].scatter_(2, index, key_states.to(self.kv.dtype))
        values = self.kv[2 * layer_idx + 1].scatter_(2, index, value_states.to(self.kv.dtype))
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are always passed explicitly


class TreeStep(torch.nn.Module):
    """The wrapper that is exported: one verify step of the target over a tree."""

    def __init__(self, model, info: TargetInfo, batch: int, max_length: int, kv: torch.Tensor | None = None):
        super().__init__()
        self.model, self.info, self.max_length = model, info, max_length
        if kv is None:
            device = next(model.parameters()).device
            kv = torch.zeros(2 * info.num_layers, batch, info.num_kv_heads, max_length, info.head_dim,
                             dtype=info.dtype, device=device)
        self.register_buffer("kv", kv, persistent=False)
        forward = inspect.signature(type(model).forward).parameters
        self._cache_kwarg = "cache" if "cache" in forward else "past_key_values"

    def forward(self, input_ids, positions, cache_len, tree_mask):
        n = input_ids.shape[1]
        slots = cache_len.to(torch.int64).unsqueeze(1) + torch.arange(n, device=input_ids.device)
        masks = {w: torch.ops.specgraph.tree_attention_mask(cache_len, tree_mask, self.max_length, w)
                 for w in sorted(set(self.info.layer_windows))}
        if len(masks) == 1:
            attention_mask = masks[self.info.layer_windows[0]]
        else:
            attention_mask = {"full_attention": masks[0],
                              "sliding_attention": masks[max(self.info.layer_windows)]}
        out = self.model(input_ids=input_ids, position_ids=positions, attention_mask=attention_mask,
                         use_cache=True, **{self._cache_kwarg: _TreeCache(self.kv, slots)})
        return out.logits


def example_inputs(batch: int, nodes: int, device) -> tuple[torch.Tensor, ...]:
    """Shape-only example inputs for export: a chain at cache_len 0."""
    chain = chain_mask(nodes, device)
    return (torch.zeros(batch, nodes, dtype=torch.int64, device=device),
            torch.arange(nodes, device=device).expand(batch, nodes).contiguous(),
            torch.zeros(batch, dtype=torch.int64, device=device),
            chain.expand(batch, nodes).contiguous())


@contextlib.contextmanager
def no_stack_traces():
    """Trace without torch.fx's per-node Python stack trace: a fifth of an export's time (SmolLM2-135M,
    5.2 -> 4.0 s on a CPU), read by nothing in specgraph. SPECGRAPH_DEBUG=1 keeps them."""
    import torch.fx.config as fx_config

    before = getattr(fx_config, "do_not_emit_stack_traces", None)
    if before is None or config.debug:
        yield
        return
    fx_config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        fx_config.do_not_emit_stack_traces = before


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module):
    """Trace in eval mode (no dropout), leaving the user's model in the mode it was in (as model.generate)."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def export_tree_step(model, batch: int, nodes: int, max_length: int, kv: torch.Tensor | None = None,
                     module: TreeStep | None = None):
    """Export one (B, N) bucket (of ``module``, or a TreeStep made here). returns (ExportedProgram, TargetInfo)."""
    if not 1 <= nodes <= MAX_NODES:
        raise ValueError(f"nodes={nodes}: a tree has 1 .. {MAX_NODES} nodes")
    if max_length < nodes:
        raise ValueError(f"max_length={max_length} must be at least nodes={nodes}")
    info = TargetInfo.from_model(model)
    narrow = info.narrow_windows(nodes)
    if narrow:
        raise CompileError("sliding window narrower than the tree", [
            f"layer {i}: window {w} <= tree of {nodes} nodes (depth up to {nodes - 1}); use a smaller tree" for i, w in narrow])
    step = module if module is not None else TreeStep(model, info, batch, max_length, kv)
    device = next(model.parameters()).device
    with torch.no_grad(), no_stack_traces(), eval_mode(model):
        program = torch.export.export(step, example_inputs(batch, nodes, device), strict=False)
    return program, info


def graph_context(program, info: TargetInfo, taps=None, logits_rows=None, tp=None):
    """Name the exported step's placeholders by role (the kv buffer; cache_len, tree_mask inputs)."""
    from .passes import GraphContext

    signature = program.graph_signature
    buffer_input = {target: name for name, target in signature.inputs_to_buffers.items()}
    users = [spec.arg.name for spec in signature.input_specs if spec.kind.name == "USER_INPUT"]
    params = {name: program.state_dict[target] for name, target in signature.inputs_to_parameters.items()}
    return GraphContext(info, kv=buffer_input["kv"], cache_len=users[2], tree_mask=users[3], taps=taps,
                        logits_rows=logits_rows, params=params, tp=tp)


class CapturedStep:
    """One (B, N) bucket: the exported graph, rewritten by the pass pipeline.

    ``step(input_ids, positions, cache_len, tree_mask)`` returns logits
    ``[B, N, V]`` (rows pruned by ``logits_rows``), or ``(logits, [taps])``
    when hidden states are tapped. The graph runs flat: parameters and
    buffers are passed in by position, so passes may add outputs freely and
    ``kv`` (the live cache, shared by every bucket of one batch size) is
    just another argument.
    """

    def __init__(self, model, batch: int, nodes: int, max_length: int, kv: torch.Tensor | None = None,
                 debug: bool | None = None, taps=None, logits_rows: tuple[int, int] | None = None):
        from .passes import run_pipeline

        tp = model.__dict__.get("_specgraph_tp")
        self.info = TargetInfo.from_model(model)
        module = TreeStep(model, self.info, batch, max_length, kv)  # what export traces (in eval mode); names the state
        cache_key = (capture_cache.key(model, module, batch, nodes, max_length, taps, logits_rows)
                     if capture_cache.enabled(debug, tp, model) else None)
        loaded = capture_cache.load(cache_key, module) if cache_key else None
        self.cache_key = cache_key  # None: the capture cache is off for this bucket
        self.from_cache = loaded is not None  # no torch.export, no passes: an earlier process's graph
        if loaded is None:
            program, _ = export_tree_step(model, batch, nodes, max_length, module=module)
            context = graph_context(program, self.info, taps, logits_rows, tp)
            pass_results = run_pipeline(program.graph_module, context, debug)
            tensors = {**program.state_dict, **program.constants}
            targets = [s.target for s in program.graph_signature.input_specs if s.kind.name != "USER_INPUT"]
            state = [tensors[t] for t in targets]
            loaded = (capture_cache.store(cache_key, program.graph_module, targets, state, module, pass_results)
                      if cache_key else (program.graph_module, state, pass_results))  # stored: a warm start's code
        self.graph, self._state, self.pass_results = loaded
        self._kv_index = next(i for i, t in enumerate(self._state) if capture_cache.same_tensor(t, module.kv))
        self._state[self._kv_index] = module.kv  # the batch size's live cache, shared by its buckets
        self.batch, self.nodes, self.max_length = batch, nodes, max_length
        self.tapped = taps is not None and (bool(taps.layer_ids) or taps.final)
        self.run = self.graph  # what __call__ executes: the graph itself, or its torch.compile'd form

    @property
    def kv(self) -> torch.Tensor:
        return self._state[self._kv_index]

    def __call__(self, input_ids, positions, cache_len, tree_mask):
        out = self.run(*self._state, input_ids, positions, cache_len, tree_mask)
        return (out[0], list(out[1:])) if self.tapped else out[0]


class Capture:
    """Captured steps of one target, cached per bucket, one KV buffer per batch size.

    ``backend="inductor"`` runs every bucket's rewritten graph through
    ``torch.compile(fullgraph=True, dynamic=False)`` (one compile per bucket;
    the specgraph ops stay custom-op calls inside the compiled graph).
    Creating one lays out the model's q/k/v and gate/up weights back to back
    (``passes.pack_projections``: same Parameters and values, new storage), so
    the ``fuse_projections`` pass can read each group as one matrix.
    """

    def __init__(self, model, max_length: int, debug: bool | None = None, backend: str = "eager"):
        if backend not in ("eager", "inductor", "cudagraphs"):
            raise ValueError(f"backend={backend!r}: 'eager', 'inductor' or 'cudagraphs'")
        self.model, self.max_length, self.debug, self.backend = model, max_length, debug, backend
        self.kv_device = next(model.parameters()).device
        # one generate at a time: every SpecModel of this model and backend shares these caches and buffers
        self.lock = threading.RLock()
        self.decode_steps: dict = {}  # runtime.generate.decode_step's Bucket per (draft, B, tree, ...)
        self.readbacks: dict = {}  # runtime.generate's pinned host buffers per (B, 2D+3)
        self.prefills: dict = {}  # runtime.generate.prefill's GraphedCall per (B, chunk, taps)
        self.info = TargetInfo.from_model(model)
        pack_projections(model)
        self._steps: dict[tuple, CapturedStep] = {}
        self._kv: dict[int, torch.Tensor] = {}

    def step(self, batch: int, nodes: int, taps=None, logits_rows: tuple[int, int] | None = None) -> CapturedStep:
        key = (batch, nodes, taps, logits_rows)
        if key not in self._steps:
            start = time.perf_counter()
            log.info("capturing %s for batch %d, %d tree rows (torch.export and the passes) ...",
                     type(self.model).__name__, batch, nodes)
            with TRACE_LOCK:
                step = CapturedStep(self.model, batch, nodes, self.max_length, self._kv.get(batch), self.debug,
                                    taps, logits_rows)
            self._kv.setdefault(batch, step.kv)
            if self.backend == "inductor":  # compiled; with the capture cache on, kept across processes
                frame_key = compiled_cache.key(step.cache_key, "target")
                step.run = compiled_cache.compile_frame(step.graph.forward, frame_key,
                                                        f"target's bucket (B={batch}, {nodes} rows)")
            self._steps[key] = step
            log.info("%s in %.1f s", "loaded from the capture cache" if step.from_cache else "captured",
                     time.perf_counter() - start)
        return self._steps[key]

    def kv(self, batch: int) -> torch.Tensor:
        return self._kv[batch]

    @classmethod
    def shared(cls, model, max_length: int, backend: str = "eager") -> "Capture":
        """The model's latest Capture for ``backend``, kept on the model: another ``compile`` with the
        same max_length reuses its captured (and compiled) buckets and KV buffers. One per backend is
        kept (a new max_length replaces it, so old caches can be freed), and only while every
        parameter is the same object with the same dtype and device (layers replaced or ``.to(...)``
        since: a new one)."""
        key = (max_length, tuple((id(p), p.dtype, p.device) for p in model.parameters()))
        captures = model.__dict__.setdefault("_specgraph_captures", _Captures())
        if backend not in captures or captures[backend][0] != key:
            captures[backend] = (key, cls(model, max_length, backend=backend))
        return captures[backend][1]

    @staticmethod
    def release(model) -> None:
        """Drop the model's shared Captures (their graphs and KV buffers go once no SpecModel holds them)."""
        model.__dict__.pop("_specgraph_captures", None)


class _Captures(dict):
    """A model's shared Captures (see ``Capture.shared``); a copied or pickled model starts with none."""

    def __deepcopy__(self, memo):
        return _Captures()

    def __reduce__(self):
        return _Captures, ()
