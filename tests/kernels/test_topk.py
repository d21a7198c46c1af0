"""topk: the reference, the CPU packing and the Triton kernel against a Python oracle (sorted by
(-value, index), NaN as +inf), on rows full of ties, infinities and NaN, one pass and two; the op's
fake and errors."""
import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import specgraph.kernels  # noqa: F401
from specgraph.kernels import topk as topk_module
from specgraph.kernels.topk import topk_packed, topk_reference, topk_triton

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
needs_triton = pytest.mark.skipif(not (INTERPRET or torch.cuda.is_available()),
                                  reason="Triton needs a GPU or TRITON_INTERPRET=1")
SPECIAL = [float("nan"), float("inf"), float("-inf"), -0.0, 0.0]


def oracle(x: torch.Tensor, k: int) -> list[list[int]]:
    """Each row's k best indices: larger first, NaN as +inf, equal values by lower index."""
    rows = x.reshape(-1, x.shape[-1]).double().tolist()
    key = lambda row, i: (-(math.inf if math.isnan(row[i]) else row[i]), i)  # noqa: E731
    return [sorted(range(len(row)), key=lambda i: key(row, i))[:k] for row in rows]


def tied_rows(seed: int, rows: int, vocab: int, dtype, special: bool) -> torch.Tensor:
    """Few distinct values (many ties across chunks), optionally NaN, +-inf and +-0 sprinkled in."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-4, 4, (rows, vocab), generator=g).to(torch.float32) / 2
    if special:
        where = torch.randint(0, vocab, (rows, len(SPECIAL)), generator=g)
        for j, value in enumerate(SPECIAL):
            x[torch.arange(rows), where[:, j]] = value
    return x.to(dtype)


def assert_matches_oracle(x, values, indices, k):
    want = oracle(x.cpu(), k)
    assert indices.reshape(-1, k).cpu().tolist() == want
    flat = x.reshape(-1, x.shape[-1]).cpu()
    expected = flat.gather(1, torch.tensor(want))
    got = values.reshape(-1, k).cpu()
    assert torch.equal(got.isnan(), expected.isnan())
    assert torch.equal(torch.nan_to_num(got, nan=0.0), torch.nan_to_num(expected, nan=0.0))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), rows=st.integers(1, 5), vocab=st.integers(1, 300), k=st.integers(1, 12),
       special=st.booleans())
def test_reference_and_cpu_packing_match_oracle(seed, rows, vocab, k, special):
    k = min(k, vocab)
    for dtype in (torch.float32, torch.bfloat16):
        x = tied_rows(seed, rows, vocab, dtype, special)
        for topk in (topk_reference, topk_packed, torch.ops.specgraph.topk):  # the op on the CPU: packed
            values, indices = topk(x, k)
            assert_matches_oracle(x, values, indices, k)


def test_reference_agrees_with_torch_topk_without_ties():
    x = torch.randn(3, 7, 1000)
    got, want = topk_reference(x, 10), x.topk(10, -1)
    assert torch.equal(got[0], want.values) and torch.equal(got[1], want.indices)


@needs_triton
@pytest.mark.parametrize("vocab", [5, 300, 8192, 8193, 3 * 4096 + 17])  # one pass; two, last chunk partial
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("special", [False, True])
def test_kernel_matches_oracle(vocab, dtype, special):
    k = min(5, vocab)
    x = tied_rows(vocab, 3, vocab, dtype, special).to(DEVICE)
    values, indices = topk_triton(x, k)
    assert values.dtype == dtype and indices.dtype == torch.int64
    assert_matches_oracle(x, values, indices, k)


@needs_triton
def test_kernel_two_passes_with_fewer_than_k_in_the_last_chunk():
    """The last chunk holds 2 entries < k = 4: its missing candidates (-1) are never picked, even when
    every real entry is -inf."""
    vocab = topk_module.CHUNK + 2
    x = torch.full((2, vocab), float("-inf"), device=DEVICE)
    x[1, -1] = 1.0
    values, indices = topk_triton(x, 4)
    assert indices.cpu().tolist() == [[0, 1, 2, 3], [vocab - 1, 0, 1, 2]]
    assert_matches_oracle(x, values, indices, 4)


def test_op_checks_and_fake_shapes():
    x = torch.randn(2, 3, 50)
    values, indices = torch.ops.specgraph.topk(x, 4)
    assert values.shape == indices.shape == (2, 3, 4) and indices.dtype == torch.int64
    assert_matches_oracle(x, values, indices, 4)
    torch.library.opcheck(torch.ops.specgraph.topk.default, (x, 4))  # fake vs real, schema, dispatch
    with torch.device("meta"):
        fake = torch.ops.specgraph.topk(torch.empty(8, 8192, dtype=torch.bfloat16), 8)
    assert fake[0].shape == (8, 8) and fake[0].dtype == torch.bfloat16 and fake[1].dtype == torch.int64
    with pytest.raises(ValueError, match=r"k=9 must be in 1 \.\. min\(64, V=8\)"):
        torch.ops.specgraph.topk(torch.randn(2, 8), 9)
    for bad in (torch.arange(8), torch.randn(8, dtype=torch.float64)):
        with pytest.raises(ValueError, match="x must be a float32, bfloat16 or float16 tensor"):
            torch.ops.specgraph.topk(bad, 2)


def test_op_compiles_on_cpu():
    x = torch.randn(4, 700)
    got = torch.compile(lambda t: torch.ops.specgraph.topk(t.float() * 2, 6), fullgraph=True)(x)
    assert_matches_oracle(x * 2, *got, 6)


@needs_triton
@pytest.mark.parametrize("vocab", [6, 2 * 4096 + 6])
def test_kernel_signed_zeros_tie_by_index(vocab):
    """-0.0 and +0.0 are equal: the lower index first, whichever sign it has (bit patterns would not tie)."""
    x = torch.full((1, vocab), -1.0, device=DEVICE)
    x[0, 2], x[0, 4], x[0, -1] = -0.0, 0.0, -0.0
    values, indices = topk_triton(x, 3)
    assert indices.cpu().tolist() == [[2, 4, vocab - 1]]
    assert torch.equal(values.cpu().signbit(), torch.tensor([[True, False, True]]))


@needs_triton
@pytest.mark.parametrize("k", [1, 8, 31, 64])  # 31: the selection's N - 1 (a K below its power of two)
@pytest.mark.parametrize("vocab", [152, 2 * 4096 + 70])
def test_kernel_every_k_matches_oracle(k, vocab):
    x = tied_rows(k + vocab, 2, vocab, torch.float32, special=True).to(DEVICE)
    values, indices = topk_triton(x, k)
    assert values.shape == indices.shape == (2, k)
    assert_matches_oracle(x, values, indices, k)


def test_kernel_compiles_for_hopper():
    """The kernel as the GPU builds it (Triton's own ptxas for sm_90, in a child process without the
    interpreter): one pass over 8,192 entries, the pass over chunks' candidates (k = 8 and 31), and chunks of
    1,024 merged in the launch by the row's last program (one gpu-scope acq_rel atomic), and the one pass with
    the row's log-softmax (top_log_probs)."""
    import subprocess
    import sys
    import textwrap

    pytest.importorskip("triton.backends.nvidia")
    child = textwrap.dedent('''
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from specgraph.kernels.topk import _topk_kernel
        types = dict(X="*fp32", IdxIn="*i64", Values="*fp32", Indices="*i64", PartV="*fp32", PartI="*i64",
                     Arrived="*i32")
        for k, block, has_idx, merge, log_softmax in ((8, 8192, False, False, False), (31, 256, True, False, False),
                                                      (8, 1024, False, True, False), (8, 8192, False, False, True)):
            constexprs = dict(K=k, K_POW2=triton.next_power_of_2(k), BLOCK=block, HAS_IDX=has_idx, MERGE=merge,
                              MERGE_BLOCK=64, LOG_SOFTMAX=log_softmax)
            signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in _topk_kernel.arg_names}
            ptx = triton.compile(ASTSource(fn=_topk_kernel, signature=signature, constexprs=constexprs),
                                 target=GPUTarget("cuda", 90, 32)).asm["ptx"]
            assert ".entry" in ptx and ("atom.global.gpu.acq_rel.add" in ptx) == merge
    ''')
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]


