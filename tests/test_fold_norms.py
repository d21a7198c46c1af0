"""fold_norms: HF's RMSNorm folds into the products
that read it, the residual add into the product it adds, SiLU·mul into the down product; near misses
stay apart; the folded step
computes the same logits and cache as the unfolded one on the CPU (fused_linear's reference is HF's
formula op for op) on four architectures, and leaves alone what was measured slower folded: steps of
more than one row."""

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from specgraph.capture import Capture
from specgraph.drafts.autoregressive import chain_mask
from specgraph.passes.fold_norms import fold_norms
from test_capture import tiny_model

FUSED = torch.ops.specgraph.fused_linear.default


class Block(torch.nn.Module):
    """residual + down(norm(x)) and a second product off the same norm, as a decoder layer's halves."""

    def __init__(self, norm, bias=False, also_return_norm=False):
        super().__init__()
        self.norm, self.also = norm, also_return_norm
        self.up = torch.nn.Linear(16, 24, bias=bias)
        self.gate = torch.nn.Linear(16, 24, bias=bias)
        self.down = torch.nn.Linear(24, 16, bias=bias)

    def forward(self, x):
        normed = self.norm(x)
        out = x + self.down(self.up(normed) * self.gate(normed))
        return (out, normed) if self.also else out


class GemmaStyleNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(16))

    def forward(self, x):
        x32 = x.float()
        return ((x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)) * (1.0 + self.weight.float())).to(x.dtype)


def folded(module, dtype=torch.float32, rows=1):
    module = module.to(dtype)
    x = torch.randn(1, rows, 16, dtype=dtype)
    gm = torch.export.export(module, (x,)).graph_module
    result = fold_norms(gm, None)  # the pass reads no context
    return result, gm, x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_llama_norm_and_residual_add_fold(dtype):
    torch.manual_seed(0)
    block = Block(LlamaRMSNorm(16, eps=1e-5))
    result, gm, x = folded(block, dtype)
    assert result.counters == {"norms_folded": 1, "adds_folded": 1, "gated_folded": 0, "too_many_rows": 0}
    fused = gm.graph.find_nodes(op="call_function", target=FUSED)
    assert len(fused) == 3  # up and gate read the norm, down adds the residual
    assert not gm.graph.find_nodes(op="call_function", target=torch.ops.aten.rsqrt.default)
    assert not gm.graph.find_nodes(op="call_function", target=torch.ops.aten.linear.default)


@pytest.mark.parametrize("block, why", [
    (lambda: Block(GemmaStyleNorm()), "Gemma's (1 + weight) norm"),
    (lambda: Block(LlamaRMSNorm(16), also_return_norm=True), "a norm also read elsewhere"),
], ids=["gemma_norm", "norm_read_elsewhere"])
def test_near_misses_keep_their_norm(block, why):
    torch.manual_seed(0)
    result, gm, _ = folded(block())
    assert result.counters["norms_folded"] == 0, why
    assert gm.graph.find_nodes(op="call_function", target=torch.ops.aten.rsqrt.default)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_products_with_a_bias_take_the_norm_and_their_bias(dtype):
    """Qwen2's q/k/v: biased products reading a norm fold it and carry their bias; the residual add of a
    biased product stays apart. The folded graph computes the module's output (the reference is HF's
    formula op for op, F.linear with the bias included: bit for bit on the CPU)."""
    torch.manual_seed(0)
    block = Block(LlamaRMSNorm(16, eps=1e-5), bias=True)
    with torch.no_grad():
        for linear in (block.up, block.gate):
            linear.bias.normal_()
    result, gm, x = folded(block, dtype)
    assert result.counters == {"norms_folded": 1, "adds_folded": 0, "gated_folded": 0, "too_many_rows": 0}
    fused = gm.graph.find_nodes(op="call_function", target=FUSED)
    assert len(fused) == 2 and all(n.kwargs["bias"].op in ("placeholder", "get_attr") for n in fused)
    assert not gm.graph.find_nodes(op="call_function", target=torch.ops.aten.rsqrt.default)
    params = {"p_" + name.replace(".", "_"): p for name, p in block.named_parameters()}
    (got,) = gm(*(params.get(n.target, x) for n in gm.graph.find_nodes(op="placeholder")))
    torch.testing.assert_close(got, block(x), atol=0, rtol=0)


class GatedMLP(torch.nn.Module):
    """x + down(act(gate) * up) on one packed gate/up product, split as fuse_projections splits it."""

    def __init__(self, act):
        super().__init__()
        self.act = act
        self.gate_up = torch.nn.Linear(16, 48, bias=False)
        self.down = torch.nn.Linear(24, 16, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).split_with_sizes([24, 24], -1)
        return x + self.down(self.act(gate) * up)


@pytest.mark.parametrize("act, folds", [(torch.nn.functional.silu, True), (torch.nn.functional.gelu, False)],
                         ids=["silu", "gelu"])
def test_silu_mul_folds_into_the_down_product(act, folds):
    torch.manual_seed(0)
    mlp = GatedMLP(act)
    result, gm, _ = folded(mlp)
    assert result.counters["adds_folded"] == 1 and result.counters["gated_folded"] == int(folds)
    (down,) = [n for n in gm.graph.find_nodes(op="call_function", target=FUSED) if n.args[4] is not None]
    assert (down.args[5:6] == (True,)) == folds  # reads the packed gate/up itself, or act(gate) * up
    assert not gm.graph.find_nodes(op="call_function", target=torch.ops.aten.silu.default) or not folds


