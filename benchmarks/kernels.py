"""Kernel benchmark (GPU): tree_attention against its peers, and the compact_kv
op against its torch reference, all measured in one run.

    python benchmarks/kernels.py [--quick] [--decode] [--topk] [--out DIR]

For every (shape, B, prefix, N), bf16: median time of
  tree      specgraph::tree_attention (the Triton kernel)
  sdpa      F.scaled_dot_product_attention with an explicit boolean mask
  flex      FlexAttention (torch.compile'd) with a block mask built from the tree
  decode    SDPA without a mask at N = 1 (the plain decode path)
Every time is a CUDA-graph replay (GPU time, no Python or launch overhead,
as the step graph runs); ``tree_eager_ms`` in the JSON adds the op's eager
dispatch. Also reported: the bandwidth tree_attention achieves (K/V of prefix+tree read once, plus
q and out) as a fraction of the device-to-device copy bandwidth measured in
the same run. Trees are random depth-first trees of N nodes.
"""
from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from common import LLAMA_8B, QWEN_1_5B, SMOLLM2, attention_shape, copy_bandwidth, graphed_ms, median_ms  # first: sys.path (common.py)
import specgraph.kernels  # noqa: E402,F401
from specgraph.cli_args import Parser, RawDescriptionDefaultsShown  # noqa: E402
from specgraph.kernels.bitmask import ancestor_masks  # noqa: E402
from specgraph.kernels.compact_kv import compact_kv_reference  # noqa: E402
from specgraph.trees import random_parents as random_tree_parents  # noqa: E402

SHAPES = {"llama8b": attention_shape(LLAMA_8B), "smollm2": attention_shape(SMOLLM2),
          "qwen1.5b": attention_shape(QWEN_1_5B)}  # H, H_kv, D
DEFAULT_SHAPES = ("llama8b", "smollm2")  # what a run without --decode-shapes measures
BATCHES, PREFIXES, NODES = (1, 8, 32, 64), (1024, 4096, 32768), (1, 8, 16, 64)


def random_tree_masks(b: int, n: int, seed: int) -> torch.Tensor:
    return ancestor_masks(random_parents(b, n, seed))[0]


def random_parents(b: int, n: int, seed: int) -> torch.Tensor:
    """[B, N] random trees numbered depth first."""
    rng = random.Random(seed)
    return torch.tensor([random_tree_parents(rng, n) for _ in range(b)])


_flex = None


def flex_runner(q, k, v, cache_len: int, tree_mask):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    global _flex
    if _flex is None:
        import torch._dynamo

        for knob in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit", "accumulated_recompile_limit"):
            if hasattr(torch._dynamo.config, knob):  # one compile per shape, never the eager fallback
                setattr(torch._dynamo.config, knob, 4096)
        _flex = torch.compile(flex_attention, dynamic=False)
    b, h, n, _ = q.shape

    def tree_mod(bi, hi, qi, ki):
        rel = ki - cache_len
        bit = (tree_mask[bi, qi] >> rel.clamp(0, 63)) & 1
        return (ki < cache_len) | ((rel >= 0) & (rel < 64) & (bit == 1))

    block = create_block_mask(tree_mod, b, None, n, k.shape[2], device="cuda")
    try:
        _flex(q, k, v, block_mask=block, enable_gqa=True)
        return lambda: _flex(q, k, v, block_mask=block, enable_gqa=True)
    except Exception:  # noqa: BLE001 - its decoding template rejects some shapes; use the general one
        options = {"FORCE_USE_FLEX_ATTENTION": True}
        return lambda: _flex(q, k, v, block_mask=block, enable_gqa=True, kernel_options=options)


