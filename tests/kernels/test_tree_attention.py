"""tree_attention: reference vs the per-path SDPA oracle, Triton (interpreted
on CPU, native on GPU) vs the reference, and the op through export/compile."""
import os

import pytest
import torch
import torch.nn.functional as F

import specgraph.kernels  # noqa: F401  (registers the ops)
from specgraph.kernels.tree_attention import tree_attention_reference, tree_attention_triton
from attention_cases import Case, make_case, oracle

# max |kernel - reference| allowed, per dtype (reference computes in float32)
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not (INTERPRET or torch.cuda.is_available()),
                                  reason="Triton needs a GPU or TRITON_INTERPRET=1")


@pytest.mark.parametrize("seed", range(40))
def test_reference_matches_per_path_sdpa(seed):
    case = make_case(seed, dtype=torch.float64)
    got = tree_attention_reference(*case.args())
    assert not got.isnan().any()
    torch.testing.assert_close(got.double(), oracle(case), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", range(12))
def test_cpu_op_reads_only_the_slots_in_use(seed):
    """The CPU op body attends over the slots up to the last one a row may read (slots_in_use): the same
    output as the float64 oracle and the reference over the whole cache, with NaN in every slot past
    the window (a read of one would show), in a cache far longer than the context."""
    case = make_case(seed, s_max=600, dtype=torch.float64)
    case.cache_len.clamp_(max=200)
    for row in range(case.q.shape[0]):
        case.k[row, :, int(case.cache_len[row]) + 64:] = float("nan")
        case.v[row, :, int(case.cache_len[row]) + 64:] = float("nan")
    got = torch.ops.specgraph.tree_attention(*case.args())
    assert not got.isnan().any()
    torch.testing.assert_close(got.double(), oracle(case), atol=1e-5, rtol=1e-5)
    # float32 math over fewer slots: the matmuls' blocking may differ from the whole cache's by an ulp or so
    torch.testing.assert_close(got, tree_attention_reference(*case.args()), atol=1e-6, rtol=1e-6)


def test_chain_mask_is_causal_attention():
    b, h, n, d, s_max = 2, 4, 12, 32, 64
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, h, n, d, generator=g)
    k, v = torch.randn(b, 2, s_max, d, generator=g), torch.randn(b, 2, s_max, d, generator=g)
    cache_len = torch.tensor([20, 5])
    chain = torch.tensor([(1 << (i + 1)) - 1 for i in range(n)]).expand(b, n)
    got = tree_attention_reference(q, k, v, cache_len, chain, d**-0.5, 0)
    for row in range(b):
        c = int(cache_len[row])
        kk = k[row, :, : c + n].repeat_interleave(2, 0)
        vv = v[row, :, : c + n].repeat_interleave(2, 0)
        causal = torch.ones(n, c + n, dtype=torch.bool).tril(c)
        want = F.scaled_dot_product_attention(q[row], kk, vv, attn_mask=causal)
        torch.testing.assert_close(got[row], want, atol=1e-5, rtol=1e-5)


