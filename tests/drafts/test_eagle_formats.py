"""EAGLE-1/2 and EAGLE-3 checkpoints in the public layouts: synthetic
checkpoints written with the keys, shapes and config fields the reference
systems write, loaded, round-tripped, and refused by name when wrong. The
EAGLE-3 variants are checked against a plain-torch float64 reference of the
published math (the oracle does not share the draft's code)."""
import json
import math

import pytest
import torch
import transformers
from safetensors.torch import save_file

import specgraph
from specgraph.drafts import Eagle, Eagle3
from specgraph.errors import CheckpointError
from specgraph.drafts.autoregressive import chain_mask
from test_capture import tiny_model

H, V, HEADS, KV_HEADS = 64, 101, 4, 2


def _write(path, state: dict, config: dict, torch_file: bool = False):
    path.mkdir(parents=True, exist_ok=True)
    if torch_file:
        torch.save(state, path / "pytorch_model.bin")
    else:
        save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))


def _llama_fields(**extra) -> dict:
    return dict(architectures=["LlamaForCausalLM"], hidden_size=H, intermediate_size=96, num_attention_heads=HEADS,
                num_key_value_heads=KV_HEADS, num_hidden_layers=1, vocab_size=V, rms_norm_eps=1e-6,
                rope_theta=10000.0, max_position_embeddings=512) | extra


def _random_state(module: torch.nn.Module, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: (torch.randn(v.shape, generator=g) * 0.2 + (1.0 if "norm" in k else 0.0)) if v.is_floating_point() else v
            for k, v in module.state_dict().items()}


def _eagle1_state(bias: bool) -> dict:
    return _random_state(Eagle(transformers.LlamaConfig(**_llama_fields()), bias=bias), 1)


# ----------------------------------------------------------------------------- EAGLE-1/2
@pytest.mark.parametrize("layout", ["safeailab-vicuna", "safeailab-llama3", "vllm"])
def test_eagle_layouts_load(tmp_path, layout):
    bias = layout == "safeailab-vicuna"  # Vicuna configs say nothing about bias: fc has one
    state = _eagle1_state(bias)
    config = _llama_fields() if bias else _llama_fields(bias=False)
    if layout == "vllm":  # prefixed names, no embedding (the target's is shared)
        state = {"model." + k: v for k, v in state.items() if not k.startswith("embed_tokens")}
    _write(tmp_path, state, config, torch_file=layout == "safeailab-vicuna")
    draft = Eagle.from_pretrained(tmp_path)
    assert (draft.fc.bias is not None) == bias
    assert draft.embed_from_target == (layout == "vllm")
    for key, value in draft.state_dict().items():
        if not (layout == "vllm" and key.startswith("embed_tokens")):
            assert torch.equal(value, state[("model." if layout == "vllm" else "") + key]), key


def test_eagle_round_trip_and_errors(tmp_path):
    state = _eagle1_state(True)
    _write(tmp_path / "src", state, _llama_fields())
    draft = Eagle.from_pretrained(tmp_path / "src")
    draft.save_pretrained(tmp_path / "copy")
    again = Eagle.from_pretrained(tmp_path / "copy")
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in draft.state_dict().items())
    broken = {k: v for k, v in state.items() if k != "layers.0.mlp.down_proj.weight"}
    _write(tmp_path / "missing", broken, _llama_fields())
    with pytest.raises(ValueError, match=r"missing weights \['layers.0.mlp.down_proj.weight'\]"):
        Eagle.from_pretrained(tmp_path / "missing")
    _write(tmp_path / "extra", {**state, "layers.0.input_layernorm.weight": torch.ones(H)}, _llama_fields())
    with pytest.raises(ValueError, match="unexpected weights .*input_layernorm"):
        Eagle.from_pretrained(tmp_path / "extra")
    _write(tmp_path / "shape", {**state, "fc.weight": torch.zeros(H, H)}, _llama_fields())
    with pytest.raises(ValueError, match=r"fc.weight: checkpoint \(64, 64\) != expected \(64, 128\)"):
        Eagle.from_pretrained(tmp_path / "shape")
    _write(tmp_path / "deep", state, _llama_fields() | {"num_hidden_layers": 2})
    with pytest.raises(ValueError, match="num_hidden_layers=2"):
        Eagle.from_pretrained(tmp_path / "deep")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Eagle.from_pretrained(tmp_path / "nowhere")
    for field, value in (("hidden_size", "64"), ("rms_norm_eps", "tiny")):  # checked as EAGLE-3's, file named
        _write(tmp_path / "typed", state, _llama_fields() | {field: value})
        with pytest.raises(CheckpointError, match=rf"typed/config.json: .*{field}"):
            Eagle.from_pretrained(tmp_path / "typed")


