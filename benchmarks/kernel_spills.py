"""Register use and spills of the tree_attention kernel, compiled for the H200 (sm_90a) without a GPU.

    python3 benchmarks/kernel_spills.py [--head-dims 128 64] [--warps 4 8] [--block-m 64] [--rope ...] [--out DIR]

Triton compiles ``_tree_attention_kernel`` to PTX for each (head_dim, RoPE form, warps, BLOCK_M) and the
ptxas that ships with Triton assembles it with ``-v``: registers a thread and bytes of spill stores /
loads a thread. RoPE forms: none (q and keys arrive rotated), turned (x and its turned copy loaded, as
``fold_rotary`` launches it). Not under TRITON_INTERPRET=1. The step's case: WRITE_NEW (the step's keys read from
the new K/V), 5 splits, no sliding window, bf16, strides of the head dimension 1 (as launches specialise
them). A spill is local memory traffic a thread pays at every access; whether it costs time depends on
what the L1/L2 hold, so this says where to look, not what a step takes: time it with ``kernels.py
--decode`` and ``e2e.py``.
"""
from __future__ import annotations

import argparse
import inspect
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
import triton.backends.nvidia as nvidia_backend
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specgraph.kernels.tree_attention import WINDOW_SLOTS, _tree_attention_kernel  # noqa: E402

POINTERS = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "CacheLen": "*i32", "Mask": "*i64", "Out": "*bf16",
            "PartO": "*fp32", "PartLse": "*fp32", "NewK": "*bf16", "NewV": "*bf16", "Arrived": "*i32",
            "Cos": "*bf16", "Sin": "*bf16"}
ROPE_FORMS = {"none": dict(ROPE=False), "turned": dict(ROPE=True)}
PTXAS = Path(nvidia_backend.__file__).parent / "bin" / "ptxas"


def compile_ptx(head_dim: int, rope: str, warps: int, block_m: int, splits: int = 5) -> str:
    """The kernel's PTX for sm_90a at this configuration (no GPU needed)."""
    names = list(inspect.signature(_tree_attention_kernel.fn).parameters)
    constants = dict(G=4, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=64, NUM_SPLITS=splits,
                     PREFIX_SPLITS=splits - 1, HAS_WINDOW=False, WINDOW_SLOTS=WINDOW_SLOTS, WRITE_NEW=True,
                     MERGE_HERE=False, SPLITS_POW2=triton.next_power_of_2(splits), UPCAST=False, **ROPE_FORMS[rope])
    signature = {n: "constexpr" if n in constants else POINTERS.get(n, "fp32" if n == "qk_scale" else "i32")
                 for n in names}
    unit_strides = {n: 1 for n in names if n.startswith("stride_") and n.endswith("d") and n != "stride_cd"}
    constexprs = {(names.index(n),): v for n, v in {**unit_strides, **constants}.items()}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in POINTERS}
    kernel = triton.compile(ASTSource(fn=_tree_attention_kernel, signature=signature, constexprs=constexprs,
                                      attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=3))
    return kernel.asm["ptx"]


def ptxas_usage(ptx: str) -> dict:
    """Registers a thread and spill bytes a thread, from ``ptxas -v``."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.ptx"
        path.write_text(ptx)
        report = subprocess.run([str(PTXAS), "-v", "--gpu-name=sm_90a", str(path), "-o", os.devnull],
                                capture_output=True, text=True, check=True).stderr
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    registers = re.search(r"Used (\d+) registers", report)
    return dict(registers=int(registers.group(1)), spill_stores=int(spills.group(1)),
                spill_loads=int(spills.group(2)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[128, 64])
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--block-m", type=int, nargs="+", default=[64])
    parser.add_argument("--rope", nargs="+", default=list(ROPE_FORMS), choices=list(ROPE_FORMS))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows = []
    print(f"# triton {triton.__version__}, sm_90a | registers a thread, spill stores / loads (bytes a thread)")
    for head_dim, block_m, warps, rope in itertools.product(args.head_dims, args.block_m, args.warps, args.rope):
        usage = ptxas_usage(compile_ptx(head_dim, rope, warps, block_m))
        rows.append(dict(head_dim=head_dim, block_m=block_m, warps=warps, rope=rope, **usage))
        print(f"D={head_dim:<4d} BLOCK_M={block_m:<3d} warps={warps} rope={rope:<7s} registers {usage['registers']:3d}  "
              f"spills {usage['spill_stores']:5d} / {usage['spill_loads']:5d}", flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "kernel-spills.json").write_text(json.dumps(dict(triton=triton.__version__, rows=rows), indent=1))


if __name__ == "__main__":
    main()
