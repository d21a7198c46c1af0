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

import logging
import os
import types
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from .graphed import GraphedCall, StaticStep
from .step import DecodeStep, features_of

log = logging.getLogger(__name__)

# prefill chunk: as wide as tree attention goes (64 rows; a chain mask of 64 bits): each chunk reads
# every weight once, so the widest chunk means the fewest passes over a long prompt
PREFILL_NODES = 64


@dataclass
class GenerateResult:
    sequences: list[list[int]]  # per row: the generated tokens (eos included, nothing after it)
    accept_lens: list[list[int]] = field(default_factory=list)  # per step, per row: tokens committed


@dataclass(frozen=True)
class AcceptanceStats:
    """How much one generate call's speculation bought, over all rows. ``tau``: tokens emitted per
    target verify step (the bonus token included; 1.0 = no draft token accepted); ``position_rate[k]``:
    the share of steps whose (k+1)-th drafted token was accepted; ``accepted_hist[k]``: steps that
    accepted exactly k drafted tokens."""

    steps: int
    tokens: int
    tau: float
    accepted_hist: tuple[int, ...]
    position_rate: tuple[float, ...]

    @classmethod
    def of(cls, result: GenerateResult, depth: int) -> "AcceptanceStats":
        hist = accepted_histogram((n for step in result.accept_lens for n in step), depth)
        tokens, steps = sum(map(len, result.sequences)), sum(hist)
        return cls(steps, tokens, tokens / max(steps, 1), tuple(hist), tuple(position_rates(hist)[0]))


def accepted_histogram(lens, depth: int) -> list[int]:
    """``hist[k]``: steps that accepted exactly k drafted tokens (committed - the bonus, at most ``depth``),
    from per-step committed counts ``lens`` (0: a finished row, skipped)."""
    hist = [0] * (depth + 1)
    for n in lens:
        if n > 0:
            hist[min(n - 1, depth)] += 1
    return hist


def position_rates(hist: list[int]) -> tuple[list[float], list[float]]:
    """Per draft depth k+1: the share of steps that accepted it, and the share given depth k was."""
    steps, depth = sum(hist), len(hist) - 1
    reached = [sum(hist[k:]) for k in range(depth + 1)]  # steps that accepted at least k drafts
    return ([reached[k + 1] / max(steps, 1) for k in range(depth)],
            [reached[k + 1] / max(reached[k], 1) for k in range(depth)])


def _chain_mask(n: int, device) -> torch.Tensor:
    return torch.tensor([(1 << (i + 1)) - 1 if i < 63 else -1 for i in range(n)], device=device)


