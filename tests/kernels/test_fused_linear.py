"""fused_linear: the reference against HF's LlamaRMSNorm + nn.Linear (+ the residual add), the Triton
kernel (interpreted on CPU, native on GPU) against the reference per dtype and against float64, the
op's refusals, export and compile."""
import os

import pytest
import torch

import specgraph.kernels
from specgraph.kernels.fused_linear import (fused_linear_norm_out_reference, fused_linear_reference,
                                            fused_linear_triton, rms_norm_reference)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
needs_triton = pytest.mark.skipif(not (INTERPRET or torch.cuda.is_available()),
                                  reason="Triton needs a GPU or TRITON_INTERPRET=1")
# fp32: sums in another order; bf16: the normalized input and the output rounded as HF rounds them,
# a last-bit difference in the rms may flip one rounding
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
PAST_TILE = 24  # rows past one 16-row tile: tile_config's 32-row tile, 8 rows of it masked


def case(seed, m=3, k=96, n=40, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(1, m, k, generator=g) * 3).to(dtype)
    weight = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    gamma = (1 + 0.2 * torch.randn(k, generator=g)).to(dtype)
    residual = torch.randn(1, m, n, generator=g).to(dtype)
    return x, weight, gamma, residual


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_reference_is_hf_rmsnorm_linear_and_residual_add(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x, weight, gamma, residual = case(0, dtype=dtype)
    norm = LlamaRMSNorm(x.shape[-1], eps=1e-5).to(dtype)
    norm.weight.data.copy_(gamma)
    linear = torch.nn.Linear(x.shape[-1], weight.shape[0], bias=False).to(dtype)
    linear.weight.data.copy_(weight)
    exact = dict(atol=0, rtol=0)
    torch.testing.assert_close(fused_linear_reference(x, weight, gamma, 1e-5), linear(norm(x)), **exact)
    torch.testing.assert_close(fused_linear_reference(x, weight, None, 0.0, residual), residual + linear(x), **exact)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gated_reference_is_hf_llama_mlp(dtype):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    mlp = LlamaMLP(LlamaConfig(hidden_size=32, intermediate_size=48, hidden_act="silu")).to(dtype)
    x = torch.randn(1, 3, 32, dtype=dtype)
    gate_up = torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], -1)  # what the packed product computes
    got = fused_linear_reference(gate_up, mlp.down_proj.weight, gated=True)
    # SiLU of a strided half (the packed tensor's chunk) may take another vector path than of a
    # contiguous tensor: equal up to an ulp, not bit for bit
    torch.testing.assert_close(got, mlp(x))


@needs_triton
# float32 on one row and past a tile (the upcast is the one dtype branch); bf16, the GPU's dtype, on every shape
@pytest.mark.parametrize("m, k, n, dtype", [(1, 96, 40, torch.float32), (PAST_TILE, 300, 17, torch.float32)] +
                         [(*shape, torch.bfloat16) for shape in ((1, 96, 40), (3, 576, 96), (PAST_TILE, 300, 17),
                                                                 (8, 64, 256))], ids=str)
@pytest.mark.parametrize("norm, gated, add", [(True, False, False), (False, False, True), (True, False, True),
                                              (False, False, False), (False, True, False), (False, True, True)],
                         ids=["norm", "residual", "norm_residual", "plain", "gated", "gated_residual"])
def test_triton_matches_reference(m, k, n, dtype, norm, gated, add):
    x, weight, gamma, residual = (t.to(DEVICE) for t in case(m * k + n, m, k, n, dtype))
    if gated:  # x holds gate and up: [..., 2K]
        x = torch.cat([x, x.flip(-1)], -1) * 0.3  # gate and up of the norm's scale
    gamma, residual = gamma if norm else None, residual if add else None
    want = fused_linear_reference(x, weight, gamma, 1e-6, residual, gated)
    for tiles in (None, (16, 16, 32, 4, 2), (1, 32, 64, 4, 3)):  # (1, ...): one row on the CUDA cores
        got = fused_linear_triton(x, weight, gamma, 1e-6, residual, gated, tiles)
        assert got.shape == want.shape and got.dtype == dtype
        torch.testing.assert_close(got.float(), want.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@needs_triton
@pytest.mark.parametrize("m", [1, 5], ids=["one_row", "rows"])  # one row: the rms summed in the product's loop
def test_triton_against_float64(m):
    """fp32 against a float64 oracle: the kernel's own error, not the reference's."""
    x, weight, gamma, residual = (t.to(DEVICE) for t in case(11, m, 200, 48))
    x64 = x.double()
    normed = gamma.double() * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
    want = residual.double() + torch.nn.functional.linear(normed, weight.double())
    got = fused_linear_triton(x, weight, gamma, 1e-6, residual)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)


