"""Medusa heads: every public checkpoint layout loads, round-trips, binds to its
target (or names every mismatch), and drives a token-exact generate over trees."""
import json

import pytest
import torch
from safetensors.torch import save_file

import specgraph
from specgraph import CompileError, StaticTree
from specgraph.drafts import Medusa
from test_capture import tiny_model

H, V, K, L = 64, 101, 3, 1


def head_tensors(seed=0, bias=True, own_head=True):
    g = torch.Generator().manual_seed(seed)
    return [dict(w=torch.randn(H, H, generator=g) * 0.1, b=torch.randn(H, generator=g) * 0.1 if bias else None,
                 head=torch.randn(V, H, generator=g) if own_head else None) for _ in range(K)]


def expected_logits(heads, x, shared_head=None):
    """Independent oracle: x + SiLU(x W^T + b), then the head's (or the shared) LM head."""
    out = []
    for t in heads:
        h = x + torch.nn.functional.silu(x @ t["w"].T + (t["b"] if t["b"] is not None else 0))
        out.append(h @ (t["head"] if t["head"] is not None else shared_head).T)
    return torch.stack(out, 1)


def layout(name, heads):
    state = {}
    for i, t in enumerate(heads):
        if name in ("fasterdecoding", "medusa2", "modelopt", "legacy"):
            prefix = {"fasterdecoding": "", "legacy": "", "medusa2": "medusa_head.", "modelopt": "medusa_heads."}[name]
            state[f"{prefix}{i}.0.linear.weight"] = t["w"]
            state[f"{prefix}{i}.0.linear.bias"] = t["b"]
            if name != "legacy":
                state[f"{prefix}{i}.1.weight"] = t["head"]
        else:  # vllm
            state[f"blocks.{i}.layers.0.weight"] = t["w"]
            state[f"lm_heads.{i}.weight"] = t["head"]
    if name == "medusa2":  # the base model's weights sit alongside
        state["model.embed_tokens.weight"] = torch.zeros(V, H)
    return state


@pytest.mark.parametrize("name, file", [("fasterdecoding", "medusa_lm_head.pt"), ("medusa2", "model.safetensors"),
                                        ("modelopt", "model.safetensors"), ("vllm", "model.safetensors"),
                                        ("legacy", "medusa_lm_head.safetensors")])
def test_every_layout_loads(tmp_path, name, file):
    heads = head_tensors(bias=name != "vllm", own_head=name != "legacy")
    state = layout(name, heads)
    if file.endswith(".pt"):
        torch.save(state, tmp_path / file)
    else:
        save_file(state, str(tmp_path / file))
    # FasterDecoding's uploaded configs claim 5 heads: the keys decide
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 5, "vocab_size": V}))
    medusa = Medusa.from_pretrained(tmp_path)
    assert medusa.num_heads == K and medusa.num_layers == L
    x = torch.randn(4, H)
    shared = torch.randn(V, H)
    if name == "legacy":
        medusa._shared_head.module = lambda h: h @ shared.T
    torch.testing.assert_close(medusa(x), expected_logits(heads, x, shared), atol=1e-5, rtol=1e-5)


def test_save_pretrained_round_trips(tmp_path):
    medusa = Medusa(H, V, K, num_layers=2)
    medusa.save_pretrained(tmp_path, base_model_name_or_path="tiny-llama")
    again = Medusa.from_pretrained(tmp_path)
    x = torch.randn(2, H)
    torch.testing.assert_close(again(x), medusa(x))
    assert json.loads((tmp_path / "config.json").read_text())["medusa_num_heads"] == K