@needs_triton
@pytest.mark.parametrize("k", [1, 5, 31])
@pytest.mark.parametrize("vocab, chunk", [(8192, 1024), (300, 64), (3 * 4096 + 17, 4096), (40, 64)])
def test_kernel_merged_in_one_launch_matches_oracle(k, vocab, chunk):
    """``chunk``: a row's chunks in programs of their own, the last to finish picking the row's k best from
    theirs (ties across chunks by index; a last chunk with fewer than k entries); the counters reset."""
    from specgraph.kernels import arrivals

    k = min(k, vocab)
    for special in (False, True):
        x = tied_rows(k * vocab + chunk, 3, vocab, torch.float32, special).to(DEVICE)
        for _ in range(2):  # the counters a launch leaves are the next one's start
            values, indices = topk_triton(x, k, chunk=chunk)
            assert_matches_oracle(x, values, indices, k)
        assert not any(b.any() for b in arrivals.buffers("topk"))


def assert_log_probs(x, values, indices, k):
    """top_log_probs: the oracle's k best indices, and values within 1e-5 of torch's log-softmax there (a GPU's
    exp and log are approximate instructions: a few 1e-6 over log(8192)), NaN where it is NaN (a row holding NaN
    or +inf)."""
    want = oracle(x.cpu(), k)
    assert indices.reshape(-1, k).cpu().tolist() == want
    expected = torch.log_softmax(x.cpu().float().reshape(-1, x.shape[-1]), -1).gather(1, torch.tensor(want))
    got = values.reshape(-1, k).cpu()
    assert got.dtype == torch.float32 and torch.equal(got.isnan(), expected.isnan())
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-5, equal_nan=True)


