"""The draft fast paths (specgraph/fast_paths.py) on by default, token-exact with HF greedy, and
config.skip_fast_paths switching them off."""
import pytest
import torch

import specgraph
from specgraph import config
from test_capture import tiny_model
from test_generate import generated_rows, hf_greedy, left_pad, prompts


# slow: inductor's CPU codegen (half a minute on CI's 2 cores); eager here, inductor on CUDA in the GPU tests
@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_draft_fast_paths_are_token_exact(monkeypatch, settings, backend):
    """The draft fast paths (default): EAGLE-2's top-k and ranking through specgraph::topk, the draft
    layer's q/k/v and gate/up as one product each, eager and compiled: HF greedy's tokens.
    config.skip_fast_paths switches them off at the next compile; an unknown name is refused."""
    from specgraph.drafts import Eagle3
    from specgraph.kernels import topk as topk_module

    calls = []
    for name in ("topk_reference", "topk_packed"):  # the op's decomposition; on the CPU, its implementation
        spy = lambda x, k, f=getattr(topk_module, name): calls.append(k) or f(x, k)  # noqa: E731
        monkeypatch.setattr(topk_module, name, spy)
    settings(skip_fast_paths="")
    model = tiny_model("llama")
    torch.manual_seed(0)
    draft = Eagle3.for_target(model, aux_layer_ids=(0, 1, 1))
    spec = specgraph.compile(model, draft, tree=specgraph.DynamicTree(steps=3, topk=3, nodes=8), max_batch=2,
                             max_cache_len=128, backend=backend)
    attn = draft.midlayer.self_attn
    assert attn.fused_qkv is not None and draft.midlayer.fused_gate_up is not None
    assert attn.fused_qkv[0].data_ptr() == attn.q_proj.weight.data_ptr()  # a view of the packed weights
    rows = prompts(11, [7, 30])
    ids, mask = left_pad(rows)
    out = spec.generate(ids, attention_mask=mask, max_new_tokens=16, eos_token_id=None)
    for row, got in zip(rows, generated_rows(out, ids.shape[1])):
        assert got == hf_greedy(model, row, max_new_tokens=16, eos_token_id=None)
    # the op ran: each level's top 3 tokens and lanes, the 7 nodes kept, and the confidence's best of the
    # 3 + 9 + 9 candidates (selection.budget_confidence)
    assert set(calls) == {3, 7, 21}
    settings(skip_fast_paths="topk,fuse_projections")
    calls.clear()
    specgraph.compile(model, draft, tree=specgraph.DynamicTree(steps=3, topk=3, nodes=8), max_cache_len=128)
    assert attn.fused_qkv is None and draft.midlayer.fused_gate_up is None  # off at the next compile
    specgraph.selection.top_k(torch.randn(2, 50), 3)
    assert not calls  # torch.topk
    settings(skip_fast_paths="topk,cub")
    with pytest.raises(ValueError, match=r"SPECGRAPH_SKIP_FAST_PATHS names \['cub'\]"):
        specgraph.selection.top_k(torch.randn(2, 50), 3)


@pytest.mark.model
@torch.no_grad()
def test_fast_paths_leave_the_shipped_heads_proposals_alone():
    """On the real SmolLM2 with its shipped EAGLE-3 head (fp32, CPU), the fast paths change no proposal:
    the same tokens accepted at every step as with both switched off (the unfused products and torch.topk
    as the reference), and the head still drafts well (tau above 1.5)."""
    from specgraph.models import load_default_draft, load_gguf

    model, tokenizer = load_gguf()
    row = tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": "Explain what a hash table is."}],
                                                  tokenize=False, add_generation_prompt=True)).input_ids
    accepted = {}
    for skip in ("", "topk,fuse_projections"):
        with config.patch(skip_fast_paths=skip):
            spec = specgraph.compile(model, load_default_draft(), tree=specgraph.DynamicTree(3, 4, 8),
                                     max_cache_len=256)
            out = spec.generate(torch.tensor([row]), max_new_tokens=32, eos_token_id=None, return_dict_in_generate=True)
        accepted[skip] = [lens[0] for lens in out["accept_lens"]]
    assert accepted[""] == accepted["topk,fuse_projections"]
    assert sum(accepted[""]) / len(accepted[""]) > 1.5
