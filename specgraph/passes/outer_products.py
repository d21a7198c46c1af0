"""outer_products: a matrix product over a contraction of length 1 becomes a broadcast multiply.

transformers before 5.2x computes RoPE's angles as ``inv_freq[None, :, None] @ positions[:, None, :]``:
a product with K = 1, which inductor hands to cuBLAS on a GPU (an fp32 sgemm launch of ~2.9 us a step on
an H100), where a multiply fuses into the cos/sin kernel. One term, one rounding: the multiply gives the
product's values exactly.

Requires: nothing.
Ensures: no ``aten.matmul`` / ``aten.bmm`` / ``aten.mm`` node with operands of at least 2 dims and a
  contraction of length 1 is left; each became ``aten.mul`` of the same operands, whose broadcast has the
  product's shape and dtype. Nothing else changes.
"""
from __future__ import annotations

import torch

from .pass_result import GraphContext, PassResult, ensure, graph_pass, recompile

aten = torch.ops.aten
PRODUCTS = (aten.matmul.default, aten.bmm.default, aten.mm.default)


def is_outer_product(node: torch.fx.Node) -> bool:
    """A matrix product of two operands of >= 2 dims whose contraction (a's last dim) has length 1."""
    if node.op != "call_function" or node.target not in PRODUCTS:
        return False
    values = [arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None for arg in node.args[:2]]
    return all(v is not None and v.dim() >= 2 for v in values) and values[0].shape[-1] == 1


@graph_pass()
def outer_products(gm: torch.fx.GraphModule, ctx: GraphContext) -> PassResult:
    products = [node for node in gm.graph.nodes if is_outer_product(node)]
    for node in products:
        a, b = node.args[:2]
        with gm.graph.inserting_before(node):
            mul = gm.graph.call_function(aten.mul.Tensor, (a, b))
        mul.meta = dict(node.meta)  # same shape, dtype, module path
        node.replace_all_uses_with(mul)
        gm.graph.erase_node(node)
    if products:
        gm.graph.lint()
        recompile(gm)
    ensure(not any(is_outer_product(node) for node in gm.graph.nodes), "outer_products",
           "a product over a contraction of length 1 is left")
    return PassResult(gm, bool(products), {"outer_products": len(products)})
