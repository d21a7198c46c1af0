"""MTP drafts: the module a target checkpoint ships, in its three layouts.

Oracles: the tensors written into synthetic checkpoint directories (loading);
the MTP formula written out here from the written tensors and the target's
own HF decoder layer run causally (forward, per layout, and genuine
DeepSeek-V3 MLA/MoE and Qwen3-Next blocks); the draft run alone on each node's root path
(proposals, as for EAGLE); the draft run alone over the final sequence (the
state commit leaves); the target's greedy ``model.generate`` (token-exact)."""
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import specgraph
from specgraph import Chain, DynamicTree
from specgraph.drafts import MTP
from specgraph.drafts.autoregressive import chain_mask
from test_capture import tiny_model
from test_eagle import SMALL_STATIC, check_dynamic_row, oracle_logprobs, propose_once
from test_generate import (_small_vocab_model, assert_one_compile_across_lengths, generated_rows, hf_greedy, left_pad,
                           prompts)

TARGET = {"deepseek": "llama", "mimo": "qwen2", "qwen3_next": "qwen3"}  # GLM-style, MiMo's own, key layout only
PREFIX = {"deepseek": "model.layers.{L}.", "mimo": "model.mtp_layers.0.", "qwen3_next": "mtp."}
BLOCK = {"deepseek": "", "mimo": "", "qwen3_next": "layers.0."}
PARTS = {  # role -> checkpoint name under the prefix (vLLM deepseek_mtp / mimo_mtp / qwen3_next_mtp)
    "deepseek": dict(enorm="enorm", hnorm="hnorm", proj="eh_proj", norm="shared_head.norm", head="shared_head.head",
                     embed="embed_tokens"),
    "mimo": dict(enorm="token_layernorm", hnorm="hidden_layernorm", proj="input_proj", norm="final_layernorm"),
    "qwen3_next": dict(enorm="pre_fc_norm_embedding", hnorm="pre_fc_norm_hidden", proj="fc", norm="norm"),
}
ATTR = dict(enorm="enorm", hnorm="hnorm", proj="eh_proj", norm="norm", head="head", embed="embed_tokens")
FAMILY = {"deepseek": (False, True, False), "mimo": (True, True, True), "qwen3_next": (False, False, True)}
DYNAMIC = DynamicTree(steps=3, topk=3, nodes=8)


def mtp_weights(model, layout: str, seed: int = 5, extras=("head", "embed")) -> dict[str, torch.Tensor]:
    """Random MTP tensors under ``layout``'s names, shaped as the reference systems load them."""
    torch.manual_seed(seed)
    config, h, v = model.config, model.config.hidden_size, model.config.vocab_size
    prefix = PREFIX[layout].format(L=config.num_hidden_layers)
    block = type(model.model.layers[0])(config, 0).state_dict()  # names and shapes only
    out = {}
    for key, value in block.items():
        value = 1 + 0.1 * torch.randn_like(value) if key.endswith("norm.weight") else torch.randn_like(value) * 0.1
        if "q_proj" in key or "k_proj" in key:  # random init attends almost uniformly: sharpen
            value = value * 12.0
        out[prefix + BLOCK[layout] + key] = value
    shapes = dict(enorm=(h,), hnorm=(h,), proj=(h, 2 * h), norm=(h,), head=(v, h), embed=(v, h))
    for role, name in PARTS[layout].items():
        if role in ("head", "embed") and role not in extras:
            continue
        out[f"{prefix}{name}.weight"] = 1 + 0.1 * torch.randn(shapes[role]) if "norm" in role else \
            torch.randn(shapes[role]) * (1.0 if role == "embed" else 0.2)
    return out


