"""specgraph::fused_linear at a few rows, in the forms a SmolLM2 verify step runs them (fold_norms_rows'
row-scaled q/k/v, o and down with the residual add and the next norm's inputs, gate/up with the SiLU·mul
epilogue), each tile of a list against the tile_config default and cuBLAS with the product alone; all 30
layers' weights, CUDA-graph replays, microseconds a product. The row-grid tiles (BLOCK_M 1 with more rows:
a program per row) are what tile_config takes up to ROW_GRID_PROGRAMS; docs/benchmarks.md cites the results.

  python3 benchmarks/investigations/few_row_tiles.py --rows 4 16 --tiles wide --out DIR
  python3 benchmarks/investigations/few_row_tiles.py --rows 2 3 5 6 8 12 --tiles row-grid --out DIR
  python3 benchmarks/investigations/few_row_tiles.py --rows 24 32 --tiles split-k --out DIR
  python3 benchmarks/investigations/few_row_tiles.py --plot RESULTS.txt OUT.png   (µs against rows, per product:
      the best 16-row tile, the best row-grid tile, cuBLAS's bare product)
"""
from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
LINE = re.compile(r"M=(\d+) (\w+) +\(.*?\) tile=(None|\((\d+),[^)]*\)) ([\d.]+) us \(cuBLAS product alone ([\d.]+)\)")

TILES = {  # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages); None: tile_config's choice
    "wide": [None, (16, 16, 1024, 4, 1), (16, 16, 1024, 8, 1), (16, 16, 2048, 4, 1), (16, 16, 512, 4, 2),
             (16, 32, 1024, 4, 1), (16, 16, 1024, 4, 2), (16, 32, 2048, 8, 1), (16, 16, 512, 8, 1),
             (1, 8, 1024, 8, 3), (1, 8, 2048, 8, 3), (1, 8, 512, 8, 3), (1, 16, 1024, 8, 3), (1, 8, 1024, 4, 3),
             (1, 16, 512, 4, 3), (1, 32, 512, 8, 2)],
    "row-grid": [None, (16, 16, 256, 4, 4), (1, 16, 512, 4, 3), (1, 8, 1024, 4, 3), (1, 8, 512, 4, 3),
                 (1, 16, 512, 8, 3), (1, 8, 512, 8, 3)],
    # 17-32 rows (one 32-row tile) with K split over 2-6 programs a tile (a 6th entry): the step's 36-96 programs
    # a product, each walking all of K, against more programs walking less of it; and 16-row tiles (two row
    # blocks: twice the programs, the weight read twice, from L2 the second time), split or not
    "split-k": [None, (32, 16, 128, 4, 3, 2), (32, 16, 128, 4, 3, 3), (32, 16, 64, 4, 3, 3), (32, 16, 32, 4, 3, 4),
                (32, 16, 64, 4, 2, 4), (32, 16, 32, 4, 2, 6), (32, 32, 64, 4, 3, 4), (32, 16, 256, 4, 2, 2),
                (32, 16, 128, 8, 3, 4), (16, 16, 256, 4, 4), (16, 16, 128, 4, 3), (16, 16, 128, 4, 3, 2),
                (16, 16, 64, 4, 3, 3)],
}


