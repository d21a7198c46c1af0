"""kernels/arrivals.py: eager launches count per stream, recorded launches in regions of their own."""
import torch

from specgraph.kernels import arrivals


def test_eager_counters_are_per_owner_and_zero(monkeypatch):
    monkeypatch.setattr(arrivals, "_counters", {})
    monkeypatch.setattr(arrivals, "_pools", {})
    a = arrivals.arrival_counters("tree_attention", torch.device("cpu"), 12)
    assert a is arrivals.arrival_counters("tree_attention", "cpu", 40)  # one stream: one buffer
    b = arrivals.arrival_counters("topk", "cpu", 3)
    assert a.data_ptr() != b.data_ptr() and a.dtype == torch.int32 and not a.any()
    assert arrivals.arrival_counters("topk", "cpu", arrivals.SLOTS + 1) is None
    assert [t.data_ptr() for t in arrivals.buffers("topk")] == [b.data_ptr()]


def test_recorded_launches_get_disjoint_regions_until_the_pool_runs_out(monkeypatch):
    monkeypatch.setattr(arrivals, "_counters", {})
    monkeypatch.setattr(arrivals, "_pools", {})
    monkeypatch.setattr(arrivals, "POOL", 100)
    assert arrivals.recorded_region("cpu", 8) is None  # no eager launch made the pool yet: merge another way
    arrivals.arrival_counters("fused_linear", "cpu", 8)
    first, second = arrivals.recorded_region("cpu", 60), arrivals.recorded_region("cpu", 40)
    assert first.shape == (60,) and second.shape == (40,) and not first.any()
    assert second.data_ptr() == first.data_ptr() + 60 * 4  # disjoint, back to back
    assert arrivals.recorded_region("cpu", 1) is None  # used up: never handed out twice
