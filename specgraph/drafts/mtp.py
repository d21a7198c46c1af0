"""MTP: the multi-token-prediction module a target checkpoint ships (DeepSeek-V3, GLM-4.5, MiMo, Qwen3-Next).

    e = embed(x_{t+1})                       zeroed at position 0 (DeepSeek, MiMo: as vLLM and SGLang do)
    x = eh_proj([enorm(e), hnorm(f_t)])      MiMo: [hnorm(f_t), enorm(e)] (reversed)
    h = block(x)                             a full decoder layer of the target's own class (MLA/MoE included)
    out = h                                  MiMo, Qwen3-Next: out = norm(h)
    logits = head(norm(h))                   head: the checkpoint's shared_head.head or the target's lm_head

f_t is the target's final (post-norm) hidden state and, for the draft's own
later steps, the previous ``out`` (vLLM ``previous_hidden_states``). The block
runs eagerly with transformers' own attention over the draft cache: K/V are
written at slot ``cache_len + slots`` and the dense ``tree_attention_mask``
gives every row the committed prefix plus its tree ancestors.

Layouts read by ``from_target`` (a HF model directory), internal name <- checkpoint name:
  DeepSeek-V3 / GLM  ``model.layers.{L+i}.``: enorm, hnorm, eh_proj, norm <- shared_head.norm,
                     head <- shared_head.head (optional), embed_tokens (optional), block <- the rest
  MiMo               ``model.mtp_layers.{i}.``: enorm <- token_layernorm, hnorm <- hidden_layernorm,
                     eh_proj <- input_proj, norm <- final_layernorm, block <- the rest
  Qwen3-Next         ``mtp.``: enorm <- pre_fc_norm_embedding, hnorm <- pre_fc_norm_hidden, eh_proj <- fc,
                     norm, block <- layers.{i}
Per-expert MoE weights are stacked into transformers' fused ``experts.gate_up_proj``
/ ``experts.down_proj``. ``save_pretrained`` writes the DeepSeek-V3 layout.
With k > 1 modules, vLLM uses module ``step % k``; here one module (``module=``) serves every step.
"""
from __future__ import annotations

import copy
import inspect
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .. import kernels  # noqa: F401  (registers specgraph::tree_attention_mask)
from ..errors import CheckpointError
from ..passes import HiddenTaps
from .autoregressive import AutoregressiveDraft
from .checkpoint import build_config, check_keys, read_config, unreadable, write_checkpoint
from .eagle import _Borrowed
from .layer import slot_tensor

REMOTE_BASES = {"mimo": "qwen2"}  # remote-code targets whose decoder layer is a transformers one (vLLM mimo_mtp)


@dataclass(frozen=True)
class Variant:
    """How one MTP family wires the same parts."""

    layout: str  # "deepseek" | "mimo" | "qwen3_next": the checkpoint layout
    hidden_first: bool  # eh_proj reads [hnorm(f), enorm(e)]
    zero_first: bool  # the embedding of the pair at position 0 is zeroed
    norm_output: bool  # the fed-back state (and the head's input) is norm(h)


VARIANTS = {"deepseek": Variant("deepseek", False, True, False), "mimo": Variant("mimo", True, True, True),
            "qwen3_next": Variant("qwen3_next", False, False, True)}
PREFIX = {"deepseek": "model.layers.{n}.", "mimo": "model.mtp_layers.{i}.", "qwen3_next": "mtp."}
ROLES = {  # (internal prefix, checkpoint name under the module's prefix); the block's catch-all last
    "deepseek": (("enorm.", "enorm."), ("hnorm.", "hnorm."), ("eh_proj.", "eh_proj."), ("norm.", "shared_head.norm."),
                 ("head.", "shared_head.head."), ("embed_tokens.", "embed_tokens."), ("block.", "")),
    "mimo": (("enorm.", "token_layernorm."), ("hnorm.", "hidden_layernorm."), ("eh_proj.", "input_proj."),
             ("norm.", "final_layernorm."), ("block.", "")),
    "qwen3_next": (("enorm.", "pre_fc_norm_embedding."), ("hnorm.", "pre_fc_norm_hidden."), ("eh_proj.", "fc."),
                   ("norm.", "norm."), ("block.", "layers.{i}.")),
}


