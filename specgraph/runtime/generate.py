"""The generate loop (host-driven for now).

Per row, the cache holds every committed token but the last, which is the
root of the next tree. One iteration: the draft session proposes a tree
from each row's root -> one captured verify step over it -> verify (greedy
or sampling) -> compact the KV cache -> the session commits the accepted
path -> advance ``cache_len`` -> append the emitted tokens.
Prefill writes each prompt but its last token in chain chunks of the
prefill bucket (their logits are pruned away: the first verify step's root
row yields the first new token).
"""
from __future__ import annotations

import os
import types
from dataclasses import dataclass, field

import torch

from .step import DecodeStep, features_of

PREFILL_NODES = 32


@dataclass
class GenerateResult:
    sequences: list[list[int]]  # per row: the generated tokens (eos included, nothing after it)
    accept_lens: list[list[int]] = field(default_factory=list)  # per step, per row: tokens committed


def _chain_mask(n: int, device) -> torch.Tensor:
    return torch.tensor([(1 << (i + 1)) - 1 if i < 63 else -1 for i in range(n)], device=device)


@torch.no_grad()
def prefill(capture, prompts: list[list[int]], device, taps=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Write every prompt but its last token into the batch's cache.

    returns cache_len [B] and, with ``taps``, the draft features of every
    written token [B, T-1, F] (None otherwise).
    """
    b = len(prompts)
    # a chunk is a chain, so it must be shallower than the narrowest sliding window, and fit the cache
    chunk = min([PREFILL_NODES, capture.max_length] + [w for w in capture.info.layer_windows if w > 0])
    step = capture.step(b, chunk, taps=taps, logits_rows=(chunk - 1, chunk))
    chain = _chain_mask(chunk, device).expand(b, -1)
    lengths = [len(p) - 1 for p in prompts]
    total = max(lengths)
    starts = list(range(0, total, chunk))
    if starts and starts[-1] + chunk > total >= chunk:
        # the last chunk ends where the longest prompt does (rewriting a few slots with the same values),
        # so nothing is written past the longest prompt: the cache may be exactly as long as generate needs
        starts[-1] = total - chunk
    features, done = [], 0
    for start in starts:
        ids = torch.tensor([(p[:-1] + [0] * (start + chunk))[start:start + chunk] for p in prompts], device=device)
        # rows whose prompt ended write padding past their length: those slots are overwritten before being read
        cache_len = torch.full((b,), start, device=device)
        out = step(ids, start + torch.arange(chunk, device=device).expand(b, -1), cache_len, chain)
        if taps is not None:
            features.append(features_of(out[1])[:, done - start:])
        done = start + chunk
    merged = torch.cat(features, 1) if features else None
    return torch.tensor(lengths, device=device), merged


@dataclass(frozen=True)
class Sampling:
    """Per-batch sampling parameters (transformers' warper semantics)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0


def decode_step(capture, draft, tree, batch: int, max_length: int, sampling: Sampling | None, compiled: bool,
                synthetic_accept: int | None = None):
    """The bucket's draft session and step function, built (and compiled) on first use and kept on
    ``capture``: later calls with the same batch, tree and sampling reuse them (``session.prefill``
    resets the per-call state), so a bucket compiles and records its CUDA graph once."""
    device = capture.kv_device
    # The whole step compiles as one graph; SPECGRAPH_WHOLE_STEP=0 compiles the target bucket alone
    # (the rest of the step then runs eagerly: a fallback for inductor bugs).
    whole_step = compiled and os.environ.get("SPECGRAPH_WHOLE_STEP", "1") == "1"
    # on CUDA the whole step replays as one CUDA graph (SPECGRAPH_CUDA_GRAPHS=0 turns that off)
    cuda_graphs = whole_step and device.type == "cuda" and os.environ.get("SPECGRAPH_CUDA_GRAPHS", "1") == "1"
    key = (id(draft), batch, repr(tree), max_length, repr(sampling), compiled, whole_step, cuda_graphs,
           synthetic_accept)
    if key in capture.decode_steps:
        return capture.decode_steps[key]
    session = draft.session(tree, batch, max_length, device)
    step = DecodeStep(capture, session, tree, batch, sampling, compiled_target=compiled and not whole_step,
                      synthetic_accept=synthetic_accept)
    run = step
    if whole_step:
        if cuda_graphs:  # the caches are mutated in place: fixed addresses let the replay own them
            for cache in (step.kv, *session.caches()):
                torch._dynamo.mark_static_address(cache)
        compiled_step = torch.compile(own_code(step.__call__), fullgraph=True, dynamic=False,
                                      mode="reduce-overhead" if cuda_graphs else None)

        def run(*args):
            if not cuda_graphs:
                return compiled_step(*args)
            torch.compiler.cudagraph_mark_step_begin()
            before = {name: id(value) for name, value in vars(session).items()}
            out = compiled_step(*args)
            # The replay's outputs live in the graph's memory pool and the next replay overwrites them:
            # what carries over to the next step (the outputs and the session state the step reassigned)
            # is cloned out of it. The caches are static buffers mutated in place and are not copied.
            for name, value in vars(session).items():
                if torch.is_tensor(value) and id(value) != before.get(name):
                    setattr(session, name, value.clone())
            return _clone_tensors(out)
    capture.decode_steps[key] = session, run
    return session, run


def own_code(method):
    """``method`` (bound) under a code object of its own. torch.compile keeps compiled frames, and
    counts them against ``recompile_limit`` (8), per code object: every DecodeStep shares
    ``DecodeStep.__call__``'s, so the ninth step built in one process (a ninth bucket, model or
    tree) failed under fullgraph=True. A step's own code object also frees its compiled graph
    with it."""
    f = method.__func__
    clone = types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    return types.MethodType(clone, method.__self__)


def _clone_tensors(value):
    if torch.is_tensor(value):
        return value.clone()
    if isinstance(value, tuple):
        return type(value)(*map(_clone_tensors, value)) if hasattr(value, "_fields") else tuple(map(_clone_tensors, value))
    if hasattr(value, "__dataclass_fields__"):
        return type(value)(**{f: _clone_tensors(getattr(value, f)) for f in value.__dataclass_fields__})
    return value


@torch.no_grad()
def speculative_generate(capture, draft, tree, prompts: list[list[int]], max_new_tokens: int,
                         eos_token_ids: set[int], max_length: int, sampling: Sampling | None = None,
                         stopping_criteria=None, streamer=None, compiled: bool = False,
                         synthetic_accept: int | None = None) -> GenerateResult:
    """Speculative decoding of ``prompts`` over ``tree``: greedy (token-exact), or with
    ``sampling`` exact in distribution (the drafts are deterministic, so each node
    draws its own target sample and a draft is accepted iff it equals its
    parent's draw).

    The draft works through a session (``draft.session(...)``): ``prefill``
    sees the prompt's tapped features, ``propose`` returns each step's Tree,
    ``commit`` sees the acceptance and the step's features. One iteration's
    device work is ``DecodeStep`` (``compiled``: through
    ``torch.compile(fullgraph=True)``, one graph, replayed as a CUDA graph
    on CUDA unless SPECGRAPH_CUDA_GRAPHS=0; see ``decode_step``);
    the host reads the emitted
    tokens and accept lengths, applies eos / ``max_new_tokens`` /
    ``stopping_criteria`` (transformers' StoppingCriteriaList, asked after
    every accepted token with scores None) and feeds ``streamer`` each row-0
    token as it is accepted.
    """
    device = capture.kv_device
    b, n = len(prompts), tree.num_nodes
    session, run = decode_step(capture, draft, tree, b, max_length, sampling, compiled, synthetic_accept)
    cache_len, features = prefill(capture, prompts, device, session.taps)
    session.prefill(prompts, features)
    sequences = [list(p) for p in prompts]
    generated: list[list[int]] = [[] for _ in range(b)]
    done = [max_new_tokens <= 0] * b
    result = GenerateResult(generated)
    topology = session.propose(sequences, torch.tensor([seq[-1] for seq in sequences], device=device))
    active = torch.tensor([not d for d in done], device=device)  # updated in place when a row finishes
    while not all(done):
        out = run(topology, cache_len, active)
        cache_len = out.cache_len
        emitted, lens = out.emitted.tolist(), out.accept_len.tolist()  # the one host read per step
        result.accept_lens.append(lens)
        for row in range(b):
            if done[row]:
                continue
            for token in emitted[row][: lens[row]]:
                generated[row].append(token)
                sequences[row].append(token)
                if streamer is not None:
                    streamer.put(torch.tensor([token]))
                stop = token in eos_token_ids or len(generated[row]) >= max_new_tokens
                if not stop and stopping_criteria is not None:
                    stop = bool(stopping_criteria(torch.tensor([sequences[row]]), None).any())
                if stop:
                    done[row] = True
                    active[row] = False
                    break
        # cache_len = prompt - 1 + generated tokens: checked from host state, without a second device read
        assert all(d or len(seq) - 1 + n <= max_length for d, seq in zip(done, sequences)), "cache overflow"
        if out.next_tree is not None:
            topology = out.next_tree
        elif not all(done):
            topology = session.propose(sequences, torch.tensor([seq[-1] for seq in sequences], device=device))
    if streamer is not None:
        streamer.end()
    return result