@needs_triton
@pytest.mark.parametrize("vocab", [5, 300, 8192, 8193])  # 8193: past one pass, the top-k kernel then a log-softmax
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("special", [False, True])
def test_top_log_probs_matches_log_softmax_at_the_oracles_best(vocab, dtype, special):
    k = min(8, vocab)
    x = (tied_rows(vocab + 1, 3, vocab, torch.float32, special) * 3).to(dtype).to(DEVICE)
    if vocab <= topk_module.ONE_PASS:
        assert_log_probs(x, *topk_module.top_log_probs_triton(x, k), k)
    assert_log_probs(x, *topk_module._top_log_probs_cuda(x, k) if DEVICE == "cuda" else
                     torch.ops.specgraph.top_log_probs(x, k), k)


def test_top_log_probs_op_cpu_fake_and_compile():
    x = torch.randn(2, 3, 500) * 5
    values, indices = torch.ops.specgraph.top_log_probs(x, 4)
    assert values.shape == indices.shape == (2, 3, 4)
    assert_log_probs(x, values, indices, 4)
    torch.library.opcheck(torch.ops.specgraph.top_log_probs.default, (x, 4))
    with torch.device("meta"):
        fake = torch.ops.specgraph.top_log_probs(torch.empty(8, 8192, dtype=torch.bfloat16), 8)
    assert fake[0].dtype == torch.float32 and fake[1].dtype == torch.int64 and fake[0].shape == (8, 8)
    got = torch.compile(lambda t: torch.ops.specgraph.top_log_probs(t * 2, 6), fullgraph=True)(x)
    assert_log_probs(x * 2, *got, 6)
    with pytest.raises(ValueError, match=r"k=9 must be in 1 \.\. min\(64, V=8\)"):
        torch.ops.specgraph.top_log_probs(torch.randn(2, 8), 9)
