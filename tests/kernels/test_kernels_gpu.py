"""The kernels on the GPU at real shapes: against the reference, under CUDA
graphs and torch.compile. Marked gpu: skipped without CUDA."""
import pytest
import torch

import specgraph.kernels  # noqa: F401
from specgraph.kernels.compact_kv import compact_kv_reference
from specgraph.kernels.tree_attention import tree_attention_reference, tree_attention_triton
from specgraph.kernels.tree_attention_write import tree_attention_write_reference
from specgraph.kernels.verify import verify_greedy
from attention_cases import Case, make_case, oracle
from test_tree_attention_write import rope_tables

pytestmark = pytest.mark.gpu
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("seed", range(30))
def test_fuzz_against_reference_and_oracle(seed, dtype):
    case = make_case(1000 + seed, dtype=dtype).to(device="cuda")
    got = torch.ops.specgraph.tree_attention(*case.args())
    want = tree_attention_reference(*case.args())
    torch.testing.assert_close(got.float(), want.float(), atol=TOLERANCE[dtype], rtol=0)
    if seed < 5:
        torch.testing.assert_close(got.double().cpu(), oracle(case.to(device="cpu")), atol=4 * TOLERANCE[dtype], rtol=0)


@pytest.mark.parametrize("h_kv, g, d", [(8, 4, 128), (3, 3, 64), (1, 4, 256)])
@pytest.mark.parametrize("r, lanes", [(1, False), (8, False), (64, False), (4, True)])
@pytest.mark.parametrize("window", [0, 1000])
def test_real_shapes(h_kv, g, d, r, lanes, window):
    case = make_case(7, b=4, h_kv=h_kv, g=g, d=d, r=r, s_max=4096 + 64, lanes=lanes, window=window,
                     dtype=torch.bfloat16).to(device="cuda")
    torch.testing.assert_close(tree_attention_triton(*case.args()).float(), tree_attention_reference(*case.args()).float(),
                               atol=TOLERANCE[torch.bfloat16], rtol=0)


def test_long_context_128k():
    case = make_case(9, b=1, h_kv=2, g=4, d=128, r=16, s_max=131072, lanes=False, window=0, dtype=torch.bfloat16,
                     poison=False).to(device="cuda")
    case.cache_len.fill_(131072 - 64)
    torch.testing.assert_close(tree_attention_triton(*case.args()).float(), tree_attention_reference(*case.args()).float(),
                               atol=TOLERANCE[torch.bfloat16], rtol=0)