def write_target(model, path, mtp: dict, sharded: bool = False, **config_extra):
    """A HF model directory of ``model`` whose safetensors also carry ``mtp``."""
    model.save_pretrained(path, max_shard_size="40KB" if sharded else "5GB")
    if sharded:
        save_file(mtp, str(path / "mtp.safetensors"))
        index = json.loads((path / "model.safetensors.index.json").read_text())
        index["weight_map"].update(dict.fromkeys(mtp, "mtp.safetensors"))
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        save_file({**load_file(str(path / "model.safetensors")), **mtp}, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config.update({"num_nextn_predict_layers": 1, **config_extra})
    (path / "config.json").write_text(json.dumps(config))
    return path


def mtp_target(layout: str, path, model=None, **kwargs):
    model = model if model is not None else tiny_model(TARGET[layout])
    written = mtp_weights(model, layout, **kwargs)
    draft = MTP.from_target(write_target(model, path, written))
    assert draft.bind(model) == []
    return model, draft, written


def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def formula(model, written: dict, layout: str, tokens: torch.Tensor, features: torch.Tensor, layer=None, norm=None):
    """The MTP math written out from the checkpoint tensors: (fed-back state, logits) over a chain [1, T].

    The block is ``layer`` (default: a fresh target layer holding the written block) run causally by HF."""
    config = model.config
    prefix = PREFIX[layout].format(L=config.num_hidden_layers)
    part = {role: written.get(f"{prefix}{name}.weight") for role, name in PARTS[layout].items()}
    hidden_first, zero_first, norm_output = FAMILY[layout]
    norm = norm or (lambda x, w: rms(x, w, config.rms_norm_eps))
    emb = model.get_input_embeddings()(tokens) if part.get("embed") is None else part["embed"][tokens]
    positions = torch.arange(tokens.shape[1]).unsqueeze(0)
    if zero_first:
        emb = torch.where(positions.unsqueeze(-1) == 0, 0.0, emb)
    e, f = norm(emb, part["enorm"]), norm(features, part["hnorm"])
    x = torch.cat([f, e] if hidden_first else [e, f], -1) @ part["proj"].T
    if layer is None:
        layer, block = type(model.model.layers[0])(config, 0), prefix + BLOCK[layout]
        layer.load_state_dict({k[len(block):]: v for k, v in written.items() if k.startswith(block) and
                               k[len(block):].split(".")[0] in ("self_attn", "mlp", "input_layernorm",
                                                                  "post_attention_layernorm")})
    with torch.no_grad():
        h = layer(hidden_states=x, position_embeddings=model.model.rotary_emb(x, positions), position_ids=positions)
    normed = norm(h, part["norm"])
    head = model.lm_head.weight if part.get("head") is None else part["head"]
    return (normed if norm_output else h)[0], (normed @ head.T)[0]


def target_features(model, tokens: list[int]) -> torch.Tensor:
    """[T, H]: the target's final post-norm hidden state (the LM head's input) at every token."""
    with torch.no_grad():
        return model.model(torch.tensor([tokens])).last_hidden_state[0]


# ---------------------------------------------------------------------- loading
@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("layout", list(PARTS))
def test_every_mtp_tensor_loads_where_its_layout_puts_it(layout, sharded, tmp_path):
    model = tiny_model(TARGET[layout])
    written = mtp_weights(model, layout)
    draft = MTP.from_target(write_target(model, tmp_path, written, sharded=sharded))
    assert (draft.variant.layout, draft.kind, draft.taps.final) == (layout, "mtp", True)
    assert (draft.variant.hidden_first, draft.variant.zero_first, draft.variant.norm_output) == FAMILY[layout]
    assert type(draft.block) is type(model.model.layers[0])
    prefix = PREFIX[layout].format(L=model.config.num_hidden_layers)
    own = draft.state_dict()
    for role, name in PARTS[layout].items():
        assert torch.equal(own[ATTR[role] + ".weight"], written[f"{prefix}{name}.weight"]), role
    block = {k[len(prefix + BLOCK[layout]):]: v for k, v in written.items() if k.startswith(prefix + BLOCK[layout])
             and not any(k == f"{prefix}{n}.weight" for n in PARTS[layout].values())}
    assert block.keys() == draft.block.state_dict().keys()
    for key, value in block.items():
        assert torch.equal(draft.block.state_dict()[key], value), key
    assert len(own) == len(block) + len(PARTS[layout])  # nothing else, nothing random
    assert draft.bind(model) == []
    if layout != "deepseek":  # these layouts share the target's embedding and LM head
        assert draft._embed.module is model.get_input_embeddings() and draft._head.module is model.lm_head


@pytest.mark.parametrize("layout", list(PARTS))
def test_forward_is_the_layouts_formula(layout, tmp_path):
    model, draft, written = mtp_target(layout, tmp_path)
    tokens = prompts(2, [9])[0]
    features = target_features(model, tokens)
    want_out, want_logits = formula(model, written, layout, torch.tensor([tokens[1:]]), features[None, :-1])
    t = len(tokens) - 1
    pairs = torch.arange(t).unsqueeze(0)
    with torch.no_grad():
        out = draft(torch.tensor([tokens[1:]]), features[None, :-1], True, pairs, draft.new_cache(1, 96, "cpu"),
                    torch.zeros(1, dtype=torch.long), pairs, chain_mask(t, "cpu").unsqueeze(0))
        torch.testing.assert_close(out[0], want_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(draft.draft_logits(out)[0], want_logits, atol=1e-4, rtol=1e-4)


GENUINE_COMMON = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, vocab_size=101,
                      max_position_embeddings=512, attn_implementation="sdpa")
GENUINE = {  # transformers' own MoE targets; the MTP block is a copy of layer ``source`` (same class and kind)
    "deepseek": (1, lambda: transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        num_hidden_layers=2, first_k_dense_replace=1, moe_intermediate_size=32, n_routed_experts=4, n_group=1,
        topk_group=1, num_experts_per_tok=2, n_shared_experts=1, num_key_value_heads=4, q_lora_rank=32,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, **GENUINE_COMMON))),
    "qwen3_next": (3, lambda: transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(
        num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"], num_key_value_heads=2,
        head_dim=16, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, **GENUINE_COMMON))),
}