def bench_attention(shape: str, b: int, prefix: int, n: int, bandwidth: float, with_flex: bool) -> dict:
    h, h_kv, d = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(0)
    s_max = prefix + 64
    q = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(b, h_kv, s_max, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(b, h_kv, s_max, d, device="cuda", dtype=torch.bfloat16, generator=g)
    cache_len = torch.full((b,), prefix, device="cuda", dtype=torch.int32)
    tree_mask = random_tree_masks(b, n, seed=b * n).cuda()
    scale = d**-0.5
    row = dict(shape=shape, B=b, prefix=prefix, N=n)

    tree = lambda: torch.ops.specgraph.tree_attention(q, k, v, cache_len, tree_mask, scale, 0)  # noqa: E731
    out = tree()
    row["tree_ms"] = graphed_ms(tree)
    row["tree_eager_ms"] = median_ms(tree)  # with the custom op's Python dispatch
    moved = 2 * b * h_kv * (prefix + n) * d * 2 + 2 * b * h * n * d * 2
    row["floor_ms"] = moved / bandwidth * 1e3
    row["bw_frac"] = row["floor_ms"] / row["tree_ms"]

    kk, vv = k[:, :, : prefix + n], v[:, :, : prefix + n]
    bits = (tree_mask.unsqueeze(-1) >> torch.arange(n, device="cuda")) & 1  # [B, N, N]
    dense = torch.cat([torch.ones(b, n, prefix, dtype=torch.bool, device="cuda"), bits.bool()], -1).unsqueeze(1)
    sdpa = lambda: F.scaled_dot_product_attention(q, kk, vv, attn_mask=dense, scale=scale, enable_gqa=True)  # noqa: E731
    try:
        row["max_abs_diff"] = (sdpa().float() - out.float()).abs().max().item()
        row["sdpa_ms"] = graphed_ms(sdpa)
    except torch.OutOfMemoryError:
        row["sdpa_ms"] = None
    if with_flex:
        try:
            flex = flex_runner(q, kk, vv, prefix, tree_mask)
            flex()
            row["flex_ms"] = graphed_ms(flex)
        except Exception as err:  # noqa: BLE001 - report, keep measuring the rest
            row["flex_ms"], row["flex_error"] = None, f"{type(err).__name__}: {err}"[:200]
    if n == 1:
        kd, vd = k[:, :, : prefix + 1], v[:, :, : prefix + 1]
        row["decode_ms"] = graphed_ms(lambda: F.scaled_dot_product_attention(q, kd, vd, scale=scale, enable_gqa=True))
    del q, k, v, kk, vv, dense
    return row


def bench_ops() -> list[dict]:
    """compact_kv: the Triton op vs the torch reference (the greedy verdict is plain torch in the step:
    kernels/verify.py)."""
    rows = []
    for b, layers in [(1, 30), (32, 32)]:
        kv = torch.randn(2 * layers, b, 8, 4096 + 64, 128, device="cuda", dtype=torch.bfloat16)
        cache_len = torch.full((b,), 4000, device="cuda")
        path = torch.tensor([[0, 2, 5, 9, 12, -1, -1, -1]], device="cuda").expand(b, -1).contiguous()
        accept_len = torch.full((b,), 5, device="cuda")
        op = lambda: torch.ops.specgraph.compact_kv(kv, cache_len, path, accept_len)  # noqa: E731
        ref = lambda: compact_kv_reference(kv, cache_len, path, accept_len)  # noqa: E731
        rows.append(dict(op="compact_kv", B=b, N=2 * layers, triton_ms=graphed_ms(op), torch_ms=graphed_ms(ref)))
        del kv
    return rows


TOPK_CASES = ((1, 8192), (8, 8192), (64, 8192), (8, 49152), (8, 128256), (64, 128256))  # rows, vocabulary


def topk_sweep(bandwidth: float, k: int, out: Path) -> list[dict]:
    """A draft level's top k of float32 log-probs: ``torch.topk``, ``selection.top_k`` (chunked torch, what the
    drafts run) and ``specgraph::topk`` (the Triton kernel), each a CUDA-graph replay, against the
    floor (the rows read once / copy bandwidth); the kernel's indices checked against its reference. Also the
    kernel with each row in chunks of 512-4,096 programs merged by the row's last (``topk_triton(chunk=)``)."""
    from specgraph.kernels.topk import topk_reference, topk_triton
    from specgraph.selection import top_k

    rows = []
    for r, vocab in TOPK_CASES:
        x = torch.randn(r, vocab, device="cuda").log_softmax(-1)
        got, want = torch.ops.specgraph.topk(x, k), topk_reference(x, k)
        row = dict(rows=r, vocab=vocab, k=k, floor_us=r * vocab * 4 / bandwidth * 1e6,
                   exact=bool(torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])),
                   torch_topk_us=graphed_ms(lambda: x.topk(k, -1)) * 1e3,
                   chunked_us=graphed_ms(lambda: top_k(x, k)) * 1e3,
                   kernel_us=graphed_ms(lambda: torch.ops.specgraph.topk(x, k)) * 1e3)
        for chunk in (c for c in (512, 1024, 2048, 4096) if c < vocab):
            merged = topk_triton(x, k, chunk=chunk)
            row[f"merged_{chunk}_exact"] = bool(torch.equal(merged[1], want[1]) and torch.equal(merged[0], want[0]))
            row[f"merged_{chunk}_us"] = graphed_ms(lambda: topk_triton(x, k, chunk=chunk)) * 1e3  # noqa: B023
        rows.append(row)
        print(f"# topk rows={r} V={vocab} k={k}: floor {row['floor_us']:.2f} us | torch.topk {row['torch_topk_us']:.2f} | "
              f"selection.top_k {row['chunked_us']:.2f} | specgraph::topk {row['kernel_us']:.2f} | exact {row['exact']} | "
              + " | ".join(f"{key} {value:.2f}" if isinstance(value, float) else f"{key} {value}"
                           for key, value in row.items() if key.startswith("merged_")))
    out.write_text(json.dumps(dict(bandwidth=bandwidth, topk=rows), indent=1))
    return rows


