"""Head checkpoints that SGLang, vLLM and FasterDecoding read the way specgraph meant them. Each
engine's reading is re-implemented here from its own source (commit cited per test), and checked
on a real target's hidden states (HF ``hidden_states[j]`` is the input of layer j)."""
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file

from specgraph.drafts import Eagle3, Medusa
from specgraph.train.eagle3 import tap_states

LAYERS = 8


def _target():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=LAYERS,
        vocab_size=101, attn_implementation="sdpa")).eval()


def _states(target):
    with torch.no_grad():
        return target(torch.tensor([[5, 9, 2, 7]]), output_hidden_states=True).hidden_states


def sglang_taps(config: dict, rule: str) -> list[int]:
    """SGLang: model_runner.py (01cc04e2b5) reads only ``eagle_config["eagle_aux_hidden_state_layer_ids"]``;
    llama.py (00239548f1) ``set_eagle3_layers_to_capture`` captures ``hidden_states + residual`` before
    layer ``val + 1`` (rule "plus1"; sgl-project/sglang#25454, merged 2026-05: +1 only when the first id
    is 1, rule "first"); ids absent -> [2, n//2, n-3] unshifted. Returns the layers whose input is tapped."""
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        return [2, LAYERS // 2, LAYERS - 3]
    shift = 1 if rule == "plus1" or ids[0] == 1 else 0
    return [i + shift for i in ids]


def vllm_taps(config: dict) -> list[int]:
    """vLLM: v1/worker/gpu/spec_decode/eagle/eagle3_utils.py (0cfdd2e15d) reads the draft config's top-level
    ``eagle_aux_hidden_state_layer_ids`` (then eagle_config["layer_ids"]); models/llama.py (e06c9ba2a6)
    appends ``hidden_states + residual`` when ``idx in aux_hidden_state_layers`` before layer idx;
    default (2, n//2, n-3)."""
    ids = config.get("eagle_aux_hidden_state_layer_ids") or (config.get("eagle_config") or {}).get("layer_ids")
    return list(ids) if ids else [2, LAYERS // 2, LAYERS - 3]


@pytest.mark.parametrize("ids, convention", [((1, 4, 6), "layer_output"), ((2, 4, 5), "layer_input"),
                                             ((0, 3, 6), "layer_output")])
def test_eagle3_save_is_read_at_the_trained_layers_by_sglang_and_vllm(tmp_path, ids, convention):
    target = _target()
    draft = Eagle3.for_target(target, aux_layer_ids=ids, aux_convention=convention)
    draft.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    hs = _states(target)
    trained = tap_states(hs, ids, convention)  # the features the head was trained on
    for taps in (vllm_taps(config), sglang_taps(config, "plus1")):
        torch.testing.assert_close(torch.cat([hs[j] for j in taps], -1), trained, rtol=0, atol=0)
    if sglang_taps(config, "plus1")[0] == 2:  # first output id 1: SGLang after #25454 reads it the same way
        assert sglang_taps(config, "first") == sglang_taps(config, "plus1")
    again = Eagle3.from_pretrained(tmp_path)
    torch.testing.assert_close(tap_states(hs, again.aux_layer_ids, again.aux_convention), trained, rtol=0, atol=0)


def test_eagle3_reads_each_engines_key_as_that_engine_does(tmp_path):
    """A vLLM / speculators config (top-level ids only: formerly ignored) and an SGLang / SpecForge config
    (eagle_config ids only) load tapping the layers their engine taps; two keys that disagree are refused."""
    target, base = _target(), tmp_path / "base"
    Eagle3.for_target(target).save_pretrained(base)
    config = json.loads((base / "config.json").read_text())
    for k in ("eagle_aux_hidden_state_layer_ids", "specgraph_aux_convention", "eagle_config"):
        config.pop(k, None)
    hs = _states(target)
    cases = {"vllm": config | {"eagle_aux_hidden_state_layer_ids": [1, 3, 6]},
             "sglang": config | {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 6]}}}
    for name, cfg in cases.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
        (tmp_path / name / "model.safetensors").write_bytes((base / "model.safetensors").read_bytes())
        draft = Eagle3.from_pretrained(tmp_path / name)
        engine = vllm_taps(cfg) if name == "vllm" else sglang_taps(cfg, "plus1")
        assert engine == ([1, 3, 6] if name == "vllm" else [2, 4, 7])
        torch.testing.assert_close(tap_states(hs, draft.aux_layer_ids, draft.aux_convention),
                                   torch.cat([hs[j] for j in engine], -1), rtol=0, atol=0)
    both = cases["sglang"] | {"eagle_aux_hidden_state_layer_ids": [1, 3, 6]}  # SGLang: inputs 2, 4, 7
    (tmp_path / "sglang" / "config.json").write_text(json.dumps(both))
    with pytest.raises(ValueError, match="disagree"):
        Eagle3.from_pretrained(tmp_path / "sglang")


