"""Medusa-1 training: K heads on the frozen target's final hidden state.

At position t the target's own LM head predicts token t+1; head k predicts
token t+k+2. With self-distilled data the tokens are the target's own
greedy outputs, so the heads learn what verification will accept. Loss:
cross-entropy per head where the predicted token carries loss (assistant
tokens), heads weighted 0.8^k as in Medusa's trainer.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..drafts.medusa import Medusa

HEAD_DECAY = 0.8


def medusa_loss(model, draft: Medusa):
    """``loss_fn(batch) -> (loss, metrics)`` for ``specgraph.train.loop.train``."""

    def loss_fn(batch):
        ids, mask = batch["input_ids"], batch["loss_mask"]
        with torch.no_grad():  # the target is frozen: its final (post-norm) hidden state is the feature
            hidden = model.base_model(input_ids=ids).last_hidden_state  # [B, T, H]
        logits = draft(hidden.to(next(draft.parameters()).dtype))  # [B, K, T, V]
        total, metrics = 0.0, {}
        for k in range(draft.num_heads):
            shift = k + 2
            if ids.shape[1] <= shift:
                break
            pred = logits[:, k, :-shift]  # [B, T-shift, V]
            labels, keep = ids[:, shift:], mask[:, shift:]
            loss = F.cross_entropy(pred[keep].float(), labels[keep]) if keep.any() else pred.sum() * 0
            total = total + HEAD_DECAY ** k * loss
            with torch.no_grad():
                metrics[f"top1_head{k}"] = (pred[keep].argmax(-1) == labels[keep]).float().mean() if keep.any() else 0.0
        return total, metrics

    return loss_fn


def new_medusa_for(model, num_heads: int = 4, num_layers: int = 1, own_lm_head: bool = True) -> Medusa:
    """Heads for ``model``; each LM head starts as a copy of the target's (Medusa's initialisation),
    each ResBlock at zero (the identity), so training starts from the target's next-token guess.
    ``own_lm_head=False``: the heads share the target's frozen LM head (the legacy layout; only the
    ResBlocks train and ship, a few MB instead of K vocabulary-sized matrices)."""
    config = model.config.get_text_config()
    draft = Medusa(config.hidden_size, config.vocab_size, num_heads, num_layers, own_lm_head=own_lm_head)
    if not own_lm_head:
        draft._shared_head.module = model.get_output_embeddings()
    with torch.no_grad():
        for head in draft.lm_heads or ():
            head.weight.copy_(model.get_output_embeddings().weight)
        for blocks in draft.blocks:
            for block in blocks:
                block.linear.weight.zero_()
                block.linear.bias.zero_()
    param = next(model.parameters())
    return draft.to(device=param.device, dtype=torch.float32)