def test_eagle_bind_names_every_mismatch():
    model = tiny_model("llama")
    draft = Eagle(transformers.LlamaConfig(**(_llama_fields() | {"hidden_size": 32, "vocab_size": 99})))
    with pytest.raises(specgraph.CompileError) as err:
        specgraph.compile(model, draft, tree=specgraph.Chain(2))
    assert "vocabulary 99 != target vocabulary 101" in str(err.value)
    assert "hidden size 32 != target hidden size 64" in str(err.value)


# ----------------------------------------------------------------------------- EAGLE-3
def _eagle3_config(**extra) -> dict:
    return _llama_fields(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=40, target_hidden_size=H) | extra


def _eagle3_state(config: dict, seed: int = 2) -> dict:
    draft = _build_eagle3(config)
    state = _random_state(draft, seed)
    used = torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:40].sort().values
    state["d2t"], state["t2d"] = used - torch.arange(40), torch.isin(torch.arange(V), used)
    return {k: v for k, v in state.items() if not k.startswith("embed_tokens")}


def _build_eagle3(config: dict) -> Eagle3:
    path_flags = {**config, **(config.get("eagle_config") or {})}
    llama = transformers.LlamaConfig(**{k: v for k, v in config.items() if k in _llama_fields() and k != "architectures"})
    llama.draft_vocab_size, llama.target_hidden_size = config["draft_vocab_size"], config["target_hidden_size"]
    return Eagle3(llama, (1, 1, 1), "layer_output", **{f: bool(path_flags.get(f)) for f in
                                                        ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")})


def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, positions, theta=10000.0):
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions.double()[:, None] * inv[None]  # [R, D/2]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    rotated = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + rotated * sin


def eagle3_reference(s: dict, flags: dict, embed: torch.Tensor, tokens: list[int], feats: torch.Tensor):
    """The published EAGLE-3 first step over a causal chain, float64, from the raw state dict.

    returns (hidden fed to the next step [R, H], logits [R, V_draft])."""
    s = {k: v.double() for k, v in s.items() if v.is_floating_point()}
    g = feats.double()
    if flags.get("norm_before_fc"):
        g = _rms(g, s["input_norm.weight"])
    if flags.get("fc_norm"):
        g = torch.cat([_rms(part, s[f"fc_norm.{i}.weight"]) for i, part in enumerate(g.chunk(3, -1))], -1)
    g = g @ s["fc.weight"].T
    normed = _rms(g, s["midlayer.hidden_norm.weight"])
    a = torch.cat([_rms(embed.double()[tokens], s["midlayer.input_layernorm.weight"]), normed], -1)
    r, d = len(tokens), H // HEADS
    q = (a @ s["midlayer.self_attn.q_proj.weight"].T).view(r, HEADS, d).transpose(0, 1)
    k = (a @ s["midlayer.self_attn.k_proj.weight"].T).view(r, KV_HEADS, d).transpose(0, 1)
    v = (a @ s["midlayer.self_attn.v_proj.weight"].T).view(r, KV_HEADS, d).transpose(0, 1)
    pos = torch.arange(r)
    q, k = _rope(q, pos), _rope(k, pos).repeat_interleave(HEADS // KV_HEADS, 0)
    v = v.repeat_interleave(HEADS // KV_HEADS, 0)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(d) + torch.full((r, r), float("-inf")).triu(1)
    attn = (torch.softmax(scores, -1) @ v).transpose(0, 1).reshape(r, H)
    h = (normed if flags.get("norm_before_residual") else g) + attn @ s["midlayer.self_attn.o_proj.weight"].T
    m = _rms(h, s["midlayer.post_attention_layernorm.weight"])
    mlp = (torch.nn.functional.silu(m @ s["midlayer.mlp.gate_proj.weight"].T) * (m @ s["midlayer.mlp.up_proj.weight"].T))
    h = h + mlp @ s["midlayer.mlp.down_proj.weight"].T
    out = _rms(h, s["norm.weight"])
    return (out if flags.get("norm_output") else h), out @ s["lm_head.weight"].T


VARIANTS = {
    "plain": {},
    "norm_before_residual": {"norm_before_residual": True},
    "norm_before_fc": {"eagle_config": {"norm_before_fc": True}},  # NVIDIA checkpoints keep it in eagle_config
    "fc_norm": {"fc_norm": True},
    "norm_output": {"norm_output": True},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_eagle3_variants_match_the_published_math(tmp_path, variant):
    config = _eagle3_config(**VARIANTS[variant])
    state = _eagle3_state(config)
    _write(tmp_path, state, config)
    draft = Eagle3.from_pretrained(tmp_path)
    assert draft.embed_from_target
    embed = torch.randn(V, H, generator=torch.Generator().manual_seed(5))
    draft.embed_tokens.weight.data.copy_(embed)
    tokens, feats = [5, 17, 3, 99, 42], torch.randn(5, 3 * H, generator=torch.Generator().manual_seed(6))
    kv = draft.new_cache(1, 80, "cpu")
    idx = torch.arange(5).unsqueeze(0)
    with torch.no_grad():
        hidden = draft(torch.tensor([tokens]), feats[None], True, idx, kv, torch.zeros(1, dtype=torch.long), idx,
                       chain_mask(5, "cpu")[None])[0]
        logits = draft.draft_logits(hidden)
    flags = {**config, **(config.get("eagle_config") or {})}
    want_hidden, want_logits = eagle3_reference(state, flags, embed, tokens, feats)
    torch.testing.assert_close(hidden.double(), want_hidden, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits.double(), want_logits, atol=1e-4, rtol=1e-4)
    assert torch.equal(draft.to_target(torch.arange(40)), torch.arange(40) + state["d2t"])


def test_eagle3_modelopt_names_and_round_trip(tmp_path):
    config = _eagle3_config(norm_before_residual=True)
    state = _eagle3_state(config)
    layer_keys = ("midlayer.self_attn", "midlayer.mlp", "midlayer.post")
    modelopt = {("layers.0." + k[len("midlayer."):]) if k.startswith(layer_keys) else k: v for k, v in state.items()}
    modelopt["input_embeds_norm.weight"] = modelopt.pop("midlayer.input_layernorm.weight")
    modelopt["hidden_norm.weight"] = modelopt.pop("midlayer.hidden_norm.weight")
    modelopt["eagle_lm_head.weight"] = modelopt.pop("lm_head.weight")
    _write(tmp_path / "modelopt", modelopt, config)
    draft = Eagle3.from_pretrained(tmp_path / "modelopt")
    assert all(torch.equal(draft.state_dict()[k], v) for k, v in state.items())
    draft.save_pretrained(tmp_path / "copy")
    again = Eagle3.from_pretrained(tmp_path / "copy")
    assert again.norm_before_residual and again.aux_layer_ids == draft.aux_layer_ids
    assert all(torch.equal(again.state_dict()[k], v) for k, v in state.items())


def test_eagle3_aux_layer_conventions(tmp_path):
    config = _eagle3_config()
    state = _eagle3_state(config)
    _write(tmp_path / "none", state, config)
    _write(tmp_path / "ids", state, config | {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}})
    _write(tmp_path / "named", state, config | {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 3, 4]},
                                               "specgraph_aux_convention": "layer_input"})
    ids = Eagle3.from_pretrained(tmp_path / "ids")
    assert (ids.aux_layer_ids, ids.aux_convention) == ((1, 2, 3), "layer_output")  # ModelOpt / SpecForge / SGLang
    named = Eagle3.from_pretrained(tmp_path / "named")
    assert (named.aux_layer_ids, named.aux_convention) == ((2, 3, 4), "layer_input")
    assert Eagle3.from_pretrained(tmp_path / "ids", aux_convention="layer_input").aux_convention == "layer_input"
    target = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=H, intermediate_size=96, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        num_hidden_layers=8, vocab_size=V, attn_implementation="sdpa"))
    default = Eagle3.from_pretrained(tmp_path / "none")
    assert default.bind(target) == []
    assert (default.aux_layer_ids, default.aux_convention) == ((2, 4, 5), "layer_input")  # EAGLE's (2, L//2, L-3)


