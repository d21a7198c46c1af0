"""spec.export(format="onnx"): the verify step with explicit caches, in standard ONNX ops, run by
onnxruntime on the CPU. Checked against independent oracles: HF eager on every root-to-node path
(logits), the brute-force longest accepted path (verification), and the reference compaction of
the torch path (the returned cache)."""
import onnx
import onnxruntime as ort
import pytest
import torch

import specgraph
from capture_harness import Driver
from oracles import longest_accepted_path
from specgraph.drafts import NGram
from specgraph.export import INPUTS, ONNX_OPSET, OUTPUTS, export_onnx
from test_capture import TOL, tiny_model


@pytest.mark.parametrize("arch,nodes", [("llama", 8), ("gemma3", 8), ("llama", 1)])  # 1: RoPE folded into attention
def test_onnx_verify_step_matches_hf_and_the_reference(arch, nodes, tmp_path):
    model = tiny_model(arch)
    driver = Driver(model, batch=2, max_length=96, seed=3)
    rng = driver.rng
    driver.prefill([[rng.randrange(3, 101) for _ in range(n)] for n in (9, 30)])
    spec = specgraph.Chain(nodes - 1)  # bucket of N nodes, paths up to N long: any N-node tree fits
    path = export_onnx(driver.capture, spec, tmp_path / "step.onnx", batch=2)

    exported = onnx.load(path)
    assert {node.domain for node in exported.graph.node} == {""}  # no custom ops: TensorRT's parser reads it
    assert max(o.version for o in exported.opset_import if o.domain == "") >= ONNX_OPSET
    assert [i.name for i in exported.graph.input] == list(INPUTS)
    assert [o.name for o in exported.graph.output] == list(OUTPUTS)

    tokens, parents, mask, depth = driver.random_tree(nodes=nodes)
    kv = driver.capture.kv(2).clone()
    feed = dict(input_ids=tokens, positions=driver.cache_len.unsqueeze(1) + depth, cache_len=driver.cache_len,
                tree_mask=mask, parents=parents, kv=kv)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    logits, accept_len, emitted, kv_out = (torch.from_numpy(x) for x in
                                           session.run(None, {k: v.numpy() for k, v in feed.items()}))
    for row in range(2):
        row_tokens, row_parents = tokens[row].tolist(), parents[row].tolist()
        want = driver.oracle_logits(row, row_tokens, row_parents)
        torch.testing.assert_close(logits[row], want, **TOL)
        accepted = longest_accepted_path(row_tokens, row_parents, logits[row].argmax(-1).tolist())
        assert int(accept_len[row]) == len(accepted)
        bonus = int(logits[row, accepted[-1]].argmax())
        assert emitted[row, : len(accepted)].tolist() == [row_tokens[i] for i in accepted[1:]] + [bonus]
    driver.tree_logits(tokens, mask, depth)  # the torch path writes the same step into its own cache ...
    driver.verify_and_commit(tokens, parents, mask, logits)  # ... and compacts it with the reference op
    torch.testing.assert_close(kv_out, driver.capture.kv(2), atol=1e-5, rtol=1e-5)


def test_export_refuses_what_it_cannot_do(tmp_path):
    spec = specgraph.compile(tiny_model("llama"), NGram(), tree=specgraph.Chain(3), max_cache_len=64, max_batch=2)
    with pytest.raises(ValueError, match="format='gguf'"):
        spec.export(tmp_path / "x", format="gguf")
    with pytest.raises(ValueError, match="batch=3"):
        spec.export(tmp_path / "x.onnx", batch=3)
    try:
        import torch_tensorrt  # noqa: F401
    except ImportError:
        with pytest.raises(ModuleNotFoundError, match="torch-tensorrt .* not installed.*format='onnx'"):
            spec.export(tmp_path / "x.engine", format="tensorrt")


def test_export_checks_its_path_and_its_extra_before_any_work(tmp_path, monkeypatch):
    """A directory, an unwritable folder, a missing extra: refused before the step is traced; the missing extra
    before the output's folders are made (none left behind)."""
    import sys

    import specgraph.export

    spec = specgraph.compile(tiny_model("llama"), NGram(), tree=specgraph.Chain(3), max_cache_len=64)
    with pytest.raises(IsADirectoryError, match="is a directory: name the .onnx file"):
        spec.export(tmp_path)
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(PermissionError, match="cannot be written"):
        spec.export(blocker / "step.onnx")  # its folder is a file
    def no_work(*args, **kwargs):
        raise AssertionError("the step was captured before the checks")

    monkeypatch.setattr(specgraph.export, "decomposed_program", no_work)
    monkeypatch.setitem(sys.modules, "onnxscript", None)  # as if not installed: importing it raises ImportError
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'specgraph\[export\]'"):
        spec.export(tmp_path / "new" / "deeper" / "step.onnx")
    assert not (tmp_path / "new").exists()


def test_check_export_is_what_the_command_runs_before_loading(tmp_path, monkeypatch):
    """specgraph.export.check_export, shared by spec.export and `specgraph export`: format, extra, then path."""
    import sys

    from specgraph.export import check_export

    with pytest.raises(ValueError, match="format='gguf': one of"):
        check_export(tmp_path / "x", "gguf")
    assert check_export(tmp_path / "a" / "step.onnx", "onnx") == tmp_path / "a" / "step.onnx"
    assert (tmp_path / "a").is_dir() and not (tmp_path / "a" / "step.onnx").exists()
    monkeypatch.setitem(sys.modules, "torch_tensorrt", None)
    with pytest.raises(ModuleNotFoundError, match="torch-tensorrt"):
        check_export(tmp_path / "b" / "step.engine", "tensorrt")
    assert not (tmp_path / "b").exists()
