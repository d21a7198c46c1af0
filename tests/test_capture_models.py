"""Capture on the real models: SmolLM2-135M-Instruct (Llama) and Gemma-3-270M
(sliding-window layers, 1 KV head, head_dim 256), fp32 on CPU. Every tree
node's logits equal HF eager on its root path; the cache after verify/compact
steps equals HF's own."""
import pytest
import torch

from specgraph.models import gemma3_gguf, load_gguf
from capture_harness import Driver, check_cache_against_hf, check_tree_against_hf

pytestmark = pytest.mark.model
TOL = dict(atol=2e-3, rtol=1e-4)  # fp32, 30/18 layers, logits of magnitude ~30


def prompts(tokenizer, chat: bool):
    texts = ["What is the capital of France?", "Write a haiku about the sea, then explain it.", "2 + 2 ="]
    if chat:
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
                 for t in texts]
    return [tokenizer(t).input_ids for t in texts]


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def driver(request):
    if request.param == "smollm2":
        model, tokenizer = load_gguf()
    else:
        try:
            path = gemma3_gguf()
        except FileNotFoundError as err:
            pytest.skip(str(err))
        model, tokenizer = load_gguf(path)
    model.config._attn_implementation = "sdpa"
    d = Driver(model, batch=3, max_length=160, seed=0)
    d.prefill(prompts(tokenizer, chat=request.param == "smollm2"))
    return d


def test_tree_nodes_match_hf_paths(driver):
    check_tree_against_hf(driver, nodes=8, tol=TOL, same_argmax=True)


def test_cache_after_steps_equals_hf(driver):
    accepted = 0
    for _ in range(2):
        tokens, parents, mask, depth = driver.random_tree(nodes=8)
        acc = driver.verify_and_commit(tokens, parents, mask, driver.tree_logits(tokens, mask, depth))
        accepted += int(acc.accept_len.sum())
    assert accepted > 2 * driver.batch  # the drafted greedy paths were (partly) accepted
    check_cache_against_hf(driver, TOL)
