"""tree_attention_write: the step's K/V written at slots cache_len + first + i and attended in one op.

Oracle: the cache written slot by slot in Python, then per-query float64 SDPA over exactly the keys
each root path may see (attention_cases.oracle). The Triton kernel (interpreted on CPU, native on
GPU) against the reference: the same output within the dtype's tolerance, the same cache bit for bit.
"""
import os

import pytest
import torch

import specgraph.kernels  # noqa: F401  (registers the ops)
from specgraph.kernels.bitmask import mask_to_matrix
from specgraph.kernels.tree_attention import tree_attention_triton
from specgraph.kernels.tree_attention_write import tree_attention_write_reference
from attention_cases import Case, make_case, oracle

TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # as tree_attention's
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
needs_triton = pytest.mark.skipif(not (INTERPRET or torch.cuda.is_available()),
                                  reason="Triton needs a GPU or TRITON_INTERPRET=1")


def write_case(seed: int, dtype=torch.float64, layers: int = 2, **kw):
    """(case over the cache before the write, kv, layer, key, value): the step's slots hold NaN before
    the write, so reading the cache there instead of the new rows would show."""
    case = make_case(seed, lanes=False, **kw)  # a tree of R nodes: its mask names window slots 0 .. R-1 only
    b, h_kv, s_max, d = case.k.shape
    r = case.q.shape[2]
    gen = torch.Generator().manual_seed(seed)
    layer = seed % layers
    kv = torch.randn(2 * layers, b, h_kv, s_max, d, generator=gen, dtype=torch.float64)
    kv[2 * layer], kv[2 * layer + 1] = case.k.double(), case.v.double()
    for row in range(b):
        c = int(case.cache_len[row])
        kv[2 * layer:2 * layer + 2, row, :, c:c + r] = float("nan")
    key = torch.randn(b, r, h_kv, d, generator=gen, dtype=torch.float64).transpose(1, 2)  # strided, as a projection's
    value = torch.randn(b, h_kv, r, d, generator=gen, dtype=torch.float64)
    return case.to(dtype=dtype), kv.to(dtype), layer, key.to(dtype), value.to(dtype)


def written_by_hand(kv, layer, key, value, cache_len):
    out = kv.clone()
    for row in range(key.shape[0]):
        for i in range(key.shape[2]):
            out[2 * layer, row, :, int(cache_len[row]) + i] = key[row, :, i]
            out[2 * layer + 1, row, :, int(cache_len[row]) + i] = value[row, :, i]
    return out


@pytest.mark.parametrize("seed", range(12))
def test_reference_writes_then_attends(seed):
    case, kv, layer, key, value = write_case(seed)
    want_kv = written_by_hand(kv, layer, key, value, case.cache_len)
    got = tree_attention_write_reference(case.q, kv, layer, key, value, case.cache_len, case.mask, case.scale,
                                         case.window)
    torch.testing.assert_close(kv, want_kv, equal_nan=True, atol=0, rtol=0)  # other layers, other slots untouched
    after = Case(case.q, want_kv[2 * layer], want_kv[2 * layer + 1], case.cache_len, case.mask, case.scale, case.window)
    assert not got.isnan().any()
    torch.testing.assert_close(got, oracle(after), atol=1e-5, rtol=1e-5)


def test_window_slots_past_the_rows_are_not_read():
    case, kv, layer, key, value = write_case(3, r=4, poison=True)
    mask = case.mask | (1 << 5)  # names window slot 5: no row of this step, NaN in the cache
    got = tree_attention_write_reference(case.q, kv, layer, key, value, case.cache_len, mask, case.scale, case.window)
    want = tree_attention_write_reference(case.q, kv.clone(), layer, key, value, case.cache_len, case.mask,
                                          case.scale, case.window)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("seed", range(4))
