"""Arrival counters for launches whose programs share one output tile: tree attention's prefix splits,
fused_linear's split of K, topk's chunks of a row. Each program stores its partial, counts itself in with one
gpu-scope acq_rel atomic, and the tile's last to arrive merges the partials and resets the tile's counter to 0,
so one launch does what a second (merging) launch would, and the counters are zero between launches.

Two launches that use the same counters must never run at once. Launches on one stream never count at once
(a kernel launched with programmatic dependent launch counts only after its wait for the kernel ahead), but a
fast start (runtime/fast_start.py) runs a background compile's launches on its own stream beside the serving
thread's replays. So an eager launch counts in a buffer of its stream's, and a launch recorded into a CUDA graph
in a region of its own, taken once at recording from a per-device pool (a graph's launches then never share
counters with any other launch, whichever stream replays it).
"""
from __future__ import annotations

import threading

import torch

SLOTS = 1 << 16  # tiles one launch may count arrivals for
POOL = 1 << 20  # counters per device for launches recorded into CUDA graphs (4 MB)
_counters: dict[tuple[str, torch.device, int], torch.Tensor] = {}  # (kernel module, device, stream): eager launches
_pools: dict[torch.device, list] = {}  # device -> [pool, next free counter]: recorded launches, each a region
_lock = threading.Lock()  # two threads may record at once (thread-local capture mode)


def arrival_counters(owner: str, device: torch.device, tiles: int) -> torch.Tensor | None:
    """Counters for one launch of ``owner`` (a kernel module) over ``tiles`` tiles ([>= tiles] int32, zero).
    None (the caller merges another way for this launch): more than SLOTS tiles, or a launch being recorded
    before any eager launch made the device's pool, or the pool used up."""
    if tiles > SLOTS:
        return None
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return recorded_region(device, tiles)
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    with _lock:
        if (owner, device, stream) not in _counters:
            _counters[owner, device, stream] = torch.zeros(SLOTS, dtype=torch.int32, device=device)
            if device not in _pools:
                _pools[device] = [torch.zeros(POOL, dtype=torch.int32, device=device), 0]
        return _counters[owner, device, stream]


def recorded_region(device: torch.device, tiles: int) -> torch.Tensor | None:
    """A region of ``tiles`` counters of the device's pool that no other launch uses (never given back: a
    graph's launches keep theirs), or None where the pool does not exist yet or has too few left."""
    with _lock:
        pool = _pools.get(torch.device(device))
        if pool is None or pool[1] + tiles > POOL:
            return None
        start, pool[1] = pool[1], pool[1] + tiles
        return pool[0][start: start + tiles]


def buffers(owner: str) -> list[torch.Tensor]:
    """``owner``'s eager counters on every device and stream (tests: all zero after each launch)."""
    with _lock:
        return [value for (name, _, _), value in _counters.items() if name == owner]
