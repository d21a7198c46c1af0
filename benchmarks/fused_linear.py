"""specgraph::fused_linear against what the decode step runs now (GPU).

Two parts, both at batch 1 with M = 1 and 8 rows, at the decoder-layer shapes of SmolLM2-135M and
Llama-3.1-8B (random bf16 weights, every layer its own, so nothing is served from L2):

  products  each of a layer's four products alone (and down with only the residual folded), chained
            over all layers in one CUDA graph:
            cuBLAS ``F.linear`` (the product only) against ``fused_linear`` (with its prologue and
            epilogue) in every tile configuration of the sweep; µs per product against its floor
            (weight bytes / copy bandwidth). The best configuration per product shape is kept.
  layers    the layers without attention, chained in one CUDA graph, both compiled:
            now    RMSNorm (the residual add fused in by inductor), cuBLAS products, SiLU*mul
            fused  norm in the q/k/v and gate/up products' prologue, SiLU*mul in the down product's,
                   the residual add in the o and down products' epilogue, in the default tiles and in
                   the best tiles of the sweep.
            rows_folded  (M > 1) as the pass fold_norms_rows leaves a step: o and down
                   add the residual and hand gamma * h and h's squares to the next norm's readers,
                   q/k/v and gate/up scale their rows by the rstd, gate/up writes silu(gate) * up.
  At M > 1 the product part also times those epilogue forms (qkv_scaled, o_norm_out,
  gate_up_silu, down_norm_out).

    python3 benchmarks/fused_linear.py [--shapes smollm2 llama8b] [--rows 1 8] [--tiles all|wide-rows|few-rows] [--out DIR]
    python3 benchmarks/fused_linear.py --pdl --shapes smollm2 qwen1.5b llama8b --rows 1 8   (layer chains only:
        programmatic dependent launch off / on / on with the weights' first lines prefetched, kernels/pdl.py;
        at M > 1 rows_folded too, as a verify step of M nodes runs)
"""
from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from common import LLAMA_8B, QWEN_1_5B, SMOLLM2, copy_bandwidth, graphed_ms, layer_products  # first: sys.path (common.py)
import specgraph.kernels  # noqa: E402,F401
from specgraph import config  # noqa: E402
from specgraph.kernels import fused_linear as fl  # noqa: E402

# layers, hidden, q/k/v rows, intermediate: the decoder layers' products
SHAPES = {"smollm2": layer_products(SMOLLM2), "qwen1.5b": layer_products(QWEN_1_5B), "llama8b": layer_products(LLAMA_8B)}
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages); BLOCK_M 1: a row per program on the CUDA cores, 16: tl.dot
DOT_TILES = [(16, bn, bk, 4, st) for bn, bk, st in itertools.product((16, 32, 64), (128, 256), (3, 4))]
ROW_TILES = [(1, bn, bk, 4, st) for bn, bk, st in itertools.product((8, 16, 32), (256, 512), (3, 4))]
WIDE_ROW_TILES = [(1, bn, bk, w, 3) for bn, bk, w in itertools.product((4, 8, 16), (512, 1024, 2048), (4, 8))]
# few rows of small weights (a verify step of 2-16 nodes on a small model): the whole of K (or half) per
# tl.dot step, few stages (DOT_TILES' 128-256 columns a step were swept at 8B shapes), and a program per row
# and 8-32 weight rows on the CUDA cores (the one-row path on grid axis 1; the weight slice re-read from L2)
FEW_ROW_TILES = ([(16, bn, bk, w, st) for bn, bk, w, st in itertools.product((16, 32), (512, 1024, 2048), (4, 8), (1, 2))]
                 + [(1, bn, bk, w, 3) for bn, bk, w in itertools.product((8, 16, 32), (512, 1024, 2048), (4, 8))])
EPS = 1e-5