@pytest.mark.parametrize("layout", list(GENUINE), ids=["deepseek_v3_mla", "qwen3_next_gated"])
def test_a_genuine_moe_block_loads_as_transformers_loads_it_and_runs(layout, tmp_path):
    """DeepSeek-V3 (MLA: K and V latents of different widths get their own cache) and Qwen3-Next (gated
    attention, 1 + w norms): per-expert checkpoint weights are fused exactly as transformers fuses them."""
    source, make = GENUINE[layout]
    torch.manual_seed(0)
    model = make().eval()
    model.save_pretrained(tmp_path)
    saved, prefix = load_file(str(tmp_path / "model.safetensors")), PREFIX[layout].format(L=model.config.num_hidden_layers)
    mtp = {k.replace(f"model.layers.{source}.", prefix + BLOCK[layout]): v for k, v in saved.items()
           if k.startswith(f"model.layers.{source}.")}
    assert any(".mlp.experts.3.up_proj." in k for k in mtp)  # the checkpoint names experts one by one
    mtp.update({k: v for k, v in mtp_weights(model, layout).items() if k[len(prefix):].split(".")[0] in
                {name.split(".")[0] for name in PARTS[layout].values()}})
    draft = MTP.from_target(write_target(model, tmp_path, mtp))
    layer = model.model.layers[source]
    for key, value in layer.state_dict().items():  # transformers' own load of the same tensors
        assert torch.equal(draft.block.state_dict()[key], value), key
    assert draft.bind(model) == []
    kv = draft.new_cache(1, 96, "cpu")
    if layout == "deepseek":
        assert [tuple(c.shape) for c in kv] == [(1, 1, 96, 16), (1, 1, 96, 8)]  # kv_lora_rank, qk_rope_head_dim
    tokens = prompts(3, [8])[0]
    features = target_features(model, tokens)

    def norm(x, w):  # the target's own RMSNorm class (Qwen3-Next: x * (1 + w))
        module = type(layer.input_layernorm)(w.shape[0], eps=model.config.rms_norm_eps)
        module.weight.data.copy_(w)
        return module(x)

    with torch.no_grad():  # the first 5 pairs as one chain, then the last two one row at a time
        want, want_logits = formula(model, mtp, layout, torch.tensor([tokens[1:]]), features[None, :-1], layer, norm)
        pairs = torch.arange(5).unsqueeze(0)
        outs = [draft(torch.tensor([tokens[1:6]]), features[None, :5], True, pairs, kv, torch.zeros(1, dtype=torch.long),
                      pairs, chain_mask(5, "cpu").unsqueeze(0))[0]]
        for p in (5, 6):
            at = torch.tensor([p])
            outs.append(draft(torch.tensor([[tokens[p + 1]]]), features[None, p:p + 1], True, at.view(1, 1), kv, at,
                              torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.long))[0])
        out = torch.cat(outs)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(draft.draft_logits(out), want_logits, atol=1e-4, rtol=1e-4)
    draft.save_pretrained(tmp_path / "saved")  # DeepSeek names, experts one by one again, and loaded back
    assert all(".experts.gate_up_proj" not in k for k in load_file(str(tmp_path / "saved" / "model.safetensors")))
    again = MTP.from_target(tmp_path / "saved")
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in draft.state_dict().items())