def _medusa(bias=True):
    torch.manual_seed(1)
    medusa = Medusa(64, 101, 3, num_layers=1, bias=bias)
    with torch.no_grad():
        for p in medusa.parameters():
            p.normal_(0, 0.1)
    return medusa


def test_medusa_fasterdecoding_layouts(tmp_path):
    """FasterDecoding/Medusa (e2a5d20c04): medusa/model/medusa_model.py ``MedusaModel.from_pretrained``
    torch.loads ``medusa_lm_head.pt`` into ``medusa_head`` = ModuleList of Sequential(ResBlock x
    medusa_num_layers, Linear(H, V, bias=False)), ResBlock = x + SiLU(linear(x)); the trainer
    (medusa/train/train_legacy.py) writes ``medusa_lm_head.safetensors``."""
    medusa, x = _medusa(), torch.randn(2, 64)
    for layout, file in (("fasterdecoding_pt", "medusa_lm_head.pt"), ("fasterdecoding", "medusa_lm_head.safetensors")):
        medusa.save_pretrained(tmp_path / layout, base_model_name_or_path="tiny", layout=layout)
        state = torch.load(tmp_path / layout / file) if file.endswith(".pt") else load_file(tmp_path / layout / file)
        config = json.loads((tmp_path / layout / "config.json").read_text())
        assert (config["medusa_num_heads"], config["medusa_num_layers"], config["base_model_name_or_path"]) == (3, 1, "tiny")

        class ResBlock(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.linear = torch.nn.Linear(64, 64)

            def forward(self, h):
                return h + torch.nn.functional.silu(self.linear(h))

        heads = torch.nn.ModuleList(torch.nn.Sequential(ResBlock(), torch.nn.Linear(64, 101, bias=False))
                                    for _ in range(config["medusa_num_heads"]))
        heads.load_state_dict(state, strict=True)
        torch.testing.assert_close(torch.stack([h(x) for h in heads], 1), medusa(x))
        torch.testing.assert_close(Medusa.from_pretrained(tmp_path / layout)(x), medusa(x))


@pytest.mark.parametrize("bias", [True, False])
def test_medusa_vllm_layout(tmp_path, bias):
    """vLLM: model_executor/models/medusa.py (09cddad8f0): ``blocks.{h}.layers.{l}`` Linear(H, H,
    bias=config.medusa_fc_bias), x = x + SiLU(layer(x)); ``lm_heads.{h}``; config (configs/medusa.py,
    4bb77b3239) num_heads, num_hidden_layers, truncated_vocab_size (= vocab: no token_map)."""
    medusa, x = _medusa(bias), torch.randn(2, 64)
    medusa.save_pretrained(tmp_path, layout="vllm")
    state, config = load_file(tmp_path / "model.safetensors"), json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "medusa" and config["truncated_vocab_size"] == config["vocab_size"] == 101
    assert config["medusa_fc_bias"] is bias and config["original_lm_head"] is False
    logits = []
    for h in range(config["num_heads"]):
        y = x
        for l in range(config["num_hidden_layers"]):
            b = state[f"blocks.{h}.layers.{l}.bias"] if config["medusa_fc_bias"] else 0
            y = y + torch.nn.functional.silu(y @ state[f"blocks.{h}.layers.{l}.weight"].T + b)
        logits.append(y @ state[f"lm_heads.{h}.weight"].T)
    torch.testing.assert_close(torch.stack(logits, 1), medusa(x))
    torch.testing.assert_close(Medusa.from_pretrained(tmp_path)(x), medusa(x))
    with pytest.raises(ValueError, match="layout='sglang': one of 'fasterdecoding', 'fasterdecoding_pt', 'vllm'"):
        medusa.save_pretrained(tmp_path, layout="sglang")


def test_medusa_vllm_shared_lm_head(tmp_path):
    """vLLM's ``original_lm_head``: one lm_heads.0 serves every head (specgraph's legacy heads share the
    target's): written from the bound target, read back shared."""
    medusa, target = Medusa(64, 101, 3, own_lm_head=False), _target()
    with pytest.raises(ValueError, match="bind the heads first"):
        medusa.save_pretrained(tmp_path, layout="vllm")
    assert medusa.bind(target) == []
    medusa.save_pretrained(tmp_path, layout="vllm")
    assert json.loads((tmp_path / "config.json").read_text())["original_lm_head"] is True
    again, x = Medusa.from_pretrained(tmp_path), torch.randn(2, 64)
    torch.testing.assert_close(again(x), medusa(x))
