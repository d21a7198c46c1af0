"""compact_kv: reference vs a per-row Python oracle, Triton vs reference, the
op inside an exported program."""
import os
import random

import pytest
import torch

import specgraph.kernels  # noqa: F401
from specgraph.kernels.compact_kv import compact_kv_reference, compact_kv_triton
from specgraph.kernels.verify import verify_greedy
from specgraph.trees import Tree
from specgraph.trees import random_parents

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"


def accepted_paths(seed, b, n):
    """Real verification outputs: random depth-first trees, random targets."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    parents = torch.tensor([random_parents(rng, n) for _ in range(b)])
    tokens = torch.randint(0, 2, (b, n), generator=g)
    tree = Tree.from_parents(tokens, parents, max_depth=n - 1)
    acc = verify_greedy(tree.tokens, tree.parents, tree.mask, torch.randint(0, 2, (b, n), generator=g), n - 1)
    return acc.path, acc.accept_len


def oracle(kv, cache_len, path, accept_len):
    out = kv.clone()
    for row in range(kv.shape[1]):
        c0 = int(cache_len[row])
        for d in range(1, int(accept_len[row])):
            out[:, row, :, c0 + d] = kv[:, row, :, c0 + int(path[row, d])]
    return out


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_compaction_matches_oracle(seed, dtype):
    rng = random.Random(seed)
    b, n, h_kv, d, caches = rng.randint(1, 4), rng.randint(1, 24), rng.randint(1, 3), rng.choice([8, 16, 24]), rng.randint(1, 4)
    s_max = n + rng.randint(0, 40)
    path, accept_len = accepted_paths(seed, b, n)
    cache_len = torch.tensor([rng.randint(0, s_max - n) for _ in range(b)])
    kv = torch.randn(caches, b, h_kv, s_max, d).to(dtype)
    want = oracle(kv, cache_len, path, accept_len)
    got = kv.clone()
    compact_kv_reference(got, cache_len, path, accept_len)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    if dtype != torch.float8_e4m3fn:  # the value-moving form ONNX export uses (CPU torch cannot gather float8)
        values = kv.clone()
        compact_kv_reference(values, cache_len, path, accept_len, bitwise=False)
        assert torch.equal(values.view(torch.uint8), want.view(torch.uint8))
    if INTERPRET or torch.cuda.is_available():
        got = kv.clone().to(DEVICE)
        compact_kv_triton(got, cache_len.to(DEVICE), path.to(DEVICE), accept_len.to(DEVICE))
        assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))


def test_nothing_written_past_s_max():
    # window overhangs the buffer's end: the moves inside run, nothing past S_max is touched
    kv = torch.arange(1 * 1 * 1 * 10 * 2, dtype=torch.float32).view(1, 1, 1, 10, 2)
    spare = torch.full((1, 1, 1, 4, 2), -7.0)
    big = torch.cat([kv, spare], 3)  # slots 10..13 stand for memory past S_max
    view = big[:, :, :, :10]
    path, accept_len = torch.tensor([[0, 2, 5, 11]]), torch.tensor([4])
    compact_kv_reference(view, torch.tensor([6]), path, accept_len)
    assert torch.equal(big[:, :, :, 10:], spare)
    assert torch.equal(view[0, 0, 0, 7], kv[0, 0, 0, 8])  # d=1: slot 7 <- slot 8
    assert torch.equal(view[0, 0, 0, 8], kv[0, 0, 0, 8])  # d=2 wants slot 11 (past the end): no move


def test_op_mutates_a_buffer_inside_export():
    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("kv", torch.randn(2, 2, 1, 16, 4))

        def forward(self, cache_len, path, accept_len):
            torch.ops.specgraph.compact_kv(self.kv, cache_len, path, accept_len)
            return self.kv.sum()

    args = (torch.tensor([3, 5]), torch.tensor([[0, 2, 3], [0, 1, -1]]), torch.tensor([3, 2]))
    eager = Step()
    exported = torch.export.export(Step(), args)
    module = exported.module()
    module.kv.copy_(eager.kv)
    want_kv = oracle(eager.kv.clone(), *args)
    eager(*args)
    module(*args)
    assert torch.equal(eager.kv, want_kv) and torch.equal(module.kv, want_kv)
    ops = [n.target for n in exported.graph.nodes if n.op == "call_function"]
    assert torch.ops.specgraph.compact_kv.default in ops  # kept: it mutates, so no DCE
    functional = exported.run_decompositions()
    assert "kv" in functional.graph_signature.buffers_to_mutate.values()  # functionalized into a buffer write
    again = functional.module()
    again.kv.copy_(want_kv)
    want_twice = oracle(want_kv.clone(), *args)
    again(*args)
    assert torch.equal(again.kv, want_twice)
