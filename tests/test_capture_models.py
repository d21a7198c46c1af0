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


def test_inspect_reports_sliding_window_layers_as_supported(driver):
    from specgraph.cli import inspect_model

    lines, supported = inspect_model(driver.model, nodes=8, max_length=160)
    text = "\n".join(lines)
    assert supported and "supported: specgraph.compile accepts this model" in text
    windows = list(getattr(driver.model.config.get_text_config(), "layer_types", None) or [])
    if "sliding_attention" in windows:  # Gemma-3: 15 of its 18 layers
        n = windows.count("sliding_attention")
        assert f"sliding-window layers {n}" in text and "wider than the 8-node tree): supported" in text
        assert f"sliding_window_layers    {n}" in text
    else:  # SmolLM2, with EAGLE-3's taps and the final state, as `specgraph inspect --taps 2,15,26 --final`
        assert "sliding-window layers 0" in text and "sliding windows" not in text
        from specgraph.passes import HiddenTaps

        text = "\n".join(inspect_model(driver.model, taps=HiddenTaps((2, 15, 26), "layer_input", True))[0])
        assert "pass replace_attention:" in text and "sdpa_replaced            30" in text
        assert "cache_writes_kept        60" in text and "taps                     4" in text