@pytest.mark.parametrize("rows", [2, 17])
def test_what_was_measured_slower_is_left_alone(rows):
    """Two rows or more (the 16-row tiles lost at 8 rows): nothing folds."""
    result, gm, _ = folded(Block(LlamaRMSNorm(16)), rows=rows)
    assert result.counters == {"norms_folded": 0, "adds_folded": 0, "gated_folded": 0, "too_many_rows": 2}
    assert not gm.graph.find_nodes(op="call_function", target=FUSED)


@pytest.mark.parametrize("name, layers_folded, gated", [("llama", True, True), ("qwen2", True, True),
                                                        ("qwen3", True, True), ("phi3", True, False),
                                                        ("gemma3", False, False)])
def test_folded_step_matches_the_unfolded_one(name, layers_folded, gated, settings):
    model = tiny_model(name)
    gen = torch.Generator().manual_seed(5)
    b, r = 1, 1  # decode at batch 1: the one case folded
    ids = torch.randint(3, 101, (b, r), generator=gen)
    settings(skip_passes="fold_norms")
    plain = Capture(model, 64).step(b, r)
    assert "fold_norms" not in dict(plain.pass_results)
    settings(skip_passes="")
    step = Capture(model, 64).step(b, r)  # the default pipeline folds
    counters = dict(step.pass_results)["fold_norms"].counters
    layers = model.config.num_hidden_layers
    if layers_folded:  # two norms and two residual adds a layer (Phi-3's packed products and Qwen2's biased
        # q/k/v included), and SiLU·mul into down where fuse_projections split the packed gate/up (Phi-3 chunks
        # its own: apart)
        assert counters == {"norms_folded": 2 * layers, "adds_folded": 2 * layers,
                            "gated_folded": layers if gated else 0, "too_many_rows": 0}
    else:  # Gemma-3: (1 + weight) norms, norms between each product and its residual add, GELU
        assert counters["norms_folded"] == counters["adds_folded"] == counters["gated_folded"] == 0
    assert_same_step(plain, step, ids)


def assert_same_step(plain, step, ids):
    """Both captured steps, on the same random cache, over ``ids`` [B, R] as a chain at context 7: the same
    logits and the same cache written."""
    b, r = ids.shape
    cache_len = torch.full((b,), 7)
    positions = cache_len.unsqueeze(1) + torch.arange(r)
    chain = chain_mask(r, "cpu").expand(b, r).contiguous()
    for s in (plain, step):
        s.kv.copy_(torch.randn(s.kv.shape, generator=torch.Generator().manual_seed(6)))
    with torch.no_grad():
        want, got = plain(ids, positions, cache_len, chain), step(ids, positions, cache_len, chain)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(step.kv, plain.kv, atol=1e-6, rtol=1e-6)


@pytest.mark.model
def test_smollm2_decode_step_folds_every_layer_and_matches_hf():
    """The real SmolLM2-135M-Instruct, fp32 on the CPU, batch 1: the one-row decode step folds both
    norms, both residual adds and the SiLU·mul of all 30 layers (the final norm reaches the LM head
    through prune_logits' alias: not a candidate), and six greedy decode steps through it give HF
    eager's logits."""
    from specgraph.models import load_gguf
    from capture_harness import Driver

    model, tokenizer = load_gguf()
    model.config._attn_implementation = "sdpa"
    driver = Driver(model, batch=1, max_length=96, seed=0)
    driver.prefill([tokenizer("The three primary colours are").input_ids])
    layers = model.config.num_hidden_layers
    for _ in range(6):
        tokens, parents, mask, depth = driver.random_tree(nodes=1)
        logits = driver.tree_logits(tokens, mask, depth)
        want = driver.oracle_logits(0, tokens[0].tolist(), parents[0].tolist())
        torch.testing.assert_close(logits[0], want, atol=2e-3, rtol=1e-4)
        driver.verify_and_commit(tokens, parents, mask, logits)
    counters = dict(driver.capture.step(1, 1).pass_results)["fold_norms"].counters
    assert counters == {"norms_folded": 2 * layers, "adds_folded": 2 * layers, "gated_folded": layers,
                        "too_many_rows": 0}


class SelfAdd(torch.nn.Module):
    """h = y + y of one product, then a norm read by a product: no residual apart from the product."""

    def __init__(self):
        super().__init__()
        self.proj, self.norm, self.out = torch.nn.Linear(16, 16, bias=False), LlamaRMSNorm(16), torch.nn.Linear(16, 8, bias=False)

    def forward(self, x):
        y = self.proj(x)
        return self.out(self.norm(y + y))


def test_a_product_added_to_itself_is_not_a_residual_add():
    torch.manual_seed(0)
    module = SelfAdd()
    x = torch.randn(1, 1, 16)
    program = torch.export.export(module, (x,))
    result = fold_norms(program.graph_module, None)
    assert result.counters["adds_folded"] == 0 and result.counters["norms_folded"] == 1
    torch.testing.assert_close(program.module()(x), module(x))
