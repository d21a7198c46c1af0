"""The generate loop (host-driven for now).

Per row, the cache holds every committed token but the last, which is the
root of the next tree. The prefill writes each whole prompt in chain chunks
of the prefill bucket and keeps the logits at its last token, from which the
first new token is drawn (``first_token.py``) and streamed before the decode
step's bucket is built; prompt + [first token] is then the prompt of the
loop. One iteration: the draft session proposes a tree from each row's root
-> one captured verify step over it -> verify (greedy or sampling) -> compact
the KV cache -> the session commits the accepted path -> advance
``cache_len`` -> append the emitted tokens.
"""
from __future__ import annotations

import logging
import time
import types
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from .. import compiled_cache, config
from ..drafts.lookup import open_session
from ..kernels.penalty import reset_seen, seen_buffer
from ..kernels.verify import TOP_K_CAP
from ..trees import chain_mask
from .first_token import first_tokens
from .graphed import GraphedCall, StaticStep
from .outputs import per_position
from .step import CONFIDENCE_SCALE, DecodeStep, features_of
from .stopping import BatchStopping

log = logging.getLogger(__name__)

# prefill chunk: as wide as tree attention goes (64 rows; a chain mask of 64 bits): each chunk reads
# every weight once, so the widest chunk means the fewest passes over a long prompt
PREFILL_NODES = 64


@dataclass
class GenerateResult:
    sequences: list[list[int]]  # per row: the generated tokens (eos included, nothing after it)
    accept_lens: list[list[int]] = field(default_factory=list)  # per step, per row: tokens committed
    # per step, per row: the ranks (Tree.rank) of the accepted drafted nodes, in path order
    accepted_ranks: list[list[list[int]]] = field(default_factory=list)
    # per step, per row: the verified tree's Tree.confidence (a DynamicTree's; [] for other trees)
    confidence: list[list[list[float]]] = field(default_factory=list)
    scores: tuple | None = None  # with keep: per position, [B, V] (transformers' output_scores)
    logits: tuple | None = None  # with keep: per position, [B, V] raw (transformers' output_logits)
    decode_seconds: float | None = None  # with time_steps: the steps' wall time, from the prefill's end
    prefill_tokens: int = 0  # tokens the prefill emitted (each row's first), in ``sequences`` but no step's