def test_triton_matches_reference(seed, dtype):
    case, kv, layer, key, value = write_case(200 + seed, dtype=dtype, window=0 if seed % 2 else None)
    case, kv, key, value = case.to(device=DEVICE), kv.to(DEVICE), key.to(DEVICE), value.to(DEVICE)
    want_kv = kv.clone()
    want = tree_attention_write_reference(case.q, want_kv, layer, key, value, case.cache_len, case.mask, case.scale,
                                          case.window)
    for num_splits in (None, 1, 3):
        got_kv = kv.clone()
        got = tree_attention_triton(case.q, got_kv[2 * layer], got_kv[2 * layer + 1], case.cache_len, case.mask,
                                    case.scale, case.window, num_splits=num_splits, new_kv=(key, value))
        assert not got.isnan().any() and got.stride() == want.stride()  # both rows_major
        torch.testing.assert_close(got.float(), want.float(), atol=TOLERANCE[dtype], rtol=0)
        torch.testing.assert_close(got_kv, want_kv, equal_nan=True, atol=0, rtol=0)


@needs_triton
def test_triton_never_writes_past_the_cache():
    case, kv, layer, key, value = write_case(5, dtype=torch.float32, b=2, r=8, s_max=90, window=0)
    case.cache_len[:] = torch.tensor([86, 10])  # row 0: slots 86 .. 93, four of them past S_max = 90
    case, kv, key, value = case.to(device=DEVICE), kv.to(DEVICE), key.to(DEVICE), value.to(DEVICE)
    got_kv = kv.clone()
    tree_attention_triton(case.q, got_kv[2 * layer], got_kv[2 * layer + 1], case.cache_len, case.mask, case.scale, 0,
                          new_kv=(key, value))
    want_kv = kv.clone()
    want_kv[2 * layer:2 * layer + 2, 0, :, 86:] = torch.stack([key, value])[:, 0, :, :4]
    want_kv[2 * layer:2 * layer + 2, 1, :, 10:18] = torch.stack([key, value])[:, 1]
    torch.testing.assert_close(got_kv, want_kv, equal_nan=True, atol=0, rtol=0)  # row 1's slots 0.. untouched too


def test_op_errors_name_the_argument():
    case, kv, layer, key, value = write_case(1, dtype=torch.float32, r=4)
    op = torch.ops.specgraph.tree_attention_write
    with pytest.raises(ValueError, match="key must be"):
        op(case.q, kv, layer, key[:, :, :3], value, case.cache_len, case.mask, 1.0, 0)
    with pytest.raises(ValueError, match="value must be .* dtype"):
        op(case.q, kv, layer, key, value.double(), case.cache_len, case.mask, 1.0, 0)
    with pytest.raises(ValueError, match="layer 2"):
        op(case.q, kv, 2, key, value, case.cache_len, case.mask, 1.0, 0)


def rope_tables(case, dtype, theta: float = 10000.0):
    """cos, sin [B, R, D] at each node's position cache_len + depth, as HF's rotary embedding builds them."""
    b, _, r, d = case.q.shape
    depth = mask_to_matrix(case.mask, 64).sum(-1) - 1  # [B, R]
    positions = (case.cache_len.view(b, 1) + depth).double()
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64, device=positions.device) / d)
    angles = torch.cat([positions.unsqueeze(-1) * inv_freq] * 2, dim=-1)  # [B, R, D]
    return angles.cos().to(dtype), angles.sin().to(dtype)


