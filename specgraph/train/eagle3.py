"""EAGLE-3 training with training-time test (TTT), as SafeAILab's and SpecForge's trainers do
(docs/research/eagle3-training.md).

Step 0 at row t reads the pair (f_t, x_{t+1}) (f: the target's three taps)
and predicts x_{t+2}; step j ≥ 1 at row t feeds back the draft's own
step-(j-1) output at row t with token x_{t+1+j}, at position t + j, and
attends to the step-0 keys of rows ≤ t plus its own chain (the "diagonal"
keys of steps 1..j at row t) — what a depth-j tree node sees at inference
(the committed prefix and its ancestors). Teacher: the target's
distribution at the predicted position restricted to the draft vocabulary;
soft cross-entropy, steps weighted 0.8^j.

One deliberate difference: a row carries loss when the token it predicts
is an assistant token (the reference trainers gate row t of step j by the
mask of x_{t+j}); the loss is the mean over such rows.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from ..drafts.eagle3 import Eagle3
from ..errors import SettingError
from .loop import Ratio
from .soft_cross_entropy import soft_cross_entropy

STEP_DECAY = 0.8


def select_vocab(examples: list[dict], size: int, vocab_size: int) -> torch.Tensor:
    """The ``size`` most frequent assistant tokens, sorted (ties and padding: the lowest ids)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for e in examples:
        counts += torch.bincount(e["input_ids"][e["loss_mask"]], minlength=vocab_size)
    order = torch.sort(-counts, stable=True).indices  # most frequent first, lower id first among equals
    return order[:size].sort().values


def tap_states(hidden_states: tuple, ids: tuple[int, ...], convention: str) -> torch.Tensor:
    """HF ``hidden_states`` (entry i = the input of layer i) -> the draft's features [B, T, 3H]."""
    return torch.cat([hidden_states[i if convention == "layer_input" else i + 1] for i in ids], -1)


def _shift(x: torch.Tensor, by: int, fill=0) -> torch.Tensor:
    """x[:, t] <- x[:, t + by] (tail filled)."""
    if by == 0:
        return x
    pad = x.new_full((x.shape[0], by, *x.shape[2:]), fill)
    return torch.cat([x[:, by:], pad], 1)


# cuDNN's SDPA backward (torch >= 2.11, H100/H200) returns NaN grad_q with a mask tensor when a key length is
# 64 mod 128 and a row's logsumexp < -88.7 (pytorch/pytorch#196678): half of a Qwen2.5 head's steps went NaN; none off it
NOT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def ttt_hidden(draft: Eagle3, ids: torch.Tensor, features: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The draft's output of every TTT step: ``steps`` tensors [B, T, H]; step j row t predicts x_{t+2+j}."""
    b, t = ids.shape
    attn, layer = draft.midlayer.self_attn, draft.midlayer
    heads, kv_heads, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    group = heads // kv_heads
    g = features.to(draft.fc.weight.dtype)
    if draft.input_norm is not None:
        g = draft.input_norm(g)
    if draft.fc_norm is not None:
        g = torch.cat([norm(part) for norm, part in zip(draft.fc_norm, g.chunk(3, -1))], -1)
    hidden = draft.fc(g)  # [B, T, H]
    rows = torch.arange(t, device=ids.device)
    causal = rows.view(t, 1) >= rows.view(1, t)  # [T, T]: query t sees the step-0 keys of rows <= t
    own_row = torch.eye(t, dtype=torch.bool, device=ids.device)  # a later step's key: its own row only
    keys, values, outputs = [], [], []
    for j in range(steps):
        tokens = _shift(ids, 1 + j)  # x_{t+1+j}
        normed = layer.hidden_norm(hidden)
        a = torch.cat([layer.input_layernorm(draft.embed_tokens(tokens)), normed], -1)
        q = attn.q_proj(a).view(b, t, heads, d).transpose(1, 2)  # [B, H, T, D]
        k = attn.k_proj(a).view(b, t, kv_heads, d).transpose(1, 2).repeat_interleave(group, 1)
        v = attn.v_proj(a).view(b, t, kv_heads, d).transpose(1, 2).repeat_interleave(group, 1)
        cos, sin = draft.rotary_emb(a, (rows + j).expand(b, t))
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        keys.append(k)
        values.append(v)
        # one fused attention over the keys of steps 0..j ([B, H, (j+1)T, D]) under the TTT mask
        # [T, (j+1)T]: causal over step 0, the diagonal over each later step
        mask = torch.cat([causal] + [own_row] * j, 1)
        with sdpa_kernel(NOT_CUDNN):
            out = F.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(values, 2), attn_mask=mask)
        out = attn.o_proj(out.transpose(1, 2).reshape(b, t, heads * d))
        h = (normed if draft.norm_before_residual else hidden) + out
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        hidden = draft.norm(h) if draft.norm_output else h
        outputs.append(hidden)
    return outputs


