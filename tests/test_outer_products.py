"""outer_products: transformers' older RoPE (``inv_freq @ positions``, a product over a contraction of length
1) becomes a broadcast multiply in the captured step: the step's logits bit for bit those without the pass, and
every node's logits HF eager's on its root path; products over longer contractions are left alone."""
import pytest
import torch

from capture_harness import Driver, check_tree_against_hf
from specgraph.passes import outer_products
from specgraph.passes.outer_products import is_outer_product
from test_capture import TOL, tiny_model


def older_rope(self, x, position_ids):
    """LlamaRotaryEmbedding.forward as transformers 5.17 (the GPU image's) has it: angles by a matmul."""
    inv_freq = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1).to(x.device)
    freqs = (inv_freq @ position_ids[:, None, :].float()).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


@pytest.fixture
def older_transformers(monkeypatch):
    from transformers.models.llama import modeling_llama

    monkeypatch.setattr(modeling_llama.LlamaRotaryEmbedding, "forward", older_rope)


def outer_products_left(step) -> int:
    return sum(is_outer_product(node) for node in step.graph.graph.nodes)


def test_the_older_ropes_product_becomes_a_multiply_with_the_same_logits(older_transformers, settings):
    model = tiny_model("llama")
    settings(skip_passes="outer_products")  # the negative control: the product the pass removes is there
    plain = Driver(model, batch=2, max_length=96, seed=3)
    plain.prefill([[5, 9, 2, 7, 1, 4, 8, 3, 6, 2, 9], [3, 1, 4, 1, 5, 9, 2, 6]])
    assert outer_products_left(plain.capture.step(2, 7)) == 1
    settings(skip_passes="")
    driver = Driver(model, batch=2, max_length=96, seed=3)
    driver.prefill([[5, 9, 2, 7, 1, 4, 8, 3, 6, 2, 9], [3, 1, 4, 1, 5, 9, 2, 6]])
    step = driver.capture.step(2, 7)
    assert outer_products_left(step) == 0
    assert dict(step.pass_results)["outer_products"].counters == {"outer_products": 1}
    tokens, _, mask, depth = driver.random_tree(nodes=7)
    assert torch.equal(driver.tree_logits(tokens, mask, depth), plain.tree_logits(tokens, mask, depth))
    check_tree_against_hf(driver, 7, TOL)


def test_products_over_longer_contractions_are_left_alone():
    class Products(torch.nn.Module):
        def forward(self, a, b, c, v):
            t = v.transpose(0, 1)
            return a @ b, torch.bmm(c, c.transpose(1, 2)), v @ t, a[:, :1] @ b[:1], t @ v

    args = (torch.randn(4, 3), torch.randn(3, 5), torch.randn(2, 4, 2), torch.randn(1, 6))
    gm = torch.export.export(Products(), args).graph_module
    want = gm(*args)
    result = outer_products(gm, None)
    assert result.counters == {"outer_products": 2}  # K = 3, 2 and 6 stay; a[:, :1] @ b[:1] and v.T @ v go
    for got, expected in zip(gm(*args), want):
        assert torch.equal(got, expected)
