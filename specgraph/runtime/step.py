"""The decode step: one iteration's device work as one function (one graph under torch.compile).

    verify the current tree with the target -> accept a path (greedy; sampled: seeded Gumbel-max with a
    seed or a coupled draft, else block verification on a chain, token-wise rejection on other trees; or
    Medusa's lossy typical)
    -> compact the target cache -> the draft commits the accepted pairs
    -> the draft proposes the next tree (from its device state: every draft kind)

Nothing in it reads a value back to the host and every shape is static per
(B, N) bucket, so ``torch.compile(step, fullgraph=True)`` turns the whole
iteration into one graph (and, with CUDA graphs, one replay). The host loop
reads ``emitted``, ``accept_len``, ``path_rank`` and ``confidence`` only.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from ..kernels.gumbel import stream_keys, verify_seeded
from ..kernels.penalty import mark_seen, penalize, reset_seen, seen_buffer
from ..kernels.verify import (TOP_K_CAP, greedy_tokens, sampling_probs, verify_forced, verify_greedy, verify_sample,
                              verify_typical, warped_logits)
from ..kernels.verify_block import verify_block
from ..trees import Chain, StaticTree, Tree


class StepOut(NamedTuple):
    emitted: torch.Tensor  # [B, D+1] tokens committed this step (first accept_len of each row)
    accept_len: torch.Tensor  # [B], 0 for rows that were already done
    cache_len: torch.Tensor  # [B] after the step
    next_tree: Tree | None  # the draft's next tree (None only from test stand-ins of the step)
    # with ``keep``: fp32 [B, D+1, V] at the accepted path's nodes (slot i: what emitted[i] was chosen from)
    scores: torch.Tensor | None = None  # processed (penalty, then the sampling warpers): HF's ``scores``
    logits: torch.Tensor | None = None  # the target's raw logits: HF's ``logits``
    # [B, D+1] ``tree.rank`` along the accepted path (-1: the root and past the path): what a smaller budget
    # of the same draft would have accepted (``budget_accept_lens``)
    path_rank: torch.Tensor | None = None
    # [B, C] int64: the verified tree's ``Tree.confidence`` (C = 0 unless a DynamicTree's) in units of
    # 1 / CONFIDENCE_SCALE, ready for the host read: its draft's estimate of the accepted drafted nodes at
    # other node budgets, what ``policy="cost"`` predicts larger budgets from
    confidence: torch.Tensor | None = None


CONFIDENCE_SCALE = 10_000  # StepOut.confidence's fixed point (converted in the step's graph, not per read)


# The greedy argmax runs in two stages over chunks of this many logits (``greedy_tokens``; 0 would be one
# ``argmax``): inductor runs one program per row for an arg reduction, so the 8B shape's 128k-vocabulary
# one-stage argmax took 29 us a step; two stages of 2048 took 23-26 us less (H200, docs/benchmarks.md).
ARGMAX_CHUNK = 2048


def warp_args(warpers: tuple, values) -> dict:
    """``sampling_probs``'s and ``warped_logits``' arguments for ``warpers`` (``Sampling.warpers()``) with the
    ``values`` of temperature, top_k, top_p and min_p (a mapping: numbers or 0-d tensors): the filters that
    are on, the rest skipped."""
    top_k, top_p, min_p = warpers
    return dict(temperature=values["temperature"], top_k=values["top_k"] if top_k else None,
                top_k_cap=TOP_K_CAP if top_k == "topk" else None, top_p=values["top_p"] if top_p else None,
                min_p=values["min_p"] if min_p else None)


TREE_TENSORS = tuple(f.name for f in dataclasses.fields(Tree) if f.name != "max_depth")


def session_state(session) -> list[tuple[object, str, torch.Tensor]]:
    """``(owner, attribute, tensor)`` for every tensor attribute of ``session.state_owners()``: the state a
    recorded step keeps in static buffers (``StaticStep``) and carries the step's reassignments back into."""
    return [(owner, name, value) for owner in session.state_owners() for name, value in vars(owner).items()
            if torch.is_tensor(value)]


def features_of(taps: list[torch.Tensor]) -> torch.Tensor:
    """The draft's view of the tapped states: [B, N, sum of widths] (EAGLE-3: low, mid, high)."""
    return taps[0] if len(taps) == 1 else torch.cat(taps, -1)


