"""Continuous batching for plain decoding: a queue of prompts through ``batch`` rows that are refilled as
they finish.

``speculative_generate`` runs a fixed batch until its longest row ends: with answers of mixed lengths
(self-distillation: a mean of ~255 tokens, a fifth stopped at 512) half the row-steps decode finished
rows. Here a finished row's slot takes the next prompt instead:

    prefill B prompts -> decode steps; each read: finished rows are yielded, their slots empty
    once ``refill`` slots are empty (and the queue is not): prefill ``refill`` new prompts in the
    refill bucket (its own KV buffer) -> copy their cache rows into the empty slots' rows -> set
    each slot's cache_len, root token and ``active`` -> decode on

Each row's answer is what ``generate`` gives that prompt: the step computes each row from its own
cache and tokens (greedy: the same tokens up to the kernels' batch-size rounding; sampled: the same
distribution). Plain decoding only (``Plain``, ``Chain(0)``), unseeded: a seeded stream is keyed by
(row, position), which a refilled row would repeat.
"""
from __future__ import annotations

from collections import deque
from typing import Iterator

import torch

from .. import config
from ..drafts.plain import Plain
from ..trees import Chain
from .generate import Sampling, _Readback, decode_step, prefill


@torch.no_grad()
def stream_generate(capture, draft: Plain, queue: deque, batch: int, max_new_tokens: int, eos_token_ids: set[int],
                    max_length: int, sampling: Sampling | None = None,
                    refill: int | None = None, stats: dict | None = None) -> Iterator[tuple[object, list[int], bool]]:
    """Decode every ``(key, prompt)`` popped from the left of ``queue`` (the caller may append more between
    yields) on ``batch`` rows of ``draft``'s plain decoding (the SpecModel's own ``Plain``: its buckets are
    kept per draft object); yields ``(key, tokens, ended_at_eos)`` as each finishes (eos included, at most
    ``max_new_tokens``), in finishing order. ``refill``: rows prefilled at once (its own prefill bucket and KV
    buffer; default ``batch // 8``, at least 1). Stops when the queue and every row are empty. ``stats``, if
    given, counts as it goes: ``steps`` (decode steps run) and ``refills`` (refill prefills)."""
    if not isinstance(draft, Plain):
        raise TypeError(f"draft={type(draft).__name__}: streams run plain decoding (compile(model, None))")
    if sampling is not None and sampling.seed is not None:
        raise ValueError(f"sampling.seed={sampling.seed}: a seeded stream is keyed by (row, position), which a "
                         f"refilled row repeats; stream unseeded (the global RNG), or generate in fixed batches")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}: at least 1")
    refill = max(1, batch // 8) if refill is None else refill
    if not 1 <= refill <= batch:
        raise ValueError(f"refill={refill}: between 1 and batch={batch}")
    device, tree = capture.kv_device, Chain(0)
    session, run, propose, _ = decode_step(capture, draft, tree, batch, max_length, sampling)

    def take(n: int) -> list[tuple[object, list[int]]]:
        got = []
        while queue and len(got) < n:
            key, prompt = queue.popleft()
            if not prompt or len(prompt) + max_new_tokens + 1 > max_length:
                raise ValueError(f"prompt {key!r} of {len(prompt)} tokens: a prompt needs 1 to max_length - "
                                 f"max_new_tokens - 1 = {max_length - max_new_tokens - 1} tokens")
            got.append((key, list(prompt)))
        return got

    first = take(batch)
    if not first:
        return
    # per slot: [key, prompt, tokens generated so far], or None while the slot is empty
    rows: list[list | None] = [[key, prompt, []] for key, prompt in first] + [None] * (batch - len(first))
    padded = [p for _, p in first] + [first[0][1]] * (batch - len(first))  # one bucket: B rows
    cache_len = prefill(capture, padded, device).cache_len
    session.prefill(padded, None)
    tree_now = propose(torch.tensor([p[-1] for p in padded], device=device))
    active = torch.tensor([r is not None for r in rows], device=device)
    if (batch, 3) not in capture.readbacks:
        capture.readbacks[batch, 3] = _Readback(device, batch, 3)
    readback = capture.readbacks[batch, 3]
    kv = capture.kv(batch)
    ahead = device.type == "cuda" if config.overlap is None else config.overlap

    stats = {} if stats is None else stats
    stats.update(steps=0, refills=0)

    def launch(tree, cache):
        stats["steps"] += 1
        return readback.start(run(tree, cache, active))

    def empty() -> list[int]:
        return [s for s, r in enumerate(rows) if r is None]

    def live() -> bool:  # a row still decoding (once none is, a step launched ahead would run forever)
        return any(r is not None for r in rows)

    def room() -> bool:  # a step launched before the last is read writes one slot further
        return all(r is None or len(r[1]) + len(r[2]) + 1 <= max_length for r in rows)

    pending = launch(tree_now, cache_len)
    while pending is not None:
        out, ticket = pending
        pending = None
        if ahead and live() and not (queue and len(empty()) >= refill) and room():
            pending = launch(out.next_tree, out.cache_len)  # overlaps the host's work below
        host = readback.finish(ticket)
        for s, r in enumerate(rows):
            if r is None or host[s][1] == 0:
                continue
            token = host[s][0]
            r[2].append(token)
            if token in eos_token_ids or len(r[2]) >= max_new_tokens:
                yield r[0], r[2], token in eos_token_ids
                rows[s] = None
                active[s] = False  # seen from the next step launched
        if pending is not None:
            continue
        tree_now, cache_now = out.next_tree, out.cache_len  # the static buffers the next step reads
        slots = empty()
        while queue and len(slots) >= refill:
            new = take(refill)
            group = [p for _, p in new] + [new[0][1]] * (refill - len(new))
            lengths = prefill(capture, group, device).cache_len
            stats["refills"] += 1
            at = torch.tensor(slots[: len(new)], device=device)
            if refill < batch:  # (refill == batch: every slot was empty, the prefill wrote them in place)
                kv.index_copy_(1, at, capture.kv(refill)[:, : len(new)])  # [2L, B, H, T, D]: whole rows
            cache_now.index_copy_(0, at, lengths[: len(new)].to(cache_now.dtype))
            tree_now.tokens.index_copy_(0, at, torch.tensor([[p[-1]] for _, p in new], device=device,
                                                            dtype=tree_now.tokens.dtype))
            active.index_fill_(0, at, True)
            for s, (key, prompt) in zip(slots, new):
                rows[s] = [key, prompt, []]
            slots = slots[len(new):]
        if live():
            pending = launch(tree_now, cache_now)