def test_eagle3_refusals_name_the_problem(tmp_path):
    config = _eagle3_config()
    state = _eagle3_state(config)
    _write(tmp_path / "mtp_norm", state, config | {"eagle_config": {"use_mtp_layernorm": True}})
    with pytest.raises(ValueError, match="not supported yet: use_mtp_layernorm=True"):
        Eagle3.from_pretrained(tmp_path / "mtp_norm")
    _write(tmp_path / "deep", state, config | {"num_hidden_layers": 2})
    with pytest.raises(ValueError, match="num_hidden_layers=2"):
        Eagle3.from_pretrained(tmp_path / "deep")
    import transformers  # a target model's directory, not a head: said so, not "multi-layer head"

    target = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, vocab_size=64))
    target.save_pretrained(tmp_path / "target")
    with pytest.raises(ValueError, match="LlamaForCausalLM directory with 2 layers, not an EAGLE-3 head"):
        Eagle3.from_pretrained(tmp_path / "target")
    _write(tmp_path / "no_d2t", {k: v for k, v in state.items() if k != "d2t"}, config)
    with pytest.raises(ValueError, match=r"missing weights \['d2t'\]"):
        Eagle3.from_pretrained(tmp_path / "no_d2t")
    _write(tmp_path / "wide", state, config | {"target_hidden_size": 32})
    with pytest.raises(ValueError, match="fc.weight"):
        Eagle3.from_pretrained(tmp_path / "wide")