class DecodeStep:
    """``step(tree, cache_len, active) -> StepOut`` for one batch size and tree spec."""

    def __init__(self, capture, session, spec, batch: int, sampling=None, compiled_target: bool = False,
                 synthetic_accept: int | None = None, penalty: float | None = None,
                 keep: tuple[bool, bool] = (False, False)):
        """``compiled_target``: call the bucket's own compiled graph (the rest of the step stays eager);
        otherwise the raw graph, so that compiling this whole step traces the target into it.
        ``synthetic_accept``: benchmarks only, not lossless (``verify_forced``).
        ``penalty``: transformers' repetition penalty at every node (``kernels/penalty.py``), its value
        in a tensor (``set_penalty``), the seen tokens in ``self.seen`` (``reset_seen`` per call).
        ``keep``: (scores, logits): also return them at the accepted path's nodes."""
        self.capture, self.session, self.spec = capture, session, spec
        # sampling parameters live in tensors updated in place (``set_sampling``): a compiled step, and
        # its CUDA graph, read the current values, so a new temperature recompiles nothing
        self.sampling = self.typical = self.seed_keys = None
        if sampling is not None and sampling.typical is not None:  # compile(verify="typical"): lossy
            self.typical = {name: torch.zeros((), dtype=torch.float32, device=capture.kv_device)
                            for name in ("posterior_threshold", "posterior_alpha")}
        if sampling is not None:
            self.sampling = {name: torch.zeros((), dtype=dtype, device=capture.kv_device) for name, dtype in
                             (("temperature", torch.float32), ("top_k", torch.int64), ("top_p", torch.float32),
                              ("min_p", torch.float32))}
            # seeded draws (kernels/gumbel.py) with a seed, with a draft that couples its candidates to them
            # and in plain decoding (unseeded: a random seed per call; hashed float32 noise is the cheaper exact
            # draw there: no float64 exponential race); each row's stream key
            keys = torch.zeros((batch, 2), dtype=torch.int64, device=capture.kv_device)
            coupled = sampling.typical is None and session.couple(keys, self.sampling["temperature"])
            plain = spec.num_nodes == 1 and sampling.typical is None
            if sampling.seed is not None or coupled or plain:
                self.seed_keys = keys
            self.warpers = sampling.warpers()  # the filters this step runs (its bucket's key names them)
            self.set_sampling(sampling)
        self.synthetic_accept = synthetic_accept
        self.penalty = self.seen = None
        if penalty is not None:
            self.penalty = torch.zeros((), dtype=torch.float32, device=capture.kv_device)
            self.seen = seen_buffer(batch, capture.info.vocab_size, capture.kv_device)
            self.set_penalty(penalty)
        self.keep_scores, self.keep_logits = keep
        self.argmax_chunk = ARGMAX_CHUNK
        self.target = capture.step(batch, spec.num_nodes, taps=session.taps)
        self.target_fn = self.target.run if compiled_target else self.target.graph
        self.kv = capture.kv(batch)
        # the session's state tensors by name, read outside any compiled frame (carried's loop then traces getattr
        # only); a tensor attribute a session adds later is carried by StaticStep instead, after the frame
        self.state_names = [(owner, name) for owner, name, _ in session_state(session)]

    def set_sampling(self, sampling) -> None:
        """Use ``sampling``'s temperature, top_k, top_p and min_p from the next step on (in place)."""
        if sampling.warpers() != self.warpers:  # decode_step keys its buckets by them: a bug if reached
            raise RuntimeError(f"a step built for the warpers {self.warpers} was given {sampling}")
        for name, value in self.sampling.items():
            value.fill_(getattr(sampling, name))
        for value, setting in zip((self.typical or {}).values(), sampling.typical or ()):
            value.fill_(setting)
        if self.seed_keys is not None:  # unseeded: a seed from torch's generator (torch.manual_seed repeats it)
            seed = sampling.seed if sampling.seed is not None else int(torch.randint(0, 2**63 - 1, ()))
            self.seed_keys.copy_(stream_keys(seed, self.seed_keys.shape[0]))

    def warp_args(self) -> dict:
        """``sampling_probs``'s and ``warped_logits``' arguments: the filters that are on (the rest skipped)."""
        return warp_args(self.warpers, self.sampling)

    def set_penalty(self, penalty: float) -> None:
        """Use repetition penalty ``penalty`` from the next step on (in place)."""
        self.penalty.fill_(penalty)

    def reset_seen(self, rows: list[list[int]]) -> None:
        """A new call's seen tokens: each row's prompt (its padding left out, as model.generate does)."""
        reset_seen(self.seen, rows)

    def __call__(self, tree: Tree, cache_len: torch.Tensor, active: torch.Tensor) -> StepOut:
        # rows that finished write their (ignored) tree at slot 0: their cache_len ran ahead by the
        # tokens they accepted but did not need, and the tree from there may not fit the cache
        base = torch.where(active, cache_len, 0)
        out = self.target_fn(*self.target._state, tree.tokens, tree.positions(base), base, tree.mask)
        raw = logits = out[0]
        features = features_of(list(out[1:])) if self.target.tapped else None
        if self.penalty is not None:  # node i's seen tokens: the row's committed ones and i's root path
            logits = penalize(logits, self.seen, tree.tokens, tree.mask, self.penalty)
        if self.synthetic_accept is not None:
            acc = verify_forced(tree.tokens, tree.first_child, greedy_tokens(logits, self.argmax_chunk),
                                self.synthetic_accept, self.spec.max_depth)
        elif self.sampling is None:
            target_tokens = greedy_tokens(logits, self.argmax_chunk)  # [B, N]
            acc = verify_greedy(tree.tokens, tree.parents, tree.mask, target_tokens, self.spec.max_depth)
        else:  # temperature > 0 (generate refuses the rest): the probabilities are the warped scores' softmax
            warped = warped_logits(logits, **self.warp_args()) if self.keep_scores else None
            probs = (sampling_probs(logits, **self.warp_args(), greedy_rows=False) if warped is None
                     else warped.softmax(-1))
            if self.typical is not None:
                acc = verify_typical(tree.tokens, tree.parents, tree.mask, probs, self.spec.max_depth, **self.typical)
            elif self.seed_keys is not None:  # the tokens plain sampling with this seed emits (kernels/gumbel.py);
                # the draft's candidates may be coupled to the same draws (DraftSession.couple)
                acc = verify_seeded(tree.tokens, tree.parents, tree.mask, probs, self.spec.max_depth, self.seed_keys,
                                    base)
            elif isinstance(self.spec, Chain):  # kernels/verify_block.py; point-mass drafts
                acc = verify_block(tree.tokens, probs, self.spec.max_depth)
            else:
                acc = verify_sample(tree.tokens, tree.parents, tree.mask, probs, self.spec.max_depth)
        accept_len = torch.where(active, acc.accept_len, 0)
        if self.seen is not None:
            mark_seen(self.seen, torch.where(active.unsqueeze(1), acc.emitted, -1))
        scores = kept = None
        if self.keep_scores or self.keep_logits:  # the rows each emitted token was chosen from
            rows = acc.path.clamp(min=0).unsqueeze(-1).expand(-1, -1, raw.shape[-1])
            at_path = lambda x: x.float().gather(1, rows)  # noqa: E731
            if self.keep_scores:
                scores = at_path(logits if self.sampling is None else warped)
            kept = at_path(raw) if self.keep_logits else None
        torch.ops.specgraph.compact_kv(self.kv, base, acc.path, accept_len)
        self.session.commit(tree, acc, features, accept_len)
        next_tree = self.session.propose(acc.bonus)
        path_rank = None if tree.rank is None else \
            torch.where(acc.path >= 0, tree.rank.gather(1, acc.path.clamp(min=0)), -1)
        confidence = None if tree.confidence is None else (tree.confidence * CONFIDENCE_SCALE).round().to(torch.int64)
        return StepOut(acc.emitted, accept_len, cache_len + accept_len, next_tree, scores, kept, path_rank,
                       confidence)

    def carried(self, tree: Tree, cache_len: torch.Tensor, active: torch.Tensor) -> StepOut:
        """``self(tree, cache_len, active)`` with its results written over its inputs, the static buffers of
        ``StaticStep``: the next tree into ``tree``'s tensors, the new lengths into ``cache_len``, each session
        tensor the step reassigned back into the one it replaced; returns those buffers. Compiled as one frame,
        the writes fuse into the kernels that produce them: made after the frame, each was a launch of its own
        (a CUDA graph's memcpy node: 8 a plain step, 12 the default's)."""
        before = [(owner, name, getattr(owner, name)) for owner, name in self.state_names]
        out = self(tree, cache_len, active)
        for owner, name, buffer in before:
            value = getattr(owner, name)
            if value is not buffer:
                buffer.copy_(value)
                setattr(owner, name, buffer)
        cache_len.copy_(out.cache_len)
        if out.next_tree is None:
            return _replaced(out, cache_len=cache_len)
        # a fixed topology (a chain, a static tree: Tree.from_spec) is the first tree's, already in the buffers:
        # only the tokens change, and the topology's kernels drop out of the compiled step
        for name in ("tokens",) if isinstance(self.spec, (Chain, StaticTree)) else TREE_TENSORS:
            buffer, value = getattr(tree, name), getattr(out.next_tree, name)
            if buffer is not None and value is not buffer:
                buffer.copy_(value)
        return _replaced(out, cache_len=cache_len, next_tree=tree)


def _replaced(out: StepOut, **fields) -> StepOut:
    """``out._replace(**fields)`` built field by field: dynamo of torch 2.11 cannot return the NamedTuple
    ``_replace`` makes inside a compiled frame (an object whose class it cannot source)."""
    return StepOut(*[fields.get(name, value) for name, value in zip(StepOut._fields, out)])
