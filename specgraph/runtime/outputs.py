"""``output_scores`` / ``output_logits``: the first token's and the decode steps' kept rows as
transformers lays them out.

The first token (the prefill's) comes with ``[B, 1, V]``, each step with ``[B, D+1, V]`` at its accepted
path (slot i: the distribution emitted token i was chosen from). ``model.generate`` returns one ``[B, V]``
tensor per generated position, the row's t-th token's scores in row b of the t-th tensor.
"""
from __future__ import annotations

import itertools

import torch


def per_position(steps: list[torch.Tensor], where: list[list[tuple[int, int]]]) -> tuple[torch.Tensor, ...]:
    """``steps[s]``: entry s's kept ``[B, W_s, V]`` (the first token's, W 1, then each step's, W D+1);
    ``where[b][t]``: the (entry, slot) of row b's t-th token. Returns one ``[B, V]`` fp32 tensor per
    position up to the longest row; a row that finished earlier holds zeros there (model.generate
    computes those rows on the pad-extended sequence; speculation does not run finished rows)."""
    if not steps:
        return ()
    v = steps[0].shape[2]
    offsets = [0, *itertools.accumulate(kept.shape[1] for kept in steps[:-1])]  # each entry's first slot
    positions = max(map(len, where))
    flat = torch.cat(steps, 1)  # [B, sum of W_s, V]
    index = torch.tensor([[offsets[s] + slot for s, slot in row] + [0] * (positions - len(row)) for row in where],
                         device=flat.device)
    taken = flat.gather(1, index.unsqueeze(-1).expand(-1, -1, v))  # [B, positions, V]
    filled = torch.tensor([[t < len(row) for t in range(positions)] for row in where], device=flat.device)
    taken = torch.where(filled.unsqueeze(-1), taken, 0.0)
    return tuple(taken[:, t] for t in range(positions))