def make_layers(layers: int, hidden: int, qkv: int, inter: int):
    g = torch.Generator(device="cuda").manual_seed(0)
    rand = lambda *size: torch.randn(*size, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    return [(rand(qkv, hidden) / hidden**0.5, rand(hidden, hidden) / hidden**0.5,
             rand(2 * inter, hidden) / hidden**0.5, rand(hidden, inter) / inter**0.5,
             1 + 0.1 * rand(hidden), 1 + 0.1 * rand(hidden)) for _ in range(layers)], rand


def product_sweep(weights, rand, m: int, bandwidth: float, tiles) -> tuple[list[dict], dict]:
    """Each product kind chained over the layers: cuBLAS alone vs fused_linear per tile config."""
    fused, norm_out = torch.ops.specgraph.fused_linear, torch.ops.specgraph.fused_linear_norm_out
    hidden, inter = weights[0][1].shape[0], weights[0][3].shape[1]
    h, gu = rand(1, m, hidden), rand(1, m, 2 * inter)
    squares = fl.norm_out_reference(h, weights[0][4])[1]  # what a producer hands over with gamma * h (here h)
    kinds = {  # name: (weight index, cuBLAS product, fused call)
        "qkv": (0, lambda w, g: F.linear(h, w), lambda w, g: fused(h, w, g, EPS, None)),
        "o": (1, lambda w, g: F.linear(h, w), lambda w, g: fused(h, w, None, 0.0, h)),
        "gate_up": (2, lambda w, g: F.linear(h, w), lambda w, g: fused(h, w, g, EPS, None)),
        "down": (3, lambda w, g: F.linear(gu[..., :inter], w), lambda w, g: fused(gu, w, None, 0.0, h, True)),
        "down_add": (3, lambda w, g: F.linear(gu[..., :inter], w), lambda w, g: fused(gu[..., :inter], w, None, 0.0, h)),
    }  # down_add: the residual alone folded (the SiLU·mul left to its own kernel), as o
    if m > 1:  # fold_norms_rows' products: nothing between the load of x and tl.dot
        kinds.update({
            "qkv_scaled": (0, lambda w, g: F.linear(h, w), lambda w, g: fused(h, w, None, EPS, None, False, False, squares)),
            "o_norm_out": (1, lambda w, g: F.linear(h, w), lambda w, g: norm_out(h, w, h, g)),
            "gate_up_silu": (2, lambda w, g: F.linear(h, w), lambda w, g: fused(h, w, None, EPS, None, False, True, squares)),
            "down_norm_out": (3, lambda w, g: F.linear(gu[..., :inter], w), lambda w, g: norm_out(gu[..., :inter], w, h, g)),
        })
    rows, best = [], {}
    for kind, (index, cublas, with_fused) in kinds.items():
        n, k = weights[0][index].shape
        key = (n // 2 if kind == "gate_up_silu" else n, k)  # tile_config's: the output's columns, silu(gate) * up
        chain = [(layer[index], layer[4]) for layer in weights]
        row = dict(M=m, kind=kind, N=n, K=k, floor_us=n * k * 2 / bandwidth * 1e6,
                   cublas_us=graphed_ms(lambda: [cublas(w, g) for w, g in chain]) * 1e3 / len(chain))  # noqa: B023
        default = fl.tile_config(m, *key, 2, kind in ("qkv", "gate_up"), kind == "gate_up_silu")
        timings = {}
        for tile in dict.fromkeys([*tiles, default]):  # the default timed too, where the sweep lacks it
            fl.TILE_OVERRIDE = {key: tile}
            try:
                timings[tile] = graphed_ms(lambda: [with_fused(w, g) for w, g in chain]) * 1e3 / len(chain)  # noqa: B023
            except Exception as error:  # noqa: BLE001  (a tile that does not compile is skipped, and said)
                print(f"#   tile {tile} failed: {type(error).__name__}: {str(error)[:120]}", flush=True)
        fl.TILE_OVERRIDE = None
        row["default_tile"], row["default_us"] = list(default), timings.get(default)
        tile = min(timings, key=timings.get)
        row["best_tile"], row["best_us"] = list(tile), timings[tile]
        row["all"] = {"x".join(map(str, t)): v for t, v in timings.items()}
        if kind in ("qkv", "o", "gate_up", "down"):  # the one-row chain's products
            best[key] = tile
        rows.append(row)
        print(f"# product M={m} {kind:<13} [{n}x{k}] floor {row['floor_us']:6.2f} us | cuBLAS {row['cublas_us']:6.2f} "
              f"| fused default {row['default_us'] or float('nan'):6.2f} | best {row['best_us']:6.2f} {tile}",
              flush=True)
    return rows, best


def layer_chain(weights, rand, m: int, bandwidth: float, best: dict | None, pdl: bool = False) -> dict:
    """The layers without attention: now (norm + cuBLAS + add) vs fused, default and best tiles (best None:
    not swept); ``pdl``: fused again with each kernel launched by programmatic dependent launch
    (``config.pdl`` on, then prefetch: kernels/pdl.py)."""
    from specgraph.kernels.fused_linear import rms_norm_reference

    fused = torch.ops.specgraph.fused_linear

    def now(h, layers):
        for w_qkv, w_o, w_gu, w_d, g1, g2 in layers:
            attn = F.linear(rms_norm_reference(h, g1, EPS), w_qkv)[..., : h.shape[-1]]
            h = h + F.linear(attn, w_o)
            gate, up = F.linear(rms_norm_reference(h, g2, EPS), w_gu).chunk(2, -1)
            h = h + F.linear(F.silu(gate) * up, w_d)
        return h

    def with_fused(h, layers):
        for w_qkv, w_o, w_gu, w_d, g1, g2 in layers:
            attn = fused(h, w_qkv, g1, EPS, None)[..., : h.shape[-1]]
            h = fused(attn, w_o, None, 0.0, h)
            h = fused(fused(h, w_gu, g2, EPS, None), w_d, None, 0.0, h, True)
        return h

    def rows_folded(h, layers):  # fold_norms_rows' step: norms handed over by the residual products
        norm_out = torch.ops.specgraph.fused_linear_norm_out
        scaled, squares = fl.norm_out_reference(h, layers[0][4])  # the first layer's norm reads the embedding
        for i, (w_qkv, w_o, w_gu, w_d, g1, g2) in enumerate(layers):
            attn = fused(scaled, w_qkv, None, EPS, None, False, False, squares)[..., : h.shape[-1]]
            h, scaled, squares = norm_out(attn, w_o, h, g2)
            act = fused(scaled, w_gu, None, EPS, None, False, True, squares)
            h, scaled, squares = norm_out(act, w_d, h, layers[(i + 1) % len(layers)][4])
        return h

    hidden = weights[0][1].shape[0]
    layer_bytes = sum(w.numel() * w.element_size() for w in weights[0])
    h = rand(1, m, hidden)
    row = dict(M=m, floor_us=layer_bytes / bandwidth * 1e6)
    outs = {}
    variants = [("now", now, None, "off"), ("fused", with_fused, None, "off")]
    variants += [("fused_best", with_fused, best, "off")] if best is not None else []
    variants += [("rows_folded", rows_folded, None, "off")] if m > 1 else []
    variants += [(f"fused_pdl_{mode}", with_fused, None, mode) for mode in ("on", "prefetch")] if pdl else []
    variants += [(f"rows_folded_pdl_{mode}", rows_folded, None, mode) for mode in ("on", "prefetch")] if pdl and m > 1 else []
    for label, body, tiles, mode in variants:
        fl.TILE_OVERRIDE = tiles
        try:
            with config.patch(pdl=mode):  # read at each launch: the graph records the launches made under it
                torch._dynamo.reset()
                step = torch.compile(body, dynamic=False)
                outs[label] = step(h, weights)
                row[f"{label}_us"] = graphed_ms(lambda: step(h, weights)) * 1e3 / len(weights)  # noqa: B023
        except Exception as error:  # noqa: BLE001
            print(f"#   {label} failed: {type(error).__name__}: {str(error)[:300]}", flush=True)
    fl.TILE_OVERRIDE = None
    row["max_abs_diff"] = max((outs["now"].float() - out.float()).abs().max().item() for out in outs.values())
    times = " | ".join(f"{label} {row[label + '_us']:7.2f}" for label, *_ in variants if label + "_us" in row)
    print(f"# layers  M={m} floor {row['floor_us']:7.2f} us | {times} (us per layer; max |diff| {row['max_abs_diff']:.3g})",
          flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["smollm2", "llama8b"], choices=list(SHAPES))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tiles", choices=("all", "wide-rows", "few-rows"), default="all",
                        help="all: ROW_TILES (M = 1) and DOT_TILES; wide-rows: one-row tiles of 4-16 weight rows "
                             "and 512-2048 columns, 4 or 8 warps (M = 1 only); few-rows: DOT_TILES and "
                             "FEW_ROW_TILES (512-2048 columns a step, 1-2 stages; M > 1 only)")
    parser.add_argument("--pdl", action="store_true",
                        help="only the layer chains, in the default tiles, with programmatic dependent launch off, "
                             "on and with the weight prefetch (SPECGRAPH_PDL; kernels/pdl.py): no tile sweep")
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    import torch._dynamo

    for knob in ("cache_size_limit", "recompile_limit"):  # one compile per shape, never the eager fallback
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 64)
    started = time.time()
    bandwidth = copy_bandwidth()
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    if args.tiles == "wide-rows":
        args.rows = [1]
    elif args.tiles == "few-rows":
        args.rows = [m for m in args.rows if m > 1] or [4, 16]

    def sweep(m: int) -> list[tuple[int, int, int, int, int]]:
        if args.tiles == "wide-rows":
            return WIDE_ROW_TILES
        return (ROW_TILES if m == 1 else []) + DOT_TILES + (FEW_ROW_TILES if args.tiles == "few-rows" else [])

    results = dict(bandwidth=bandwidth, tiles=sorted({t for m in args.rows for t in sweep(m)}), shapes={})
    for shape in args.shapes:
        weights, rand = make_layers(*SHAPES[shape])
        record = results["shapes"][shape] = dict(products=[], layers=[], best={})
        for m in args.rows:
            if args.pdl:
                record["layers"].append(layer_chain(weights, rand, m, bandwidth, None, pdl=True))
                continue
            rows, best = product_sweep(weights, rand, m, bandwidth, sweep(m))
            record["products"] += rows
            record["best"][m] = {f"{n}x{k}": list(t) for (n, k), t in best.items()}
            record["layers"].append(layer_chain(weights, rand, m, bandwidth, best))
        del weights
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fused-linear.json").write_text(json.dumps(results, indent=1))
    print(f"# done in {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