class _SlotCache:
    """Duck-typed transformers Cache over the draft cache: row r of batch b goes to slot ``index[b, r]``."""

    is_compileable = True

    def __init__(self, kv, index: torch.Tensor):
        self.kv, self.index = kv, index  # kv[0] K [B, H_k, S, D_k], kv[1] V [B, H_v, S, D_v]; index [B, R]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        out = []
        for cache, new in ((self.kv[0], key_states), (self.kv[1], value_states)):
            where = self.index.view(new.shape[0], 1, -1, 1).expand_as(new)
            out.append(cache.scatter_(2, where, new.to(cache.dtype)))
        return tuple(out)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are always passed explicitly


class _ShapeProbe(_SlotCache):
    """Records the per-head K and V widths the block caches (MLA caches two different latents)."""

    def __init__(self):
        self.dims = None

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.dims = (tuple(key_states.shape[1::2]), tuple(value_states.shape[1::2]))  # (heads, width) each
        return key_states, value_states


class MTP(AutoregressiveDraft):
    """The multi-token-prediction module a checkpoint ships (DeepSeek-V3 / GLM, Qwen3-Next, MiMo
    layouts), loaded from the target's own checkpoint with ``MTP.from_target(path)``; drafts
    autoregressively from the target's last hidden state."""

    kind = "mtp"

    def __init__(self, config, variant: Variant = VARIANTS["deepseek"], module: int = 0, embed: bool = False,
                 head: bool = False, device: str | torch.device = "cpu"):
        """config: the target's (text) config. ``device="meta"`` builds an empty shell for a loader."""
        super().__init__()
        self.config, self.variant, self.module = config, variant, module
        h, eps = config.hidden_size, getattr(config, "rms_norm_eps", 1e-6)
        layer_cls, rotary_cls = _target_classes(config)
        self.block_config = copy.deepcopy(config)
        self.block_config._attn_implementation = "sdpa"
        layer_idx = config.num_hidden_layers + module  # as vLLM: DeepSeek/Qwen3-Next pick MoE by this index
        if getattr(self.block_config, "layer_types", None) is not None:  # an MTP block attends to everything
            types = list(self.block_config.layer_types)
            self.block_config.layer_types = types + ["full_attention"] * (layer_idx + 1 - len(types))
        with torch.device(device):
            self.block = layer_cls(self.block_config, layer_idx)
            norm_cls = type(self.block.input_layernorm)  # the target's RMSNorm (Qwen3-Next's is 1 + w)
            self.enorm, self.hnorm, self.norm = (norm_cls(h, eps=eps) for _ in range(3))
            self.eh_proj = nn.Linear(2 * h, h, bias=False)
            self.embed_tokens = nn.Embedding(config.vocab_size, h) if embed else None
            self.head = nn.Linear(h, config.vocab_size, bias=False) if head else None
        self._rope = _Borrowed(rotary_cls(self.block_config))  # not a submodule: inv_freq stays fp32
        forward = inspect.signature(type(self.block).forward).parameters
        self._cache_kwarg = "cache" if "cache" in forward else "past_key_values"
        self._embed, self._head = _Borrowed(), _Borrowed()  # the target's, when the checkpoint has none
        self._dims = None

    @property
    def taps(self) -> HiddenTaps:
        return HiddenTaps(final=True)

    def forward(self, tokens, features, from_target, positions, kv, cache_len, slots, tree_mask):
        """tokens, positions, slots, tree_mask [B, R]; features [B, R, H]; cache_len [B] -> out [B, R, H]."""
        dtype = self.eh_proj.weight.dtype
        embed = (self.embed_tokens or self._embed.module)(tokens).to(dtype)
        if self.variant.zero_first:
            embed = embed.masked_fill((positions == 0).unsqueeze(-1), 0.0)
        parts = [self.enorm(embed), self.hnorm(features.to(dtype))]
        x = self.eh_proj(torch.cat(parts[::-1] if self.variant.hidden_first else parts, -1))
        mask = torch.ops.specgraph.tree_attention_mask(cache_len, tree_mask, kv[0].shape[2], 0)  # [B, 1, R, S]
        cache = _SlotCache(kv, cache_len.view(-1, 1) + slot_tensor(slots, *tokens.shape, tokens.device))
        h = self.block(hidden_states=x, position_embeddings=self._rope.module(x, positions), attention_mask=mask,
                       position_ids=positions, use_cache=True, **{self._cache_kwarg: cache})
        h = h[0] if isinstance(h, tuple) else h
        return self.norm(h) if self.variant.norm_output else h

    def draft_logits(self, hidden):
        head = self.head or self._head.module
        return head(hidden if self.variant.norm_output else self.norm(hidden))

    def to_target(self, draft_ids):
        return draft_ids

    # ------------------------------------------------------------------ cache
    def _cache_dims(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """((H_k, D_k), (H_v, D_v)) the block hands its cache, found by running it on one token."""
        if self._dims is None:
            probe, param = _ShapeProbe(), self.eh_proj.weight
            x = torch.zeros(1, 1, self.config.hidden_size, dtype=param.dtype, device=param.device)
            pos = torch.zeros(1, 1, dtype=torch.int64, device=param.device)
            with torch.no_grad():
                self.block(hidden_states=x, position_embeddings=self._rope.module(x, pos), attention_mask=None,
                           position_ids=pos, use_cache=True, **{self._cache_kwarg: probe})
            self._dims = probe.dims
        return self._dims

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        (h_k, d_k), (h_v, d_v) = self._cache_dims()
        if (h_k, d_k) != (h_v, d_v):
            raise ValueError(f"this MTP block caches K [{h_k}, {d_k}] and V [{h_v}, {d_v}] per token: see new_cache")
        return 1, h_k, d_k

    def new_cache(self, batch: int, slots: int, device):
        """``[2, B, H_kv, slots, D]`` (K at 0, V at 1), or a [K, V] pair when they differ (MLA latents)."""
        (h_k, d_k), (h_v, d_v) = self._cache_dims()
        dtype = self.eh_proj.weight.dtype
        if (h_k, d_k) == (h_v, d_v):
            return torch.zeros(2, batch, h_k, slots, d_k, dtype=dtype, device=device)
        return [torch.zeros(batch, h_k, slots, d_k, dtype=dtype, device=device),
                torch.zeros(batch, h_v, slots, d_v, dtype=dtype, device=device)]

    # ------------------------------------------------------------------ binding
    def bind(self, model) -> list[str]:
        """Check against the target, borrow its embedding / LM head where the checkpoint has none. returns blockers."""
        t = model.config.get_text_config()
        problems = []
        if t.hidden_size != self.config.hidden_size:
            problems.append(f"MTP hidden size {self.config.hidden_size} != target hidden size {t.hidden_size} (MTP "
                            f"fuses the target's final hidden state with its own embedding)")
        if t.vocab_size != self.config.vocab_size:
            problems.append(f"MTP vocabulary {self.config.vocab_size} != target vocabulary {t.vocab_size}")
        param = next(model.parameters())
        if not param.is_floating_point() or param.is_meta:
            problems.append(f"target weights are {param.dtype} on {param.device}: the MTP module runs in the "
                            f"target's floating dtype on its device")
        if self.head is None and model.get_output_embeddings() is None:
            problems.append("the checkpoint has no shared_head.head and the target has no LM head to share")
        if problems:
            return problems
        self._embed.module = model.get_input_embeddings()
        self._head.module = model.get_output_embeddings()
        self.to(dtype=param.dtype, device=param.device)
        self._rope.module.to(device=param.device)
        self._dims = None
        return []

    # ------------------------------------------------------------------ formats
    @classmethod
    def from_target(cls, path: str | Path, module: int | None = None) -> "MTP":
        """The MTP module inside a HF model directory (config.json + safetensors, sharded or not)."""
        if not isinstance(path, (str, Path)):
            raise TypeError(f"MTP.from_target takes the target's model directory (its config.json and safetensors), "
                            f"not a {type(path).__name__}: the module is read from the checkpoint's own files")
        path = Path(path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path}: no config.json (MTP.from_target takes the target's model directory)")
        raw = read_config(path / "config.json")
        config = _text_config(raw, path / "config.json")
        files = _tensor_files(path)
        layers = config.num_hidden_layers
        layout, found = _detect(files, layers)
        if layout is None:
            raise CheckpointError(f"{path}: no MTP weights: looked for DeepSeek-V3 / GLM 'model.layers.{{>= "
                                  f"{layers}}}.*' (num_hidden_layers={layers}), MiMo 'model.mtp_layers.{{i}}.*' and "
                                  f"Qwen3-Next 'mtp.*' keys")
        count = max(int(raw.get("num_nextn_predict_layers") or 0), max(found) + 1)
        if module is None and count > 1:
            raise CheckpointError(f"{path}: {count} MTP modules (num_nextn_predict_layers); pass module=i to draft "
                                  f"every step with module i (multi-module MTP, module step % k, is not supported yet)")
        module = module or 0
        if not 0 <= module < count:
            raise ValueError(f"module={module}: the checkpoint has MTP modules 0 .. {count - 1}")
        prefix, roles = PREFIX[layout].format(n=layers + module, i=module), ROLES[layout]
        other = re.compile(rf"mtp\.layers\.(?!{module}\.)\d+\.")  # Qwen3-Next: the other modules' blocks
        names = {k: _internal(k[len(prefix):], roles, module) for k in files
                 if k.startswith(prefix) and not other.match(k)}  # checkpoint key -> internal key
        quantized = sorted(k for k in names if k.endswith(("_scale_inv", "weight_scale", ".qweight")))
        if quantized:
            raise CheckpointError(f"{path}: quantized MTP weights {quantized[:4]}: dequantize the checkpoint first")
        state = _load(files, list(names))
        variant = VARIANTS[layout]
        if raw.get("specgraph_mtp"):  # a save_pretrained directory: the family's wiring in DeepSeek names
            variant = Variant(layout, **raw["specgraph_mtp"])
        internal = set(names.values())
        draft = cls(config, variant, module, embed="embed_tokens.weight" in internal, head="head.weight" in internal,
                    device="meta")
        shell = draft.state_dict()
        back = {_external(k, prefix, roles, module): k for k in shell}  # checkpoint name -> internal name
        expected = {name: shell[k] for name, k in back.items()}
        state = _fuse_experts(state, expected)
        check_keys(state, expected, set(), f"{layout} MTP (module {module})", path)
        draft.load_state_dict({back[k]: v for k, v in state.items()}, assign=True)
        empty = [n for n, t in [*draft.named_parameters(), *draft.named_buffers()] if t.is_meta]
        if empty:
            raise CheckpointError(f"{path}: MTP tensors {empty} were neither in the checkpoint nor computed")
        return draft.eval()

    def save_pretrained(self, path: str | Path) -> None:
        """The DeepSeek-V3 layout: ``model.layers.{L}.*`` (MTP keys only) and the target's config."""
        prefix, roles = PREFIX["deepseek"].format(n=self.config.num_hidden_layers), ROLES["deepseek"]
        state = {}
        for key, value in self.state_dict().items():
            if key == "eh_proj.weight" and self.variant.hidden_first:  # to DeepSeek's [enorm(e), hnorm(f)] order
                value = torch.cat(value.chunk(2, dim=1)[::-1], 1)
            state[_external(key, prefix, roles, 0)] = value
        config = self.config.to_dict()
        config.update(num_nextn_predict_layers=1, specgraph_mtp=dict(
            hidden_first=False, zero_first=self.variant.zero_first, norm_output=self.variant.norm_output))
        write_checkpoint(path, _split_experts(state), config)


# ---------------------------------------------------------------------- helpers
def _text_config(raw: dict, file: Path):
    """The target's text config from its config.json (``file``, named when transformers cannot build it)."""
    from transformers import AutoConfig

    fields = {k: v for k, v in raw.items() if k not in ("model_type", "specgraph_mtp")}
    model_type = REMOTE_BASES.get(raw.get("model_type"), raw.get("model_type"))
    if model_type is None:
        raise CheckpointError(f"{file.parent}: its config.json has no model_type (MTP.from_target takes the target's "
                              f"model directory, whose config names its architecture)")
    return build_config(lambda: AutoConfig.for_model(model_type, **fields), file).get_text_config()


def _target_classes(config) -> tuple[type, type]:
    """The target's decoder-layer and rotary-embedding classes (read off a meta-device instance)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        decoder = AutoModelForCausalLM.from_config(config).get_decoder()
    return type(decoder.layers[0]), type(decoder.rotary_emb)


def _tensor_files(path: Path) -> dict[str, Path]:
    """checkpoint key -> the safetensors file holding it (index.json when sharded; headers only)."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_config(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no weight_map (an object of tensor name -> file): save the model again")
        return {k: path / f for k, f in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors (MTP.from_target reads safetensors checkpoints)")
    where = {}
    for file in files:
        try:
            with safe_open(str(file), "pt") as handle:
                where.update(dict.fromkeys(handle.keys(), file))
        except Exception as err:  # a truncated or corrupted file: say which
            raise unreadable(file, "MTP", err) from err
    return where


def _load(files: dict[str, Path], keys: list[str]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    state, by_file = {}, {}
    for key in keys:
        by_file.setdefault(files[key], []).append(key)
    for file, wanted in by_file.items():
        try:
            with safe_open(str(file), "pt") as handle:
                state.update({k: handle.get_tensor(k) for k in wanted})
        except Exception as err:  # a missing shard, a truncated or corrupted file: say which
            raise unreadable(file, "MTP", err) from err
    return state


def _detect(files, layers: int) -> tuple[str | None, list[int]]:
    """(layout, module indices present) from the checkpoint's key names."""
    for layout, pattern, offset in (("qwen3_next", r"mtp\.(?:layers\.(\d+)\.)?", 0),
                                    ("mimo", r"model\.mtp_layers\.(\d+)\.", 0),
                                    ("deepseek", r"model\.layers\.(\d+)\.", layers)):
        found = {int(m.group(1) or 0) - offset for k in files if (m := re.match(pattern, k))}
        found = sorted(i for i in found if i >= 0)
        if found:
            return layout, found
    return None, []


def _internal(rel: str, roles, module: int) -> str:
    """Checkpoint name under the module's prefix -> internal name (unknown names pass through to check_keys)."""
    for internal, external in roles:
        if rel.startswith(external.format(i=module)):
            return internal + rel[len(external.format(i=module)):]
    return rel


def _external(key: str, prefix: str, roles, module: int) -> str:
    for internal, external in roles:
        if key.startswith(internal):
            return prefix + external.format(i=module) + key[len(internal):]
    raise KeyError(key)


def _fuse_experts(state: dict, expected: dict) -> dict:
    """Per-expert checkpoint weights -> transformers' fused ``experts.gate_up_proj`` [E, 2I, H] / ``down_proj``."""
    for name, ref in expected.items():
        base, sep, kind = name.rpartition(".experts.")
        if not sep or kind not in ("gate_up_proj", "down_proj") or name in state:
            continue
        parts = ("gate_proj", "up_proj") if kind == "gate_up_proj" else ("down_proj",)
        keys = [[f"{base}.experts.{e}.{p}.weight" for e in range(ref.shape[0])] for p in parts]
        if all(k in state for ks in keys for k in ks):
            state[name] = torch.cat([torch.stack([state.pop(k) for k in ks]) for ks in keys], 1)
    return state


def _split_experts(state: dict) -> dict:
    """The inverse of ``_fuse_experts``: the per-expert names every MoE checkpoint uses."""
    out = {}
    for name, value in state.items():
        base, sep, kind = name.rpartition(".experts.")
        if sep and kind == "gate_up_proj":
            for e, (gate, up) in enumerate(zip(*value.chunk(2, dim=1))):
                out[f"{base}.experts.{e}.gate_proj.weight"], out[f"{base}.experts.{e}.up_proj.weight"] = gate, up
        elif sep and kind == "down_proj":
            out.update({f"{base}.experts.{e}.down_proj.weight": w for e, w in enumerate(value)})
        else:
            out[name] = value
    return out
