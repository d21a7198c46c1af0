"""Programmatic dependent launch (kernels/pdl.py): the kernels' PTX for Hopper keeps the contract.

Compiled for sm_90 on the CPU (Triton's own ptxas; no GPU needed), in a child process without
TRITON_INTERPRET (under the interpreter ``@triton.jit`` gives no compilable kernel). In the PTX of a
kernel compiled with PDL nothing is read from or written to global memory before ``griddepcontrol.wait``
(weight prefetches excepted), and ``launch_dependents`` comes after the wait; without PDL neither appears.
Whether it pays is a GPU measurement (benchmarks/fused_linear.py --pdl).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton.backends.nvidia")

CHILD = textwrap.dedent('''
    import json, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from specgraph.kernels.fused_linear import _fused_linear_kernel
    from specgraph.kernels.tree_attention import _tree_attention_kernel

    def compile_ptx(kernel, types, constexprs, pdl):
        signature = {name: ("constexpr" if name in constexprs else types.get(name, "i32")) for name in kernel.arg_names}
        source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"launch_pdl": pdl})
        return compiled.asm["ptx"]

    BF16 = "*bf16"
    linear_types = dict(X=BF16, W=BF16, Gamma=BF16, Bias=BF16, Residual=BF16, Out=BF16, SquaresIn="*fp32",
                        NextGamma=BF16, Scaled=BF16, SquaresOut="*fp32", Partials="*fp32", Arrived="*i32", eps="fp32")
    flags = dict(NORM=False, GATED=False, BIAS=False, RESIDUAL=False, SILU_MUL=False, ROW_SCALE=False,
                 NORM_OUT=False, SQUARE_COLS=16, UPCAST=False, LINE=64, SPLIT_K=1)
    variants = {  # name: (tile, flags): the products a decode step runs
        "qkv_norm_bias_1row": ((1, 8, 1024, 4, 3), dict(NORM=True, BIAS=True)),
        "o_residual_norm_out_1row": ((1, 16, 512, 8, 3), dict(RESIDUAL=True, NORM_OUT=True)),
        "down_silu_mul_1row": ((1, 8, 512, 8, 3), dict(SILU_MUL=True, RESIDUAL=True)),
        "qkv_norm_16rows": ((16, 32, 256, 4, 4), dict(NORM=True)),
        "gate_up_row_scale_16rows": ((16, 64, 128, 4, 3), dict(ROW_SCALE=True, SILU_MUL=True)),
        # K split over programs (a tile's 6th entry): partials, an arrival counter, the last program's epilogue
        "gate_up_row_scale_32rows_split3": ((32, 16, 64, 4, 3), dict(ROW_SCALE=True, SILU_MUL=True, SPLIT_K=3)),
        "o_residual_norm_out_32rows_split4": ((32, 16, 64, 4, 3), dict(RESIDUAL=True, NORM_OUT=True, SPLIT_K=4)),
    }
    out = {}
    for name, ((bm, bn, bk, warps, stages), extra) in variants.items():
        for mode in ("off", "on", "prefetch"):
            constexprs = dict(flags, **extra, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PDL=mode != "off",
                              PREFETCH_LINES=16 if mode == "prefetch" else 0)
            out[f"fused_linear/{name}/{mode}"] = compile_ptx(_fused_linear_kernel, linear_types, constexprs, mode != "off")
    attention_types = dict(Q=BF16, K=BF16, V=BF16, CacheLen="*i32", Mask="*i64", Out=BF16, PartO="*fp32",
                           PartLse="*fp32", NewK=BF16, NewV=BF16, Arrived="*i32", Cos=BF16, Sin=BF16, qk_scale="fp32")
    for mode in ("off", "on"):
        constexprs = dict(G=6, HEAD_DIM=128, BLOCK_M=16, BLOCK_N=64, NUM_SPLITS=4, PREFIX_SPLITS=3, HAS_WINDOW=False,
                          WINDOW_SLOTS=64, WRITE_NEW=True, ROPE=True, MERGE_HERE=True, SPLITS_POW2=4, UPCAST=False,
                          PDL=mode == "on")
        out[f"tree_attention/write_rope_split/{mode}"] = compile_ptx(_tree_attention_kernel, attention_types, constexprs,
                                                                     mode == "on")
    json.dump(out, sys.stdout)
''')

MEMORY = re.compile(r"^\s*(@%p\d+\s+)?(ld|st|atom|red|cp\.async)\.global|^\s*(@%p\d+\s+)?(ld|st)\.(volatile|relaxed|acquire|release)")


@pytest.fixture(scope="module")
def ptx() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600)
    if run.returncode:
        raise AssertionError(f"compiling for sm_90 failed:\n{run.stderr[-4000:]}")
    return json.loads(run.stdout)


def _lines(text: str) -> list[str]:
    return [line.split("//")[0] for line in text.splitlines()]


def _first(lines: list[str], needle: str) -> int | None:
    return next((i for i, line in enumerate(lines) if needle in line), None)


def test_the_variants_compiled(ptx):
    assert len(ptx) == 7 * 3 + 2


@pytest.mark.parametrize("kernel", ["fused_linear/gate_up_row_scale_32rows_split3",
                                    "fused_linear/o_residual_norm_out_32rows_split4"])
def test_split_k_counts_arrivals_with_release_and_acquire(ptx, kernel):
    """A split-K tile's programs publish their partials with one acq_rel atomic on the arrival counter (gpu
    scope) and read the others' through L2 (.cg); an unsplit tile has neither."""
    for mode in ("off", "on"):
        text = ptx[f"{kernel}/{mode}"]
        assert re.search(r"atom\.(global\.)?(acq_rel\.)?(gpu\.)?.*add", text) and "acq_rel" in text
        assert "ld.global.cg" in text
    unsplit = ptx["fused_linear/gate_up_row_scale_16rows/off"]
    assert "atom." not in unsplit and "ld.global.cg" not in unsplit