@pytest.mark.parametrize("seed", range(6))
def test_reference_rotates_like_hf(seed):
    """With cos/sin, the op equals HF's apply_rotary_pos_emb on q and key, then the unrotated op."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    case, kv, layer, key, value = write_case(300 + seed)
    cos, sin = rope_tables(case, torch.float64)
    q_rot, key_rot = apply_rotary_pos_emb(case.q, key, cos, sin)  # unsqueeze_dim=1: [B, H, R, D]
    want_kv = kv.clone()
    want = tree_attention_write_reference(q_rot, want_kv, layer, key_rot, value, case.cache_len, case.mask,
                                          case.scale, case.window)
    got_kv = kv.clone()
    got = tree_attention_write_reference(case.q, got_kv, layer, key, value, case.cache_len, case.mask, case.scale,
                                         case.window, cos, sin)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(got_kv, want_kv, equal_nan=True, atol=1e-12, rtol=1e-12)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("seed", range(3))
def test_triton_rotates_like_the_reference(seed, dtype):
    """RoPE in the kernel: q rotated at load, the new keys rotated before the window reads and the cache
    stores them. The cache within one rounding of the reference's (fp32 math, rounded once, as inductor
    fuses it, against HF's op-by-op rounding), the output within the dtype's tolerance."""
    case, kv, layer, key, value = write_case(400 + seed, dtype=dtype, window=0 if seed % 2 else None)
    cos, sin = rope_tables(case, dtype)
    case, kv, key, value = case.to(device=DEVICE), kv.to(DEVICE), key.to(DEVICE), value.to(DEVICE)
    cos, sin = cos.to(DEVICE), sin.to(DEVICE)
    want_kv = kv.clone()
    want = tree_attention_write_reference(case.q, want_kv, layer, key, value, case.cache_len, case.mask, case.scale,
                                          case.window, cos, sin)
    cache_tol = {torch.float32: 1e-6, torch.bfloat16: 1.6e-2}[dtype]
    for num_splits in (None, 3):
        got_kv = kv.clone()
        got = tree_attention_triton(case.q, got_kv[2 * layer], got_kv[2 * layer + 1], case.cache_len, case.mask,
                                    case.scale, case.window, num_splits=num_splits, new_kv=(key, value),
                                    rope=(cos, sin))
        assert not got.isnan().any()
        torch.testing.assert_close(got.float(), want.float(), atol=TOLERANCE[dtype], rtol=0)
        torch.testing.assert_close(got_kv.float(), want_kv.float(), equal_nan=True, atol=cache_tol, rtol=cache_tol)
        assert torch.equal(got_kv.isnan(), want_kv.isnan())  # the same slots written, nothing past them


def test_rope_errors_name_the_argument():
    case, kv, layer, key, value = write_case(2, dtype=torch.float32, r=4)
    cos, sin = rope_tables(case, torch.float32)
    op = torch.ops.specgraph.tree_attention_write
    with pytest.raises(ValueError, match="cos and sin go together"):
        op(case.q, kv, layer, key, value, case.cache_len, case.mask, 1.0, 0, cos, None)
    with pytest.raises(ValueError, match=r"sin must be \[B, R, D\]"):
        op(case.q, kv, layer, key, value, case.cache_len, case.mask, 1.0, 0, cos, sin[:, :3])


def later_rows_case(seed: int, first: int, rows: int, dtype=torch.float64):
    """A tree of first + rows nodes of which only the last ``rows`` are this call's: the earlier window slots
    hold their keys in the cache (as a draft's earlier lanes), this call's slots NaN until written.
    Returns (case of the whole tree, q, kv, layer, key, value, mask) with q and mask of the last rows."""
    case = make_case(seed, lanes=False, r=first + rows)
    b = case.q.shape[0]
    layer = seed % 2
    kv = torch.randn(4, *case.k.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    kv[2 * layer], kv[2 * layer + 1] = case.k.double(), case.v.double()
    slots = (case.cache_len.view(b, 1) + first + torch.arange(rows)).view(b, 1, rows, 1)
    slots = slots.expand(b, case.k.shape[1], rows, case.k.shape[3])
    key, value = case.k.double().gather(2, slots), case.v.double().gather(2, slots)
    kv[2 * layer:2 * layer + 2].scatter_(3, slots.unsqueeze(0).expand(2, *slots.shape), float("nan"))
    q, mask = case.q[:, :, first:], case.mask[:, first:].contiguous()
    return case, q.to(dtype), kv.to(dtype), layer, key.to(dtype), value.to(dtype), mask


@pytest.mark.parametrize("first", [1, 5, 24])
@pytest.mark.parametrize("seed", range(3))
def test_reference_reads_earlier_window_slots_from_the_cache(seed, first):
    """first > 0: rows at window slots first .. first + R - 1 attend to earlier window slots as the cache holds
    them: the whole tree's oracle at those rows."""
    case, q, kv, layer, key, value, mask = later_rows_case(500 + seed, first, rows=1 + seed * 3)
    got = tree_attention_write_reference(q, kv, layer, key, value, case.cache_len, mask, case.scale, case.window,
                                         first=first)
    assert not got.isnan().any() and not kv[2 * layer].isnan().any() or case.k.isnan().any()
    torch.testing.assert_close(got, oracle(case)[:, :, first:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kv[2 * layer], case.k.double(), equal_nan=True, atol=0, rtol=0)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("seed", range(3))
def test_triton_reads_earlier_window_slots_from_the_cache(seed, dtype):
    """The kernel with first > 0, with and without RoPE, split or not: as the reference; the cache as the
    reference writes it (bit for bit without RoPE) and nothing else written."""
    first = (8, 3, 40)[seed]
    case, q, kv, layer, key, value, mask = later_rows_case(600 + seed, first, rows=(8, 4, 9)[seed], dtype=dtype)
    cos, sin = rope_tables(Case(q, case.k, case.v, case.cache_len, mask, case.scale, case.window), dtype)
    q, kv, key, value, mask, cos, sin = (t.to(DEVICE) for t in (q, kv, key, value, mask, cos, sin))
    cache_len = case.cache_len.to(DEVICE)
    for rope in (None, (cos, sin)):
        want_kv = kv.clone()
        want = tree_attention_write_reference(q, want_kv, layer, key, value, cache_len, mask, case.scale, case.window,
                                              *(rope or (None, None)), first=first)
        for num_splits in (None, 3):
            got_kv = kv.clone()
            got = tree_attention_triton(q, got_kv[2 * layer], got_kv[2 * layer + 1], cache_len, mask, case.scale,
                                        case.window, num_splits=num_splits, new_kv=(key, value), rope=rope,
                                        first_new=first)
            assert not got.isnan().any()
            torch.testing.assert_close(got.float(), want.float(), atol=TOLERANCE[dtype], rtol=0)
            tol = 0 if rope is None else {torch.float32: 1e-6, torch.bfloat16: 1.6e-2}[dtype]
            torch.testing.assert_close(got_kv.float(), want_kv.float(), equal_nan=True, atol=tol, rtol=tol)
            assert torch.equal(got_kv.isnan(), want_kv.isnan())


def test_first_must_keep_the_rows_in_the_window():
    case, q, kv, layer, key, value, mask = later_rows_case(7, 60, rows=4, dtype=torch.float32)
    op = torch.ops.specgraph.tree_attention_write
    assert not op(q, kv, layer, key, value, case.cache_len, mask, 1.0, 0, None, None, 60).isnan().any()
    with pytest.raises(ValueError, match="first=61"):
        op(q, kv, layer, key, value, case.cache_len, mask, 1.0, 0, None, None, 61)


class _Step(torch.nn.Module):
    def __init__(self, kv):
        super().__init__()
        self.register_buffer("kv", kv)

    def forward(self, q, key, value, cache_len, mask):
        return torch.ops.specgraph.tree_attention_write(q, self.kv, 1, key, value, cache_len, mask, 0.25, 0) * 2


def test_op_under_compile_writes_the_buffer_in_place():
    case, kv, layer, key, value = write_case(1, dtype=torch.float32, r=5, window=0)
    args = (case.q, key, value, case.cache_len, case.mask)
    eager, compiled = _Step(kv.clone()), _Step(kv.clone())
    want = eager(*args)
    got = torch.compile(compiled, fullgraph=True)(*args)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(compiled.kv, eager.kv, equal_nan=True, atol=0, rtol=0)
    assert not torch.equal(eager.kv.nan_to_num(), kv.nan_to_num())  # the write happened


@pytest.mark.slow  # ptxas over two kernels (~25 s): a design choice's reason, not behaviour
def test_rotating_kernel_spills_more_at_wide_heads(tmp_path):
    """benchmarks/kernel_spills.py (ptxas on the CPU, sm_90a): at the 8B 64-row tile (D = 128, 4 warps) the
    rotating kernel spills more registers than the unrotated one -- why fold_rotary keeps 128-dim heads'
    64-row steps apart (fold_rotary.MAX_ROWS_WIDE_HEADS; docs/benchmarks.md, 2026-12-02)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    import triton.backends.nvidia as nvidia_backend

    if not (Path(nvidia_backend.__file__).parent / "bin" / "ptxas").exists():
        pytest.skip("this triton ships no ptxas")
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiles for the GPU target
    subprocess.run([sys.executable, str(root / "benchmarks" / "kernel_spills.py"), "--head-dims", "128", "--warps",
                    "4", "--rope", "none", "turned", "--out", str(tmp_path)], env=env, check=True,
                   capture_output=True, timeout=600)
    rows = {row["rope"]: row for row in json.loads((tmp_path / "kernel-spills.json").read_text())["rows"]}
    assert rows["none"]["registers"] > 0
    assert rows["turned"]["spill_stores"] > rows["none"]["spill_stores"]
