"""soft_ce_rows: the reference against a float64 oracle written from the contract, the Triton kernel
(TRITON_INTERPRET=1 on a CPU) against the reference over several blocks a row, with and without a
column map, float32 and bfloat16 logits, argmax ties; the op's fake and errors."""
import os

import pytest
import torch

import specgraph.kernels  # noqa: F401
from specgraph.kernels.soft_ce import soft_ce_reference, soft_ce_triton

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
needs_triton = pytest.mark.skipif(not (INTERPRET or torch.cuda.is_available()),
                                  reason="Triton needs a GPU or TRITON_INTERPRET=1")


def case(seed: int, m=6, v=300, n=9, v_teacher=None, columns=False, dtype=torch.float32, ties=False):
    g = torch.Generator().manual_seed(seed)
    v_teacher = v_teacher or (v + 37 if columns else v)
    logits = 2 * torch.randn(m, v, generator=g)
    teacher = 3 * torch.randn(n, v_teacher, generator=g)
    if ties:  # few distinct values: argmax must take the first of equal maxima, across blocks too
        logits, teacher = logits.round().clamp(-2, 2), teacher.round().clamp(-2, 2)
    index = torch.randint(0, n, (m,), generator=g)
    cols = torch.randperm(v_teacher, generator=g)[:v].sort().values if columns else None
    return logits.to(dtype), teacher.to(dtype), index, cols


def oracle(logits, teacher, index, columns):
    """Per row from the contract, float64, with Python's max for the argmax (first of equal maxima)."""
    out = []
    for i in range(logits.shape[0]):
        z = teacher[index[i]].double()
        z = z if columns is None else z[columns]
        l = logits[i].double()
        p, log_q = torch.softmax(z, 0), torch.log_softmax(l, 0)
        first = lambda x: max(range(len(x)), key=lambda j: (x[j], -j))  # noqa: E731
        out.append((-(p * log_q).sum(), log_q.exp() - p, first(l.tolist()), first(z.tolist())))
    return out


@pytest.mark.parametrize("columns", [False, True])
@pytest.mark.parametrize("ties", [False, True])
def test_reference_is_the_contract(columns, ties):
    args = case(1 + columns + 2 * ties, columns=columns, ties=ties, dtype=torch.float64)
    loss, grad, draft_top, teacher_top = soft_ce_reference(*args)
    for i, (want_loss, want_grad, want_l, want_z) in enumerate(oracle(*args)):
        torch.testing.assert_close(loss[i], want_loss, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(grad[i], want_grad, atol=1e-12, rtol=1e-12)
        assert (int(draft_top[i]), int(teacher_top[i])) == (want_l, want_z)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("columns", [False, True])
@pytest.mark.parametrize("ties", [False, True])
def test_kernel_equals_the_reference_over_several_blocks(dtype, columns, ties):
    logits, teacher, index, cols = (x if x is None else x.to(DEVICE)
                                    for x in case(5 + columns, columns=columns, ties=ties, dtype=dtype))
    got = soft_ce_triton(logits, teacher, index, cols, block=128)  # 300 entries: 3 blocks, the last partial
    want = soft_ce_reference(logits, teacher, index, cols)
    assert got[1].dtype == dtype and got[0].dtype == torch.float32
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1].float(), want[1].float(), atol=1e-6 if dtype == torch.float32 else 4e-3,
                               rtol=1e-5 if dtype == torch.float32 else 1e-2)
    assert torch.equal(got[2], want[2]) and torch.equal(got[3], want[3])


def test_fake_shapes_and_errors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    logits, teacher, index, cols = case(2, columns=True, dtype=torch.bfloat16)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(x) for x in (logits, teacher, index, cols)]
        loss, grad, draft_top, teacher_top = torch.ops.specgraph.soft_ce_rows(*fake)
    assert (loss.shape, loss.dtype, grad.shape, grad.dtype) == ((6,), torch.float32, (6, 300), torch.bfloat16)
    assert draft_top.dtype == teacher_top.dtype == torch.int64
    with pytest.raises(ValueError, match="the logits have 300 columns but the teacher gives 337"):
        torch.ops.specgraph.soft_ce_rows(logits, teacher, index, None)


@pytest.mark.gpu
@pytest.mark.parametrize("columns", [False, True])
def test_the_cuda_op_at_a_real_vocabulary_equals_the_reference(columns):
    """SmolLM2's 49,152 tokens (or a 16,384-token draft vocabulary of them), bf16 logits, the default block."""
    v = 16384 if columns else 49152
    logits, teacher, index, cols = case(11, m=64, v=v, n=80, v_teacher=49152, columns=columns, dtype=torch.bfloat16)
    logits, teacher, index = logits.cuda(), teacher.cuda(), index.cuda()
    cols = None if cols is None else cols.cuda()
    got = torch.ops.specgraph.soft_ce_rows(logits, teacher, index, cols)
    want = soft_ce_reference(logits, teacher, index, cols)
    torch.testing.assert_close(got[0], want[0], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(got[1].float(), want[1].float(), atol=1e-4, rtol=1e-2)
    assert torch.equal(got[2], want[2]) and torch.equal(got[3], want[3])


COMPILE_FOR_THE_H200 = """
import inspect, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from specgraph.kernels.soft_ce import BLOCK, _soft_ce_kernel
names = list(inspect.signature(_soft_ce_kernel.fn).parameters)
for dtype, columns in (("*bf16", True), ("*fp32", False)):
    pointers = dict(Logits=dtype, Teacher=dtype, Index="*i64", Columns="*i64", Loss="*fp32", Grad=dtype,
                    DraftTop="*i64", TeacherTop="*i64")
    constants = dict(HAS_COLUMNS=columns, BLOCK=BLOCK)
    signature = {n: "constexpr" if n in constants else pointers.get(n, "i32") for n in names}
    constexprs = {(names.index(n),): v for n, v in constants.items()}
    kernel = triton.compile(ASTSource(fn=_soft_ce_kernel, signature=signature, constexprs=constexprs, attrs={}),
                            target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8))
    assert "ld.global" in kernel.asm["ptx"] and kernel.asm["cubin"]
"""


def test_the_kernel_compiles_for_the_h200():
    """The interpreter runs Python, not Triton's compiler: compile the kernel for sm_90 (PTX, then ptxas) in a
    process without TRITON_INTERPRET, for bf16 logits with a column map and float32 without."""
    import subprocess
    import sys
    from pathlib import Path

    import triton.backends.nvidia as nvidia_backend

    if not (Path(nvidia_backend.__file__).parent / "bin" / "ptxas").exists():
        pytest.skip("this triton ships no ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE_FOR_THE_H200], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