# ---------------------------------------------------------------------- drafting
@pytest.mark.parametrize("layout", list(PARTS))
@pytest.mark.parametrize("tree", [SMALL_STATIC, DynamicTree(steps=4, topk=3, nodes=10)], ids=["static", "dynamic"])
def test_every_proposed_node_is_what_the_draft_picks_on_its_root_path(tree, layout, tmp_path):
    model, draft, _ = mtp_target(layout, tmp_path)
    rows, features, seen, proposed = propose_once(model, draft, tree)
    for b, prompt in enumerate(rows):
        if isinstance(tree, DynamicTree):
            check_dynamic_row(draft, features, prompt, tree, seen, proposed, b)
            continue
        parents, tokens = proposed.parents[b].tolist(), proposed.tokens[b].tolist()
        depth = [len(root_path(parents, tokens, i)) for i in range(len(tokens))]
        for d, (values, _) in enumerate(seen):  # each level's call: its expanding nodes' top-k, as run alone
            expanding = sorted({parents[i] for i in range(1, len(tokens)) if depth[i] == d + 1})
            for j, node in enumerate(expanding):
                want = oracle_logprobs(draft, features[b], prompt, root_path(parents, tokens, node)).topk(tree.topk)
                torch.testing.assert_close(values[b, j], want.values, atol=1e-5, rtol=1e-5)
        for i in range(1, len(tokens)):  # node i is its parent's rank-r pick
            logprobs = oracle_logprobs(draft, features[b], prompt, root_path(parents, tokens, parents[i]))
            assert torch.isclose(logprobs[tokens[i]], logprobs.topk(tree.topk).values[tree.ranks()[i]], atol=1e-5), (b, i)


def root_path(parents: list[int], tokens: list[int], node: int) -> list[int]:
    """The drafted tokens from the root's child down to ``node`` (empty for the root)."""
    path = []
    while node > 0:
        path.append(tokens[node])
        node = parents[node]
    return path[::-1]


