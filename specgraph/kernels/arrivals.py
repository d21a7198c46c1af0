"""Arrival counters for launches whose programs share one output tile: tree attention's prefix splits,
fused_linear's split of K, topk's chunks of a row. Each program stores its partial, counts itself in with one
gpu-scope acq_rel atomic, and the tile's last to arrive merges the partials and resets the tile's counter to 0,
so one launch does what a second (merging) launch would.

One int32 buffer per (kernel module, device), zero between launches. Launches on one stream never count at
once (a kernel launched with programmatic dependent launch counts only after its wait for the kernel ahead),
so a module's launches may share its buffer; they must not run concurrently on two streams of one device.
"""
from __future__ import annotations

import torch

SLOTS = 1 << 16  # tiles one launch may count arrivals for
_counters: dict[tuple[str, torch.device], torch.Tensor] = {}


def arrival_counters(owner: str, device: torch.device, tiles: int) -> torch.Tensor | None:
    """``owner``'s counters on ``device`` ([SLOTS] int32, zero between launches), made on first use. None for
    more than SLOTS tiles, or when first asked for inside a CUDA graph capture (allocated there they would live
    in the graph's pool): the caller then merges another way for this call."""
    if tiles > SLOTS:
        return None
    key = (owner, torch.device(device))
    if key not in _counters:
        if key[1].type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        _counters[key] = torch.zeros(SLOTS, dtype=torch.int32, device=device)
    return _counters[key]
