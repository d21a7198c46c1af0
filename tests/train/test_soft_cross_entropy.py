"""The chunked soft cross-entropy against the loss written out (float64 autograd is the oracle), under
autocast against the same written out under autocast, in EAGLE-3's training loss against the
unrolled steps' own logits, and what it keeps for backward."""
import pytest
import torch

from specgraph.train.eagle3 import STEP_DECAY, eagle3_loss, new_eagle3_for, tap_states, ttt_forward
from specgraph.train.soft_cross_entropy import soft_cross_entropy
from test_eagle3_train import frozen_target
from test_medusa_train import self_distilled


def case(seed: int, m=10, h=8, n=13, v_teacher=24, columns=None, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    vocab = v_teacher if columns is None else len(columns)
    hidden = torch.randn(m, h, generator=g, dtype=dtype)
    weight = torch.randn(vocab, h, generator=g, dtype=dtype)
    teacher = 3 * torch.randn(n, v_teacher, generator=g, dtype=dtype)
    index = torch.randint(0, n, (m,), generator=g)
    return hidden, weight, teacher, index, None if columns is None else torch.tensor(columns)


def written_out(hidden, weight, teacher, index, columns):
    z = teacher[index] if columns is None else teacher[index][:, columns]
    logits = (hidden @ weight.T).float() if hidden.dtype != torch.float64 else hidden @ weight.T
    z = z.float() if z.dtype != torch.float64 else z
    loss = -(torch.softmax(z, -1) * torch.log_softmax(logits, -1)).sum()
    return loss, logits.argmax(-1), z.argmax(-1)


@pytest.mark.parametrize("columns", [None, [0, 3, 4, 9, 17, 23]])
@pytest.mark.parametrize("chunk_rows", [1, 3, None])
@pytest.mark.parametrize("train_weight", [True, False])
def test_loss_gradients_and_argmaxes_are_the_written_out_ones_in_float64(columns, chunk_rows, train_weight):
    inputs = case(len(columns or ()) + (chunk_rows or 0), columns=columns)
    results = []
    for fn in (written_out, lambda *a: soft_cross_entropy(*a, chunk_rows=chunk_rows)):
        hidden, weight = inputs[0].clone().requires_grad_(), inputs[1].clone().requires_grad_(train_weight)
        loss, draft_top, teacher_top = fn(hidden, weight, *inputs[2:])
        (0.37 * loss).backward()  # a scale on the way back, as a step weight and a row count put there
        results.append((loss.double(), hidden.grad, weight.grad, draft_top, teacher_top))
    (loss, grad_h, grad_w, top, t_top), (want, want_h, want_w, want_top, want_t_top) = results[1], results[0]
    torch.testing.assert_close(loss, want, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(grad_h, want_h, atol=1e-10, rtol=1e-10)
    if train_weight:
        torch.testing.assert_close(grad_w.double(), want_w, atol=1e-10, rtol=1e-10)
    else:
        assert grad_w is None and want_w is None
    assert torch.equal(top, want_top) and torch.equal(t_top, want_t_top)


def test_under_autocast_it_is_the_written_out_loss_under_autocast():
    """float32 weights, bfloat16 autocast (as the trainer runs): the same products in bfloat16, softmax in
    float32; the gradients agree to bfloat16's rounding of d loss / d logits."""
    hidden, weight, teacher, index, columns = case(7, m=40, h=32, v_teacher=64, dtype=torch.float32)
    results = []
    for fn in (written_out, lambda *a: soft_cross_entropy(*a, chunk_rows=16)):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, _, _ = fn(h, w, teacher.bfloat16(), index, columns)
        loss.backward()
        results.append((loss, h.grad, w.grad))
    for got, want in zip(results[1], results[0]):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, atol=2e-2 * float(want.abs().max()), rtol=2e-2)


def test_refuses_a_head_of_another_width_than_the_teachers_columns():
    hidden, weight, teacher, index, _ = case(1)
    with pytest.raises(ValueError, match="the head has 24 rows but the teacher gives 24 columns \\(3 selected\\)"):
        soft_cross_entropy(hidden, weight, teacher, index, torch.tensor([1, 2, 3]))


def ttt_written_out(model, draft, batch, steps):
    """The EAGLE-3 loss from the unrolled steps' own logits (``ttt_forward``, through ``draft_logits``), as
    the module docstring states it: per step, the mean over rows that predict an answer token the target
    would emit inside the draft vocabulary, of the soft cross-entropy, weighted STEP_DECAY ** j."""
    ids, mask = batch["input_ids"], batch["loss_mask"]
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    logits = ttt_forward(draft, ids, tap_states(out.hidden_states, draft.aux_layer_ids, draft.aux_convention), steps)
    total = 0.0
    for j, step in enumerate(logits):
        terms = []
        for b in range(ids.shape[0]):
            for t in range(ids.shape[1] - 2 - j):
                if not mask[b, t + 2 + j]:
                    continue
                z = out.logits[b, t + 1 + j].float()
                if draft.t2d is not None:
                    if not draft.t2d[z.argmax()]:
                        continue
                    z = z[draft.t2d]
                terms.append(-(torch.softmax(z, -1) * torch.log_softmax(step[b, t].float(), -1)).sum())
        total = total + STEP_DECAY ** j * torch.stack(terms).sum() / max(len(terms), 1)
    return total


@pytest.mark.parametrize("draft_vocab", [40, 0])
def test_eagle3_loss_and_its_gradients_are_the_written_out_ttt_loss(draft_vocab):
    model = frozen_target()
    examples = self_distilled(model, 3, length=20)
    torch.manual_seed(4)
    draft = new_eagle3_for(model, examples, draft_vocab_size=draft_vocab, aux_layer_ids=(0, 1, 1))
    batch = {"input_ids": torch.stack([e["input_ids"] for e in examples]),
             "loss_mask": torch.stack([e["loss_mask"] for e in examples])}
    params = [p for p in draft.parameters() if p.requires_grad]
    grads = []
    for fn in (lambda: ttt_written_out(model, draft, batch, 3), lambda: eagle3_loss(model, draft, steps=3)(batch)[0]):
        loss = fn()
        grads.append((loss.detach(), torch.autograd.grad(loss, params)))
    (want, want_grads), (got, got_grads) = grads
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)