@pytest.mark.parametrize("tree", [Chain(3), SMALL_STATIC, DYNAMIC], ids=["chain", "static", "dynamic"])
def test_greedy_is_token_exact(tree, tmp_path):
    model, draft, _ = mtp_target("deepseek", tmp_path, extras=())  # the target's embedding and LM head
    spec = specgraph.compile(model, draft, tree=tree, max_batch=3, max_cache_len=200)
    rows = prompts(4, [5, 17, 11])
    ids, mask = left_pad(rows)
    out = spec.generate(ids, attention_mask=mask, max_new_tokens=24, eos_token_id=None)
    for row, got in zip(rows, generated_rows(out, ids.shape[1])):
        assert got == hf_greedy(model, row, max_new_tokens=24, eos_token_id=None)


@pytest.mark.parametrize("layout", ["deepseek", "mimo", "qwen3_next"])
def test_commit_leaves_the_state_of_the_draft_run_over_the_sequence(layout, tmp_path):
    """Small vocabulary, so drafts get accepted; afterwards the session's last output is the draft's
    output over the generated sequence alone, run as one chain on the target's own features."""
    model = _small_vocab_model()
    if layout != "deepseek":  # the same tiny target in the layout's own architecture
        name = "Qwen2" if layout == "mimo" else "Qwen3"
        config = getattr(transformers, name + "Config")(**{k: getattr(model.config, k) for k in (
            "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "vocab_size", "max_position_embeddings", "head_dim")}, attn_implementation="sdpa")
        torch.manual_seed(3)
        model = getattr(transformers, name + "ForCausalLM")(config).eval()
        with torch.no_grad():
            model.lm_head.weight.mul_(3.0)
    model, draft, _ = mtp_target(layout, tmp_path, model=model)
    sessions = []
    make = draft.session
    draft.session = lambda *a: sessions.append(make(*a)) or sessions[-1]
    spec = specgraph.compile(model, draft, tree=DYNAMIC, max_batch=3, max_cache_len=96)
    rows = [[3, 4, 5, 3, 4, 5, 3, 4], [7, 9, 3], [7, 9, 3, 7, 9]]  # repeating continuations: drafts accepted
    ids, mask = left_pad(rows)
    out = spec.generate(ids, attention_mask=mask, max_new_tokens=20, eos_token_id=None, return_dict_in_generate=True)
    assert max(max(step) for step in out["accept_lens"]) > 1  # multi-row commits happened
    session = sessions[0]
    for b, row in enumerate(rows):
        n = int(session.length[b])  # committed pairs (f_p, x_{p+1}), p < n
        sequence = row + hf_greedy(model, row, max_new_tokens=n + 1 - len(row), eos_token_id=None)
        features = target_features(model, sequence[:n + 1])
        pairs = torch.arange(n).unsqueeze(0)
        with torch.no_grad():
            want = draft(torch.tensor([sequence[1:n + 1]]), features[None, :n], True, pairs,
                         draft.new_cache(1, 96, "cpu"), torch.zeros(1, dtype=torch.long), pairs,
                         chain_mask(n, "cpu").unsqueeze(0))[0, -1]
        torch.testing.assert_close(session.last[b], want, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------- formats and refusals
@pytest.mark.parametrize("layout", list(PARTS))
def test_a_missing_mtp_weight_is_named(layout, tmp_path):
    model = tiny_model(TARGET[layout])
    written = mtp_weights(model, layout)
    gone = f"{PREFIX[layout].format(L=2)}{PARTS[layout]['hnorm']}.weight"
    del written[gone]
    with pytest.raises(ValueError, match=rf"missing weights \['{gone}'\]"):
        MTP.from_target(write_target(model, tmp_path, written))


def test_a_checkpoint_without_mtp_weights_is_refused_naming_the_layouts(tmp_path):
    write_target(tiny_model("llama"), tmp_path, {})
    with pytest.raises(ValueError, match=r"no MTP weights: looked for DeepSeek-V3 .* MiMo .* Qwen3-Next"):
        MTP.from_target(tmp_path)


def test_a_damaged_target_directory_is_named_file_by_file(tmp_path):
    """config.json that is not JSON or has no model_type, weights that are not safetensors: a CheckpointError (a
    ValueError) naming the file or directory, not json's or safetensors' own error."""
    from specgraph.errors import CheckpointError

    model = tiny_model("llama")
    target = write_target(model, tmp_path / "t", mtp_weights(model, "deepseek"))
    config = (target / "config.json").read_text()
    (target / "config.json").write_text("{'hidden_size': 64}")
    with pytest.raises(CheckpointError, match=rf"{target}/config.json: not valid JSON"):
        MTP.from_target(target)
    (target / "config.json").write_text(json.dumps({k: v for k, v in json.loads(config).items() if k != "model_type"}))
    with pytest.raises(CheckpointError, match=rf"{target}: its config.json has no model_type"):
        MTP.from_target(target)
    (target / "config.json").write_text(config)
    (target / "model.safetensors").write_bytes(b"\xff" * 4096)  # a header length past the file: not safetensors
    with pytest.raises(CheckpointError, match=rf"{target}/model.safetensors: cannot read MTP weights"):
        MTP.from_target(target)


def test_several_modules_need_a_choice(tmp_path):
    model = tiny_model("llama")
    first, second = mtp_weights(model, "deepseek", seed=1), mtp_weights(model, "deepseek", seed=2)
    write_target(model, tmp_path, {**first, **{k.replace(".layers.2.", ".layers.3."): v for k, v in second.items()}},
                 num_nextn_predict_layers=2)
    with pytest.raises(ValueError, match="2 MTP modules .* module=i"):
        MTP.from_target(tmp_path)
    draft = MTP.from_target(tmp_path, module=1)
    assert torch.equal(draft.eh_proj.weight, second["model.layers.2.eh_proj.weight"])


def test_a_target_of_another_width_is_refused_at_compile(tmp_path):
    _, draft, _ = mtp_target("deepseek", tmp_path)
    other = _small_vocab_model()  # hidden 32, vocabulary 12
    with pytest.raises(specgraph.CompileError) as err:
        specgraph.compile(other, draft, tree=Chain(3))
    blockers = "\n".join(err.value.blockers)
    assert "MTP hidden size 64 != target hidden size 32" in blockers
    assert "MTP vocabulary 101 != target vocabulary 12" in blockers


@pytest.mark.parametrize("layout", list(PARTS))
def test_save_pretrained_round_trips_through_from_target(layout, tmp_path):
    model, draft, _ = mtp_target(layout, tmp_path / "target")
    draft.save_pretrained(tmp_path / "saved")
    keys = load_file(str(tmp_path / "saved" / "model.safetensors")).keys()
    assert all(k.startswith("model.layers.2.") for k in keys)  # DeepSeek-V3 names, MTP keys only
    again = MTP.from_target(tmp_path / "saved")
    assert again.bind(model) == [] and again.variant.norm_output == draft.variant.norm_output
    tokens = prompts(6, [12])[0]
    features = target_features(model, tokens)
    t = len(tokens) - 1
    pairs = torch.arange(t).unsqueeze(0)
    with torch.no_grad():
        got, want = (d.draft_logits(d(torch.tensor([tokens[1:]]), features[None, :-1], True, pairs,
                                      d.new_cache(1, 64, "cpu"), torch.zeros(1, dtype=torch.long), pairs,
                                      chain_mask(t, "cpu").unsqueeze(0))) for d in (again, draft))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_compiles_once_across_prompt_lengths(tmp_path, aot_eager_compile):
    """backend="inductor" with the MTP module (dynamo's decisions; aot_eager in place of inductor's code
    generation): prompts of new lengths recompile nothing, token-exact."""
    model, draft, _ = mtp_target("deepseek", tmp_path, extras=())
    spec = specgraph.compile(model, draft, tree=DYNAMIC, max_cache_len=128, backend="inductor")
    assert_one_compile_across_lengths(spec, model, [[6], [40], [75]])