def plot(results: Path, out: Path) -> None:
    """Per product form, µs against rows: the best 16-row tile (tile=None counted as one: it was a 16-row
    tile when these were measured), the best row-grid tile, cuBLAS."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best = defaultdict(dict)  # (kind, family) -> rows -> µs
    for m, kind, tile, block_m, us, cublas in LINE.findall(results.read_text()):
        family = "row grid (BLOCK_M 1)" if block_m == "1" else "16-row tl.dot tiles"
        rows = int(m)
        for key, value in (((kind, family), float(us)), ((kind, "cuBLAS, bare product"), float(cublas))):
            best[key][rows] = min(best[key].get(rows, float("inf")), value)
    kinds = sorted({k for k, _ in best})
    fig, axes = plt.subplots(1, len(kinds), figsize=(4 * len(kinds), 3.4), sharey=True)
    for ax, kind in zip(axes, kinds):
        for (k, family), points in sorted(best.items()):
            if k == kind:
                rows = sorted(points)
                ax.plot(rows, [points[r] for r in rows], marker="o", label=family)
        ax.set_title(kind)
        ax.set_xlabel("rows")
        ax.set_ylim(0, 12)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("µs a product")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--tiles", choices=list(TILES), default="row-grid")
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--plot", nargs=2, type=Path, metavar=("RESULTS", "PNG"), help="plot a results file instead")
    args = parser.parse_args()
    if args.plot:
        return plot(*args.plot)
    import torch
    import torch.nn.functional as F
    from common import SMOLLM2, graphed_ms, layer_products

    import specgraph.kernels  # noqa: F401  (registers the ops)
    from specgraph import config
    from specgraph.kernels import fused_linear as fl
    layers_n, hidden, qkv, inter = layer_products(SMOLLM2)
    g = torch.Generator(device="cuda").manual_seed(0)
    rand = lambda *size: torch.randn(*size, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    layers = [(rand(qkv, hidden) / hidden**0.5, rand(hidden, hidden) / hidden**0.5, rand(2 * inter, hidden) / hidden**0.5,
               rand(hidden, inter) / inter**0.5, 1 + 0.1 * rand(hidden)) for _ in range(layers_n)]
    fused, norm_out = torch.ops.specgraph.fused_linear, torch.ops.specgraph.fused_linear_norm_out
    args.out.mkdir(parents=True, exist_ok=True)
    out = open(args.out / f"few-row-tiles-{args.tiles}.txt", "w")
    out.write(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | SmolLM2 shapes, {layers_n} layers, bf16\n")
    for m in args.rows:
        h, gu = rand(1, m, hidden), rand(1, m, inter)
        squares = fl.norm_out_reference(h, layers[0][4])[1]
        kinds = {  # name: (weight index, tile_config's (N, K), the op call)
            "qkv_scaled": (0, (qkv, hidden), lambda w, gm: fused(h, w, None, 1e-5, None, False, False, squares)),
            "o_norm_out": (1, (hidden, hidden), lambda w, gm: norm_out(h, w, h, gm)),
            "gate_up_silu": (2, (inter, hidden), lambda w, gm: fused(h, w, None, 1e-5, None, False, True, squares)),
            "down_norm_out": (3, (hidden, inter), lambda w, gm: norm_out(gu, w, h, gm))}
        for kind, (index, key, call) in kinds.items():
            chain = [(layer[index], layer[4]) for layer in layers]
            x = gu if index == 3 else h
            cublas = graphed_ms(lambda: [F.linear(x, w) for w, _ in chain]) * 1e3 / layers_n
            with config.patch(reference_kernels=True):  # plain torch: each tile's output is held against it
                reference = call(*chain[0])
            for tile in TILES[args.tiles]:
                fl.TILE_OVERRIDE = None if tile is None else {key: tile}
                try:
                    us = graphed_ms(lambda: [call(w, gm) for w, gm in chain]) * 1e3 / layers_n
                    got = call(*chain[0])
                    pairs = zip(got, reference) if isinstance(got, tuple) else [(got, reference)]  # norm_out: 3 outputs
                    error = max((a.float() - b.float()).abs().max().item() / b.float().abs().max().item()
                                for a, b in pairs)
                except Exception:  # noqa: BLE001  (a tile that does not compile: out of shared memory)
                    us = error = float("nan")
                line = (f"M={m} {kind:14s} {key} tile={tile} {us:.2f} us (cuBLAS product alone {cublas:.2f}) "
                        f"max error / max {error:.1e}")
                print(line, flush=True)
                out.write(line + "\n")
            fl.TILE_OVERRIDE = None


if __name__ == "__main__":
    main()
