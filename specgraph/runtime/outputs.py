"""``output_scores`` / ``output_logits``: the decode steps' kept rows as transformers lays them out.

Each step hands back ``[B, D+1, V]`` at its accepted path (slot i: the distribution emitted token i
was chosen from). ``model.generate`` returns one ``[B, V]`` tensor per generated position, the
row's t-th token's scores in row b of the t-th tensor.
"""
from __future__ import annotations

import torch


def per_position(steps: list[torch.Tensor], where: list[list[tuple[int, int]]]) -> tuple[torch.Tensor, ...]:
    """``steps[s]``: step s's kept ``[B, D+1, V]``; ``where[b][t]``: the (step, slot) of row b's t-th
    token. Returns one ``[B, V]`` fp32 tensor per position up to the longest row; a row that
    finished earlier holds zeros there (model.generate computes those rows on the pad-extended
    sequence; speculation does not run finished rows)."""
    if not steps:
        return ()
    b, width, v = len(where), steps[0].shape[1], steps[0].shape[2]
    positions = max(map(len, where))
    flat = torch.stack(steps, 1).reshape(b, -1, v)  # [B, S * (D+1), V]
    index = torch.tensor([[s * width + slot for s, slot in row] + [0] * (positions - len(row)) for row in where],
                         device=flat.device)
    taken = flat.gather(1, index.unsqueeze(-1).expand(-1, -1, v))  # [B, positions, V]
    filled = torch.tensor([[t < len(row) for t in range(positions)] for row in where], device=flat.device)
    taken = torch.where(filled.unsqueeze(-1), taken, 0.0)
    return tuple(taken[:, t] for t in range(positions))
