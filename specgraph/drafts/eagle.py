"""EAGLE-1/2 draft head (SafeAILab layout; EAGLE-2 = the same weights on a DynamicTree).

    x = fc([embed(x_{t+1}), f_t])          fc: [H, 2H], bias unless config "bias": false
    h = layers.0(x)                        Llama layer without input_layernorm
    logits = target.lm_head(h)             no final norm; the LM head is the target's

f_t is the target's final hidden state (after its final norm, the LM head's
input) and, for the draft's own later steps, the draft's previous output h.

Checkpoint: config.json (a LlamaConfig with num_hidden_layers 1, optional
"bias") and pytorch_model.bin or model.safetensors with ``embed_tokens.weight``
(optional: vLLM-style exports drop it and the target's is used),
``fc.{weight,bias}``, ``layers.0.{self_attn,mlp,post_attention_layernorm}.*``.
A leading ``model.`` (vLLM) is accepted. ``save_pretrained`` writes the
SafeAILab layout as model.safetensors.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from ..errors import CheckpointError
from ..passes import HiddenTaps
from .autoregressive import AutoregressiveDraft
from .checkpoint import check_fields, check_keys, llama_config, read_checkpoint, write_checkpoint
from .layer import DraftLayer

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def draft_config_for(model, **overrides) -> LlamaConfig:
    """A one-layer Llama config with the target's widths and RoPE (for new, untrained heads)."""
    t = model.config.get_text_config()
    fields = dict(hidden_size=t.hidden_size, intermediate_size=t.intermediate_size, vocab_size=t.vocab_size,
                  num_attention_heads=t.num_attention_heads, rms_norm_eps=getattr(t, "rms_norm_eps", 1e-6),
                  num_key_value_heads=getattr(t, "num_key_value_heads", None) or t.num_attention_heads,
                  head_dim=getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads,
                  max_position_embeddings=t.max_position_embeddings, rope_parameters=getattr(t, "rope_parameters", None),
                  num_hidden_layers=1, hidden_act=getattr(t, "hidden_act", "silu"))
    fields.update(overrides)
    return LlamaConfig(**{k: v for k, v in fields.items() if v is not None})


class _Borrowed:
    """A target module the draft uses but does not own (not a submodule: no state_dict, no .to())."""

    def __init__(self, module: nn.Module | None = None):
        self.module = module


def llama_rope(rotary: LlamaRotaryEmbedding, x: torch.Tensor, positions: torch.Tensor):
    """``rotary(x, positions)``'s (cos, sin) with the angles by a broadcast multiply, as transformers 5.2x has
    it; earlier releases take them from a matmul over a contraction of length 1, a cuBLAS sgemm launch a draft
    step on a GPU. Same values (one term, one rounding). RoPE types that rescale as they run keep HF's forward."""
    if "dynamic" in rotary.rope_type or rotary.rope_type == "longrope":
        return rotary(x, positions)
    freqs = positions[..., None].float() * rotary.inv_freq.to(device=x.device, dtype=torch.float)  # [B, N, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * rotary.attention_scaling).to(x.dtype), (emb.sin() * rotary.attention_scaling).to(x.dtype)


