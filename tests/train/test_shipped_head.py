"""The EAGLE-3 head that ships with specgraph: it loads as the default draft, generates
token-exact with the target, and still accepts what it did when it was recorded (τ within 5%
of specgraph/heads/…/reference.json, on the CPU in fp32)."""
import json

import pytest
import torch

import specgraph
from specgraph.models import default_draft_path, load_default_draft
from specgraph.train.evaluate import acceptance, mt_bench_questions

pytestmark = pytest.mark.model


def test_shipped_head_is_small_bf16_and_complete():
    files = {p.name: p.stat().st_size for p in default_draft_path().iterdir()}
    assert {"config.json", "model.safetensors", "README.md", "reference.json"} <= set(files)
    assert sum(files.values()) <= 25 * 2**20
    from safetensors import safe_open

    with safe_open(default_draft_path() / "model.safetensors", "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert {d for k, d in dtypes.items() if k not in ("d2t", "t2d")} == {"BF16"}, dtypes
    draft = load_default_draft()
    assert draft.config.draft_vocab_size == 8192 and draft.d2t.shape == (8192,)


def test_shipped_head_acceptance_matches_the_recorded_value():
    from specgraph.models import load_gguf

    ref = json.loads((default_draft_path() / "reference.json").read_text())["cpu_regression"]
    model, tokenizer = load_gguf()
    spec = specgraph.compile(model, load_default_draft(), tree=specgraph.DynamicTree(3, 4, 8), max_cache_len=512,
                             max_batch=ref["batch_size"])
    questions = mt_bench_questions(ref["questions"])
    report = acceptance(spec, tokenizer, questions, max_new_tokens=ref["max_new_tokens"], batch_size=ref["batch_size"])
    assert report["tau"] == pytest.approx(ref["tau"], rel=0.05), report
    # and the speculative answer is the target's own greedy answer
    ids = tokenizer.apply_chat_template([{"role": "user", "content": questions[0]["turns"][0]}], tokenize=True,
                                        add_generation_prompt=True, return_dict=True, return_tensors="pt")["input_ids"]
    plain = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False)
    assert torch.equal(spec.generate(ids, max_new_tokens=32), plain)


def test_shipped_medusa_head_loads_and_is_token_exact():
    """The comparison head (specgraph/heads/smollm2-135m-instruct-medusa) on its own tree."""
    from specgraph.drafts import Medusa
    from specgraph.models import load_gguf

    model, tokenizer = load_gguf()
    head = Medusa.from_pretrained(default_draft_path().parent / "smollm2-135m-instruct-medusa")
    assert head.num_heads == 4
    spec = specgraph.compile(model, head, tree=specgraph.MEDUSA_MC_SIM_7B_63, max_cache_len=512)
    question = mt_bench_questions(2)[1]["turns"][0]
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=True,
                                        add_generation_prompt=True, return_dict=True, return_tensors="pt")["input_ids"]
    plain = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False)
    out = spec.generate(ids, max_new_tokens=32, return_dict_in_generate=True)
    assert torch.equal(out["sequences"], plain)
    assert sum(map(sum, out["accept_lens"])) / len(out["accept_lens"]) > 1.2  # the heads do accept