@dataclass(frozen=True)
class AcceptanceStats:
    """How much one generate call's speculation bought, over all rows. ``tau``: tokens emitted per
    target verify step (the bonus token included; 1.0 = no draft token accepted; the first token, which
    the prefill emits, counts in neither; 0.0 when no step ran); ``position_rate[k]``:
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
        tokens, steps = sum(map(len, result.sequences)) - result.prefill_tokens, sum(hist)
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


class Prefilled(NamedTuple):
    cache_len: torch.Tensor  # [B] the tokens written per row
    features: torch.Tensor | None  # [B, T, F] the draft features of each written token (T: the most written)
    logits: torch.Tensor | None  # with whole: [B, 1, V] the target's logits at each row's last token


@torch.no_grad()
def prefill(capture, prompts: list[list[int]], device, taps=None, whole: bool = False) -> Prefilled:
    """Write each prompt (``whole``) or all but its last token into the batch's cache, in chunks of the
    prefill bucket, and with ``whole`` keep the logits at each row's last token (the first token's).

    Each row's last chunk ends where the row does (it rewrites a few slots of the chunk before with the same
    values; a row that ends sooner repeats its last chunk while longer rows go on), so the bucket's one
    logits row (its last) is each row's last token. A row shorter than a chunk is followed by padding: its
    last token is also put in the chunk's last row, at its own position and attending what it attends (a
    sibling of itself in the chunk's tree), so that row sees exactly the prompt. Under ``backend="inductor"``
    the chunk bucket runs as a ``GraphedCall`` kept on ``capture`` (a CUDA graph on CUDA: one replay per
    chunk instead of every kernel launched from the host)."""
    b = len(prompts)
    # a chunk is a chain, so it must be shallower than the narrowest sliding window, and fit the cache
    chunk = min([PREFILL_NODES, capture.max_length] + [w for w in capture.info.layer_windows if w > 0])
    step = capture.step(b, chunk, taps=taps, logits_rows=(chunk - 1, chunk))
    graphed = capture.backend in ("inductor", "cudagraphs")  # a GraphedCall: CUDA graph replays on CUDA
    if graphed:
        key = (b, chunk, taps)
        if key not in capture.prefills:
            capture.prefills[key] = GraphedCall(step, cuda_graphs_on(device),
                                                f"the prefill bucket (B={b}, {chunk} rows)")
        step = capture.prefills[key]
    lengths = [len(p) - (0 if whole else 1) for p in prompts]
    total = max(lengths)
    chain = chain_mask(chunk, device)  # [chunk]: row i attends rows 0 .. i
    rows = torch.arange(chunk, device=device)
    written = torch.tensor(lengths, device=device).view(b, 1)
    # rows shorter than a chunk (whole): the last token again in the chunk's last row, beside its copy at row
    # n - 1 (the same position and ancestors); the same in every chunk, since such a row starts at 0 in each
    again = [whole and n < chunk for n in lengths]
    moved = torch.tensor(again, device=device).view(b, 1) & (rows == chunk - 1)  # [B, chunk]
    last_bit = chain[-1] ^ chain[-2] if chunk > 1 else chain[-1]  # the chunk's last row alone
    ancestors = torch.where(written > 1, chain[(written - 2).clamp(0, chunk - 1)], 0) | last_bit  # [B, 1]
    mask = torch.where(moved, ancestors, chain)  # [B, chunk], contiguous: the graphed call's static buffers are
    features = logits = None
    for k in range(-(-total // chunk)):
        starts = [min(k * chunk, max(n - chunk, 0)) for n in lengths]
        ids = [(p[:n] + [0] * chunk)[s:s + chunk] for p, n, s in zip(prompts, lengths, starts)]
        for r, n in enumerate(lengths):
            if again[r]:
                ids[r][-1] = prompts[r][n - 1]
        first = torch.tensor(starts, device=device)
        slots = first.view(b, 1) + rows  # [B, chunk] where each row's tokens go in the cache
        positions = torch.where(moved, written - 1, slots)
        out = step(torch.tensor(ids, device=device), positions, first, mask)
        if taps is not None:  # each written token's features to its place (the rest to a discarded column)
            tapped = features_of(out[1])  # [B, chunk, F]
            if features is None:
                features = tapped.new_zeros(b, total + 1, tapped.shape[-1])
            at = torch.where(slots < written, slots, total)
            features.scatter_(1, at.unsqueeze(-1).expand_as(tapped), tapped)
        if whole and k == -(-total // chunk) - 1:  # a graphed call's outputs are overwritten by its next replay
            logits = out[0] if taps is not None else out  # (logits, taps) or the logits alone
            logits = logits.clone() if graphed else logits
    return Prefilled(written.view(b), None if features is None else features[:, :total].contiguous(), logits)


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

    def warpers(self) -> tuple[str | None, bool, bool]:
        """The filters a sampled step runs, part of its bucket: top-k ("topk": the k-th largest logit found
        among the TOP_K_CAP largest; "sort": a sort of the vocabulary; None: off), top-p, min-p. A filter
        that is off costs nothing (transformers does not run its warper either)."""
        top_k = None if self.top_k == 0 else "topk" if self.top_k <= TOP_K_CAP else "sort"
        return top_k, self.top_p < 1.0, self.min_p > 0.0


def verify_rule(sampling: Sampling | None) -> tuple | None:
    """What of ``sampling`` a compiled step is built for (its bucket's key): the verification rule (typical,
    seeded) and the warpers. The values (temperature, k, p) are not: the step reads them from tensors."""
    return None if sampling is None else (sampling.typical is not None, sampling.seed is not None, sampling.warpers())


def decode_step(capture, draft, tree, batch: int, max_length: int, sampling: Sampling | None,
                synthetic_accept: int | None = None, penalty: float | None = None,
                keep: tuple[bool, bool] = (False, False)):
    """The bucket's draft session and step function, built (and compiled) on first use and kept on
    ``capture``: later calls with the same batch, tree and sampling reuse them (``session.prefill``
    resets the per-call state), so a bucket compiles and records its CUDA graph once. A repetition
    ``penalty`` (on or off) and ``keep`` (scores, logits handed back) are part of the bucket: steps
    without them pay nothing for them."""
    device = capture.kv_device
    # backends inductor and cudagraphs: the whole step over static buffers, one graph; inductor compiles
    # it (config.whole_step=False compiles the target bucket alone, the rest of the step then eager: a
    # fallback for inductor bugs), cudagraphs records it as it is (no compile: a fast start)
    compiled = capture.backend == "inductor"
    whole_step = capture.backend == "cudagraphs" or (compiled and config.whole_step)
    graphed = whole_step and cuda_graphs_on(device)
    # sampling's and the penalty's values are not in the key: the step reads them from tensors
    # (DecodeStep.set_sampling, set_penalty)
    verify = verify_rule(sampling)
    key = (id(draft), batch, repr(tree), max_length, verify, compiled, whole_step, graphed, synthetic_accept,
           penalty is None, tuple(keep))
    if key in capture.decode_steps:
        bucket = capture.decode_steps[key]
        if sampling is not None:
            bucket.step.set_sampling(sampling)
        if penalty is not None:
            bucket.step.set_penalty(penalty)
        return bucket
    if compiled:  # the first call of the bucket compiles it: say so, it is the one slow call
        log.info("the decode step for batch %d, %s compiles on its first call (about a minute on a GPU; "
                 "inductor's cache makes later processes faster)", batch, tree)
    session = open_session(draft, tree, batch, max_length, device)  # a WithLookup tree: a lookup branch beside
    step = DecodeStep(capture, session, tree, batch, sampling, compiled_target=compiled and not whole_step,
                      synthetic_accept=synthetic_accept, penalty=penalty, keep=keep)

    def frame(method, name: str):  # compiled; kept across processes where the target bucket is (compiled_cache)
        if not compiled:
            return method  # cudagraphs: recorded as it runs
        cache_key = compiled_cache.key(step.target.cache_key, name, draft=draft, tree=repr(tree), verify=verify,
                                       graphed=graphed, synthetic_accept=synthetic_accept,
                                       penalty=penalty is None, keep=list(keep))
        return compiled_cache.compile_frame(own_code(method), cache_key, f"the {name} (B={batch}, {tree})")

    if whole_step:  # host-side per-call work (the EAGLE drafts' pass over the prompt; a no-op for others),
        # compiled, over static inputs, and on CUDA recorded as a graph like the target's prefill chunks
        session.compile_host_work(lambda method: GraphedCall(
            frame(method, f"draft's {method.__name__}"), graphed, f"the draft's pass over the prompt (B={batch})"))
    run = step
    if whole_step:
        run = StaticStep(frame(step.carried, "decode step"), session, cuda_graph=graphed)
    # The first tree of a call: the session's propose, compiled like the step (eagerly it
    # is thousands of small launches: an EAGLE-2 tree of 8 draft steps is ~4,300 aten ops), over a static
    # roots buffer and on CUDA recorded as a graph: it reads the session's state at fixed addresses (each
    # session's prefill writes it in place) and returns a Tree the step copies in before the next call
    propose = session.propose
    if whole_step:
        propose = GraphedCall(frame(session.propose, "first propose"), graphed, f"the first propose (B={batch})")
    capture.decode_steps[key] = Bucket(session, run, propose, step)
    return capture.decode_steps[key]


class Bucket(NamedTuple):
    """What ``decode_step`` keeps per bucket: the draft session, the (compiled) step, how the first
    tree of a call is proposed (``propose(roots)``), and the DecodeStep itself."""

    session: object
    run: object
    propose: object
    step: object


def cuda_graphs_on(device: torch.device) -> bool:
    """Compiled steps and prefill chunks replay as hand-recorded CUDA graphs (``StaticStep``,
    ``GraphedCall``): on CUDA unless ``config.cuda_graphs`` is off."""
    return device.type == "cuda" and config.cuda_graphs


def own_code(method):
    """``method`` (bound) under a code object of its own. torch.compile keeps compiled frames, and
    counts them against ``recompile_limit`` (8), per code object: every DecodeStep shares
    ``DecodeStep.__call__``'s, so the ninth step built in one process (a ninth bucket, model or
    tree) failed under fullgraph=True. A step's own code object also frees its compiled graph
    with it."""
    f = method.__func__
    clone = types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    return types.MethodType(clone, method.__self__)


class _Readback:
    """A step's emitted tokens, accept lengths, accepted path's ranks and tree confidence on their way to the
    host, ``[B, 2D+3+C]`` int64 (emitted, accept_len, path_rank, confidence in fixed point): on CUDA an async
    copy into pinned memory, two buffers taking turns, so the next step can be launched before this one is
    read (it would overwrite the replay's outputs)."""

    def __init__(self, device: torch.device, batch: int, width: int):
        self.pinned = device.type == "cuda"
        if self.pinned:
            self.buffers = [torch.empty(batch, width, dtype=torch.int64, pin_memory=True) for _ in range(2)]
            self.events = [torch.cuda.Event() for _ in range(2)]
            self.turn = 0

    def start(self, out):
        rank = out.path_rank if out.path_rank is not None else torch.full_like(out.emitted, -1)
        confidence = out.confidence if out.confidence is not None else out.emitted.new_zeros(out.emitted.shape[0], 0)
        packed = torch.cat((out.emitted.to(torch.int64), out.accept_len.view(-1, 1).to(torch.int64),
                            rank.to(torch.int64), confidence.to(torch.int64)), 1)
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
                         stopping_criteria=None, streamer=None, pad_token_id: int = 0,
                         synthetic_accept: int | None = None, padding: list[list[int]] | None = None,
                         penalty: float | None = None, keep: tuple[bool, bool] = (False, False),
                         time_steps: bool = False) -> GenerateResult:
    """Speculative decoding of ``prompts`` over ``tree``: greedy (token-exact), or with
    ``sampling`` exact in distribution (the drafts are deterministic, so each node
    draws its own target sample and a draft is accepted iff it equals its
    parent's draw).

    The first token comes from the prefill (``first_token.py``): a call of one
    token, or whose rows all end there, builds no decode step. The draft works
    through a session (``draft.session(...)``): ``prefill``
    sees the prompt's tapped features, ``propose`` returns each step's Tree,
    ``commit`` sees the acceptance and the step's features. One iteration's
    device work is ``DecodeStep`` (under backends inductor and cudagraphs over
    static buffers, through ``torch.compile(fullgraph=True)`` under inductor,
    one graph, and replayed as a CUDA graph on CUDA unless ``config.cuda_graphs``
    is off; see ``decode_step``);
    the host reads the emitted
    tokens and accept lengths, applies eos / ``max_new_tokens`` /
    ``stopping_criteria`` (transformers' StoppingCriteriaList, asked once per
    generated position on the whole batch with scores None, finished rows
    filled with ``pad_token_id``, as model.generate asks it: ``BatchStopping``)
    and feeds ``streamer`` each row-0 token as it is accepted. On CUDA the next step is launched before this one
    is read, while every row has room for it (``config.overlap``), so that
    host work overlaps the device; outputs are the same.
    ``penalty``: transformers' repetition penalty (each row's seen tokens: its prompt without the
    padding, then what it commits); ``keep`` = (scores, logits): also return them per generated
    position (``GenerateResult.scores`` / ``logits``), as model.generate's output_scores / output_logits.
    ``time_steps``: also time the steps apart from the prefill (``GenerateResult.decode_seconds``; one sync).
    """
    device = capture.kv_device
    b, n = len(prompts), tree.num_nodes
    padding = padding or [[] for _ in prompts]
    sequences = [list(p) for p in prompts]
    generated: list[list[int]] = [[] for _ in range(b)]
    done = [max_new_tokens <= 0] * b
    active = torch.tensor([not d for d in done], device=device)  # updated in place when a row finishes
    result = GenerateResult(generated)
    kept: list[tuple] = []  # with keep: the first token's, then each launched step's (scores, logits)
    where: list[list[tuple[int, int]]] = [[] for _ in range(b)]  # per row, per token: (kept entry, slot)
    stopper = None if stopping_criteria is None else BatchStopping(
        stopping_criteria, [lead + p for lead, p in zip(padding, prompts)], pad_token_id, max_new_tokens, streamer)

    def take(row: int, token: int, at: tuple[int, int]) -> bool:  # one emitted token; True: the row is done
        where[row].append(at)
        generated[row].append(token)
        sequences[row].append(token)
        if streamer is not None and stopper is None:
            streamer.put(torch.tensor([token]))
        if token in eos_token_ids or len(generated[row]) >= max_new_tokens:
            done[row] = True
            active[row] = False  # seen from the next step launched (the one ahead, if any, runs on)
            return True
        return False

    def stop_where_asked() -> None:  # a criterion stopped rows (or their eos / length was reached): cut there
        for row in stopper.advance(generated, eos_token_ids) if stopper is not None else ():
            done[row] = True
            active[row] = False
            del sequences[row][len(prompts[row]) + len(generated[row]):]
            del where[row][len(generated[row]):]

    if not all(done):  # the first token from the prefill: streamed before the decode step's bucket is built
        filled = prefill(capture, prompts, device, draft.taps, whole=True)
        seen = None
        if penalty is not None:  # the prompt's tokens (its padding left out, as model.generate does)
            seen = seen_buffer(b, capture.info.vocab_size, device)
            reset_seen(seen, prompts)
        first = first_tokens(filled.logits, torch.tensor([p[-1] for p in prompts], device=device),
                             filled.cache_len - 1, sampling, penalty, seen, keep)
        if any(keep):
            kept.append((first.scores, first.logits))
        for row, token in enumerate(first.tokens.tolist()):
            take(row, token, (0, 0))
        result.prefill_tokens = b
        stop_where_asked()
    if all(done):
        return finish(result, streamer, keep, kept, where)
    # from here on prompt + [first token] is each row's prompt, its last token the first tree's root
    session, run, propose, step = decode_step(capture, draft, tree, b, max_length, sampling,
                                              synthetic_accept, penalty, keep)
    if session.taps != draft.taps:
        raise RuntimeError(f"{type(draft).__name__}.taps={draft.taps} but its session reads {session.taps}: the "
                           "prefill tapped what the session does not read (a draft's bug)")
    if penalty is not None:
        step.reset_seen(sequences)
    session.prefill([list(seq) for seq in sequences], filled.features)
    topology = propose(first.tokens)
    confidence_width = 0 if topology.confidence is None else topology.confidence.shape[1]
    width = 2 * tree.max_depth + 3 + confidence_width
    if (b, width) not in capture.readbacks:  # kept: pinning host memory is slow
        capture.readbacks[b, width] = _Readback(device, b, width)
    readback = capture.readbacks[b, width]
    ahead = device.type == "cuda" if config.overlap is None else config.overlap
    # a step writes the tree at cache_len .. cache_len + n - 1 and advances cache_len by at most D + 1:
    # a step launched before the previous one is read needs room for both
    room = lambda seq: len(seq) - 1 + tree.max_depth + 1 + n <= max_length  # noqa: E731

    def launch(tree_now, cache_now):
        out = run(tree_now, cache_now, active)
        if any(keep):  # the step's outputs are overwritten by the next launch: copied (on the device) first
            kept.append(tuple(None if x is None else x.clone() for x in (out.scores, out.logits)))
        return readback.start(out)

    if time_steps and device.type == "cuda":  # the prefill done first; this stream only (a background compile
        torch.cuda.current_stream(device).synchronize()  # runs on its own)
    decode_start = time.perf_counter()
    pending = launch(topology, filled.cache_len)
    while pending is not None:
        out, ticket = pending
        pending = None
        if ahead and out.next_tree is not None and all(d or room(seq) for d, seq in zip(done, sequences)):
            # step k+1 goes to the device before step k is read, so the host's work below overlaps it
            pending = launch(out.next_tree, out.cache_len)
        host = readback.finish(ticket)  # the one host read per step
        d1 = tree.max_depth + 1
        emitted, lens = [row[:d1] for row in host], [0 if d else row[d1] for d, row in zip(done, host)]
        result.accept_lens.append(lens)
        result.accepted_ranks.append([row[d1 + 2: d1 + 1 + n] for row, n in zip(host, lens)])
        result.confidence.append([[c / CONFIDENCE_SCALE for c in row[2 * d1 + 1:]] for row in host])
        for row in range(b):
            for slot, token in enumerate(emitted[row][: lens[row]]):  # (a done row's lens are 0)
                if take(row, token, (len(result.accept_lens), slot)):
                    break
        stop_where_asked()
        if all(done):
            break
        # cache_len = prompt - 1 + generated tokens: checked from host state, without a second device read
        if not all(d or len(seq) - 1 + n <= max_length for d, seq in zip(done, sequences)):
            raise RuntimeError(f"a row's next tree of {n} nodes would run past max_length={max_length}: the room "
                               "check missed it (a specgraph bug)")
        if pending is None:
            topology = out.next_tree
            pending = launch(topology, out.cache_len)
    if time_steps:
        result.decode_seconds = time.perf_counter() - decode_start
    return finish(result, streamer, keep, kept, where)


def finish(result: GenerateResult, streamer, keep: tuple[bool, bool], kept: list[tuple],
           where: list[list[tuple[int, int]]]) -> GenerateResult:
    """End the stream and hand back the kept scores / logits per generated position."""
    if streamer is not None:
        streamer.end()
    if keep[0]:
        result.scores = per_position([k[0] for k in kept], where)
    if keep[1]:
        result.logits = per_position([k[1] for k in kept], where)
    return result
