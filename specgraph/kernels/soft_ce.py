"""``specgraph::soft_ce_rows``: per row, the soft cross-entropy of a head's logits against a teacher's,
its gradient in the logits and both argmaxes, reading each [V] row twice and writing the gradient once.

Contract:
  logits:   [M, V] float32, bfloat16 or float16 (or float64: the reference), finite
  teacher:  [N, V_teacher] float, finite; row ``index[i]`` teaches row i
  index:    [M] int64 in [0, N)
  columns:  [V] int64 or None: the teacher's columns of the head's vocabulary (None: V_teacher = V)
  returns   loss [M] (float32; float64 for float64 logits): -Σ_v p_v log q_v
            grad [M, V] (logits' dtype): q - p, d loss / d logits (Σ_v p_v = 1)
            draft_top [M], teacher_top [M] int64: argmax of logits and of the teacher's columns (first on ties)
  with p = softmax(teacher[index, columns]), q = softmax(logits), both in float32 (float64 for float64).

Why: EAGLE-3's training loss runs this at every unrolled step over every answer row and the whole
vocabulary. Written out in torch it is about a dozen float32 passes over [rows, V] (casts, two
softmaxes, the product, the sum, the gradient); here one program a row keeps running maxima and sums
(online softmax, and Σ p·logits rescaled with the teacher's maximum) over the row in blocks, then
writes q - p in a second pass over the same blocks.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048  # entries of a row per loop iteration


@triton.jit
def _soft_ce_kernel(Logits, Teacher, Index, Columns, Loss, Grad, DraftTop, TeacherTop, V,
                    stride_l, stride_t, stride_g, HAS_COLUMNS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    teacher_row = Teacher + tl.load(Index + row).to(tl.int64) * stride_t
    lane = tl.arange(0, BLOCK)
    inf = float("inf")
    max_l, sum_l, arg_l = -inf, 0.0, 0  # the logits: running max, Σ exp(l - max), argmax
    max_z, sum_z, arg_z = -inf, 0.0, 0  # the teacher's
    pl = 0.0  # Σ exp(z - max_z) · l: with sum_z, Σ p · l
    for start in range(0, V, BLOCK):
        offs = start + lane
        alive = offs < V
        l = tl.load(Logits + row * stride_l + offs, mask=alive, other=-inf).to(tl.float32)
        col = tl.load(Columns + offs, mask=alive, other=0) if HAS_COLUMNS else offs
        z = tl.load(teacher_row + col, mask=alive, other=-inf).to(tl.float32)
        block_l, block_z = tl.max(l, 0), tl.max(z, 0)
        arg_l = tl.where(block_l > max_l, start + tl.argmax(l, 0), arg_l)  # strict: the first maximum stays
        arg_z = tl.where(block_z > max_z, start + tl.argmax(z, 0), arg_z)
        new_l, new_z = tl.maximum(max_l, block_l), tl.maximum(max_z, block_z)
        sum_l = sum_l * tl.exp(max_l - new_l) + tl.sum(tl.where(alive, tl.exp(l - new_l), 0.0), 0)
        e = tl.where(alive, tl.exp(z - new_z), 0.0)
        scale = tl.exp(max_z - new_z)
        sum_z = sum_z * scale + tl.sum(e, 0)
        pl = pl * scale + tl.sum(e * tl.where(alive, l, 0.0), 0)
        max_l, max_z = new_l, new_z
    tl.store(Loss + row, max_l + tl.log(sum_l) - pl / sum_z)  # -Σ p (l - max_l - log sum_l), Σ p = 1
    tl.store(DraftTop + row, arg_l.to(tl.int64))
    tl.store(TeacherTop + row, arg_z.to(tl.int64))
    for start in range(0, V, BLOCK):
        offs = start + lane
        alive = offs < V
        l = tl.load(Logits + row * stride_l + offs, mask=alive, other=0.0).to(tl.float32)
        col = tl.load(Columns + offs, mask=alive, other=0) if HAS_COLUMNS else offs
        z = tl.load(teacher_row + col, mask=alive, other=0.0).to(tl.float32)
        g = tl.exp(l - max_l) / sum_l - tl.exp(z - max_z) / sum_z
        tl.store(Grad + row * stride_g + offs, g.to(Grad.dtype.element_ty), mask=alive)


def soft_ce_triton(logits, teacher, index, columns, block: int = BLOCK):
    m, v = logits.shape
    logits, teacher = logits.contiguous(), teacher.contiguous()
    loss = torch.empty(m, dtype=torch.float32, device=logits.device)
    grad = torch.empty_like(logits)
    draft_top = torch.empty(m, dtype=torch.int64, device=logits.device)
    teacher_top = torch.empty(m, dtype=torch.int64, device=logits.device)
    if m:
        _soft_ce_kernel[(m,)](logits, teacher, index.contiguous(), index if columns is None else columns.contiguous(),
                              loss, grad, draft_top, teacher_top, v, logits.stride(0), teacher.stride(0),
                              grad.stride(0), HAS_COLUMNS=columns is not None, BLOCK=block, num_warps=8)
    return loss, grad, draft_top, teacher_top


def soft_ce_reference(logits, teacher, index, columns):
    """Plain torch: the CPU path and the kernel's oracle."""
    exact = torch.promote_types(logits.dtype, torch.float32)
    z = (teacher[index] if columns is None else teacher[index.unsqueeze(1), columns]).to(exact)  # [M, V]
    p = torch.softmax(z, -1)
    log_q = torch.log_softmax(logits.to(exact), -1)
    loss = -(p * log_q).sum(-1)
    return loss, (log_q.exp() - p).to(logits.dtype), log_q.argmax(-1), z.argmax(-1)


def _check(logits, teacher, index, columns) -> None:
    if logits.dim() != 2 or teacher.dim() != 2 or index.shape != logits.shape[:1]:
        raise ValueError(f"soft_ce_rows: logits [M, V], teacher [N, V_teacher], index [M]; got "
                         f"{tuple(logits.shape)}, {tuple(teacher.shape)}, {tuple(index.shape)}")
    width = teacher.shape[1] if columns is None else columns.numel()
    if width != logits.shape[1]:
        raise ValueError(f"soft_ce_rows: the logits have {logits.shape[1]} columns but the teacher gives {width}"
                         f"{'' if columns is None else ' (columns selected)'}")


@torch.library.custom_op("specgraph::soft_ce_rows", mutates_args=())
def soft_ce_rows(logits: torch.Tensor, teacher: torch.Tensor, index: torch.Tensor,
                 columns: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: loss, d loss / d logits, both argmaxes (contract above). Other devices: the reference."""
    _check(logits, teacher, index, columns)
    return soft_ce_reference(logits, teacher, index, columns)


@soft_ce_rows.register_kernel("cuda")
def _soft_ce_cuda(logits, teacher, index, columns):
    _check(logits, teacher, index, columns)
    if logits.dtype == torch.float64:
        return soft_ce_reference(logits, teacher, index, columns)
    return soft_ce_triton(logits, teacher, index, columns)


@soft_ce_rows.register_fake
def _soft_ce_fake(logits, teacher, index, columns):
    _check(logits, teacher, index, columns)
    m = logits.shape[0]
    loss = logits.new_empty(m, dtype=torch.promote_types(logits.dtype, torch.float32))
    return loss, torch.empty_like(logits), logits.new_empty(m, dtype=torch.int64), logits.new_empty(m, dtype=torch.int64)
