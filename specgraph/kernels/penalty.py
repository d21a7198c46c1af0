"""transformers' repetition penalty over a tree of candidate continuations, lossless.

``RepetitionPenaltyLogitsProcessor(penalty)`` rescales the logit of every token already in the
sequence: divided by ``penalty`` where positive, multiplied where negative. Under speculation node
i's logits predict the token after the sequence ``committed + the tokens on node i's root path``
(its ancestors and itself; not its siblings), so node i's "already seen" set is

    seen[b] (prompt and every committed token of row b)  |  tokens of node i's ancestors-or-self

Static shapes, no host sync (it runs inside the compiled decode step):

  seen:  [B, V + 1] bool, kept by the decode step across steps and updated in place with each
         step's emitted tokens (``mark_seen``); column V absorbs the -1 / padding entries.
         Memory: B * (V + 1) bytes (49 KB a row at SmolLM2's 49,152 tokens, 128 KB at 128k).
  a step: the [B, N, N] ancestor matrix and a [B, N, V + 1] bool mask (a quarter of the fp32
         logits' size), and the penalized fp32 logits [B, N, V] (one elementwise pass; inductor
         fuses mask and rescale).
"""
from __future__ import annotations

import torch

from .bitmask import mask_to_matrix


def seen_buffer(batch: int, vocab: int, device) -> torch.Tensor:
    """An empty ``[B, V + 1]`` seen set (column V: the discard column)."""
    return torch.zeros(batch, vocab + 1, dtype=torch.bool, device=device)


def reset_seen(seen: torch.Tensor, rows: list[list[int]]) -> None:
    """``seen`` (in place: its address is fixed in a recorded step) := each row's tokens."""
    vocab = seen.shape[1] - 1
    width = max(1, max(map(len, rows)))
    index = torch.tensor([r + [vocab] * (width - len(r)) for r in rows], dtype=torch.int64).to(seen.device)
    seen.zero_()
    seen.scatter_(1, index, True)


def mark_seen(seen: torch.Tensor, tokens: torch.Tensor) -> None:
    """Add ``tokens [B, K]`` to ``seen`` in place; negative entries (nothing emitted) are skipped."""
    vocab = seen.shape[1] - 1
    seen.scatter_(1, torch.where(tokens >= 0, tokens, vocab), True)


def penalize(logits: torch.Tensor, seen: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor,
             penalty: torch.Tensor) -> torch.Tensor:
    """``logits [B, N, V]`` (fp32) with transformers' repetition penalty applied at every node.

    seen: [B, V + 1] bool; tokens, mask: the tree's [B, N] tokens and ancestor-or-self bitmasks;
    penalty: a 0-d tensor (or a number) > 0. Returns fp32 [B, N, V]."""
    b, n, v = logits.shape
    on_path = mask_to_matrix(mask, n)  # [B, N, N]: node j is an ancestor-or-self of node i
    index = torch.where(on_path, tokens.unsqueeze(1).expand(b, n, n), v)
    path_tokens = torch.zeros(b, n, v + 1, dtype=torch.bool, device=logits.device).scatter_(2, index, True)
    hit = (path_tokens | seen.unsqueeze(1))[..., :v]
    logits = logits.float()
    return torch.where(hit, torch.where(logits < 0, logits * penalty, logits / penalty), logits)