@pytest.mark.parametrize("h_kv, g, d", [(8, 4, 128), (3, 3, 64), (1, 4, 256)])
@pytest.mark.parametrize("r", [1, 8, 64])
@pytest.mark.parametrize("rope", [False, True], ids=["rotated", "rope_in_kernel"])
def test_write_and_attend_at_real_shapes_replayed_in_a_cuda_graph(h_kv, g, d, r, rope):
    """tree_attention_write: eager and replayed (split programs merge through arrival counters that
    must be back at zero for every replay) against the reference, cache bit for bit; with RoPE in the
    kernel (cos/sin at each replay's positions), the cache within one bf16 rounding."""
    b, s_max, layer = 4, 4096 + 64, 1
    case = make_case(13, b=b, h_kv=h_kv, g=g, d=d, r=r, s_max=s_max, lanes=False, window=0, dtype=torch.bfloat16,
                     poison=False).to(device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    kv = torch.randn(4, b, h_kv, s_max, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    key = torch.randn(b, h_kv, r, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    value = torch.randn(b, h_kv, r, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    cache_len = case.cache_len.clone()
    tables = [t.cuda() for t in rope_tables(case, torch.bfloat16)] if rope else [None, None]

    def call(cache):
        return torch.ops.specgraph.tree_attention_write(case.q, cache, layer, key, value, cache_len, case.mask,
                                                        case.scale, 0, *tables)

    def check(got, got_kv):
        want_kv = kv.clone()
        want = tree_attention_write_reference(case.q, want_kv, layer, key, value, cache_len, case.mask, case.scale, 0,
                                              *tables)
        if rope:  # the kernel rounds x * cos + rotate_half(x) * sin once, the reference op by op
            torch.testing.assert_close(got_kv, want_kv, atol=1.6e-2, rtol=1.6e-2)
        else:
            assert torch.equal(got_kv, want_kv)
        torch.testing.assert_close(got.float(), want.float(), atol=TOLERANCE[torch.bfloat16], rtol=0)

    static_kv = kv.clone()
    check(call(static_kv), static_kv)  # eager; also warms up (compiles) before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call(static_kv)
    for lengths in (case.cache_len, torch.tensor([0, 100, 4000, 2047]), torch.tensor([4095 - r, 1, 63, 64])):
        cache_len.copy_(lengths)
        if rope:  # the tables follow the positions: cache_len + depth
            moved = Case(case.q, case.k, case.v, cache_len.cpu(), case.mask.cpu(), case.scale, 0)
            for table, fresh in zip(tables, rope_tables(moved, torch.bfloat16)):
                table.copy_(fresh)
        static_kv.copy_(kv)
        graph.replay()
        check(out, static_kv)


def test_step_ops_replay_in_a_cuda_graph():
    case = make_case(11, b=2, h_kv=2, g=2, d=64, r=8, s_max=512, lanes=False, window=0, dtype=torch.bfloat16,
                     poison=False).to(device="cuda")
    kv = torch.randn(4, 2, 2, 512, 64, device="cuda", dtype=torch.bfloat16)
    tokens = torch.randint(0, 3, (2, 8), device="cuda")
    parents = torch.zeros(2, 8, dtype=torch.long, device="cuda")
    target = torch.randint(0, 3, (2, 8), device="cuda")

    def step():
        out = torch.ops.specgraph.tree_attention(*case.args())
        path, accept_len, bonus, emitted = verify_greedy(tokens, parents, case.mask, target, 7)
        torch.ops.specgraph.compact_kv(kv, case.cache_len, path, accept_len)
        return out, path, accept_len

    kv_start = kv.clone()
    step()  # warm up (compiles the kernels)
    kv.copy_(kv_start)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, path, accept_len = step()
    kv.copy_(kv_start)
    graph.replay()
    torch.cuda.synchronize()
    want_kv = kv_start.clone()
    compact_kv_reference(want_kv, case.cache_len, path, accept_len)
    assert torch.equal(kv, want_kv)
    torch.testing.assert_close(out.float(), tree_attention_reference(*case.args()).float(), atol=1.6e-2, rtol=0)


def test_compiled_module_calls_the_kernel():
    case = make_case(12, b=2, h_kv=2, g=2, d=64, r=8, s_max=300, window=0, dtype=torch.bfloat16).to(device="cuda")

    def layer(q, k, v, cache_len, mask):
        return torch.ops.specgraph.tree_attention(q, k, v, cache_len, mask, case.scale, 0) * 2

    compiled = torch.compile(layer, fullgraph=True)
    torch.testing.assert_close(compiled(*case.args()[:5]).float(), 2 * tree_attention_reference(*case.args()).float(),
                               atol=3.2e-2, rtol=0)


@pytest.mark.parametrize("k, n", [(576, 960), (576, 3072), (1536, 576), (4096, 6144), (14336, 4096)],
                         ids=["smollm2_qkv", "smollm2_gate_up", "smollm2_down", "8b_qkv", "8b_down"])
@pytest.mark.parametrize("m", [1, 16])
def test_fused_linear_at_real_shapes_replayed_in_a_cuda_graph(k, n, m):
    """fused_linear (norm or SiLU·mul prologue; residual epilogue) in bf16 against its reference, eager and
    replayed in a CUDA graph."""
    from specgraph.kernels.fused_linear import fused_linear_reference

    g = torch.Generator(device="cuda").manual_seed(k + n + m)
    x = torch.randn(1, m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) / k**0.5
    gamma = 1 + 0.1 * torch.randn(k, device="cuda", dtype=torch.bfloat16, generator=g)
    residual = torch.randn(1, m, n, device="cuda", dtype=torch.bfloat16, generator=g)
    gate_up = 0.3 * torch.randn(1, m, 2 * k, device="cuda", dtype=torch.bfloat16, generator=g)
    op = torch.ops.specgraph.fused_linear
    for args in ((x, weight, gamma, 1e-5, None), (x, weight, None, 0.0, residual),
                 (gate_up, weight, None, 0.0, residual, True)):
        want = fused_linear_reference(*args)
        torch.testing.assert_close(op(*args).float(), want.float(), atol=3e-2, rtol=3e-2)
        out = op(*args)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = op(*args)
        out.zero_()
        graph.replay()
        torch.testing.assert_close(out.float(), want.float(), atol=3e-2, rtol=3e-2)



@pytest.mark.parametrize("hidden, inter", [(576, 1536), (4096, 14336)], ids=["smollm2", "8b"])
@pytest.mark.parametrize("m", [1, 8, 16])
def test_fused_linear_epilogues_at_real_shapes_replayed_in_a_cuda_graph(hidden, inter, m):
    """fold_norms_rows' ops in bf16, replayed in a CUDA graph: o + residual against its reference, the handed
    over gamma * h and squares against the reference's of the kernel's own h, gate/up scaled by the rstd with
    the SiLU·mul epilogue against its reference on the kernel's own inputs; and that pair of references
    against HF's norm-then-product."""
    from specgraph.kernels.fused_linear import fused_linear_reference, norm_out_reference

    g = torch.Generator(device="cuda").manual_seed(hidden + m)
    rand = lambda *size: torch.randn(*size, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    x, residual, gamma = rand(1, m, hidden), rand(1, m, hidden), 1 + 0.1 * rand(hidden)
    w_o, w_gu = rand(hidden, hidden) / hidden**0.5, rand(2 * inter, hidden) / hidden**0.5

    def layer():
        h, scaled, squares = torch.ops.specgraph.fused_linear_norm_out(x, w_o, residual, gamma)
        return h, scaled, squares, torch.ops.specgraph.fused_linear(scaled, w_gu, None, 1e-5, None, False, True, squares)

    outs = layer()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = layer()
    for out in outs:
        out.zero_()
    graph.replay()
    h, scaled, squares, act = outs
    want_h = fused_linear_reference(x, w_o, None, 0.0, residual)
    torch.testing.assert_close(h.float(), want_h.float(), atol=3e-2, rtol=3e-2)
    want_scaled, want_squares = norm_out_reference(h, gamma)
    torch.testing.assert_close(scaled.float(), want_scaled.float(), atol=0, rtol=8e-3)  # one bf16 rounding
    torch.testing.assert_close(squares, want_squares, atol=1e-3, rtol=1e-5)  # float32 sums of 16 squares
    want_act = fused_linear_reference(scaled, w_gu, None, 1e-5, None, False, True, squares)
    torch.testing.assert_close(act.float(), want_act.float(), atol=3e-2, rtol=3e-2)
    hf = fused_linear_reference(want_h, w_gu, gamma, 1e-5, None, False, True)  # norm, gate/up, SiLU·mul as HF
    ref_scaled, ref_squares = norm_out_reference(want_h, gamma)
    chained = fused_linear_reference(ref_scaled, w_gu, None, 1e-5, None, False, True, ref_squares)
    torch.testing.assert_close(chained.float(), hf.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("rows", [1, 8, 64])
@pytest.mark.parametrize("vocab", [49152, 128256])
def test_greedy_tokens_in_chunks_compiled_on_cuda(rows, vocab):
    """The two-stage greedy argmax (the default; runtime.step.ARGMAX_CHUNK) compiled by inductor for CUDA at real vocabulary
    widths (128256: a partial last chunk): eager argmax's indices, ties across chunks to the first."""
    from specgraph.kernels.verify import greedy_tokens

    g = torch.Generator(device="cuda").manual_seed(rows)
    logits = torch.randint(-3, 4, (rows, vocab), device="cuda", generator=g).to(torch.bfloat16)
    logits[0, vocab - 5] = logits[0, 3000] = 8  # one maximum in two chunks: the first wins
    got = torch.compile(lambda x: greedy_tokens(x, 2048), fullgraph=True)(logits)
    assert torch.equal(got, logits.argmax(-1)) and got[0].item() == 3000


@pytest.mark.parametrize("rows", [8, 64])
@pytest.mark.parametrize("vocab", [8192, 128256])  # one pass; two, the last chunk partial
@pytest.mark.parametrize("k", [8, 64])
def test_topk_at_draft_vocabularies(rows, vocab, k):
    """specgraph::topk on CUDA (one pass at 8,192, two above) against its reference, bit for bit: float32
    log-probs with ties (rounded to 1/8) and bf16 logits; eager, in a CUDA graph and compiled."""
    from specgraph.kernels.topk import topk_reference

    g = torch.Generator(device="cuda").manual_seed(vocab + rows)
    logprobs = (torch.randn(rows, vocab, device="cuda", generator=g) * 8).round() / 8
    logits = torch.randn(rows, vocab, device="cuda", generator=g).to(torch.bfloat16)
    for x in (logprobs, logits):
        want = topk_reference(x, k)
        eager = torch.ops.specgraph.topk(x, k)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = torch.ops.specgraph.topk(x, k)
        graph.replay()
        compiled = torch.compile(lambda t: torch.ops.specgraph.topk(t, k), fullgraph=True)(x)
        for values, indices in (eager, replayed, compiled):
            assert torch.equal(indices, want[1]) and torch.equal(values, want[0])


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch needs Hopper or later")
@pytest.mark.parametrize("m", [1, 8])
def test_pdl_chain_replayed_in_a_cuda_graph_equals_plain_launches(m, settings):
    """Layers of the decode step's kernels (norm + q/k/v, write + attend with rope, o + residual, norm +
    gate/up, SiLU·mul + down + residual), each reading the one before, replayed from a CUDA graph: with
    programmatic dependent launch (on, prefetch) the outputs are bitwise those of plain launches; a kernel
    reading before its wait would read its predecessor's half-written output. The cache is reset before
    each replay so every mode starts from the same state."""
    from specgraph import config

    hidden, heads, h_kv, d, inter, layers, s_max = 1536, 12, 2, 128, 8960, 4, 1024
    g = torch.Generator(device="cuda").manual_seed(m)
    rand = lambda *size: torch.randn(*size, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    qkv_rows = (heads + 2 * h_kv) * d
    weights = [(rand(qkv_rows, hidden) / hidden**0.5, rand(qkv_rows), rand(hidden, heads * d) / hidden**0.5,
                rand(2 * inter, hidden) / hidden**0.5, rand(hidden, inter) / inter**0.5,
                1 + 0.1 * rand(hidden), 1 + 0.1 * rand(hidden)) for _ in range(layers)]
    kv0 = [(rand(1, h_kv, s_max, d), rand(1, h_kv, s_max, d)) for _ in range(layers)]
    cache_len = torch.tensor([700], device="cuda", dtype=torch.int32)
    tree_mask = torch.tensor([[(1 << (i + 1)) - 1 for i in range(m)]], device="cuda", dtype=torch.int64)  # a chain
    cos, sin = rand(1, m, d).cos(), rand(1, m, d).sin()
    x0 = rand(1, m, hidden)

    def step(kv):
        h = x0
        for (w_qkv, b_qkv, w_o, w_gu, w_d, g1, g2), (k_cache, v_cache) in zip(weights, kv):
            qkv = torch.ops.specgraph.fused_linear(h, w_qkv, g1, 1e-6, None, bias=b_qkv)  # [1, m, (H + 2 Hkv) D]
            q = qkv[..., : heads * d].view(1, m, heads, d).transpose(1, 2)
            k_new = qkv[..., heads * d: (heads + h_kv) * d].view(1, m, h_kv, d).transpose(1, 2)
            v_new = qkv[..., (heads + h_kv) * d:].view(1, m, h_kv, d).transpose(1, 2)
            attn = tree_attention_triton(q, k_cache, v_cache, cache_len, tree_mask, d**-0.5, 0,
                                         new_kv=(k_new, v_new), rope=(cos, sin))  # [1, H, m, D]
            h = torch.ops.specgraph.fused_linear(attn.transpose(1, 2).reshape(1, m, heads * d), w_o, None, 0.0, h)
            h = torch.ops.specgraph.fused_linear(torch.ops.specgraph.fused_linear(h, w_gu, g2, 1e-6, None),
                                                 w_d, None, 0.0, h, True)
        return h

    results = {}
    for mode in ("off", "on", "prefetch"):
        with config.patch(pdl=mode):
            kv = [(k.clone(), v.clone()) for k, v in kv0]
            step(kv)  # compiles the variant outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = step(kv)
            for (k, v), (k0, v0) in zip(kv, kv0):
                k.copy_(k0), v.copy_(v0)
            out.zero_()
            graph.replay()
            torch.cuda.synchronize()
            results[mode] = (out.clone(), [k.clone() for k, _ in kv])
    for mode in ("on", "prefetch"):
        assert torch.equal(results[mode][0], results["off"][0]), mode
        assert all(torch.equal(a, b) for a, b in zip(results[mode][1], results["off"][1])), mode
    assert results["off"][0].abs().sum() > 0