def test_eagle3_bind_names_every_mismatch(tmp_path):
    config = _eagle3_config(target_hidden_size=32, vocab_size=99)
    state = _eagle3_state(config)
    state["t2d"] = torch.zeros(99, dtype=torch.bool)
    _write(tmp_path, state, config | {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 7]}})
    draft = Eagle3.from_pretrained(tmp_path)
    with pytest.raises(specgraph.CompileError) as err:
        specgraph.compile(tiny_model("llama"), draft, tree=specgraph.Chain(2))
    message = str(err.value)
    assert "vocabulary 99 != target vocabulary 101" in message
    assert "fc reads 3 x 32 target features; the target's hidden size is 64" in message
    assert "aux layer ids [0, 1, 7]" in message


def test_eagle3_ships_in_bf16_shards(tmp_path):
    """A head small enough to move: bf16, split into shards with transformers' index; it loads back."""
    config = _eagle3_config()
    state = _eagle3_state(config)
    _write(tmp_path / "src", state, config)
    draft = Eagle3.from_pretrained(tmp_path / "src")
    draft.save_pretrained(tmp_path / "bf16", dtype=torch.bfloat16, max_shard_bytes=40_000)
    shards = sorted((tmp_path / "bf16").glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "bf16" / "model.safetensors.index.json").is_file()
    assert all(f.stat().st_size < 40_000 + 20_000 for f in shards)  # each shard stays near the limit
    again = Eagle3.from_pretrained(tmp_path / "bf16")
    for key, value in draft.state_dict().items():
        if key in state:  # bf16 on disk: the loaded values are the bf16-rounded originals
            want = value.to(torch.bfloat16).float() if value.is_floating_point() else value
            assert torch.equal(again.state_dict()[key], want), key


@pytest.mark.parametrize("field, value", [("hidden_size", "64"), ("draft_vocab_size", "256"),
                                          ("eagle_aux_hidden_state_layer_ids", "1,2,3"), ("hidden_size", None)])
def test_a_config_field_of_the_wrong_type_or_missing_is_named(tmp_path, field, value):
    """A head's shapes come from its config: a size that is not an integer, aux ids that are not a list of
    integers, or no hidden_size at all (LlamaConfig would take 4096) are named with the file."""
    import json

    from specgraph.drafts import Eagle3

    (tmp_path / "config.json").write_text(json.dumps({**{"hidden_size": 64, "num_attention_heads": 4,
                                                         "num_key_value_heads": 2, "vocab_size": 256},
                                                      **({field: value} if value is not None else {})}
                                                     if value is not None else {"num_attention_heads": 4}))
    from safetensors.torch import save_file

    save_file({"fc.weight": torch.zeros(64, 192)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=f"config.json: .*{'hidden_size missing' if value is None else field}"):
        Eagle3.from_pretrained(tmp_path)
