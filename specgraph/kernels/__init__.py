"""specgraph's ops: one module per op (Triton kernel, registration, plain-torch reference).

Imports nothing else of specgraph but its settings (``specgraph.config``). Importing this package registers the
``torch.ops.specgraph.*`` ops. ``DECOMPOSITIONS`` maps each op to standard
aten ops (``ExportedProgram.run_decompositions(DECOMPOSITIONS)``: what ONNX
and TensorRT export lower to).
"""
import hashlib
from pathlib import Path

import torch

from . import compact_kv as _compact_kv  # noqa: F401
from . import fused_linear as _fused_linear
from . import kv_write as _kv_write  # noqa: F401  (export traces it as its reference: export.py)
from . import soft_ce as _soft_ce  # noqa: F401  (training's loss: specgraph.train.soft_cross_entropy)
from . import topk as _topk
from . import tree_attention as _tree_attention
from . import tree_attention_write as _tree_attention_write  # noqa: F401  (export traces its reference)

DECOMPOSITIONS = {
    torch.ops.specgraph.tree_attention.default: _tree_attention.tree_attention_reference,
    torch.ops.specgraph.tree_attention_mask.default: lambda *a: _tree_attention.allowed_keys(*a).unsqueeze(1),
    torch.ops.specgraph.fused_linear.default: _fused_linear.fused_linear_reference,
    torch.ops.specgraph.fused_linear_norm_out.default: _fused_linear.fused_linear_norm_out_reference,
    torch.ops.specgraph.topk.default: _topk.topk_reference,
    torch.ops.specgraph.top_log_probs.default: _topk.top_log_probs_reference,
}


def _tag_compile_caches() -> None:
    """torch.compile's on-disk caches key a graph by its ops' names, not their code: a graph cached
    against an older fake impl (another output layout, say) would fail its stride asserts after an
    upgrade. A digest of this package's sources joins ``torch.compiler.config.cache_key_tag``."""
    config = getattr(torch.compiler, "config", None)
    if config is None or not hasattr(config, "cache_key_tag"):
        return
    sources = b"".join(path.read_bytes() for path in sorted(Path(__file__).parent.glob("*.py")))
    tag = "specgraph-" + hashlib.sha256(sources).hexdigest()[:16]
    if tag not in config.cache_key_tag:
        config.cache_key_tag = f"{config.cache_key_tag}+{tag}" if config.cache_key_tag else tag


_tag_compile_caches()
