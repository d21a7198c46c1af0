"""fold_norms_rows: in steps of 2..max_rows rows (16 on CPU; 64 of a small weight under PDL), the norms
whose input is a residual add of a product move into that product's epilogue and their readers' row scaling,
SiLU·mul into the packed gate/up product's epilogue. The folded step computes the unfolded one's logits and
cache (fp32, CPU: the ops' references) on four architectures, every node of a tree still matches HF eager on
its root path, and steps outside 2..max_rows rows are left alone."""
import pytest
import torch

from specgraph import config
from specgraph.capture import Capture
from capture_harness import Driver, check_tree_against_hf
from test_capture import TOL, tiny_model
from test_fold_norms import assert_same_step

NORM_OUT = torch.ops.specgraph.fused_linear_norm_out.default
FUSED = torch.ops.specgraph.fused_linear.default


def _step(model, rows, folded: bool):
    with config.patch(skip_passes="" if folded else "fold_norms_rows"):
        return Capture(model, 64).step(1, rows)


@pytest.mark.parametrize("name, silu", [("llama", True), ("qwen3", True), ("phi3", False), ("gemma3", None)])
def test_multi_row_step_matches_the_unfolded_one(name, silu):
    """8 rows: every norm but the first layer's (its input is the embedding) and the final one (read through
    prune_logits' alias) folds; SiLU·mul where fuse_projections split the packed gate/up (Phi-3 chunks its
    own); Gemma-3's (1 + weight) norms sit between each product and its residual add: nothing."""
    model = tiny_model(name)
    layers = model.config.num_hidden_layers
    plain, step = _step(model, 8, False), _step(model, 8, True)
    counters = dict(step.pass_results)["fold_norms_rows"].counters
    if silu is None:
        assert counters == {"norms_folded": 0, "silu_mul_folded": 0, "rows_out_of_range": 0}
    else:
        assert counters == {"norms_folded": 2 * layers - 1, "silu_mul_folded": layers if silu else 0,
                            "rows_out_of_range": 0}
        graph = step.graph.graph
        assert len(graph.find_nodes(op="call_function", target=NORM_OUT)) == 2 * layers - 1
        readers = [n for n in graph.find_nodes(op="call_function", target=FUSED) if n.args[7] is not None]
        assert len(readers) == 2 * layers - 1  # one packed q/k/v or gate/up product per norm
        rsqrts = [len(s.graph.graph.find_nodes(op="call_function", target=torch.ops.aten.rsqrt.default))
                  for s in (plain, step)]
        assert rsqrts[0] - rsqrts[1] == 2 * layers - 1  # the folded norms' (Qwen3's q/k norms stay)
    assert_same_step(plain, step, torch.randint(3, 101, (1, 8), generator=torch.Generator().manual_seed(5)))


@pytest.mark.parametrize("name", ["llama", "phi3"])
def test_every_node_matches_hf_with_the_fold(name):
    """Three sequences, a 5-node tree each (15 rows): each node's logits equal HF eager's on its root path."""
    d = Driver(tiny_model(name), batch=3, max_length=96, seed=3)
    d.prefill([[d.rng.randrange(3, 101) for _ in range(length)] for length in (6, 29, 17)])
    counters = dict(d.capture.step(3, 5).pass_results)["fold_norms_rows"].counters
    assert counters["norms_folded"] == 2 * d.model.config.num_hidden_layers - 1
    check_tree_against_hf(d, nodes=5, tol=TOL)


@pytest.mark.parametrize("rows, out_of_range", [(1, 0), (17, 5)])
def test_rows_outside_the_kernels_range_are_left_alone(rows, out_of_range):
    """One row is fold_norms' (already folded: nothing left to match); 17 rows exceed max_rows without PDL
    (16): counted, the graph keeps its norms and SiLU·mul."""
    step = _step(tiny_model("llama"), rows, True)
    assert dict(step.pass_results)["fold_norms_rows"].counters == {"norms_folded": 0, "silu_mul_folded": 0,
                                                                   "rows_out_of_range": out_of_range}
    assert not step.graph.graph.find_nodes(op="call_function", target=NORM_OUT)


@pytest.mark.parametrize("small_weights", [True, False], ids=["small", "large"])
def test_past_16_rows_folds_only_small_weights_under_pdl(monkeypatch, small_weights):
    """24 rows under PDL (patched in: CPU has none): small weights fold and compute the unfolded step; with
    every weight counted large (SMALL_WEIGHT_BYTES 0) the step stays apart, each fold counted out of range."""
    from specgraph.kernels import fused_linear as fl

    monkeypatch.setattr(fl, "pdl_launch", lambda device: True)
    if not small_weights:
        monkeypatch.setattr(fl, "SMALL_WEIGHT_BYTES", 0)
    model = tiny_model("llama")
    layers = model.config.num_hidden_layers
    plain, step = _step(model, 24, False), _step(model, 24, True)
    counters = dict(step.pass_results)["fold_norms_rows"].counters
    if small_weights:
        assert counters == {"norms_folded": 2 * layers - 1, "silu_mul_folded": layers, "rows_out_of_range": 0}
        assert_same_step(plain, step, torch.randint(3, 101, (1, 24), generator=torch.Generator().manual_seed(7)))
    else:
        assert counters == {"norms_folded": 0, "silu_mul_folded": 0, "rows_out_of_range": 2 * layers - 1 + layers}
        assert not step.graph.graph.find_nodes(op="call_function", target=NORM_OUT)


def test_a_product_added_to_itself_is_not_a_producer():
    """h = y + y (one product on both sides of the add): no residual to hand over; the norm stays."""
    from specgraph.passes.fold_norms_rows import fold_norms_rows
    from test_fold_norms import SelfAdd

    torch.manual_seed(0)
    module, x = SelfAdd(), torch.randn(1, 4, 16)
    program = torch.export.export(module, (x,))
    assert fold_norms_rows(program.graph_module, None).counters == {"norms_folded": 0, "silu_mul_folded": 0,
                                                                    "rows_out_of_range": 0}
    torch.testing.assert_close(program.module()(x), module(x))