def test_op_errors_name_the_argument():
    x, weight, gamma, residual = case(1)
    op = torch.ops.specgraph.fused_linear
    with pytest.raises(ValueError, match="gamma must be"):
        op(x, weight, gamma[:-1], 1e-6, None)
    with pytest.raises(ValueError, match="weight must be"):
        op(x, weight[:, :-1], gamma, 1e-6, None)
    with pytest.raises(ValueError, match="residual must be"):
        op(x, weight, None, 1e-6, residual[..., :-1])
    with pytest.raises(ValueError, match="share one dtype"):
        op(x, weight, gamma.double(), 1e-6, None)
    with pytest.raises(ValueError, match="eps=0"):
        op(x, weight, gamma, 0.0, None)
    with pytest.raises(ValueError, match="gated: x must be"):
        op(x, weight[:, :48], gamma, 1e-6, None, True)
    with pytest.raises(ValueError, match=r"weight must be \[N, K=48\]"):
        op(x, weight, None, 0.0, None, True)


class _Block(torch.nn.Module):
    def forward(self, x, weight, gamma, residual):
        return torch.ops.specgraph.fused_linear(x, weight, gamma, 1e-5, residual) * 2


def test_op_through_export_decompositions_and_compile():
    args = case(2)
    want = _Block()(*args)
    decomposed = torch.export.export(_Block(), args).run_decompositions(specgraph.kernels.DECOMPOSITIONS)
    assert not any("specgraph" in str(n.target) for n in decomposed.graph.nodes)
    torch.testing.assert_close(decomposed.module()(*args), want)
    torch.testing.assert_close(torch.compile(_Block(), fullgraph=True)(*args), want)