@pytest.mark.parametrize("mode", ["on", "prefetch"])
@pytest.mark.parametrize("kernel", ["fused_linear/qkv_norm_bias_1row", "fused_linear/o_residual_norm_out_1row",
                                    "fused_linear/down_silu_mul_1row", "fused_linear/qkv_norm_16rows",
                                    "fused_linear/gate_up_row_scale_16rows", "tree_attention/write_rope_split",
                                    "fused_linear/gate_up_row_scale_32rows_split3",
                                    "fused_linear/o_residual_norm_out_32rows_split4"])
def test_no_global_memory_access_before_the_wait(ptx, kernel, mode):
    if kernel.startswith("tree_attention") and mode == "prefetch":
        pytest.skip("tree attention has no weights to prefetch")
    lines = _lines(ptx[f"{kernel}/{mode}"])
    wait, launch = _first(lines, "griddepcontrol.wait"), _first(lines, "griddepcontrol.launch_dependents")
    assert wait is not None and launch is not None and wait < launch
    early = [line.strip() for line in lines[:wait] if MEMORY.search(line)]
    assert early == [], f"global memory touched before griddepcontrol.wait: {early[:5]}"
    assert sum("griddepcontrol.wait" in line for line in lines) == 1
    prefetches = [i for i, line in enumerate(lines) if "prefetch.global.L2" in line]
    if mode == "prefetch":
        assert prefetches and max(prefetches) < wait  # the weights' lines asked for while the kernel ahead runs
    else:
        assert prefetches == []


@pytest.mark.parametrize("kernel", ["fused_linear/qkv_norm_bias_1row", "fused_linear/down_silu_mul_1row",
                                    "fused_linear/gate_up_row_scale_16rows", "tree_attention/write_rope_split"])
def test_without_pdl_no_grid_dependency_control(ptx, kernel):
    text = ptx[f"{kernel}/off"]
    assert "griddepcontrol" not in text and "prefetch.global" not in text


def test_the_oracle_sees_an_early_load(ptx):
    """Negative control: the check above flags a kernel whose loads come before its wait."""
    lines = _lines(ptx["fused_linear/qkv_norm_bias_1row/off"])
    first_load = next(i for i, line in enumerate(lines) if MEMORY.search(line))
    spliced = lines[: first_load + 1] + ["\tgriddepcontrol.wait;"] + lines[first_load + 1:]
    wait = _first(spliced, "griddepcontrol.wait")
    assert [line for line in spliced[:wait] if MEMORY.search(line)]


def test_settings_and_launch_arguments(settings):
    import torch

    from specgraph import config
    from specgraph.errors import SettingError
    from specgraph.kernels.pdl import pdl_kwargs, pdl_launch

    assert config.pdl == "prefetch" and not pdl_launch(torch.device("cpu"))  # the default; CUDA only
    with config.patch(pdl="prefetch"):
        assert not pdl_launch(torch.device("cpu"))  # CUDA only
    assert pdl_kwargs(False, LINE=64) == {}
    assert pdl_kwargs(True, LINE=64) == dict(PDL=True, launch_pdl=True, LINE=64)
    with pytest.raises(TypeError, match="pdl"):
        with config.patch(pdl="yes"):
            pass
    with pytest.raises(SettingError, match="SPECGRAPH_PDL"):
        config.Settings.from_environ({"SPECGRAPH_PDL": "1"})
    assert config.Settings.from_environ({"SPECGRAPH_PDL": "prefetch"}).pdl == "prefetch"
