"""Export the verify step to ONNX (and, when torch-tensorrt is installed, TensorRT).

The exported graph is one (B, N) bucket of the target's verify step with
every cache an explicit input and output, in standard ops only:

    inputs   input_ids [B, N] int64   tree tokens (node 0 = the root)
             positions [B, N] int64   cache_len + depth
             cache_len [B]    int64   committed length per row
             tree_mask [B, N] int64   ancestor-or-self bits (trees.Tree.mask)
             parents   [B, N] int64   parent node, -1 for the root
             kv        [C, B, H_kv, S_max, D]   every K and V cache, stacked
    outputs  logits     [B, N, V]
             accept_len [B]          tokens committed (accepted drafts + the bonus)
             emitted    [B, D+1]     those tokens, first accept_len of each row
             kv_out     like kv: this step's keys and values written, the
                                     accepted nodes moved to the window front

The host (or an engine's runtime) adds accept_len to cache_len and feeds
kv_out back as kv. specgraph's ops are lowered by their decompositions
(``kernels.DECOMPOSITIONS``: the plain-torch references), so the ONNX file
uses the default domain only. The tree mask's bit tests are traced in integer arithmetic
(``bitmask.arithmetic_bits``) and integer clamps are Wheres, so every node is in onnx-tensorrt's
operator table (tests/test_export_trt_ops.py; not yet built by TensorRT itself). The
mutating ops (``kv_write``, ``tree_attention_write``, ``compact_kv``) are traced as their references,
whose in-place scatters torch.export functionalizes (it keeps a mutating
custom op as an ``auto_functionalized`` node that no decomposition removes).
"""
from __future__ import annotations

import copy
import logging
from pathlib import Path

import torch

from .capture import no_stack_traces
from .kernels import DECOMPOSITIONS
from .kernels.bitmask import arithmetic_bits
from .kernels.compact_kv import compact_kv_reference
from .kernels.kv_write import kv_write_reference
from .kernels.tree_attention_write import tree_attention_write_reference
from .kernels.verify import verify_greedy

log = logging.getLogger(__name__)

ONNX_OPSET = 20
INPUTS = ("input_ids", "positions", "cache_len", "tree_mask", "parents", "kv")
OUTPUTS = ("logits", "accept_len", "emitted", "kv_out")


class VerifyStep(torch.nn.Module):
    """A captured bucket as a self-contained module: target over the tree -> greedy verify ->
    KV compaction, with the cache passed in and returned (no state outside the arguments)."""

    def __init__(self, step, max_depth: int):
        super().__init__()
        graph = copy.deepcopy(step.graph.graph)
        for node in graph.find_nodes(op="call_function", target=torch.ops.specgraph.kv_write.default):
            node.target = kv_write_reference  # traced as plain in-place scatters
        for node in graph.find_nodes(op="call_function", target=torch.ops.specgraph.tree_attention_write.default):
            node.target = tree_attention_write_reference  # the scatters, then tree_attention's decomposition
        placeholders = {n.name: n for n in graph.find_nodes(op="placeholder")}
        for node in [n for n in graph.find_nodes(op="get_attr") if "fused_from" in n.meta]:
            # fuse_projections' joined weight is a view aliasing the parameters, which export cannot lift
            # twice: the exported graph concatenates the parameters instead (a constant the ONNX runtime folds)
            with graph.inserting_after(node):
                joined = graph.call_function(torch.ops.aten.cat.default,
                                             ([placeholders[name] for name in node.meta["fused_from"]],))
            node.replace_all_uses_with(joined)
            graph.erase_node(node)
        self.graph = torch.fx.GraphModule(step.graph, graph)
        self.kv_index, self.max_depth = step._kv_index, max_depth
        self.num_state = len(step._state)
        for i, tensor in enumerate(step._state):
            if i != self.kv_index:
                self.register_buffer(f"state_{i}", tensor)

    def forward(self, input_ids, positions, cache_len, tree_mask, parents, kv):
        kv = kv.clone()  # the graph writes the step's keys/values into it in place
        state = [kv if i == self.kv_index else getattr(self, f"state_{i}") for i in range(self.num_state)]
        logits = self.graph(*state, input_ids, positions, cache_len, tree_mask)[0]
        acc = verify_greedy(input_ids, parents, tree_mask, logits.argmax(-1), self.max_depth)
        compact_kv_reference(kv, cache_len, acc.path, acc.accept_len, bitwise=False)
        return logits, acc.accept_len, acc.emitted, kv


