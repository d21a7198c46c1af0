"""Soft cross-entropy of a linear head against a teacher's logits, in row chunks (Liger's fused linear
cross-entropy, with a distribution for the target instead of a label):

    loss = Σ_i -Σ_v softmax(teacher[index_i, columns])_v · log_softmax(hidden_i @ weight.T)_v

Why: EAGLE-3's training-time test takes this loss at every unrolled step over every answer row and
the whole draft vocabulary. Written out, each step kept its [M, V] float32 logits, log-probabilities
and teacher probabilities for the backward pass, so memory grew with batch x vocabulary x steps and
much of a step went to elementwise passes over them. Here each [chunk, V] block lives only inside
the loop, and the gradient is made in the forward pass (d loss / d logits = softmax(logits) - p,
scaled by the scalar that reaches the loss in backward): nothing [M, V] kept. Per chunk the head's
product is the only [chunk, V] tensor made besides its gradient: ``specgraph::soft_ce_rows``
(kernels/soft_ce.py) reads it and the teacher's rows in place, and on CUDA does the softmaxes, the
loss, the argmaxes and q - p in one kernel.

Numerics follow the written-out form under autocast: the head's product in autocast's dtype (or the
inputs' own without autocast), softmax and log-softmax in float32 (float64 for float64 inputs), the
gradient's products in the forward product's dtype, the weight's gradient summed over chunks in float32.
"""
from __future__ import annotations

import torch

from .. import kernels  # noqa: F401  (registers specgraph::soft_ce_rows)

CHUNK_ELEMENTS = 1 << 26  # rows per chunk x vocabulary: 256 MB per float32 block


class _ChunkedSoftCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, teacher, index, columns, chunk_rows, grad_on):
        device = hidden.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
        exact = torch.promote_types(dtype, torch.float32)  # softmax's dtype: float32, or float64 for float64 inputs
        want_hidden, want_weight = grad_on and ctx.needs_input_grad[0], grad_on and ctx.needs_input_grad[1]
        m = hidden.shape[0]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None  # every chunk writes its rows
        grad_weight = torch.zeros(weight.shape, dtype=exact, device=weight.device) if want_weight else None
        total = torch.zeros((), dtype=exact, device=hidden.device)
        draft_top = torch.empty(m, dtype=torch.long, device=hidden.device)
        teacher_top = torch.empty(m, dtype=torch.long, device=hidden.device)
        w = weight.to(dtype)
        with torch.autocast(device, enabled=False):
            for start in range(0, m, chunk_rows):
                part = slice(start, start + chunk_rows)
                h = hidden[part].to(dtype)  # [c, H]
                # [c] loss, [c, V] d loss / d logits, argmaxes: the logits read twice, the teacher rows in place
                loss, g, draft_top[part], teacher_top[part] = torch.ops.specgraph.soft_ce_rows(
                    h @ w.T, teacher, index[part], columns)
                total += loss.sum()
                if want_hidden:
                    grad_hidden[part] = g @ w
                if want_weight:
                    grad_weight += (g.T @ h).to(exact)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(draft_top, teacher_top)
        return total, draft_top, teacher_top

    @staticmethod
    def backward(ctx, grad_total, _draft_top, _teacher_top):
        grad_hidden, grad_weight = ctx.saved_tensors
        return (None if grad_hidden is None else grad_total * grad_hidden,
                None if grad_weight is None else (grad_total * grad_weight).to(ctx.weight_dtype),
                None, None, None, None, None)


def soft_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, teacher: torch.Tensor, index: torch.Tensor,
                       columns: torch.Tensor | None = None, chunk_rows: int | None = None):
    """``(loss, draft_top, teacher_top)``: the loss summed over the M rows (differentiable in ``hidden``
    [M, H] and ``weight`` [V, H]), and per row the argmax of the head's logits and of the teacher's
    (both in the head's vocabulary). ``teacher`` [N, V_teacher]: logits, row ``index[i]`` (``index``
    [M]) teaches row i; ``columns`` [V] (long): the teacher's columns of the head's vocabulary (None:
    all, V = V_teacher). ``chunk_rows``: rows per chunk (default: about CHUNK_ELEMENTS / V)."""
    vocab = weight.shape[0]
    if (teacher.shape[-1] if columns is None else columns.numel()) != vocab:
        raise ValueError(f"the head has {vocab} rows but the teacher gives {teacher.shape[-1]} columns"
                         f"{'' if columns is None else f' ({columns.numel()} selected)'}")
    chunk = chunk_rows or max(1, CHUNK_ELEMENTS // vocab)
    # under no_grad (evaluation) no gradient is made: needs_input_grad reads requires_grad alone
    return _ChunkedSoftCrossEntropy.apply(hidden, weight, teacher, index, columns, chunk, torch.is_grad_enabled())
