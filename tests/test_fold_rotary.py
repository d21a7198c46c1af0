"""fold_rotary's matcher on small exported functions: HF's rotate_half RoPE is recognised (operands in
either order, a no-op cast, Phi-3's empty pass-through); near misses are not (wrong sign, interleaved
pairs, partial rotation, different tables for the two products, a dtype change)."""
import pytest
import torch

from specgraph.passes.fold_rotary import _rope_parts

B, H, R, D = 2, 3, 4, 8


def rotate_half(x):
    return torch.cat((-x[..., D // 2:], x[..., : D // 2]), dim=-1)


class Rope(torch.nn.Module):
    def __init__(self, body):
        super().__init__()
        self.body = body

    def forward(self, x, cos, sin, other):
        return self.body(x, cos.unsqueeze(1), sin.unsqueeze(1), other.unsqueeze(1))


def matched(body, dtype=torch.float32):
    args = (torch.randn(B, H, R, D, dtype=dtype), torch.randn(B, R, D, dtype=dtype), torch.randn(B, R, D, dtype=dtype),
            torch.randn(B, R, D, dtype=dtype))
    graph = torch.export.export(Rope(body), args).graph_module.graph
    (output,) = graph.find_nodes(op="output")
    x, cos, sin, _ = [n for n in graph.find_nodes(op="placeholder")]
    parts = _rope_parts(output.args[0][0])
    return parts if parts is None else (parts[0] is x, parts[1] is cos, parts[2] is sin)


@pytest.mark.parametrize("body", [
    lambda x, c, s, o: x * c + rotate_half(x) * s,                      # HF's apply_rotary_pos_emb
    lambda x, c, s, o: s * rotate_half(x) + c * x,                      # operands swapped
    lambda x, c, s, o: (x * c + rotate_half(x) * s).to(torch.float32),  # a cast to the dtype it has
    lambda x, c, s, o: torch.cat((x * c + rotate_half(x) * s, x[..., D:]), dim=-1),  # Phi-3 at factor 1
], ids=["hf", "swapped", "no_op_cast", "empty_pass_through"])
def test_rotate_half_rope_is_recognised(body):
    assert matched(body) == (True, True, True)


def interleaved(x):
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


@pytest.mark.parametrize("body", [
    lambda x, c, s, o: x * c + torch.cat((x[..., D // 2:], -x[..., : D // 2]), dim=-1) * s,  # wrong sign
    lambda x, c, s, o: x * c + interleaved(x) * s,                                          # GPT-J pairs
    lambda x, c, s, o: torch.cat(((x[..., :4] * c[..., :4] + torch.cat((-x[..., 2:4], x[..., :2]), -1) * s[..., :4]),
                                  x[..., 4:]), dim=-1),                                      # half the dims rotated
    lambda x, c, s, o: x * c + rotate_half(o) * s,                                          # another tensor turned
    lambda x, c, s, o: x - rotate_half(x) * s,                                              # not a sum of products
], ids=["wrong_sign", "interleaved", "partial", "other_tensor", "difference"])
def test_near_misses_are_left_alone(body):
    assert matched(body) is None


def test_a_dtype_change_is_left_alone():
    """bf16 x with fp32 tables rounds differently than the kernel would: not folded."""
    def body(x, c, s, o):
        y = x.to(torch.bfloat16)
        return y * c + rotate_half(y) * s  # promoted to fp32: not y's dtype

    assert matched(body) is None
