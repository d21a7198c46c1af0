"""EAGLE-3 draft head (SafeAILab / SpecForge ``LlamaForCausalLMEagle3`` layout).

    g = fc([f_low, f_mid, f_high])              first step only: 3 target taps -> H
    a = [midlayer.input_layernorm(embed(x)), midlayer.hidden_norm(g)]   2H into attention
    h = midlayer(a, residual=g)                 (norm_before_residual: residual = hidden_norm(g))
    logits = lm_head(norm(h))                   over the draft vocabulary; target id = d + d2t[d]
Later steps feed back h itself (no fc).

Taps: the states entering target layers (2, L//2, L-3) by default ("layer_input",
= the outputs of layers 1, L//2-1, L-4; SGLang's and vLLM's default too). Ids in a
config, as the engines read them (see ``docs/api.md``, "EAGLE-3 aux layer ids"):
``eagle_config.eagle_aux_hidden_state_layer_ids`` is SGLang's key, read in the
output-of-layer convention (SGLang taps layer id+1's input; ModelOpt and SpecForge
write it so) unless the config names its convention (``specgraph_aux_convention``)
or the caller does; a top-level ``eagle_aux_hidden_state_layer_ids`` is vLLM's key,
read as layer inputs (vLLM taps the input of layer id). ``save_pretrained`` writes
both, for the same layers.

Keys: ``midlayer.self_attn.{q,k,v,o}_proj.weight`` (q/k/v take 2H),
``midlayer.{mlp.*, hidden_norm, input_layernorm, post_attention_layernorm}``,
``fc.weight`` [H, 3·H_target], ``norm.weight``, ``lm_head.weight`` [V_draft, H],
``d2t`` [V_draft] int64, ``t2d`` [V] bool (both absent when the vocabularies
are equal), ``embed_tokens.weight`` (usually absent: the target's is used).
Without ``lm_head.weight`` and ``draft_vocab_size`` the head drafts over the
full vocabulary through the target's own LM head (SGLang's
``load_lm_head_from_target``; no vocabulary matrix to ship).
ModelOpt / vLLM names (``layers.0.`` for ``midlayer.``, a ``model.`` prefix)
are accepted. Variants, with vLLM's semantics (config top level or
``eagle_config``): ``norm_before_residual`` (residual = hidden_norm(g));
``norm_before_fc`` (``input_norm.weight`` [3·H_target], one RMSNorm over the
concatenation, before fc); ``fc_norm`` (``fc_norm.{0,1,2}.weight``
[H_target], one RMSNorm per tap, after input_norm); ``norm_output`` (the
state fed back to the next step is norm(h); logits always read norm(h)).
Other variant flags are refused by name rather than silently ignored.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from ..errors import CheckpointError
from ..kernels.pdl import pdl_launch
from ..passes import HiddenTaps
from ..trees import Chain, DynamicTree, WithLookup
from .checkpoint import check_fields, llama_config, read_checkpoint, write_checkpoint
from .eagle import WEIGHT_FILES, FeatureDraft, draft_config_for
from .layer import DraftLayer

SUPPORTED_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
REFUSED_FLAGS = ("use_mtp_layernorm", "add_para_norm", "mlp_bias")
_NOT_LLAMA = ("draft_vocab_size", "target_hidden_size", "eagle_config", "architectures", "specgraph_aux_convention",
              "bias", "eagle_aux_hidden_state_layer_ids") + SUPPORTED_FLAGS
log = logging.getLogger(__name__)


class Eagle3(FeatureDraft):
    """EAGLE-3 head (SpecForge / SGLang ``LlamaForCausalLMEagle3`` layout): ``fc`` [H, 3·H_target]
    over three tapped target states (``aux_layer_ids``, convention ``aux_convention``:
    "layer_input" or "layer_output"), ``midlayer`` with a 2H attention input, ``norm``, ``lm_head``
    over a draft vocabulary mapped back by ``d2t`` / ``t2d``. Autoregressive over a tree.
    ``Eagle3.from_pretrained(dir)`` / ``save_pretrained(dir)``; ``Eagle3.for_target(model)``: a new
    untrained head; ``specgraph.models.load_default_draft()``: the shipped SmolLM2 head."""

    kind = "eagle3"

    def __init__(self, config: LlamaConfig, aux_layer_ids: tuple[int, ...] | None = None,
                 aux_convention: str = "layer_input", norm_before_residual: bool = False,
                 norm_before_fc: bool = False, fc_norm: bool = False, norm_output: bool = False,
                 lm_head_from_target: bool = False):
        if aux_convention not in (None, "layer_input", "layer_output"):
            raise ValueError(f"aux_convention={aux_convention!r}: 'layer_input', 'layer_output' or None")
        super().__init__(config)
        h = config.hidden_size
        target_h = getattr(config, "target_hidden_size", None) or h
        self.draft_vocab_size = getattr(config, "draft_vocab_size", None) or config.vocab_size
        self.aux_layer_ids, self.aux_convention = aux_layer_ids, aux_convention
        self.norm_before_residual, self.norm_output = norm_before_residual, norm_output
        self.input_norm = LlamaRMSNorm(3 * target_h, eps=config.rms_norm_eps) if norm_before_fc else None
        self.fc_norm = nn.ModuleList(LlamaRMSNorm(target_h, eps=config.rms_norm_eps) for _ in range(3)) \
            if fc_norm else None
        self.fc = nn.Linear(3 * target_h, h, bias=bool(getattr(config, "bias", False)))
        self.midlayer = DraftLayer(config, 2 * h)
        self.midlayer.hidden_norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.midlayer.input_layernorm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        if lm_head_from_target and self.draft_vocab_size != config.vocab_size:
            raise ValueError(f"lm_head_from_target with a draft vocabulary of {self.draft_vocab_size} != the "
                             f"target's {config.vocab_size}: the target's LM head covers the full vocabulary")
        # lm_head_from_target: the target's LM head (borrowed at bind, like the embedding), not a weight of ours
        self.lm_head = None if lm_head_from_target else nn.Linear(h, self.draft_vocab_size, bias=False)
        if self.draft_vocab_size != config.vocab_size:
            self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.int64))
            self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        else:
            self.d2t = self.t2d = None

    @classmethod
    def for_target(cls, model, draft_vocab: torch.Tensor | None = None, **kwargs) -> "Eagle3":
        """A new (untrained) head for ``model``; ``draft_vocab`` (sorted target ids) makes a reduced
        vocabulary; ``lm_head_from_target=True`` drafts through the target's LM head instead."""
        if draft_vocab is not None:  # any sequence of ints; all of the target's ids: no reduced vocabulary
            draft_vocab = _token_ids(draft_vocab, model.config.vocab_size)
            if draft_vocab.numel() == model.config.vocab_size:
                draft_vocab = None
        config = draft_config_for(model, draft_vocab_size=None if draft_vocab is None else len(draft_vocab))
        draft = cls(config, **kwargs)
        if draft_vocab is not None:
            draft.set_vocab(draft_vocab)
        draft.embed_from_target = True
        if draft.lm_head is None:
            draft._head.module = model.get_output_embeddings()
        return draft

    def set_vocab(self, used) -> None:
        """The reference trainer's map: ``d2t[i] = used[i] - i``, ``t2d[t] = t in used``."""
        vocab = self.config.vocab_size
        used = _token_ids(used, vocab).sort().values
        if used.numel() != self.draft_vocab_size or used.unique().numel() != used.numel() or \
                (used.numel() and not 0 <= int(used[0]) <= int(used[-1]) < vocab):
            raise ValueError(f"draft_vocab: {self.draft_vocab_size} distinct target token ids in 0 .. {vocab - 1} "
                             f"(got {used.numel()} ids, {used.unique().numel()} distinct)")
        self.d2t.copy_(used - torch.arange(len(used)))
        self.t2d.zero_()
        self.t2d[used] = True

    @property
    def layer(self) -> DraftLayer:
        return self.midlayer

    @property
    def taps(self) -> HiddenTaps:
        return HiddenTaps(layer_ids=tuple(self.aux_layer_ids), convention=self.aux_convention)

    def forward(self, tokens, features, from_target, positions, kv, cache_len, slots, tree_mask):
        """tokens [B, R]; features [B, R, 3·H_target] (from_target) or [B, R, H] (own outputs) -> h [B, R, H]."""
        g = features.to(self.fc.weight.dtype)
        if from_target:
            if self.input_norm is not None:
                g = self.input_norm(g)
            if self.fc_norm is not None:
                g = torch.cat([norm(part) for norm, part in zip(self.fc_norm, g.chunk(3, -1))], -1)
            g = self.fc(g)
        normed = self.midlayer.hidden_norm(g)
        attn_in = torch.cat([self.midlayer.input_layernorm(self.embed_tokens(tokens)), normed], -1)
        cos, sin = self.rope(g, positions)
        h = self.midlayer(attn_in, normed if self.norm_before_residual else g, cos, sin, kv,
                          cache_len, slots, tree_mask)
        return self.norm(h) if self.norm_output else h

    @property
    def lm_head_from_target(self) -> bool:
        return self.lm_head is None

    @property
    def head(self) -> nn.Module:
        """The linear layer that makes the draft logits: its own ``lm_head``, or the target's."""
        return self._head.module if self.lm_head is None else self.lm_head

    def head_input(self, hidden):
        """What ``head`` reads: the layer's output, normalized unless the layer did (``norm_output``)."""
        return hidden if self.norm_output else self.norm(hidden)

    def draft_logits(self, hidden):
        return self.head(self.head_input(hidden))

    def ranked_vocab_size(self, target_vocab_size: int) -> int:
        return self.draft_vocab_size

    def to_target(self, draft_ids):
        return draft_ids if self.d2t is None else draft_ids + self.d2t[draft_ids]

    def default_tree(self, device: torch.device, max_batch: int):
        """On one CUDA row, the fastest tree measured end to end with the shipped SmolLM2 head (docs/benchmarks.md,
        SmolLM2 speculation): DynamicTree(3, 8, 32) whose 32 nodes a 16-deep prompt-lookup chain competes for
        (shared), where a step of 32 rows folds into ``fused_linear`` (PDL: Hopper and later); without PDL such
        a step falls back to unfused kernels, so DynamicTree(2, 8, 16) with a 12-deep chain. Larger batches and
        CPUs pay for every verified node: a 4-deep chain."""
        if device.type == "cuda" and max_batch == 1:
            if pdl_launch(device):
                return WithLookup(DynamicTree(3, 8, 32), 16, shared=True)
            return WithLookup(DynamicTree(2, 8, 16), 12, shared=True)
        return Chain(4)

    def bind(self, model) -> list[str]:
        t = model.config.get_text_config()
        chosen, convention = self.aux_layer_ids is None, self.aux_convention  # None: EAGLE-3's rule for this target
        if chosen:
            layers = t.num_hidden_layers
            self.aux_layer_ids, self.aux_convention = (2, layers // 2, layers - 3), "layer_input"
        problems = super().bind(model)
        if chosen and problems:  # refused: the head stays unbound, free to meet another target
            self.aux_layer_ids, self.aux_convention = None, convention
        return problems

    def _bind_problems(self, t) -> list[str]:
        problems = super()._bind_problems(t)
        target_h = self.fc.in_features // 3
        if t.hidden_size != target_h:
            problems.append(f"EAGLE-3 fc reads 3 x {target_h} target features; the target's hidden size is "
                            f"{t.hidden_size}")
        if self.embed_from_target and t.hidden_size != self.config.hidden_size:
            problems.append(f"the checkpoint has no embed_tokens and its width {self.config.hidden_size} != the "
                            f"target's {t.hidden_size}, so the target's embedding cannot be borrowed")
        ids = self.aux_layer_ids or ()
        bad = [i for i in ids if not 0 <= i < t.num_hidden_layers]
        if len(ids) != 3 or bad:
            problems.append(f"EAGLE-3 aux layer ids {list(ids)} ({self.aux_convention}) must be 3 ids of the "
                            f"target's {t.num_hidden_layers} layers: pass aux_layer_ids=(low, mid, high) to "
                            f"Eagle3.for_target (the default (2, L // 2, L - 3) needs L >= 4 layers)")
        return problems

    # ------------------------------------------------------------------ formats
    @classmethod
    def from_pretrained(cls, path: str | Path, aux_convention: str | None = None) -> "Eagle3":
        if aux_convention not in (None, "layer_input", "layer_output"):
            raise ValueError(f"aux_convention={aux_convention!r}: 'layer_input' (EAGLE-3's reference trainer and "
                             f"SpecForge), 'layer_output' (SGLang's taps) or None (the config's, else layer_input)")
        state, config = read_checkpoint(path, WEIGHT_FILES, "EAGLE-3")
        if not config:
            raise FileNotFoundError(f"{path}: EAGLE-3 checkpoints carry a config.json")
        check_fields(config, path)
        eagle_config = config.get("eagle_config") or {}
        architectures = config.get("architectures") or []
        if config.get("num_hidden_layers", 1) != 1 and not eagle_config and "draft_vocab_size" not in config and \
                not any("eagle" in str(a).lower() for a in architectures):  # no mark of a head at all
            raise CheckpointError(f"{path}: a {', '.join(map(str, architectures)) or 'model'} directory with "
                                  f"{config['num_hidden_layers']} layers, not an EAGLE-3 head (a head's config has "
                                  f"one layer, and draft_vocab_size or eagle_config): pass the head's directory")
        flags = {**config, **eagle_config}
        refused = [f"{f}={flags[f]!r}" for f in REFUSED_FLAGS if flags.get(f)]
        if config.get("num_hidden_layers", 1) != 1:
            refused.append(f"num_hidden_layers={config['num_hidden_layers']} (multi-layer EAGLE-3 heads)")
        if refused:
            raise CheckpointError(f"{path}: EAGLE-3 variant not supported yet: {', '.join(refused)}")
        ids, convention = aux_ids_of(config, aux_convention, path)
        state = {_rename(k): v for k, v in state.items()}
        llama = llama_config({k: v for k, v in config.items() if k not in _NOT_LLAMA}, path)
        llama.draft_vocab_size = config.get("draft_vocab_size")
        llama.target_hidden_size = config.get("target_hidden_size")
        llama.bias = bool(config.get("bias", False))
        # SGLang's rule: no draft vocabulary named and no LM head stored -> the target's LM head
        borrow = "lm_head.weight" not in state and not config.get("draft_vocab_size")
        draft = cls(llama, tuple(ids) if ids else None, convention,
                    norm_before_residual=bool(flags.get("norm_before_residual")),
                    norm_before_fc=bool(flags.get("norm_before_fc")), fc_norm=bool(flags.get("fc_norm")),
                    norm_output=bool(flags.get("norm_output")), lm_head_from_target=borrow)
        return draft._load(state, "EAGLE-3", path)

    def save_pretrained(self, path: str | Path, dtype: torch.dtype | None = None,
                        max_shard_bytes: int | None = None) -> None:
        """The SpecForge/SGLang layout, aux ids for SGLang and vLLM alike (``aux_ids_config``); ``dtype``
        (e.g. bf16) and ``max_shard_bytes`` as in write_checkpoint."""
        config = self.config.to_dict()
        config.update(architectures=["LlamaForCausalLMEagle3"],
                      draft_vocab_size=None if self.lm_head_from_target else self.draft_vocab_size,
                      target_hidden_size=self.fc.in_features // 3, norm_before_residual=self.norm_before_residual,
                      norm_before_fc=self.input_norm is not None, fc_norm=self.fc_norm is not None,
                      norm_output=self.norm_output)
        if self.aux_layer_ids is not None:
            config.update(aux_ids_config(self.aux_layer_ids, self.aux_convention))
        state = {k: v for k, v in self.state_dict().items() if not (self.embed_from_target and k.startswith("embed"))}
        write_checkpoint(path, state, config, dtype=dtype, max_shard_bytes=max_shard_bytes)


def layer_inputs(ids, convention: str) -> tuple[int, ...]:
    """Tapped layers as "the input of layer j" ids (vLLM's form; the output of layer i is j = i + 1)."""
    return tuple(int(i) + (convention == "layer_output") for i in ids)


def aux_ids_of(config: dict, aux_convention: str | None, path) -> tuple[tuple[int, ...] | None, str]:
    """(ids, convention) from a config, each key read as the engine that owns it reads it: SGLang's
    ``eagle_config.eagle_aux_hidden_state_layer_ids`` (layer outputs, unless ``specgraph_aux_convention``
    or ``aux_convention`` says otherwise), vLLM's top-level key (layer inputs). Both present: they must
    tap the same layers."""
    nested = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    top = config.get("eagle_aux_hidden_state_layer_ids")
    if top and not nested:
        return tuple(top), aux_convention or "layer_input"
    if not nested:
        return None, aux_convention or "layer_output"
    convention = aux_convention or config.get("specgraph_aux_convention") or "layer_output"
    if top and layer_inputs(nested, convention) != tuple(top):
        raise CheckpointError(f"{path}: eagle_config.eagle_aux_hidden_state_layer_ids={list(nested)} ({convention}: "
                              f"SGLang taps the inputs of layers {list(layer_inputs(nested, convention))}) and the "
                              f"top-level eagle_aux_hidden_state_layer_ids={list(top)} (vLLM taps the inputs of those "
                              f"layers) disagree; keep the key of the engine that trained the head, or pass "
                              f"aux_convention")
    return tuple(nested), convention


def aux_ids_config(ids, convention: str) -> dict:
    """Config keys with which SGLang and vLLM tap the layers ``ids`` (``convention``) name: vLLM's top-level
    ``eagle_aux_hidden_state_layer_ids`` as layer inputs; SGLang's ``eagle_config`` key as layer outputs
    (SGLang adds 1; since sgl-project/sglang#25454 only when the first id is 1, which holds for the
    default taps), with ``specgraph_aux_convention`` naming it. An embedding tap (input of layer 0) has
    no output id: SGLang's key then keeps the inputs and SGLang reads it one layer late."""
    inputs = layer_inputs(ids, convention)
    if min(inputs) >= 1:
        nested, named = [j - 1 for j in inputs], "layer_output"
    else:
        log.warning("EAGLE-3 taps %s include the embeddings (input of layer 0): SGLang cannot name that tap, "
                    "its key is written as layer inputs and SGLang will read it one layer late", list(inputs))
        nested, named = list(inputs), "layer_input"
    return {"eagle_aux_hidden_state_layer_ids": list(inputs), "specgraph_aux_convention": named,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": nested}}


def _rename(key: str) -> str:
    key = key.removeprefix("model.")
    for old, new in (("layers.0.", "midlayer."), ("input_embeds_norm.", "midlayer.input_layernorm."),
                     ("eagle_lm_head.", "lm_head.")):
        if key.startswith(old):
            return new + key[len(old):]
    if key.startswith("hidden_norm."):
        return "midlayer." + key
    return key


def _token_ids(ids, vocab: int) -> torch.Tensor:
    """``draft_vocab`` as int64 target ids: a tensor or sequence of ints, each in 0 .. vocab - 1 (named if not)."""
    ids = torch.as_tensor(ids)
    if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.dim() != 1:
        raise TypeError(f"draft_vocab: a 1-d sequence of integer target token ids (got {ids.dtype}, {ids.dim()}-d)")
    ids = ids.to(torch.int64)
    outside = ids[(ids < 0) | (ids >= vocab)]
    if outside.numel():
        raise ValueError(f"draft_vocab: ids {outside[:8].tolist()} lie outside the target's vocabulary "
                         f"0 .. {vocab - 1}")
    return ids