def example_inputs(step, tree) -> tuple[torch.Tensor, ...]:
    """Valid inputs for a bucket: ``tree``'s topology (a chain of as many nodes for a DynamicTree,
    whose topology is an input anyway) at cache length 1."""
    from .trees import Chain, StaticTree, Tree

    b, n = step.batch, step.nodes
    device = step.kv.device
    # any topology of N nodes traces the same graph: a chain stands in for those chosen per step
    fixed = tree if isinstance(tree, (Chain, StaticTree)) else Chain(n - 1)
    topology = Tree.from_spec(fixed, torch.zeros(b, n, dtype=torch.int64, device=device))
    cache_len = torch.ones(b, dtype=torch.int64, device=device)
    return (topology.tokens, topology.positions(cache_len), cache_len, topology.mask, topology.parents,
            torch.zeros_like(step.kv))


def decomposed_program(capture, tree, batch: int):
    """(module, ExportedProgram, example inputs) of the bucket's verify step, specgraph's ops replaced
    by their decompositions."""
    step = capture.step(batch, tree.num_nodes)
    module = VerifyStep(step, tree.max_depth).eval()
    inputs = example_inputs(step, tree)
    with torch.no_grad(), no_stack_traces(), arithmetic_bits():  # bit tests without int bitwise ops (TensorRT)
        program = torch.export.export(module, inputs, strict=False).run_decompositions(DECOMPOSITIONS)
    left = sorted({str(n.target) for n in program.graph.nodes if "specgraph" in str(n.target)})
    if left:
        raise RuntimeError(f"ops without a decomposition: {left}; add them to specgraph.kernels.DECOMPOSITIONS")
    return module, program, inputs


EXTRAS = {  # format -> (the module it needs, what to do without it)
    "onnx": ("onnxscript", "spec.export(format='onnx') needs onnx and onnxscript: pip install 'specgraph[export]'"),
    "tensorrt": ("torch_tensorrt", "format='tensorrt' needs torch-tensorrt (and TensorRT), which is not installed "
                 "here. Export ONNX instead (spec.export(path, format='onnx')): it uses standard ops only, and "
                 "TensorRT's ONNX parser (trtexec --onnx=...) builds an engine from it."),
}


def check_export(path: str | Path, format: str) -> Path:
    """What ``spec.export`` checks before any work (the ``specgraph export`` command too, before it loads the
    target): ``format``, the extra it needs installed (torch.onnx's exporter needs onnxscript: said before seconds of
    tracing), then ``path`` a file name (not a directory) in a folder that can be written (made if missing: only once
    the rest holds, so a refusal leaves no folders behind)."""
    import importlib

    if format not in EXTRAS:
        raise ValueError(f"format={format!r}: one of {sorted(EXTRAS)}")
    module, missing = EXTRAS[format]
    try:
        importlib.import_module(module)
    except ImportError:
        raise ModuleNotFoundError(missing) from None
    return _writable(Path(path))


def export_onnx(capture, tree, path: str | Path, batch: int = 1) -> Path:
    """Write the (batch, tree.num_nodes) verify step of ``capture``'s target to ``path`` (.onnx)."""
    path = check_export(path, "onnx")
    log.info("exporting the verify step (batch %d, %d nodes) to %s ...", batch, tree.num_nodes, path)
    module, program, _ = decomposed_program(capture, tree, batch)
    with torch.no_grad():
        torch.onnx.export(program, (), str(path), dynamo=True, opset_version=ONNX_OPSET, input_names=list(INPUTS),
                          output_names=list(OUTPUTS), external_data=_large(module), verbose=False)
    return path


def export_tensorrt(capture, tree, path: str | Path, batch: int = 1) -> Path:
    """A TensorRT engine through torch-tensorrt, when it is installed."""
    path = check_export(path, "tensorrt")
    import torch_tensorrt

    _, program, inputs = decomposed_program(capture, tree, batch)
    with torch.no_grad():
        engine = torch_tensorrt.dynamo.compile(program, inputs=list(inputs))
    torch_tensorrt.save(engine, str(path), inputs=list(inputs))
    return path


def _writable(path: Path) -> Path:
    """``path`` checked before any work: a file name (not a directory) in a folder we can write."""
    if path.is_dir():
        raise IsADirectoryError(f"export path {str(path)!r} is a directory: name the .onnx file, e.g. {path / 'step.onnx'}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        existed = path.exists()
        with open(path, "ab"):  # opened for writing, nothing written
            pass
        if not existed:
            path.unlink()
    except OSError as err:
        raise PermissionError(f"export path {str(path)!r} cannot be written ({err.strerror}): choose another") from err
    return path


def _large(module: torch.nn.Module) -> bool:
    """Weights past protobuf's 2 GB limit go to an external data file beside the .onnx."""
    return sum(b.numel() * b.element_size() for b in module.buffers()) > (1 << 31) - (1 << 26)