class FeatureDraft(AutoregressiveDraft):
    """What Eagle and Eagle3 share: the embedding (own or the target's), RoPE, binding."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self.embed_from_target = False  # set by a loader whose checkpoint has no embedding
        self._head = _Borrowed()

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        attn = self.layer.self_attn
        return 1, attn.num_kv_heads, attn.head_dim

    def bind(self, model) -> list[str]:
        """Check against the target and borrow what the checkpoint leaves out. returns blockers."""
        t = model.config.get_text_config()
        problems = self._bind_problems(t)
        if problems:
            return problems
        if self.embed_from_target:
            self.embed_tokens = model.get_input_embeddings()  # shared, like the reference loaders
        self._head.module = model.get_output_embeddings()
        param = next(model.parameters())
        self.to(dtype=param.dtype, device=param.device)
        return []

    def _bind_problems(self, t) -> list[str]:
        problems = []
        if t.vocab_size != self.config.vocab_size:
            problems.append(f"{self.kind} vocabulary {self.config.vocab_size} != target vocabulary {t.vocab_size}")
        return problems

    def rope(self, x, positions):
        return llama_rope(self.rotary_emb, x, positions)

    def _load(self, state: dict, what: str, path) -> "FeatureDraft":
        """Strictly load ``state`` (only the embedding may be missing: then the target's is borrowed)."""
        check_keys(state, self.state_dict(), {"embed_tokens.weight"}, what, path)
        self.load_state_dict(state, strict=False)
        self.embed_from_target = "embed_tokens.weight" not in state
        return self.eval()


class Eagle(FeatureDraft):
    """EAGLE-1/2 head (SafeAILab layout): ``fc`` [H, 2H] over ``[embedding, feature]``, one decoder
    layer without input norm, the target's LM head. Reads the target's last hidden state;
    autoregressive (K lanes per draft step, EAGLE-2 selection over a DynamicTree).
    ``Eagle.from_pretrained(dir)`` / ``save_pretrained(dir)``: config.json + safetensors or
    pytorch_model.bin; ``Eagle.for_target(model)``: a new untrained head."""

    kind = "eagle"

    def __init__(self, config: LlamaConfig, bias: bool = True):
        super().__init__(config)
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=bias)
        self.layers = nn.ModuleList([DraftLayer(config, config.hidden_size)])

    @classmethod
    def for_target(cls, model, bias: bool = True) -> "Eagle":
        """A new (untrained) head shaped for ``model``, its embedding copied from it."""
        draft = cls(draft_config_for(model), bias=bias)
        with torch.no_grad():
            draft.embed_tokens.weight.copy_(model.get_input_embeddings().weight)
        return draft

    @property
    def layer(self) -> DraftLayer:
        return self.layers[0]

    @property
    def taps(self) -> HiddenTaps:
        return HiddenTaps(final=True)

    def forward(self, tokens, features, from_target, positions, kv, cache_len, slots, tree_mask):
        """tokens [B, R], features [B, R, H] -> h [B, R, H] (EAGLE-1 fuses every step's input with fc)."""
        x = self.fc(torch.cat([self.embed_tokens(tokens), features.to(self.fc.weight.dtype)], -1))
        cos, sin = self.rope(x, positions)
        return self.layer(x, x, cos, sin, kv, cache_len, slots, tree_mask)

    def draft_logits(self, hidden):
        return self._head.module(hidden)

    def to_target(self, draft_ids):
        return draft_ids

    def _bind_problems(self, t) -> list[str]:
        problems = super()._bind_problems(t)
        if t.hidden_size != self.config.hidden_size:
            problems.append(f"EAGLE hidden size {self.config.hidden_size} != target hidden size {t.hidden_size} "
                            f"(EAGLE-1 reads the target's final hidden state and shares its LM head)")
        return problems

    # ------------------------------------------------------------------ formats
    @classmethod
    def from_pretrained(cls, path: str | Path) -> "Eagle":
        state, config = read_checkpoint(path, WEIGHT_FILES, "EAGLE")
        if not config:
            raise FileNotFoundError(f"{path}: EAGLE checkpoints carry a config.json (a one-layer LlamaConfig)")
        check_fields(config, path)
        state = {k.removeprefix("model."): v for k, v in state.items()}
        if config.get("num_hidden_layers", 1) != 1:
            raise CheckpointError(f"{path}: config.num_hidden_layers={config['num_hidden_layers']}: EAGLE-1/2 heads "
                                  f"have one layer")
        bias = bool(config.get("bias", True))  # SafeAILab: absent means True
        llama = llama_config({k: v for k, v in config.items() if k not in ("bias", "architectures")}, path)
        return cls(llama, bias=bias)._load(state, "EAGLE-1/2", path)

    def save_pretrained(self, path: str | Path, dtype: torch.dtype | None = None,
                        max_shard_bytes: int | None = None) -> None:
        config = self.config.to_dict()
        config.update(architectures=["LlamaForCausalLM"], bias=self.fc.bias is not None)
        write_checkpoint(path, dict(self.state_dict()), config, dtype=dtype, max_shard_bytes=max_shard_bytes)