def sweep(bandwidth: float) -> None:
    """Time tile configurations at the acceptance shapes (B=32, 4k, 8B) and print them."""
    import itertools

    from specgraph.kernels.tree_attention import tree_attention_triton

    h, h_kv, d = SHAPES["llama8b"]
    for n in (8, 64):
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(32, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(32, h_kv, 4096 + 64, d, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn_like(k)
        cache_len = torch.full((32,), 4096, device="cuda", dtype=torch.int32)
        mask = random_tree_masks(32, n, seed=n).cuda()
        results = []
        for bm, bn, nw, ns in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4)):
            try:
                fn = lambda: tree_attention_triton(q, k, v, cache_len, mask, d**-0.5, 0, block_m=bm, block_n=bn,  # noqa: E731
                                                   num_warps=nw, num_stages=ns)
                fn()
                results.append((median_ms(fn), bm, bn, nw, ns))
            except Exception as err:  # noqa: BLE001 - out of shared memory etc.
                results.append((float("inf"), bm, bn, nw, ns))
        for ms, bm, bn, nw, ns in sorted(results)[:6]:
            print(f"# sweep N={n}: {ms:.4f} ms  block_m={bm} block_n={bn} num_warps={nw} num_stages={ns}")


DECODE_CASES = ("16:1", "1024:1", "4096:1", "1024:8")  # context:rows R, at batch 1
DECODE_SPLITS = (None, 1, 2, 3, 5, 9, 17, 33)  # None: launch_config's choice; else prefix splits + 1