def test_a_config_that_disagrees_with_the_weights_is_logged_and_bad_save_settings_are_refused(tmp_path, caplog):
    medusa = Medusa(H, V, K, num_layers=2)
    medusa.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for field, value, message in (("medusa_num_heads", K + 2, f"says {K + 2} heads, the weights hold {K}"),
                                  ("medusa_num_layers", 1, "says 1 layers a head, the weights hold 2")):
        (tmp_path / "config.json").write_text(json.dumps({**config, field: value}))
        with caplog.at_level("WARNING", logger="specgraph"):
            loaded = Medusa.from_pretrained(tmp_path)  # the weights decide (published configs over-count heads)
        assert (loaded.num_heads, loaded.num_layers) == (K, 2) and message in caplog.text
    (tmp_path / "config.json").write_text("[]")
    with pytest.raises(ValueError, match="config.json: a JSON object of settings expected, not a list"):
        Medusa.from_pretrained(tmp_path)
    for kwargs, error, message in ((dict(dtype=torch.int8), TypeError, "a floating torch dtype"),
                                   (dict(dtype="bfloat16"), TypeError, "a floating torch dtype"),
                                   (dict(max_shard_bytes=-5), ValueError, "max_shard_bytes=-5")):
        with pytest.raises(error, match=message):  # int8 used to write zeros that loaded silently
            medusa.save_pretrained(tmp_path / "bad", **kwargs)


def test_missing_and_empty_checkpoints_are_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Medusa.from_pretrained(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="medusa_lm_head.safetensors"):
        Medusa.from_pretrained(tmp_path)
    save_file({"model.embed_tokens.weight": torch.zeros(3, 3)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="no Medusa heads found"):
        Medusa.from_pretrained(tmp_path)


def test_a_bad_head_is_named_by_key_and_file(tmp_path):
    """A block of another shape, a config vocab_size that is not a number, one head without its LM head: a
    CheckpointError (a ValueError) naming the directory, the key and what is wrong. A checkpoint holding fewer
    heads than its config claims loads (published configs over-count): tested above."""
    from specgraph.errors import CheckpointError

    def write(name, state, config=None):
        (tmp_path / name).mkdir()
        save_file(state, str(tmp_path / name / "medusa_lm_head.safetensors"))
        (tmp_path / name / "config.json").write_text(json.dumps(config or {"medusa_num_heads": K}))
        return tmp_path / name

    state = layout("fasterdecoding", head_tensors())
    wrong = write("shape", {**state, "1.0.linear.weight": torch.zeros(H // 2, H // 2)})
    with pytest.raises(CheckpointError, match=rf"{wrong}: .*1.0.linear.weight: checkpoint \(32, 32\) != expected "
                                              rf"\(64, 64\)"):
        Medusa.from_pretrained(wrong)
    legacy = layout("legacy", head_tensors(own_head=False))
    lots = write("vocab", legacy, {"medusa_num_heads": K, "vocab_size": "lots"})
    with pytest.raises(CheckpointError, match=rf"{lots}/config.json: vocab_size='lots'"):
        Medusa.from_pretrained(lots)
    no_head = write("no-head", {k: v for k, v in state.items() if k != "1.1.weight"})
    with pytest.raises(CheckpointError, match=rf"{no_head}: Medusa heads differ: head 1 has no LM head weight "
                                              rf"1.1.weight"):
        Medusa.from_pretrained(no_head)


def test_compile_names_every_mismatch_with_the_target():
    model = tiny_model("llama")  # hidden 64, vocab 101
    wrong = Medusa(32, 50, num_heads=2)
    with pytest.raises(CompileError) as err:
        specgraph.compile(model, wrong, tree=StaticTree([[0], [0, 0], [0, 0, 0]]))
    text = str(err.value)
    assert "hidden size 32 != target hidden size 64" in text and "vocabulary 50 != target vocabulary 101" in text
    assert "tree depth 3 > 2 Medusa heads" in text


@pytest.mark.parametrize("tree", [specgraph.Chain(3), StaticTree([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]])],
                         ids=["chain", "static"])
def test_generate_with_random_heads_is_token_exact(tree):
    model = tiny_model("llama")
    torch.manual_seed(5)
    medusa = Medusa(H, V, K)
    spec = specgraph.compile(model, medusa, tree=tree, max_batch=2, max_cache_len=160)
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = (ids != 0).long()
    out = spec.generate(ids, attention_mask=mask, max_new_tokens=20, eos_token_id=None)
    for row, p in enumerate(prompts):
        x = torch.tensor([p])
        want = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=20, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        assert out[row, width:].tolist() == want[0, len(p):].tolist()
