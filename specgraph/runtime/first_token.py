"""A call's first token, from the prefill's logits at each prompt's last token.

The prefill writes the whole prompt and keeps the logits of its last row, so the first token is streamed
before the decode step's bucket is built (captured, compiled, recorded): the decode loop then starts from
prompt + [first token] as if that were the prompt. The first token is drawn as the decode step would
draw it from a tree of the root alone (``DecodeStep.__call__``): the repetition penalty over the prompt,
then greedy argmax or the warped distribution; with a seed the draw at the root's position that plain
sampling with that seed makes (``verify_seeded``), so seeded calls emit the same tokens as before.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..kernels.gumbel import stream_keys, verify_seeded
from ..kernels.penalty import penalize
from ..kernels.verify import greedy_tokens, sample_categorical, warped_logits
from .graphed import drawing_turn
from .step import ARGMAX_CHUNK, warp_args


class FirstToken(NamedTuple):
    tokens: torch.Tensor  # [B] int64
    scores: torch.Tensor | None  # with keep[0]: fp32 [B, 1, V], processed as HF's ``scores``
    logits: torch.Tensor | None  # with keep[1]: fp32 [B, 1, V], the target's raw logits


@torch.no_grad()
def first_tokens(logits: torch.Tensor, roots: torch.Tensor, base: torch.Tensor, sampling=None,
                 penalty: float | None = None, seen: torch.Tensor | None = None,
                 keep: tuple[bool, bool] = (False, False)) -> FirstToken:
    """logits [B, 1, V]: the target's at each row's last prompt token ``roots`` [B], which sits at
    position ``base`` [B] (the prompt's length - 1). ``seen`` [B, V + 1]: the prompt's tokens
    (``kernels/penalty.py``), with ``penalty``. ``sampling``: None (greedy) or a ``Sampling``."""
    b = logits.shape[0]
    raw = logits.float()
    scores = raw
    mask = torch.ones((b, 1), dtype=torch.int64, device=logits.device)  # a tree of the root alone
    if penalty is not None:
        if seen is None:
            raise ValueError("first_tokens: a repetition penalty needs the prompt's seen tokens (seen=)")
        scores = penalize(raw, seen, roots.view(b, 1), mask, penalty)
    if sampling is None:
        tokens = greedy_tokens(scores, ARGMAX_CHUNK)[:, 0]
    else:
        scores = warped_logits(scores, **warp_args(sampling.warpers(), vars(sampling)))
        probs = scores.softmax(-1)
        if sampling.seed is not None and sampling.typical is None:
            parents = torch.full((b, 1), -1, dtype=torch.int64, device=logits.device)
            keys = stream_keys(sampling.seed, b, logits.device)
            tokens = verify_seeded(roots.view(b, 1), parents, mask, probs, 0, keys, base).emitted[:, 0]
        else:  # exact in distribution; Medusa's typical acceptance samples its bonus token the same way
            with drawing_turn():  # not while a background compile records a graph (runtime/fast_start.py)
                tokens = sample_categorical(probs[:, 0])
    return FirstToken(tokens, scores if keep[0] else None, raw if keep[1] else None)
