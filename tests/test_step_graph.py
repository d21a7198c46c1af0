"""The compiled decode step of compile's default on a CUDA row (a tiny Llama, EAGLE-3, its tree with lookup), as
AOTAutograd hands it to the backend, holds nothing inductor leaves to a library launch on a GPU: no scatter of
int64 or bool values (aten's kernel: inductor's atomics cannot take them) and no product over a contraction of
length 1 (a cuBLAS sgemm), even with transformers' older RoPE; its draft steps rank their children without a
log-softmax over the vocabulary; the tokens stay HF greedy's."""
import pytest
import torch

import specgraph
from specgraph.passes.outer_products import is_outer_product
from test_capture import tiny_model
from test_generate import generated_rows, hf_greedy, left_pad, prompts
from test_outer_products import older_rope

SCATTERS = {torch.ops.aten.scatter.src, torch.ops.aten.scatter_.src}


@pytest.fixture
def recorded_graphs(monkeypatch):
    """torch.compile with AOTAutograd and no code generation: each forward graph kept, run as it is."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs, real = [], torch.compile

    def keep(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    def compile_recorded(model=None, **kwargs):
        kwargs.update(backend=aot_autograd(fw_compiler=keep), mode=None)
        return real(model, **kwargs) if model is not None else real(**kwargs)

    monkeypatch.setattr(torch, "compile", compile_recorded)
    return graphs


def library_launches(gm: torch.fx.GraphModule) -> list[str]:
    found = []
    for node in gm.graph.nodes:
        if node.target in SCATTERS and node.args[3].meta["val"].dtype in (torch.int64, torch.bool):
            found.append(f"{node.name}: a scatter of {node.args[3].meta['val'].dtype} values")
        if is_outer_product(node):
            found.append(f"{node.name}: {node.target} over a contraction of length 1")
    return found


def test_the_default_step_leaves_nothing_to_a_library_launch(recorded_graphs, monkeypatch):
    from transformers.models.llama import modeling_llama

    from specgraph.drafts import Eagle3

    monkeypatch.setattr(modeling_llama.LlamaRotaryEmbedding, "forward", older_rope)
    model = tiny_model("llama")
    torch.manual_seed(0)
    draft = Eagle3.for_target(model, aux_layer_ids=(0, 1, 1))
    tree = specgraph.WithLookup(specgraph.DynamicTree(3, 8, 32), 16, shared=True)  # the default on a CUDA row
    spec = specgraph.compile(model, draft, tree=tree, max_batch=2, max_cache_len=160, backend="inductor")
    rows = prompts(5, [6, 21])
    ids, mask = left_pad(rows)
    out = spec.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=None)
    for row, got in zip(rows, generated_rows(out, ids.shape[1])):
        assert got == hf_greedy(model, row, max_new_tokens=12, eos_token_id=None)
    steps = [gm for gm in recorded_graphs if any("topk" in str(n.target) for n in gm.graph.nodes)]
    assert steps, "no compiled graph drafts a tree"  # the decode step (its draft's top-k) was compiled
    assert [found for gm in recorded_graphs for found in library_launches(gm)] == []
    # each draft step ranks its children with one op (the log-softmax at the k best), no log-softmax over the
    # vocabulary before a top-k (a reduction launch of its own a draft step)
    targets = [n.target for gm in steps for n in gm.graph.nodes]
    assert torch.ops.specgraph.top_log_probs.default in targets
    assert torch.ops.aten._log_softmax.default not in targets
    # the draft's calls write their K/V and attend in one op each: no scatter into the draft's cache, no RoPE launch
    assert torch.ops.specgraph.tree_attention.default not in targets
    scatters = [n for gm in steps for n in gm.graph.nodes if n.target in SCATTERS]
    assert [n.args[0].meta["val"].shape for n in scatters if n.args[0].meta["val"].dim() == 4] == []