def test_nothing_of_rows_x_vocabulary_is_kept_for_backward():
    """Negative control: the written-out loss keeps [M, V] tensors (its logits, log-probabilities,
    teacher probabilities) until backward; the chunked one keeps the gradient it made, [M, H] and [V, H]."""
    m, h, vocab = 64, 8, 96
    hidden, weight, teacher, index, _ = case(2, m=m, h=h, n=70, v_teacher=vocab)

    def largest_kept(fn):
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda x: sizes.append(x.numel()) or x, lambda x: x):
            fn(hidden.clone().requires_grad_(), weight.clone().requires_grad_(), teacher, index, None)
        return max(sizes)

    assert largest_kept(written_out) >= m * vocab
    assert largest_kept(soft_cross_entropy) == max(m * h, vocab * h) < m * vocab


def test_under_no_grad_no_gradient_is_made(monkeypatch):
    """Evaluation runs the loss under no_grad: the forward makes no gradient (it would cost a product per chunk)."""
    hidden, weight, teacher, index, _ = case(3)
    products = []
    real = torch.Tensor.__matmul__
    monkeypatch.setattr(torch.Tensor, "__matmul__", lambda a, b: products.append(1) or real(a, b))
    soft_cross_entropy(hidden.requires_grad_(), weight.requires_grad_(), teacher, index, chunk_rows=5)
    with_grad, products[:] = len(products), []
    with torch.no_grad():
        loss, _, _ = soft_cross_entropy(hidden, weight, teacher, index, chunk_rows=5)
    assert with_grad == 2 * 3 and len(products) == 2  # per chunk: logits, d hidden, d weight; then logits only
    torch.testing.assert_close(loss, written_out(hidden, weight, teacher, index, None)[0])