def test_one_query_is_decode():
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(3, 6, 1, 64, generator=g), torch.randn(3, 2, 50, 64, generator=g), torch.randn(3, 2, 50, 64, generator=g)
    cache_len = torch.tensor([0, 17, 48])
    got = tree_attention_reference(q, k, v, cache_len, torch.ones(3, 1, dtype=torch.long), 0.125, 0)
    for row in range(3):
        n = int(cache_len[row]) + 1  # prefix + the query's own slot
        want = F.scaled_dot_product_attention(q[row], k[row, :, :n].repeat_interleave(3, 0), v[row, :, :n].repeat_interleave(3, 0), scale=0.125)
        torch.testing.assert_close(got[row], want, atol=1e-5, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("seed", range(6))
def test_triton_matches_reference(seed, dtype):
    device = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
    case = make_case(100 + seed, dtype=dtype).to(device=device)
    splits = [1, 3] if seed % 2 else [None]
    for num_splits in splits:
        got = tree_attention_triton(*case.args(), num_splits=num_splits)
        want = tree_attention_reference(*case.args())
        assert got.shape == want.shape and got.dtype == dtype
        assert got.stride() == want.stride() and got.transpose(1, 2).is_contiguous()  # rows_major, both
        assert not got.isnan().any()
        torch.testing.assert_close(got.float(), want.float(), atol=TOLERANCE[dtype], rtol=0)


@needs_triton
@pytest.mark.parametrize("d", [64, 128, 256])
def test_triton_head_dims_and_full_trees(d):
    device = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
    case = make_case(7, b=1, h_kv=1, g=2, d=d, r=64, s_max=160, lanes=False, window=0).to(device=device)
    torch.testing.assert_close(tree_attention_triton(*case.args()), tree_attention_reference(*case.args()),
                               atol=TOLERANCE[torch.float32], rtol=0)


@needs_triton
def test_triton_sliding_window_and_lanes():
    device = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
    case = make_case(8, b=2, h_kv=2, g=2, d=32, r=8, s_max=200, lanes=True, window=40).to(device=device)
    for splits in (1, 2, 4):
        torch.testing.assert_close(tree_attention_triton(*case.args(), num_splits=splits),
                                   tree_attention_reference(*case.args()), atol=TOLERANCE[torch.float32], rtol=0)


def test_head_dim_64_takes_16_row_tiles_up_to_96_rows_when_the_grid_is_short():
    """A grid short of the SMs: 16-row tiles merging in the kernel up to SMALL_TILE_ROWS_D64 (96) rows a KV head at
    head dim <= 64 (SmolLM2's 16- and 32-node steps), up to SMALL_TILE_ROWS (32) at larger head dims; 64-row split
    tiles merged by a second launch past them."""
    from specgraph.kernels.tree_attention import launch_config

    def tile(rows, d):  # one KV head of 3 query heads: 3 programs of 16-row tiles, fewer than the CPU's 4 "SMs"
        config = launch_config(torch.empty(1, 3, rows // 3, d), 1, 512)
        return config["block_m"], config["merge_here"]

    assert tile(48, 64) == (16, True)
    assert tile(48, 128) == (64, False)
    assert tile(24, 128) == (16, True)


@needs_triton
def test_48_rows_in_16_row_tiles_merged_in_the_kernel():
    """launch_config's own tiles for 48 rows of 64-dim heads (16 rows, merged in the kernel), split or not."""
    device = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
    case = make_case(41, b=1, h_kv=1, g=3, d=64, r=16, s_max=260, lanes=False, window=0).to(device=device)
    want = tree_attention_reference(*case.args())
    for splits in (1, 3):
        torch.testing.assert_close(tree_attention_triton(*case.args(), num_splits=splits), want,
                                   atol=TOLERANCE[torch.float32], rtol=0)


@needs_triton
@pytest.mark.parametrize("seed", range(3))
def test_splits_merged_by_their_last_program_or_a_second_launch(seed):
    from specgraph.kernels import arrivals

    device = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
    case = make_case(300 + seed, dtype=torch.float32).to(device=device)
    want = tree_attention_reference(*case.args())
    for splits in (2, 9):
        here = tree_attention_triton(*case.args(), num_splits=splits, merge_here=True)
        launched = tree_attention_triton(*case.args(), num_splits=splits, merge_here=False)
        torch.testing.assert_close(here, want, atol=TOLERANCE[torch.float32], rtol=0)
        torch.testing.assert_close(here, launched, atol=1e-6, rtol=0)
    assert not any(b.any() for b in arrivals.buffers("tree_attention"))  # every tile reset its counter


def test_op_errors_name_the_argument():
    case = make_case(0, b=2, h_kv=2, g=2, d=16, r=4)
    op = torch.ops.specgraph.tree_attention
    with pytest.raises(ValueError, match="multiple of H_kv"):
        op(case.q[:, :3], case.k, case.v, case.cache_len, case.mask, 1.0, 0)
    with pytest.raises(ValueError, match="tree_mask must be"):
        op(case.q, case.k, case.v, case.cache_len, case.mask.int(), 1.0, 0)
    with pytest.raises(ValueError, match="cache_len must be"):
        op(case.q, case.k, case.v, case.cache_len[:1], case.mask, 1.0, 0)
    with pytest.raises(ValueError, match="R=65"):
        op(case.q[:, :, :1].expand(-1, -1, 65, -1), case.k, case.v, case.cache_len, case.mask[:, :1].expand(-1, 65), 1.0, 0)


class _Layer(torch.nn.Module):
    def forward(self, q, k, v, cache_len, mask):
        return torch.ops.specgraph.tree_attention(q, k, v, cache_len, mask, 0.25, 0) * 2


def test_op_through_export_decompositions_and_compile():
    case = make_case(3, b=2, h_kv=1, g=2, d=16, r=5, window=0, poison=False)
    want = _Layer()(*case.args()[:5])
    ep = torch.export.export(_Layer(), case.args()[:5])
    targets = {n.target for n in ep.graph.nodes if n.op == "call_function"}
    assert torch.ops.specgraph.tree_attention.default in targets
    torch.testing.assert_close(ep.module()(*case.args()[:5]), want)
    decomposed = ep.run_decompositions(specgraph.kernels.DECOMPOSITIONS)
    names = {str(n.target) for n in decomposed.graph.nodes if n.op == "call_function"}
    assert not any("specgraph" in name for name in names), names
    torch.testing.assert_close(decomposed.module()(*case.args()[:5]), want)
    compiled = torch.compile(_Layer(), fullgraph=True)
    torch.testing.assert_close(compiled(*case.args()[:5]), want)


@pytest.mark.parametrize("r", [1, 6])
def test_output_is_rows_major_in_every_impl(r):
    """Reference, fake impl and Triton kernel agree on the strides ([B, H, R, D] over [B, R, H, D]
    memory, size-1 dims included): inductor trusts the fake one's, and asserts them."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    case = make_case(5, b=2, h_kv=2, g=2, d=16, r=r, window=0, poison=False)
    real = torch.ops.specgraph.tree_attention(*case.args())
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = torch.ops.specgraph.tree_attention(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                                                    for a in case.args()))
    assert real.shape == fake.shape and real.stride() == fake.stride() == (r * 4 * 16, 16, 4 * 16, 1)
    if INTERPRET or torch.cuda.is_available():
        device = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
        assert tree_attention_triton(*case.to(device=device).args()).stride() == real.stride()


class _ToRows(torch.nn.Module):
    """What an HF attention layer does with the output: back to [B, R, H * D] rows, then o_proj."""

    def forward(self, q, k, v, cache_len, mask, weight):
        out = torch.ops.specgraph.tree_attention(q, k, v, cache_len, mask, 0.25, 0)
        b, h, r, d = out.shape
        return out.transpose(1, 2).contiguous().reshape(b, r, h * d) @ weight


def test_compiled_layer_reads_the_output_without_a_copy():
    from torch._inductor.utils import run_and_get_code

    case = make_case(4, b=2, h_kv=1, g=2, d=16, r=5, window=0, poison=False)
    args = (*case.args()[:5], torch.randn(32, 8, dtype=case.q.dtype))
    want = _ToRows()(*args)
    torch._dynamo.reset()
    got, (code,) = run_and_get_code(torch.compile(_ToRows(), fullgraph=True), *args)
    torch.testing.assert_close(got, want)
    # the op (a fallback call) and the product (extern mm) only: no generated copy kernel between them
    assert "cpp_fused" not in code and "triton_" not in code, "the transpose back to rows was copied"