def decode_sweep(bandwidth: float, shapes, cases, out: Path, tiles=None, splits=DECODE_SPLITS, ropes=(True, False),
                 flush_l2: bool = False, merges=(None,)) -> list[dict]:
    """The folded op (``tree_attention_write`` with RoPE, as the decode step runs it) at batch-1
    shapes: launch_config's choice with and without RoPE, then RoPE x tiles x warps x splits.
    Prints the default and the best five per case and RoPE setting; every row goes to ``out`` (after each case).
    ``flush_l2``: each replay first overwrites 256 MB (the L2 holds nothing of the op's inputs, as in the
    step, where the layer's products stream past it), and that write's own replay time is subtracted.
    ``merges``: who merges the prefix splits (None: launch_config's choice; True: the tile's last program;
    False: a second launch)."""
    import itertools

    from specgraph.drafts.autoregressive import chain_mask
    from specgraph.kernels.tree_attention import launch_config, tree_attention_triton

    rows = []
    scratch = torch.empty(256 << 20, dtype=torch.uint8, device="cuda") if flush_l2 else None
    flush_ms = graphed_ms(lambda: scratch.fill_(1)) if flush_l2 else 0.0
    for shape, case_text in itertools.product(shapes, cases):
        context, r = map(int, case_text.split(":"))
        h, h_kv, d = SHAPES[shape]
        s_max = max(context, 1024) + 272  # as e2e's max_cache_len leaves past the prompt
        g = torch.Generator(device="cuda").manual_seed(0)
        rand = lambda *size: torch.randn(*size, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
        # as the step graph passes them: q / new k / new v views of one fused projection's [1, R, (H + 2 H_kv) D]
        # output, cos / sin HF's materialized [1, R, D] tables (frequencies repeated over the two halves)
        qkv = rand(1, r, (h + 2 * h_kv) * d)
        q, new_k, new_v = (part.unflatten(-1, (-1, d)).transpose(1, 2)
                           for part in qkv.split((h * d, h_kv * d, h_kv * d), dim=-1))
        k, v = rand(1, h_kv, s_max, d), rand(1, h_kv, s_max, d)
        freqs = 10000.0 ** -(torch.arange(0, d, 2, device="cuda") / d)
        angles = torch.arange(context, context + r, device="cuda")[None, :, None] * freqs.repeat(2)
        cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
        cache_len = torch.tensor([context], device="cuda", dtype=torch.int32)
        chain = chain_mask(r, "cuda")[None]  # row i sees rows 0..i
        floor_ms = (2 * h_kv * (context + r) * d * 2 + 2 * h * r * d * 2) / bandwidth * 1e3
        default = launch_config(q, h_kv, s_max)
        case = dict(shape=shape, context=context, R=r, floor_ms=floor_ms, flush_l2=flush_l2)

        def run(rope, splits=None, **override):  # rope: in the kernel (True) or the inputs arrive rotated
            def fn():
                if flush_l2:
                    scratch.fill_(1)
                return tree_attention_triton(q, k, v, cache_len, chain, d**-0.5, 0, num_splits=splits,
                                             new_kv=(new_k, new_v), rope=(cos, sin) if rope else None, **override)
            try:
                return graphed_ms(fn) - flush_ms
            except Exception:  # noqa: BLE001 - out of registers / shared memory: not a candidate
                return float("inf")

        results = [dict(case, config="default", rope=True, ms=run(True), splits=default["num_splits"],
                        block_m=default["block_m"], num_warps=default["num_warps"]),
                   dict(case, config="default", rope=False, ms=run(False), splits=default["num_splits"],
                        block_m=default["block_m"], num_warps=default["num_warps"])]
        if r == 1:
            kd, vd = k[:, :, : context + 1], v[:, :, : context + 1]
            sdpa = lambda: F.scaled_dot_product_attention(q, kd, vd, scale=d**-0.5, enable_gqa=True)  # noqa: E731
            results.append(dict(case, config="sdpa decode (peer)", rope=False, ms=graphed_ms(sdpa)))
        case_tiles = tiles or (16, 32, 64) + ((128,) if r * h // h_kv >= 128 else ())
        for rope, bm, nw, n_splits, merge in itertools.product(ropes, case_tiles, (4, 8), splits, merges):
            ms = run(rope, n_splits, block_m=bm, num_warps=nw, **({} if merge is None else dict(merge_here=merge)))
            results.append(dict(case, config="sweep", rope=rope, block_m=bm, num_warps=nw, ms=ms, merge_here=merge,
                                splits=n_splits or launch_config(q, h_kv, s_max, block_m=bm)["num_splits"]))
        rows += results
        print(f"# decode {shape} context={context} R={r}: floor {floor_ms * 1e3:.2f} us")
        best = [x for rope in ropes for x in sorted(
            (x for x in results if x["config"] == "sweep" and x["rope"] == rope), key=lambda x: x["ms"])[:5]]
        for x in [x for x in results if x["config"] != "sweep"] + best:
            print(f"#   {x['ms'] * 1e3:7.2f} us  {x['config']:<18} rope={x['rope']!s:<5} block_m={x.get('block_m')} "
                  f"num_warps={x.get('num_warps')} splits={x.get('splits')} merge_here={x.get('merge_here')}", flush=True)
        out.write_text(json.dumps(dict(bandwidth=bandwidth, decode=rows), indent=1))
    return rows


def main() -> None:
    parser = Parser(description=__doc__, formatter_class=RawDescriptionDefaultsShown)  # defaults in --help
    parser.add_argument("--quick", action="store_true", help="only the acceptance configurations (B=32, 4k, 8B shapes)")
    parser.add_argument("--no-flex", action="store_true", help="skip FlexAttention (it compiles per shape)")
    parser.add_argument("--budget-s", type=float, default=480, help="stop starting new configurations after this")
    parser.add_argument("--sweep", action="store_true", help="time tile configurations at the acceptance shapes first")
    parser.add_argument("--decode", action="store_true",
                        help="only the batch-1 decode sweep of the folded op (RoPE on/off, tiles, warps, splits)")
    parser.add_argument("--decode-shapes", nargs="+", default=list(DEFAULT_SHAPES), choices=list(SHAPES))
    parser.add_argument("--decode-cases", nargs="+", default=list(DECODE_CASES), metavar="CONTEXT:ROWS")
    parser.add_argument("--decode-tiles", type=int, nargs="+", help="block_m values to sweep (default: 16 32 64, "
                        "and 128 where a KV head has 128 rows or more); each config compiles, ~2 s apiece")
    parser.add_argument("--decode-splits", type=int, nargs="+", default=list(DECODE_SPLITS[1:]),
                        help="split counts to sweep besides launch_config's own (prefix splits + 1)")
    parser.add_argument("--decode-rope", choices=("both", "on", "off"), default="both",
                        help="RoPE in the kernel (on), not (off), or both")
    parser.add_argument("--decode-merge", choices=("default", "both"), default="default",
                        help="who merges the prefix splits: launch_config's choice, or each config both ways "
                        "(the tile's last program, and a second launch)")
    parser.add_argument("--decode-flush-l2", action="store_true",
                        help="overwrite 256 MB before each replay (the L2 cold, as in the step) and subtract that")
    parser.add_argument("--topk", type=int, nargs="?", const=8, metavar="K",
                        help="only the draft top-k comparison (torch.topk, selection.top_k, specgraph::topk), k = K (8)")
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    from tqdm import tqdm

    started = time.time()
    bandwidth = copy_bandwidth()
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    if args.decode:
        args.out.mkdir(parents=True, exist_ok=True)
        ropes = {"both": (True, False), "on": (True,), "off": (False,)}[args.decode_rope]
        decode_sweep(bandwidth, args.decode_shapes, args.decode_cases, args.out / "kernels-decode.json",
                     args.decode_tiles, (None, *args.decode_splits), ropes, args.decode_flush_l2,
                     (True, False) if args.decode_merge == "both" else (None,))
        return
    if args.topk:
        args.out.mkdir(parents=True, exist_ok=True)
        topk_sweep(bandwidth, args.topk, args.out / "kernels-topk.json")
        return
    if args.sweep:
        sweep(bandwidth)
    configs = [("llama8b", 32, 4096, n) for n in NODES]
    if not args.quick:
        configs += [(s, b, p, n) for s in DEFAULT_SHAPES for b in BATCHES for p in PREFIXES for n in NODES
                    if (s, b, p, n) not in configs]
    rows = []
    for shape, b, prefix, n in tqdm(configs, desc="attention", file=sys.stderr):
        if time.time() - started > args.budget_s:
            print(f"# budget reached: {len(configs) - len(rows)} configurations not measured")
            break
        rows.append(bench_attention(shape, b, prefix, n, bandwidth, with_flex=not args.no_flex))
        torch.cuda.empty_cache()
    ops = bench_ops()

    def fmt(x, spec=".3f"):
        return "n/a" if x is None else format(x, spec)

    header = "| shape | B | prefix | N | tree ms | floor ms | % of copy bw | sdpa+mask ms | flex ms | decode ms | sdpa/tree | flex/tree | tree N / tree N=1 |"
    lines = [header, "|" + "---|" * 13]
    base = {(r["shape"], r["B"], r["prefix"]): r["tree_ms"] for r in rows if r["N"] == 1}
    for r in rows:
        ratio = lambda key: None if r.get(key) is None else r[key] / r["tree_ms"]  # noqa: E731
        vs_decode = base.get((r["shape"], r["B"], r["prefix"]))
        lines.append(f"| {r['shape']} | {r['B']} | {r['prefix']} | {r['N']} | {fmt(r['tree_ms'])} | {fmt(r['floor_ms'])} | "
                     f"{100 * r['bw_frac']:.0f}% | {fmt(r.get('sdpa_ms'))} | {fmt(r.get('flex_ms'))} | {fmt(r.get('decode_ms'))} | "
                     f"{fmt(ratio('sdpa_ms'), '.2f')} | {fmt(ratio('flex_ms'), '.2f')} | "
                     f"{fmt(None if vs_decode is None else r['tree_ms'] / vs_decode, '.2f')} |")
    lines += ["", "| op | B | N (nodes / caches) | Triton ms | torch ms | torch/Triton |", "|---|---|---|---|---|---|"]
    for r in ops:
        lines.append(f"| {r['op']} | {r['B']} | {r['N']} | {r['triton_ms']:.4f} | {r['torch_ms']:.4f} | {r['torch_ms'] / r['triton_ms']:.1f} |")
    table = "\n".join(lines)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kernels.md").write_text(table + "\n")
    (args.out / "kernels.json").write_text(json.dumps(dict(bandwidth=bandwidth, attention=rows, ops=ops), indent=1))
    errors = [r for r in rows if r.get("max_abs_diff", 0) > 0.05]
    if errors:
        print(f"# WARNING: {len(errors)} configurations differ from SDPA by > 0.05")


if __name__ == "__main__":
    main()
