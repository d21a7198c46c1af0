"""kv_write: the op against a per-slot Python oracle, its refusals, and what it is for: under
torch.compile (inductor) it writes the graph input in place, where the two ``scatter_`` calls into a
view of the stacked cache were functionalized into a copy of the whole cache."""
import os

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import specgraph.kernels  # noqa: F401
from specgraph.kernels.kv_write import kv_write_reference, kv_write_triton

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not (INTERPRET or torch.cuda.is_available()),
                                  reason="Triton needs a GPU or TRITON_INTERPRET=1")


def oracle(kv, layer, slots, key, value):
    out = kv.clone()
    for b in range(kv.shape[1]):
        for i in range(slots.shape[1]):
            out[2 * layer, b, :, int(slots[b, i])] = key[b, :, i]
            out[2 * layer + 1, b, :, int(slots[b, i])] = value[b, :, i]
    return out


def case(seed, dtype=torch.float32, layers=3, b=2, h=2, s=40, n=5, d=8):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(2 * layers, b, h, s, d, generator=g).to(dtype)
    cache_len = torch.randint(0, s - n + 1, (b,), generator=g)
    slots = cache_len.unsqueeze(1) + torch.arange(n)
    key, value = (torch.randn(b, h, n, d, generator=g).to(dtype) for _ in range(2))
    return kv, int(torch.randint(0, layers, (1,), generator=g)), slots, key, value


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kv_write_matches_the_oracle(seed, dtype):
    kv, layer, slots, key, value = case(seed, dtype)
    want = oracle(kv, layer, slots, key, value)
    index = slots.view(kv.shape[1], 1, -1, 1).expand_as(key)
    torch.ops.specgraph.kv_write(kv, layer, index, key, value)
    assert torch.equal(kv, want)  # a copy: bit-exact


def test_bad_arguments_are_refused_by_name():
    kv, layer, slots, key, value = case(0)
    index = slots.view(kv.shape[1], 1, -1, 1).expand_as(key)
    with pytest.raises(ValueError, match="layer 3 outside 0 .. 2"):
        torch.ops.specgraph.kv_write(kv, 3, index, key, value)
    with pytest.raises(ValueError, match="key/value dtype torch.bfloat16/torch.float32"):
        torch.ops.specgraph.kv_write(kv, layer, index, key.bfloat16(), value)
    with pytest.raises(ValueError, match=r"value must be \[B=2, H_kv=2, N, D=8\]"):
        torch.ops.specgraph.kv_write(kv, layer, index, key, value[:1])


def test_compiled_write_stays_in_place():
    """A layer's write plus a read of that layer, compiled: the result is right, and inductor
    allocates nothing the size of a cache layer (the scatter_ form copied the whole cache)."""
    kv, layer, slots, key, value = case(1, s=96)
    want = oracle(kv, layer, slots, key, value)
    layer_shape = str(tuple(kv.shape[1:]))

    def op_form(kv, index, key, value):
        torch.ops.specgraph.kv_write(kv, layer, index, key, value)
        return kv[2 * layer].sum() + kv[2 * layer + 1].sum()

    def scatter_form(kv, index, key, value):
        kv_write_reference(kv, layer, index, key, value)
        return kv[2 * layer].sum() + kv[2 * layer + 1].sum()

    index = slots.view(kv.shape[1], 1, -1, 1).expand_as(key)
    for fn, copies in ((op_form, False), (scatter_form, True)):
        buffer = kv.clone()
        out, code = run_and_get_code(torch.compile(fn, fullgraph=True, backend="inductor"), buffer, index, key, value)
        assert torch.equal(buffer, want)
        torch.testing.assert_close(out, want[2 * layer].sum() + want[2 * layer + 1].sum())
        allocations = [line for line in "\n".join(code).splitlines() if "empty_strided" in line and layer_shape in line]
        assert bool(allocations) == copies, allocations  # the scatter form is the oracle that this can fail


@needs_triton
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("n, d", [(1, 8), (5, 64), (70, 16)])  # 70 nodes: two blocks of rows
def test_triton_kernel_matches_the_oracle(seed, dtype, n, d):
    """Bit-exact against the per-slot oracle, with K/V as the non-contiguous transposes the model
    hands over ([B, N, H, D] storage) and the index an expanded view."""
    device = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
    kv, layer, slots, key, value = case(seed, dtype, n=n, d=d, s=n + 30)
    key, value = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (key, value))
    want = oracle(kv, layer, slots, key, value)
    kv, slots, key, value = (t.to(device) for t in (kv, slots, key, value))
    kv_write_triton(kv, layer, slots.view(kv.shape[1], 1, -1, 1).expand_as(key), key, value)
    assert torch.equal(kv.cpu(), want)


@needs_triton
def test_triton_kernel_never_writes_outside_the_cache():
    """Slots past S_max or negative (a contract violation) are dropped, and nothing else moves."""
    device = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
    kv, layer, slots, key, value = case(5, n=4, s=16)
    slots = torch.tensor([[13, 14, 15, 16], [-1, 0, 1, 40]])
    want = kv.clone()
    for b, i in ((b, i) for b in range(2) for i in range(4) if 0 <= slots[b, i] < 16):
        want[2 * layer, b, :, slots[b, i]] = key[b, :, i]
        want[2 * layer + 1, b, :, slots[b, i]] = value[b, :, i]
    got = kv.to(device)
    kv_write_triton(got, layer, slots.to(device).view(2, 1, -1, 1).expand_as(key), key.to(device), value.to(device))
    assert torch.equal(got.cpu(), want)


@pytest.mark.gpu
def test_op_on_cuda_runs_the_kernel_at_real_shapes():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    kv, layer, slots, key, value = case(7, torch.bfloat16, layers=2, b=4, h=8, s=4096 + 64, n=64, d=128)
    want = oracle(kv, layer, slots, key, value)
    kv, slots, key, value = (t.cuda() for t in (kv, slots, key, value))
    torch.ops.specgraph.kv_write(kv, layer, slots.view(4, 1, -1, 1).expand_as(key), key, value)
    assert torch.equal(kv.cpu(), want)