# ----------------------------------------------------------------------------- epilogues for multi-row folds
@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m", [1, 5, PAST_TILE])
@pytest.mark.parametrize("norm", [False, True], ids=["plain", "norm"])
def test_silu_mul_epilogue_is_hf_gated_mlp_input(m, dtype, norm):
    """silu_mul: the packed gate/up product writes silu(gate) * up, each rounded as HF's MLP rounds them."""
    x, _, gamma, _ = (t.to(DEVICE) for t in case(m + 7, m, 96, 40, dtype))
    gate_up = (torch.randn(2 * 24, 96, generator=torch.Generator().manual_seed(m)) / 96**0.5).to(dtype).to(DEVICE)
    gamma = gamma if norm else None
    normed = rms_norm_reference(x, gamma, 1e-6) if norm else x
    gate, up = torch.nn.functional.linear(normed, gate_up).chunk(2, -1)
    hf = torch.nn.functional.silu(gate) * up  # LlamaMLP's act_fn(gate_proj(x)) * up_proj(x)
    want = fused_linear_reference(x, gate_up, gamma, 1e-6, silu_mul=True)
    assert want.shape == (1, m, 24)
    torch.testing.assert_close(want.float(), hf.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    # bf16: a flipped rounding of the normalized row moves a cancelling up (|up| << its terms) by more than
    # its own 3%; held to 3% of the output's scale (fp32 stays at 1e-4: the logic's check)
    atol = TOLERANCE[dtype] * (want.abs().max().item() if dtype == torch.bfloat16 else 1.0)
    for tiles in (None, (16, 16, 32, 4, 2), (1, 8, 64, 4, 3)):
        got = fused_linear_triton(x, gate_up, gamma, 1e-6, tiles=tiles, silu_mul=True)
        torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=TOLERANCE[dtype])


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("n", [40, 80, 1100], ids=["part_chunk", "whole_chunks", "partials_over_64"])
def test_norm_out_feeds_the_next_norms_readers(m, n, dtype):
    """A residual-add product hands the next RMSNorm's readers gamma * h and h's row sums of squares; a reader
    scaling its product by the rstd computes HF's norm-then-product (the rstd from float32 sums, the rounding of
    gamma * h instead of HF's rounding of the normalized row: within the dtype's tolerance), the kernel as its
    reference does, and the float64 formula for float32."""
    x, w_o, _, residual = (t.to(DEVICE) for t in case(3 * m, m, 64, n, dtype))  # n columns: ceil(n / 16) chunks
    g = torch.Generator().manual_seed(m)
    gamma = (1 + 0.2 * torch.randn(n, generator=g)).to(dtype).to(DEVICE)
    w_next = (torch.randn(48, n, generator=g) / n**0.5).to(dtype).to(DEVICE)
    h, scaled, squares = fused_linear_norm_out_reference(x, w_o, residual, gamma)
    assert squares.shape == (1, m, -(-n // 16)) and squares.dtype == torch.float32
    assert tuple(t.shape for t in torch.ops.specgraph.fused_linear_norm_out(x, w_o, residual, gamma)) == (
        h.shape, scaled.shape, squares.shape)
    got = fused_linear_triton(x, w_o, None, 0.0, residual, next_gamma=gamma)
    for a, b in zip(got, (h, scaled, squares)):
        torch.testing.assert_close(a.float(), b.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    hf = fused_linear_reference(h, w_next, gamma, 1e-5)  # rms_norm(h) then the product, op for op
    want = fused_linear_reference(scaled, w_next, None, 1e-5, row_squares=squares)
    torch.testing.assert_close(want.float(), hf.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    for tiles in (None, (16, 16, 32, 4, 2), (1, 8, 64, 4, 3)):
        read = fused_linear_triton(scaled, w_next, None, 1e-5, tiles=tiles, row_squares=squares)
        torch.testing.assert_close(read.float(), want.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    if dtype == torch.float32:
        h64 = h.double()
        oracle = torch.nn.functional.linear(
            gamma.double() * h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + 1e-5), w_next.double())
        torch.testing.assert_close(read.double(), oracle, atol=2e-5, rtol=2e-5)


def test_epilogue_arguments_are_checked():
    x, weight, gamma, residual = case(4)
    op, norm_out = torch.ops.specgraph.fused_linear, torch.ops.specgraph.fused_linear_norm_out
    with pytest.raises(ValueError, match=r"weight must be \[2N, K=96\]"):
        op(x, weight[:39], None, 0.0, None, False, True)
    with pytest.raises(ValueError, match="row_squares must be float32"):
        op(x, weight, gamma, 1e-6, None, False, False, torch.ones(1, 3, 6))
    with pytest.raises(ValueError, match="row_squares must be float32"):
        op(x, weight, None, 1e-6, None, False, False, torch.ones(1, 3, 6, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"next_gamma must be \[N=40\]"):
        norm_out(x, weight, residual, gamma)


class _RowsLayer(torch.nn.Module):
    """o + residual handing the next norm's readers gamma * h and its squares; gate/up scaled by the rstd with
    the SiLU·mul epilogue; down + residual: a multi-row MLP half as fold_norms_rows leaves it."""

    def forward(self, x, w_o, residual, gamma, w_gu, w_down):
        h, scaled, squares = torch.ops.specgraph.fused_linear_norm_out(x, w_o, residual, gamma)
        act = torch.ops.specgraph.fused_linear(scaled, w_gu, None, 1e-5, None, False, True, squares)
        return torch.ops.specgraph.fused_linear(act, w_down, None, 0.0, h)


def test_epilogue_ops_through_export_decompositions_and_compile():
    g = torch.Generator().manual_seed(9)
    x, residual = torch.randn(1, 4, 32, generator=g), torch.randn(1, 4, 32, generator=g)
    args = (x, torch.randn(32, 32, generator=g) / 6, residual, 1 + 0.1 * torch.randn(32, generator=g),
            torch.randn(96, 32, generator=g) / 6, torch.randn(32, 48, generator=g) / 7)
    want = _RowsLayer()(*args)
    h = residual + torch.nn.functional.linear(x, args[1])  # the same layer in HF's ops
    gate, up = torch.nn.functional.linear(rms_norm_reference(h, args[3], 1e-5), args[4]).chunk(2, -1)
    torch.testing.assert_close(want, h + torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, args[5]),
                               atol=1e-5, rtol=1e-5)
    decomposed = torch.export.export(_RowsLayer(), args).run_decompositions(specgraph.kernels.DECOMPOSITIONS)
    assert not any("specgraph" in str(n.target) for n in decomposed.graph.nodes)
    torch.testing.assert_close(decomposed.module()(*args), want)
    torch.testing.assert_close(torch.compile(_RowsLayer(), fullgraph=True)(*args), want)


def test_tile_config_takes_the_row_grid_for_a_few_rows_of_small_weights():
    """A program per row (BLOCK_M 1) while rows x N / 8 stays within ROW_GRID_PROGRAMS; 16-row tiles past it,
    for silu_mul, and for large weights."""
    from specgraph.kernels.fused_linear import ROW_GRID_PROGRAMS, tile_config

    assert tile_config(5, 576, 576, 2)[0] == 1  # SmolLM2's o at a 5-node verify
    assert tile_config(6, 960, 576, 2)[0] == 1  # q/k/v: 6 x 120 programs
    assert tile_config(8, 960, 576, 2)[0] == 16  # 8 x 120 > 768
    assert 8 * 960 // 8 > ROW_GRID_PROGRAMS
    assert tile_config(4, 1536, 576, 2, silu_mul=True)[0] == 16
    assert tile_config(4, 4096, 4096, 2)[0] == 16  # an 8B weight (32 MB) is not small
    assert tile_config(1, 576, 576, 2)[0] == 1
    assert [tile_config(m, 576, 576, 2)[0] for m in (17, 24, 32, 33, 64)] == [32, 32, 32, 64, 64]  # one tile


def test_tile_config_splits_k_where_17_to_32_rows_of_a_small_weight_make_few_tiles():
    """SmolLM2's 32-row q/k/v, o and down (60, 36, 36 tiles) split K in three, 128 columns a step for the long
    K; not gate/up with silu_mul, nor past 32 rows, past FEW_TILES tiles, or a large weight."""
    from specgraph.kernels.fused_linear import FEW_TILES, SPLIT_PROGRAMS, tile_config

    assert tile_config(32, 576, 1536, 2) == (32, 16, 128, 4, 3, SPLIT_PROGRAMS)  # down
    assert tile_config(32, 576, 576, 2) == tile_config(17, 576, 576, 2) == (32, 16, 64, 4, 3, SPLIT_PROGRAMS)
    assert tile_config(32, 960, 576, 2)[5:] == (SPLIT_PROGRAMS,)  # q/k/v: 60 tiles
    assert len(tile_config(32, 1536, 576, 2, silu_mul=True)) == 5  # gate/up: split it lost
    assert len(tile_config(33, 576, 576, 2)) == len(tile_config(16, 576, 576, 2)) == 5
    assert len(tile_config(32, 16 * FEW_TILES + 1, 576, 2)) == 5
    assert len(tile_config(32, 512, 4096 * 4, 2)) == 5  # 16 MB: not a small weight


def test_max_rows_past_one_tile_only_for_small_weights_under_pdl(monkeypatch):
    """The op sends up to MAX_ROWS rows to the kernel where that paid (a small weight, PDL), 16 else; the
    kernel itself takes MAX_ROWS whatever the weight."""
    from specgraph.kernels import fused_linear as fl

    small, large = torch.empty(576, 576, dtype=torch.bfloat16), torch.empty(4096, 4096, dtype=torch.bfloat16)
    assert fl.max_rows(small) == fl.max_rows(large) == fl.TILE_ROWS == 16  # CPU: no PDL
    monkeypatch.setattr(fl, "pdl_launch", lambda device: True)
    assert (fl.max_rows(small), fl.max_rows(large)) == (fl.MAX_ROWS, fl.TILE_ROWS) == (64, 16)
    with pytest.raises(ValueError, match="at most 64 rows"):
        fused_linear_triton(torch.zeros(1, 65, 96), torch.zeros(40, 96))


def test_tile_config_at_one_row_by_weight_size_and_grid():
    """One row: small weights and few-program grids stream the whole of K (up to 2048) a step; a normed product
    whose K 512-column steps pad less than 1024-column ones takes them; 8B-sized weights keep their own tiles."""
    from specgraph.kernels.fused_linear import tile_config

    assert tile_config(1, 1536, 8960, 2) == (1, 8, 2048, 8, 3)  # Qwen2.5-1.5B's down: 192 programs
    assert tile_config(1, 17920, 1536, 2, norm=True) == (1, 16, 512, 4, 3)  # its gate/up, K 1536
    assert tile_config(1, 9728, 896, 2, norm=True) == (1, 8, 1024, 4, 3)  # K 896: one 1024 step pads no more
    assert tile_config(1, 2048, 1536, 2, norm=True) == (1, 8, 2048, 8, 3)  # its q/k/v: a small weight
    assert tile_config(1, 4096, 14336, 2) == (1, 8, 512, 8, 3)  # 8B down: 512 programs
    assert tile_config(1, 28672, 4096, 2, norm=True) == (1, 8, 1024, 4, 3)  # 8B gate/up
    assert tile_config(1, 6144, 4096, 2, norm=True) == (1, 8, 1024, 4, 3)  # 8B q/k/v


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m", [1, 5, PAST_TILE])
@pytest.mark.parametrize("norm, add", [(True, False), (False, True), (False, False)], ids=["norm", "residual", "plain"])
def test_bias_epilogue_is_hf_linear_with_bias(m, dtype, norm, add):
    """bias: HF's ``nn.Linear(bias=True)`` after the norm (Qwen2's q/k/v), the kernel against the reference in
    every tile family, and fp32 against float64."""
    x, weight, gamma, residual = (t.to(DEVICE) for t in case(m + 29, m, 96, 40, dtype))
    bias = torch.randn(40, generator=torch.Generator().manual_seed(m)).to(dtype).to(DEVICE)
    gamma, residual = gamma if norm else None, residual if add else None
    want = fused_linear_reference(x, weight, gamma, 1e-6, residual, bias=bias)
    normed = rms_norm_reference(x, gamma, 1e-6) if norm else x
    hf = torch.nn.functional.linear(normed, weight, bias)
    torch.testing.assert_close(want, hf if residual is None else residual + hf, atol=0, rtol=0)
    for tiles in (None, (16, 16, 32, 4, 2), (1, 8, 64, 4, 3)):
        got = fused_linear_triton(x, weight, gamma, 1e-6, residual, tiles=tiles, bias=bias)
        torch.testing.assert_close(got.float(), want.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    if dtype == torch.float32:
        x64 = x.double()
        n64 = gamma.double() * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) if norm else x64
        oracle = torch.nn.functional.linear(n64, weight.double(), bias.double())
        oracle = oracle if residual is None else residual.double() + oracle
        torch.testing.assert_close(fused_linear_triton(x, weight, gamma, 1e-6, residual, bias=bias).double(), oracle,
                                   atol=2e-5, rtol=2e-5)


def test_bias_is_checked():
    x, weight, gamma, _ = case(2)
    with pytest.raises(ValueError, match="bias must be"):
        torch.ops.specgraph.fused_linear(x, weight, gamma, 1e-6, None, bias=torch.zeros(7))
    gate_up = torch.randn(80, 96)
    with pytest.raises(ValueError, match="bias must be.*silu_mul"):
        torch.ops.specgraph.fused_linear(x, gate_up, None, 1e-6, None, silu_mul=True, bias=torch.zeros(40))


# ----------------------------------------------------------------------------- K split over programs
@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("form", ["norm_residual", "gated", "silu_mul", "norm_out_then_row_scale"])
@pytest.mark.parametrize("split", [2, 3])
def test_split_k_matches_the_unsplit_kernel_and_the_reference(form, split, dtype):
    """A 6th tile entry splits K over programs: each stores a float32 partial and the tile's last to arrive sums
    them in split order and runs the epilogue; every form against the reference, and the counters left at zero
    (the next launch counts from there: run twice)."""
    from specgraph.kernels import arrivals

    m, k, n = PAST_TILE, 200, 40  # 200 columns: splits of 112 and 96 (2), 80, 80, 40 (3) in 16-column steps
    x, weight, gamma, residual = (t.to(DEVICE) for t in case(split + 31, m, k, n, dtype))
    tiles = (32, 16, 16, 4, 2, split)
    if form == "norm_residual":
        calls = dict(gamma=gamma, eps=1e-6, residual=residual)
    elif form == "gated":
        x = torch.cat([x, x.flip(-1)], -1) * 0.3
        calls = dict(gated=True)
    elif form == "silu_mul":
        weight = torch.cat([weight, weight.flip(0)], 0)
        calls = dict(gamma=gamma, eps=1e-6, silu_mul=True)
    else:
        h, scaled, squares = fused_linear_norm_out_reference(x[..., :n], weight[:, :n], residual, gamma[:n])
        got = fused_linear_triton(x[..., :n], weight[:, :n], None, 0.0, residual, tiles=tiles, next_gamma=gamma[:n])
        for a, b in zip(got, (h, scaled, squares)):
            torch.testing.assert_close(a.float(), b.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
        x, weight = scaled, weight[:, :n]  # the next product reads gamma * h scaled by h's rstd
        calls = dict(eps=1e-5, row_squares=squares)
    want = fused_linear_reference(x, weight, **{a: v for a, v in calls.items()})
    unsplit = fused_linear_triton(x, weight, tiles=tiles[:5], **calls)
    for _ in range(2):
        got = fused_linear_triton(x, weight, tiles=tiles, **calls)
        scale = want.abs().max().item() if form == "silu_mul" and dtype == torch.bfloat16 else 1.0
        torch.testing.assert_close(got.float(), want.float(), atol=TOLERANCE[dtype] * scale, rtol=TOLERANCE[dtype])
        torch.testing.assert_close(got.float(), unsplit.float(), atol=TOLERANCE[dtype] * scale, rtol=TOLERANCE[dtype])
        assert not any(b.any() for b in arrivals.buffers("fused_linear")), "a tile's counter was not reset"


def test_split_k_refuses_the_one_row_path():
    x, weight, gamma, _ = case(5, 1, 96, 40)
    with pytest.raises(ValueError, match="split of K needs tl.dot tiles"):
        fused_linear_triton(x, weight, gamma, 1e-6, tiles=(1, 8, 64, 4, 3, 2))


@needs_triton
def test_a_tile_override_by_row_count_reaches_only_that_row_count(monkeypatch):
    """Benchmarks pass a tile per (m, n, k) (e.g. a split of K for a verify's 32 rows only) or per (n, k): the
    row count's key wins, other row counts keep tile_config's choice, and the op's output is the reference's."""
    from specgraph.kernels import fused_linear as fl

    n, k = 40, 200
    default_24, default_1 = fl.tile_config(PAST_TILE, n, k, 4), fl.tile_config(1, n, k, 4)
    monkeypatch.setattr(fl, "TILE_OVERRIDE", {(PAST_TILE, n, k): (32, 16, 16, 4, 2, 3), (n, 64): (16, 16, 32, 4, 2)})
    assert fl.tile_config(PAST_TILE, n, k, 4) == (32, 16, 16, 4, 2, 3)
    assert fl.tile_config(1, n, k, 4) == default_1 and fl.tile_config(PAST_TILE + 1, n, k, 4) == default_24
    assert fl.tile_config(3, n, 64, 4) == fl.tile_config(PAST_TILE, n, 64, 4) == (16, 16, 32, 4, 2)
    x, weight, gamma, residual = (t.to(DEVICE) for t in case(9, PAST_TILE, k, n))
    got = fused_linear_triton(x, weight, gamma, 1e-6, residual)
    want = fused_linear_reference(x, weight, gamma, 1e-6, residual)
    torch.testing.assert_close(got, want, atol=TOLERANCE[torch.float32], rtol=TOLERANCE[torch.float32])