@torch.no_grad()
def prefill(capture, prompts: list[list[int]], device, taps=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Write every prompt but its last token into the batch's cache.

    returns cache_len [B] and, with ``taps``, the draft features of every
    written token [B, T-1, F] (None otherwise). Under ``backend="inductor"`` the
    chunk bucket runs as a ``GraphedCall`` kept on ``capture`` (a CUDA graph on
    CUDA: one replay per chunk instead of every kernel launched from the host).
    """
    b = len(prompts)
    # a chunk is a chain, so it must be shallower than the narrowest sliding window, and fit the cache
    chunk = min([PREFILL_NODES, capture.max_length] + [w for w in capture.info.layer_windows if w > 0])
    step = capture.step(b, chunk, taps=taps, logits_rows=(chunk - 1, chunk))
    graphed = capture.backend == "inductor"
    if graphed:
        key = (b, chunk, taps)
        if key not in capture.prefills:
            capture.prefills[key] = GraphedCall(step, cuda_graph_mode(device) == "manual",
                                                f"the prefill bucket (B={b}, {chunk} rows)")
        step = capture.prefills[key]
    # contiguous inputs: the graphed call's static buffers are, and the compiled bucket guards on strides
    chain = _chain_mask(chunk, device).expand(b, -1).contiguous()
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
        out = step(ids, start + torch.arange(chunk, device=device).expand(b, -1).contiguous(), cache_len, chain)
        if taps is not None:  # a graphed call's outputs are overwritten by its next replay: kept as a copy
            kept = features_of(out[1])[:, done - start:]
            features.append(kept.clone() if graphed else kept)
        done = start + chunk
    merged = torch.cat(features, 1) if features else None
    return torch.tensor(lengths, device=device), merged


@dataclass(frozen=True)
class Sampling:
    """Per-batch sampling parameters (transformers' warper semantics). ``typical``: (posterior_threshold,
    posterior_alpha) of Medusa's LOSSY typical acceptance (``compile(verify="typical")``), None: exact.
    ``seed``: seeded sampling (per-row streams keyed by (seed, row, position)), None: the global RNG."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    typical: tuple[float, float] | None = None
    seed: int | None = None  # seeded sampling: the tokens plain sampling with this seed emits (kernels/gumbel.py)


def decode_step(capture, draft, tree, batch: int, max_length: int, sampling: Sampling | None, compiled: bool,
                synthetic_accept: int | None = None):
    """The bucket's draft session and step function, built (and compiled) on first use and kept on
    ``capture``: later calls with the same batch, tree and sampling reuse them (``session.prefill``
    resets the per-call state), so a bucket compiles and records its CUDA graph once."""
    device = capture.kv_device
    # The whole step compiles as one graph; SPECGRAPH_WHOLE_STEP=0 compiles the target bucket alone
    # (the rest of the step then runs eagerly: a fallback for inductor bugs).
    whole_step = compiled and os.environ.get("SPECGRAPH_WHOLE_STEP", "1") == "1"
    mode = cuda_graph_mode(device) if whole_step else "off"
    # sampling's values are not in the key: the step reads them from tensors (DecodeStep.set_sampling)
    verify = None if sampling is None else (sampling.typical is not None, sampling.seed is not None)  # the rule
    key = (id(draft), batch, repr(tree), max_length, verify, compiled, whole_step, mode, synthetic_accept)
    if key in capture.decode_steps:
        bucket = capture.decode_steps[key]
        if sampling is not None:
            bucket.step.set_sampling(sampling)
        return bucket
    if compiled:  # the first call of the bucket compiles it: say so, it is the one slow call
        log.info("the decode step for batch %d, %s compiles on its first call (about a minute on a GPU; "
                 "inductor's cache makes later processes faster)", batch, tree)
    session = draft.session(tree, batch, max_length, device)
    if whole_step:  # host-side per-call work (the EAGLE drafts' pass over the prompt; a no-op for others),
        # compiled, over static inputs, and on CUDA recorded as a graph like the target's prefill chunks
        session.compile_host_work(lambda method: GraphedCall(
            torch.compile(own_code(method), fullgraph=True, dynamic=False), mode == "manual",
            f"the draft's pass over the prompt (B={batch})"))
    step = DecodeStep(capture, session, tree, batch, sampling, compiled_target=compiled and not whole_step,
                      synthetic_accept=synthetic_accept)
    run = step
    if whole_step:
        if mode == "trees":  # the caches are mutated in place: fixed addresses let the replay own them
            for cache in (step.kv, *session.caches()):
                torch._dynamo.mark_static_address(cache)
        compiled_step = torch.compile(own_code(step.__call__), fullgraph=True, dynamic=False,
                                      mode="reduce-overhead" if mode == "trees" else None)
        run = _trees_step(compiled_step, session) if mode == "trees" else \
            StaticStep(compiled_step, session, cuda_graph=mode == "manual")
    # The first tree of a call: the session's propose, compiled like the step (eagerly it
    # is thousands of small launches: an EAGLE-2 tree of 8 draft steps is ~4,300 aten ops), over a static
    # roots buffer and on CUDA recorded as a graph: it reads the session's state at fixed addresses (each
    # session's prefill writes it in place) and returns a Tree the step copies in before the next call
    propose = session.propose
    if whole_step:
        propose = GraphedCall(torch.compile(own_code(session.propose), fullgraph=True, dynamic=False),
                              mode == "manual", f"the first propose (B={batch})")
    capture.decode_steps[key] = Bucket(session, run, propose, step)
    return capture.decode_steps[key]


class Bucket(NamedTuple):
    """What ``decode_step`` keeps per bucket: the draft session, the (compiled) step, how the first
    tree of a call is proposed (``propose(roots)``), and the DecodeStep itself."""

    session: object
    run: object
    propose: object
    step: object


def cuda_graph_mode(device: torch.device) -> str:
    """How a compiled whole step replays: "manual" (the default on CUDA: ``StaticStep`` records it
    by hand), "trees" (``SPECGRAPH_CUDA_GRAPHS=trees``: torch.compile's reduce-overhead mode, kept
    for comparison) or "off" (CPU, or ``SPECGRAPH_CUDA_GRAPHS=0``)."""
    flag = os.environ.get("SPECGRAPH_CUDA_GRAPHS", "1")
    if flag not in ("0", "1", "trees"):
        raise ValueError(f"SPECGRAPH_CUDA_GRAPHS={flag!r}: use 1 (hand-recorded CUDA graphs, the default), "
                         "trees (torch.compile's reduce-overhead) or 0 (none)")
    if device.type != "cuda" or flag == "0":
        return "off"
    return "trees" if flag == "trees" else "manual"


def _trees_step(compiled_step, session):
    """The step under torch.compile's CUDA-graph trees: its outputs, and the session state it
    reassigned, live in the graph's pool and the next replay overwrites them, so they are cloned."""
    def run(*args):
        torch.compiler.cudagraph_mark_step_begin()
        before = {name: id(value) for name, value in vars(session).items()}
        out = compiled_step(*args)
        for name, value in vars(session).items():
            if torch.is_tensor(value) and id(value) != before.get(name):
                setattr(session, name, value.clone())
        return _clone_tensors(out)
    return run


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


class _Readback:
    """A step's emitted tokens and accept lengths on their way to the host, ``[B, D+2]`` int64
    (accept_len last): on CUDA an async copy into pinned memory, two buffers taking turns, so the
    next step can be launched before this one is read (it would overwrite the replay's outputs)."""

    def __init__(self, device: torch.device, batch: int, width: int):
        self.pinned = device.type == "cuda"
        if self.pinned:
            self.buffers = [torch.empty(batch, width, dtype=torch.int64, pin_memory=True) for _ in range(2)]
            self.events = [torch.cuda.Event() for _ in range(2)]
            self.turn = 0

    def start(self, out):
        packed = torch.cat((out.emitted.to(torch.int64), out.accept_len.view(-1, 1).to(torch.int64)), 1)
        if not self.pinned:
            return out, packed
        i, self.turn = self.turn, 1 - self.turn
        self.buffers[i].copy_(packed, non_blocking=True)
        self.events[i].record()
        return out, i

    def finish(self, ticket) -> list[list[int]]:
        if not self.pinned:
            return ticket.tolist()
        self.events[ticket].synchronize()
        return self.buffers[ticket].tolist()


@torch.no_grad()
def speculative_generate(capture, draft, tree, prompts: list[list[int]], max_new_tokens: int,
                         eos_token_ids: set[int], max_length: int, sampling: Sampling | None = None,
                         stopping_criteria=None, streamer=None, compiled: bool = False,
                         synthetic_accept: int | None = None, padding: list[list[int]] | None = None
                         ) -> GenerateResult:
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
    token as it is accepted. On CUDA the next step is launched before this one
    is read, while every row has room for it (``SPECGRAPH_OVERLAP``), so that
    host work overlaps the device; outputs are the same.
    """
    device = capture.kv_device
    b, n = len(prompts), tree.num_nodes
    padding = padding or [[] for _ in prompts]
    session, run, propose, _ = decode_step(capture, draft, tree, b, max_length, sampling, compiled, synthetic_accept)
    cache_len, features = prefill(capture, prompts, device, session.taps)
    session.prefill(prompts, features)
    sequences = [list(p) for p in prompts]
    generated: list[list[int]] = [[] for _ in range(b)]
    done = [max_new_tokens <= 0] * b
    result = GenerateResult(generated)
    topology = propose(torch.tensor([seq[-1] for seq in sequences], device=device))  # each row's last token
    active = torch.tensor([not d for d in done], device=device)  # updated in place when a row finishes
    width = tree.max_depth + 2
    if (b, width) not in capture.readbacks:  # kept: pinning host memory is slow
        capture.readbacks[b, width] = _Readback(device, b, width)
    readback = capture.readbacks[b, width]
    ahead = os.environ.get("SPECGRAPH_OVERLAP", "auto")
    ahead = device.type == "cuda" if ahead == "auto" else ahead == "1"
    # a step writes the tree at cache_len .. cache_len + n - 1 and advances cache_len by at most D + 1:
    # a step launched before the previous one is read needs room for both
    room = lambda seq: len(seq) - 1 + tree.max_depth + 1 + n <= max_length  # noqa: E731
    pending = None if all(done) else readback.start(run(topology, cache_len, active))
    while pending is not None:
        out, ticket = pending
        pending = None
        if ahead and out.next_tree is not None and all(d or room(seq) for d, seq in zip(done, sequences)):
            # step k+1 goes to the device before step k is read, so the host's work below overlaps it
            pending = readback.start(run(out.next_tree, out.cache_len, active))
        host = readback.finish(ticket)  # the one host read per step
        emitted, lens = [row[:-1] for row in host], [0 if d else row[-1] for d, row in zip(done, host)]
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
                if not stop and stopping_criteria is not None:  # the row as model.generate shows it: padding first
                    stop = bool(stopping_criteria(torch.tensor([padding[row] + sequences[row]]), None).any())
                if stop:
                    done[row] = True
                    active[row] = False  # seen from the next step launched (the one ahead, if any, runs on)
                    break
        if all(done):
            break
        # cache_len = prompt - 1 + generated tokens: checked from host state, without a second device read
        assert all(d or len(seq) - 1 + n <= max_length for d, seq in zip(done, sequences)), "cache overflow"
        if pending is None:
            topology = out.next_tree
            pending = readback.start(run(topology, out.cache_len, active))
    if streamer is not None:
        streamer.end()
    return result