def ttt_forward(draft: Eagle3, ids: torch.Tensor, features: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Draft logits of every TTT step: ``steps`` tensors [B, T, V_draft]; step j row t predicts x_{t+2+j}."""
    return [draft.draft_logits(h) for h in ttt_hidden(draft, ids, features, steps)]


def chain_walk(runs: list[int], answer: list[bool]) -> list[int]:
    """Tokens a greedy chain commits per target step while generating the answers of one sequence that is
    the target's own greedy output. ``runs[t]``: drafted tokens accepted by a step whose committed text ends
    at x_{t+1}; ``answer[t]``: x_t is an answer token. An answer's first token is the prefill's (as in
    ``generate``: no step's), so its first step drafts from that token; a step commits ``runs[t]`` + 1
    tokens (the target's bonus token included) and the next step starts there, so stretches count by the
    steps spent on them, as in generation."""
    committed, t, n = [], 0, len(answer)
    while t < n:
        if not answer[t]:
            t += 1
            continue
        end = t
        while end < n and answer[end]:
            end += 1
        row = max(t - 1, 0)  # the committed text ends at x_t, the answer's first token (the prefill's)
        while row + 2 < end:  # answer tokens x_{row+2} .. x_{end-1} left to commit
            take = min(runs[row] + 1, end - row - 2)
            committed.append(take)
            row += take
        t = end
    return committed


def eagle3_loss(model, draft: Eagle3, steps: int = 7):
    """``loss_fn(batch) -> (loss, metrics)`` for ``specgraph.train.loop.train``; the target is frozen.

    The loss of each step is ``soft_cross_entropy``'s: the draft's and the teacher's [M, V] logits exist
    a row chunk at a time, only for the rows that carry loss (what makes the full vocabulary
    affordable). Metrics: ``acc_step{j}`` (draft argmax = target argmax among step j's loss rows);
    ``tau``: tokens per target step of a ``steps``-deep greedy chain generating the answers
    (``chain_walk``), which is what generation gives when the data is the target's own greedy output
    (then the fed tokens are the ones the target would have verified); ``tau_rows``: 1 + the mean run
    of hits over every row whose step-0 token is an answer token. ``tau_rows`` weighs a stretch by its
    length, not by the steps generation spends on it, so easy stretches (a small target's loops)
    inflate it. ``tau`` walks the rows on the host: evaluation only (the draft in eval mode)."""
    if getattr(draft.head, "bias", None) is not None:
        raise ValueError("eagle3_loss: the draft's LM head has a bias; the chunked loss reads its weight only")

    def loss_fn(batch):
        ids, mask = batch["input_ids"], batch["loss_mask"]
        columns = None if draft.t2d is None else draft.t2d.nonzero().squeeze(1)  # the draft vocabulary's target ids
        with torch.no_grad():
            out = model(input_ids=ids, output_hidden_states=True)
            features = tap_states(out.hidden_states, draft.aux_layer_ids, draft.aux_convention)
            b, t = ids.shape
            teacher = out.logits.reshape(b * t, -1)  # row b·T + s: the target's distribution of x_{s+1}
            teacher_top = teacher.argmax(-1) if columns is not None else None
        total, metrics = 0.0, {}
        run = first = None
        runs = torch.zeros_like(ids)  # [B, T]: drafted tokens a chain step at row t gets accepted
        for j, hidden in enumerate(ttt_hidden(draft, ids, features, steps)):
            keep = _shift(mask, 2 + j, False)  # row t of step j predicts x_{t+2+j}: loss where that is an answer token
            rows, cols = keep.nonzero(as_tuple=True)
            index = rows * t + cols + 1 + j  # [M]: the teacher row of each
            if columns is not None:  # a target token outside the draft vocabulary cannot be learnt: no loss
                inside = draft.t2d[teacher_top[index]]
                rows, cols, index = rows[inside], cols[inside], index[inside]
                keep = torch.zeros_like(keep)
                keep[rows, cols] = True
            loss, draft_top, target_top = soft_cross_entropy(draft.head_input(hidden[rows, cols]), draft.head.weight,
                                                             teacher, index, columns)
            count = keep.sum().clamp(min=1)
            total = total + STEP_DECAY ** j * loss / count
            with torch.no_grad():
                hit = torch.zeros_like(keep)
                hit[rows, cols] = draft_top == target_top
                metrics[f"acc_step{j}"] = Ratio(hit.sum(), keep.sum())
                run, first = (hit, keep) if j == 0 else (run & hit, first)  # rows still on the chain
                runs += run
        metrics["tau_rows"] = Ratio(first.sum() + runs.sum(), first.sum())  # 1 + the mean run
        if not draft.training:
            committed = [n for rr, answer in zip(runs.tolist(), mask.tolist()) for n in chain_walk(rr, answer)]
            metrics["tau"] = Ratio(sum(committed), len(committed))
        return total, metrics

    return loss_fn


def new_eagle3_for(model, examples: list[dict] | None = None, draft_vocab_size: int | None = None,
                   aux_layer_ids=None, aux_convention: str = "layer_input", init_from: Eagle3 | None = None) -> Eagle3:
    """A head for ``model`` with the target's embedding (frozen) and, with ``draft_vocab_size``,
    the vocabulary of the most frequent assistant tokens in ``examples``; ``draft_vocab_size=0``:
    the full vocabulary through the target's own LM head (frozen, not saved); None: the full
    vocabulary with an LM head of its own. ``init_from``: a trained head to start from (its taps are
    kept; see ``warm_start``)."""
    vocab = None
    full = model.config.get_text_config().vocab_size
    if draft_vocab_size is not None and not 0 <= draft_vocab_size < full:
        raise SettingError(f"draft_vocab_size={draft_vocab_size}: a reduced vocabulary has 1 .. {full - 1} tokens of "
                           f"the target's {full}; 0 drafts the whole vocabulary through the target's LM head")
    if init_from is not None:
        aux_layer_ids, aux_convention = init_from.aux_layer_ids, init_from.aux_convention
    if draft_vocab_size:
        vocab = select_vocab(examples, draft_vocab_size, model.config.get_text_config().vocab_size)
    if aux_layer_ids is None:  # EAGLE's default: the inputs of layers (2, L//2, L-3)
        layers = model.config.get_text_config().num_hidden_layers
        aux_layer_ids, aux_convention = (2, layers // 2, layers - 3), "layer_input"
    draft = Eagle3.for_target(model, draft_vocab=vocab, aux_layer_ids=aux_layer_ids, aux_convention=aux_convention,
                              lm_head_from_target=draft_vocab_size == 0)
    with torch.no_grad():  # an own frozen copy for training; checkpoints leave it out (embed_from_target)
        draft.embed_tokens.weight.copy_(model.get_input_embeddings().weight)
    draft.embed_tokens.weight.requires_grad_(False)
    if init_from is not None:
        target_head = model.get_output_embeddings()
        warm_start(draft, init_from, None if target_head is None else target_head.weight)
    return draft.to(device=next(model.parameters()).device, dtype=torch.float32)


def warm_start(draft: Eagle3, source: Eagle3, target_head: torch.Tensor | None = None) -> list[str]:
    """Copy ``source``'s trained weights into ``draft`` (a new head for the same target): every
    tensor of the same name and shape, and LM-head rows by target token id, so a head can grow its
    draft vocabulary and keep what it learnt. Rows of tokens new to the vocabulary: with ``target_head``
    (the target's LM head, [V, H]) its rows mapped into the source head's space by the least-squares map
    that takes its rows of the shared tokens to the source's (``mapped_rows``), else their initialisation.
    Returns the names copied; raises if the two read other target features."""
    if (tuple(source.aux_layer_ids or ()), source.aux_convention) != (tuple(draft.aux_layer_ids or ()),
                                                                     draft.aux_convention):
        raise ValueError(f"init_from taps layers {source.aux_layer_ids} ({source.aux_convention}), the new head "
                         f"{draft.aux_layer_ids} ({draft.aux_convention}): a warm start needs the same features")
    mine, theirs = draft.state_dict(), source.state_dict()
    skip = ("embed_tokens.", "lm_head.", "d2t", "t2d")
    copied = []
    with torch.no_grad():
        for name, value in theirs.items():
            if name.startswith(skip) or name not in mine or mine[name].shape != value.shape:
                continue
            mine[name].copy_(value)
            copied.append(name)
        if draft.lm_head is not None and source.lm_head is not None:
            def target_ids(head: Eagle3) -> torch.Tensor:  # draft row i -> its target token id
                return head.to_target(torch.arange(head.draft_vocab_size, device=head.lm_head.weight.device))
            row_of = {int(t): i for i, t in enumerate(target_ids(source).tolist())}
            pairs = [(i, row_of[int(t)]) for i, t in enumerate(target_ids(draft).tolist()) if int(t) in row_of]
            if pairs:
                new_rows, old_rows = (torch.tensor(x) for x in zip(*pairs))
                draft.lm_head.weight[new_rows] = source.lm_head.weight[old_rows].to(draft.lm_head.weight)
                copied.append(f"lm_head.weight ({len(pairs)} of {draft.draft_vocab_size} rows)")
                fresh = torch.ones(draft.draft_vocab_size, dtype=torch.bool)
                fresh[new_rows] = False
                if target_head is not None and bool(fresh.any()):
                    ids, head = target_ids(draft).cpu(), target_head.detach().cpu()
                    rows = mapped_rows(head[ids[new_rows]], source.lm_head.weight[old_rows].cpu(), head[ids[fresh]])
                    draft.lm_head.weight[fresh.to(draft.lm_head.weight.device)] = rows.to(draft.lm_head.weight)
                    copied.append(f"lm_head.weight ({int(fresh.sum())} new rows mapped from the target's)")
    missing = [n for n in mine if not n.startswith(skip) and n not in copied]
    if missing:
        raise ValueError(f"init_from has no weights of the new head's shape for {missing}")
    return copied


def mapped_rows(target_shared: torch.Tensor, head_shared: torch.Tensor, target_new: torch.Tensor,
                ridge: float = 1e-3) -> torch.Tensor:
    """Rows for tokens new to a grown draft vocabulary: ``target_new`` [n, H] (the target's LM-head rows of
    those tokens) through the ridge least-squares map A [H, H] with ``target_shared @ A ≈ head_shared`` (the
    two heads' rows of the tokens both have, [m, H] each; float64; ``ridge`` relative to the mean of
    ``target_shared``'s Gram diagonal, so the map does not depend on the rows' scale): a trained head's rows
    are not the target's, but a linear map of them predicts its rows far better than a random start."""
    x, y = target_shared.double(), head_shared.double()
    gram = x.T @ x
    damping = ridge * gram.diagonal().mean().clamp_min(torch.finfo(x.dtype).tiny)
    a = torch.linalg.solve(gram + damping * torch.eye(x.shape[1], dtype=x.dtype, device=x.device), x.T @ y)
    return target_new.double() @ a
