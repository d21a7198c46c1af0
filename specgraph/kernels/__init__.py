"""specgraph's ops: one module per op (Triton kernel, registration, plain-torch reference).

Imports nothing else of specgraph. Importing this package registers the
``torch.ops.specgraph.*`` ops. ``DECOMPOSITIONS`` maps each op to standard
aten ops (``ExportedProgram.run_decompositions(DECOMPOSITIONS)``: what ONNX
and TensorRT export lower to).
"""
import torch

from . import compact_kv as _compact_kv  # noqa: F401
from . import kv_write as _kv_write  # noqa: F401  (export traces it as its reference: export.py)
from . import tree_attention as _tree_attention
from . import verify as _verify

DECOMPOSITIONS = {
    torch.ops.specgraph.tree_attention.default: _tree_attention.tree_attention_reference,
    torch.ops.specgraph.tree_attention_mask.default: lambda *a: _tree_attention.allowed_keys(*a).unsqueeze(1),
    torch.ops.specgraph.verify_greedy.default: _verify.verify_greedy_decomposition,
}
