"""gemv_linears (opt-in, SPECGRAPH_GEMV=1): decode-sized products run as specgraph::gemv; every node
still matches the HF model run on its root path; larger buckets and the default keep aten.linear."""
import pytest
import torch

from capture_harness import Driver, check_tree_against_hf
from test_capture import TOL, tiny_model

GEMV = torch.ops.specgraph.gemv.default
LINEAR = torch.ops.aten.linear.default


def _count(step, target) -> int:
    return len(step.graph.graph.find_nodes(op="call_function", target=target))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v carry biases
def test_small_buckets_run_gemv_and_match_hf(arch, monkeypatch):
    monkeypatch.setenv("SPECGRAPH_GEMV", "1")
    model = tiny_model(arch)
    driver = Driver(model, batch=1, max_length=96, seed=5)
    rng = driver.rng
    driver.prefill([[rng.randrange(3, 101) for _ in range(20)]])
    layers = model.config.num_hidden_layers
    for nodes in (2, 8):  # B * N = 2 and 8 rows: every product, fused q/k/v and gate/up included
        step = driver.capture.step(1, nodes)
        counters = dict(step.pass_results)["gemv_linears"].counters
        assert counters == {"linears_to_gemv": 4 * layers + 1}  # qkv, o, gate_up, down; the LM head
        assert _count(step, GEMV) == 4 * layers + 1 and _count(step, LINEAR) == 0
        check_tree_against_hf(driver, nodes=nodes, tol=TOL)
    big = driver.capture.step(1, 16)  # 16 rows: matrix products stay cuBLAS's
    assert dict(big.pass_results)["gemv_linears"].counters == {"linears_to_gemv": 0} and _count(big, GEMV) == 0


def test_off_by_default(monkeypatch):
    monkeypatch.delenv("SPECGRAPH_GEMV", raising=False)
    driver = Driver(tiny_model("llama"), batch=1, max_length=96, seed=6)
    step = driver.capture.step(1, 1)
    assert not dict(step.pass_results)["gemv_linears"].modified and _count(step, GEMV) == 0
    monkeypatch.setenv("SPECGRAPH_GEMV", "1")  # part of the bucket's key: the same Capture builds a gemv step
    on = driver.capture.step(1, 1)
    assert on is not step and _count(on, GEMV) > 0 and _count(step, GEMV) == 0
