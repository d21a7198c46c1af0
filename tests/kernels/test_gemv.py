"""gemv: the Triton kernel against a float64 oracle (per dtype tolerance), its refusals, and the op's
CPU path, fake and decomposition."""
import os

import pytest
import torch

import specgraph.kernels  # noqa: F401
from specgraph.kernels import DECOMPOSITIONS
from specgraph.kernels.gemv import gemv_reference, gemv_triton

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not (INTERPRET or torch.cuda.is_available()),
                                  reason="Triton needs a GPU or TRITON_INTERPRET=1")
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
# |error| <= TOL * sum_k |x_k w_k| (+ the output's own rounding): fp32 sums of K products
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def case(seed: int, m: int, n: int, k: int, dtype):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype)


def check(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    exact = x.double() @ w.double().T  # float64 oracle from the same (rounded) inputs
    scale = x.double().abs() @ w.double().abs().T
    assert got.shape == exact.shape and got.dtype == x.dtype
    err = (got.double() - exact).abs()
    assert (err <= TOLERANCE[x.dtype] * scale + exact.abs() * 2 * torch.finfo(x.dtype).eps).all(), err.max()


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m,n,k", [(1, 48, 256), (1, 37, 200), (3, 64, 96), (8, 17, 1000), (5, 1, 64)])
def test_triton_matches_float64(m, n, k, dtype):
    """Even and ragged K, N not a multiple of the tile, 1..8 rows."""
    x, w = case(m * 1000 + n + k, m, n, k, dtype)
    check(gemv_triton(x.to(DEVICE), w.to(DEVICE)).cpu(), x, w)


@needs_triton
def test_tile_overrides_give_the_same_answer():
    x, w = case(3, 2, 70, 300, torch.float32)
    for override in (dict(block_n=8, block_k=64), dict(block_n=32, block_k=128, num_warps=8)):
        check(gemv_triton(x.to(DEVICE), w.to(DEVICE), **override).cpu(), x, w)


def test_op_cpu_path_fake_and_decomposition():
    x, w = case(5, 2, 24, 40, torch.bfloat16)
    op = torch.ops.specgraph.gemv
    check(op(x, w), x, w)
    assert torch.equal(op(x, w), gemv_reference(x, w))
    assert DECOMPOSITIONS[op.default] is gemv_reference
    with torch._subclasses.FakeTensorMode():
        fake = op(torch.empty(2, 40, dtype=torch.bfloat16), torch.empty(24, 40, dtype=torch.bfloat16))
    assert fake.shape == (2, 24) and fake.dtype == torch.bfloat16


def test_refusals_name_the_argument():
    op = torch.ops.specgraph.gemv
    with pytest.raises(ValueError, match="x has 9 rows"):
        op(torch.randn(9, 8), torch.randn(4, 8))
    with pytest.raises(ValueError, match="x's K=8 must match w's K=6"):
        op(torch.randn(1, 8), torch.randn(4, 6))
    with pytest.raises(ValueError, match="dtypes differ"):
        op(torch.randn(1, 8), torch.randn(4, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous along K"):
        op(torch.randn(1, 8), torch.randn(8, 4).T)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_op_on_cuda_at_8b_decode_shapes():
    """The op runs the kernel on CUDA at the shapes it is for (q/k/v, o, down), bf16."""
    for n, k in ((6144, 4096), (4096, 4096), (4096, 14336)):
        x, w = case(n + k, 1, n, k, torch.bfloat16)
        check(torch.ops.specgraph.gemv(x.cuda(), w.cuda()).cpu(), x, w)
