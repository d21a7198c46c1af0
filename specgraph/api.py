"""specgraph.compile(): the one place that wires the layers together."""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import warnings
from dataclasses import dataclass, replace

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

from . import capture_cache, parallel
from .capture import TRACE_LOCK, Capture
from .errors import CompileError
from .spec_config import DEFAULT_CACHE_LEN, SpecConfig, cache_len_argument
from .drafts.base import Draft
from .drafts.layer import fuse_projections as fuse_draft_projections
from .drafts.plain import Plain
from .fast_paths import draft_fast_paths
from .generate_args import (generation_config, max_new_tokens, repetition_penalty, sampling_settings, setting,
                            stopping_criteria, strip_left_padding, token_ids, unsupported_arguments)
from .runtime.generate import AcceptanceStats, Sampling, speculative_generate, verify_rule
from .runtime.budget import CostPolicy, CostTable, budget_taus, confidence_taus, cost_key, mean_confidence
from .runtime.fast_start import FastStart
from .refusals import (BACKENDS, TYPICAL_DEFAULT, auto_backend, cache_memory_problems, draft_tree, fast_start_default,
                       fast_start_problems, model_problems, tree_blockers, verify_problems)
from .model_state import (CHANGED_SINCE_COMPILE, COPY_REFUSED, bind_to, bound_elsewhere, fingerprint,
                          outside_inference_mode)
from .runtime.policy import MeasuredPolicy
from .trees import Chain, DynamicTree, StaticTree, WithLookup

log = logging.getLogger("specgraph")
_PLAIN = Plain()  # plain decoding: trees of the root alone (Chain(0))
BUDGET_LADDER = (8, 16, 32)  # policy="cost": the node budgets of a DynamicTree it may run below the tree's own
CHAIN_LADDER = (2, 4, 8, 16, 32)  # policy="cost": the depths of a chain it may run below the chain's own


def model_device(model) -> torch.device:
    """Where the target's weights are (its first parameter's device)."""
    return next(model.parameters()).device


def resolve_backend(backend: str, model) -> str:
    """``"auto"``: the compiled whole-step graph (``"inductor"``) when the model is on CUDA, ``"eager"``
    elsewhere (on a CPU compiling costs more than it saves); any other name as given."""
    if backend != "auto":
        return backend
    on_cuda = model_device(model).type == "cuda"
    chosen = auto_backend(on_cuda)
    log.info("backend 'auto' -> %r%s", chosen, " (each batch size's first generate compiles its "
             "step once, about a minute)" if on_cuda else " (the model is not on CUDA)")
    return chosen


def compile(model, draft, tree=None, backend: str = "auto", max_batch: int = 1,
            max_cache_len: int = DEFAULT_CACHE_LEN, synthetic_accept: int | None = None, policy: str = "fixed",
            verify: str = "exact", typical: tuple[float, float] | None = None, tp=None, *,
            fast_start: bool | None = None, max_length: int | None = None) -> "SpecModel":
    """Make ``model`` (a transformers causal LM) speculate with ``draft``.

    ``max_cache_len``: KV cache slots per row (prompt + max_new_tokens + tree nodes must fit);
    ``max_length=`` is its old spelling (a FutureWarning; it goes after 0.1).

    ``tree=None``: the draft's own default for the model's device and batch size
    (``Draft.default_tree``): for EAGLE-3 on one CUDA row, ``WithLookup(DynamicTree(3, 8, 32), 16,
    shared=True)``, the measured best (without PDL the 16-row one); otherwise ``Chain(4)``. With ``max_batch > 1`` (and
    ``policy="fixed"``) one-row calls still take the one-row default (``SpecConfig.tree_for``; logged on the
    ``specgraph`` logger).

    ``backend``: ``"auto"`` (default: ``"inductor"`` on CUDA — the whole decode step one compiled
    graph, replayed as a CUDA graph — and ``"eager"`` elsewhere), ``"eager"``, ``"inductor"`` or
    ``"cudagraphs"``: the same whole step over static buffers recorded as a CUDA graph without compiling
    it (no inductor: the first token in seconds, each step the eager kernels replayed; on a CPU it runs
    that static step op by op).

    ``draft=None``: plain decoding on the same engine (one node, the root, per step): the baseline.
    ``synthetic_accept=k``: FOR BENCHMARKS ONLY, output is NOT the target's: every step accepts k nodes
    down the tree's first-child chain (as SGLang's simulated acceptance), to time the engine at a given τ
    without a trained head (under a policy each mode as deep as it reaches). Greedy only; warns per call.
    ``policy="cost"``: per call, generate runs the tree, a chain as deep, a DynamicTree's smaller node
    budgets (BUDGET_LADDER), a chain's shallower depths (CHAIN_LADDER) or plain decoding, whichever is
    expected to give the most tokens per second: τ from the latest calls (a smaller budget's from a larger
    one's steps, a never-run one's predicted by the draft's confidence) over the step cost measured once per
    device, model, draft and batch size, kept on disk (``runtime/budget.py``; lossless). ``"measured"``: the
    same modes chosen by trial, each call timed whole (``runtime/policy.py``). Either way speculation that
    loses (a large batch, a CPU) shrinks or switches itself off. ``"fixed"`` (default): the tree.
    ``verify="exact"`` (default); ``"typical"``: LOSSY, opt-in — when sampling, Medusa's typical acceptance
    (a draft is kept iff the target gives it probability > min(threshold, alpha * exp(-entropy))) replaces
    exact rejection sampling, so the output is NOT distributed as the target's; greedy stays token-exact.
    ``typical=(posterior_threshold, posterior_alpha)``, default (0.09, 0.3) as Medusa's; warns here.
    ``tp=True`` (or a ``torch.distributed.ProcessGroup``): tensor parallelism. Every rank of a
    ``torchrun`` launch calls compile with the same full model and draft; the target's attention
    heads, KV heads and MLP are sharded over the group (in place; specgraph/parallel.py), the draft
    and LM head stay whole on every rank, and every rank returns the same tokens; sampling is seeded
    (``seed=``, the same on every rank, or one drawn on rank 0 and broadcast once per call).
    ``fast_start`` (None: on with backend "auto" on CUDA, policy "fixed", the capture cache on; True needs
    backend "inductor" or "auto" on CUDA, and no policy "measured"): a batch
    size's calls run uncompiled (the static step recorded as CUDA graphs, as ``backend="cudagraphs"``) while a
    background thread compiles it with inductor (under policy "cost" every mode's step, the policy learning τ
    from uncompiled calls and costs from compiled ones); the first call after that runs compiled
    (``runtime/fast_start.py``; ``SpecModel.wait_compiled``). Same tokens either way; unseeded sampled
    calls meanwhile stay exact in distribution but share the global RNG with the background warm-up (for
    reproducible samples pass ``seed=`` to generate, or ``fast_start=False``). It costs a second KV cache
    (the uncompiled step's own) until everything it served runs compiled. Where the worker must capture a
    bucket itself (``fast_start=True`` with the capture cache off, or policy "cost"), torch.export runs in
    it: until ``wait_compiled()``, run no module of the model eagerly in another thread.
    Everything that cannot be supported is refused here, all blockers at once.
    """
    max_cache_len = cache_len_argument(max_cache_len, max_length, "specgraph.compile")
    blockers = model_problems(model)
    if blockers:  # nothing else can be checked against it
        raise CompileError(f"cannot compile {type(model).__name__}", blockers)
    if isinstance(tree, str):  # a command-line spelling: "chain4", "dynamic:8,8,64", "eagle1", "medusa"
        from .trees import parse_tree

        try:
            tree = parse_tree(tree)
        except ValueError as err:
            hint = "" if "expected" in str(err) else "; spellings: chainK, dynamic:STEPS,TOPK,NODES, eagle1, medusa"
            blockers.append(f"tree={tree!r}: {err}{hint}")
            tree = None
    elif tree is not None and not isinstance(tree, (Chain, StaticTree, DynamicTree, WithLookup)):
        blockers.append(f"tree={tree!r}: a specgraph.Chain, StaticTree, DynamicTree or WithLookup (or a spelling like "
                        f"'chain4')")
        tree = None
    if isinstance(draft, type):  # nothing else can be checked against a class
        loader = f" or {draft.__name__}.from_pretrained(path)" if hasattr(draft, "from_pretrained") else ""
        blockers.append(f"draft={draft.__name__} is a class: pass an instance, e.g. {draft.__name__}(){loader}")
        raise CompileError(f"cannot compile {type(model).__name__} with {draft.__name__}", blockers)
    if draft is None:
        if tree is not None and tree != Chain(0):
            blockers.append(f"tree={tree} with draft=None: plain decoding verifies the root only; pass tree=None")
        draft, tree = _PLAIN, Chain(0)
    if backend not in BACKENDS:
        blockers.append(f"backend={backend!r}: available now: {', '.join(BACKENDS)}")
    if not isinstance(draft, Draft):  # nothing else can be checked against it
        blockers.append(f"draft={type(draft).__name__}: not a specgraph draft (see specgraph.drafts; a new kind "
                        f"implements specgraph.drafts.base.Draft)")
        raise CompileError(f"cannot compile {type(model).__name__} with {type(draft).__name__}", blockers)
    one_row_tree = None
    if tree is None:
        device = model_device(model)
        tree = draft.default_tree(device, max_batch if isinstance(max_batch, int) else 1)
        if policy == "fixed" and synthetic_accept is None and isinstance(max_batch, int) and max_batch > 1:
            one_row_tree = draft.default_tree(device, 1)  # the policies' modes all derive from one tree
            if one_row_tree == tree or tree_blockers(model, draft, one_row_tree, max_cache_len):
                one_row_tree = None  # a default the user did not ask for is dropped, never a refusal
        log.info("tree=None -> %s (%s's default on %s, max_batch=%s)%s", tree, type(draft).__name__, device.type,
                 max_batch, f"; one-row calls: {one_row_tree}" if one_row_tree is not None else "")
    blockers += tree_blockers(model, draft, tree, max_cache_len)
    blockers += cache_memory_problems(model, max_cache_len, max_batch)
    blockers += bound_elsewhere(draft, model)
    blockers += draft.bind(model)
    if synthetic_accept is not None and (not isinstance(synthetic_accept, int) or isinstance(synthetic_accept, bool) or
                                         not 1 <= synthetic_accept <= tree.max_depth + 1):
        blockers.append(f"synthetic_accept={synthetic_accept!r}: an int in 1 .. tree depth + 1 = {tree.max_depth + 1}")
    if policy not in ("fixed", "measured", "cost"):
        blockers.append(f"policy={policy!r}: 'fixed' (always the tree), 'cost' or 'measured' (the tree, a chain "
                        f"as deep, or plain decoding, whichever is faster)")
    blockers += verify_problems(verify, typical, synthetic_accept)
    if not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch < 1:
        blockers.append(f"max_batch={max_batch!r}: an int >= 1")
    tp, tp_blockers = parallel.resolve(tp)
    blockers += tp_blockers
    if fast_start is None:
        fast_start = fast_start_default(backend, model_device(model).type == "cuda", policy, tp,
                                        capture_cache.enabled(None, tp, model))
    elif fast_start is not False:
        blockers += fast_start_problems(fast_start, backend, model_device(model).type == "cuda", policy, tp)
    if tp is not None:
        blockers += parallel.shard_problems(model, tp, policy, draft)
        if verify != "exact":
            blockers.append(f"verify={verify!r} with tp: the ranks sample alike only through seeded exact "
                            f"verification; use verify='exact'")
    elif not tp_blockers and parallel.sharded(model) is not None:
        blockers.append(f"tp={tp!r}: the model was sharded over {parallel.sharded(model).world_size} ranks by an "
                        f"earlier compile or parallel.shard; pass tp=True (or its group) again")
    if blockers:
        raise CompileError(f"cannot compile {type(model).__name__} with {type(draft).__name__}", blockers)
    if tp is not None:  # a collective (weights compared across ranks): every rank gets here, or every rank refused
        parallel.shard(model, tp.group, policy, draft)
    model.config._attn_implementation = "sdpa"
    backend = resolve_backend(backend, model)
    if verify == "typical":
        typical = tuple(map(float, typical if typical is not None else TYPICAL_DEFAULT))
        warnings.warn(f"verify='typical' (posterior_threshold, posterior_alpha = {typical}) is LOSSY: sampled output "
                      f"is not distributed as the target's (greedy stays exact); verify='exact' is lossless",
                      stacklevel=2)
    spec = SpecModel(model, draft, SpecConfig(tree, backend, max_batch, max_cache_len, synthetic_accept, policy,
                                              verify, typical, one_row_tree, fast_start))
    if draft is not _PLAIN:
        bind_to(draft, spec)
    return spec


@dataclass
class SpecGenerateOutput(GenerateDecoderOnlyOutput):
    """What ``generate(..., return_dict_in_generate=True)`` returns: transformers' output
    (``out.sequences``, ``out["sequences"]``; ``scores`` / ``logits`` with ``output_scores`` /
    ``output_logits``) plus ``accept_lens`` [steps][B] and ``acceptance`` (``AcceptanceStats``: tau,
    per-position rates)."""

    accept_lens: list | None = None
    acceptance: AcceptanceStats | None = None


class SpecModel:
    """The speculating model. ``generate`` takes ``model.generate``'s arguments: greedy is token-exact,
    sampling exact in distribution (unless compiled with the lossy ``verify="typical"``)."""

    def __deepcopy__(self, memo=None):
        raise TypeError(COPY_REFUSED)

    __reduce__ = __reduce_ex__ = __deepcopy__

    def __init__(self, model, draft, config: SpecConfig):
        self.model, self.draft, self.config = model, draft, config
        # inductor: the prefill buckets compile on their own; the decode step compiles whole (runtime/step.py)
        self.capture = Capture.shared(model, config.max_cache_len, config.backend)  # reused across compiles
        self.fast_start = None if not config.fast_start else FastStart(  # its own Capture: let go when compiled
            lambda: Capture(model, config.max_cache_len, backend="cudagraphs"), self.capture)
        fuse_draft_projections(draft, "fuse_projections" in draft_fast_paths())  # a fast path, on by default
        self._fingerprint = fingerprint(model, draft)  # the captured graphs (and CUDA graphs) hold these addresses
        # what generate may run per call: the tree; with a policy also a chain as deep as the
        # tree (a smaller tree: at a large batch it can win where the tree loses) and plain decoding
        self.modes = {"tree": (draft, config.tree)}
        own = draft_tree(config.tree)  # the draft's own tree (a WithLookup's lookup branch set aside)
        if config.policy != "fixed":
            chain = Chain(own.max_depth)
            if config.tree != chain and not draft.tree_problems(chain):
                self.modes["chain"] = (draft, chain)
            if config.policy == "cost" and isinstance(own, DynamicTree):
                for nodes in BUDGET_LADDER:  # the same drafting, fewer nodes kept (and the lookup branch, if any)
                    if nodes < own.nodes:
                        smaller = DynamicTree(own.steps, own.topk, nodes)
                        self.modes[f"tree{nodes}"] = (draft, config.tree.with_tree(smaller)
                                                      if isinstance(config.tree, WithLookup) else smaller)
            if config.policy == "cost" and isinstance(config.tree, Chain):  # the same proposal, cut shorter
                for depth in CHAIN_LADDER:
                    if depth < config.tree.depth:
                        self.modes[f"chain{depth}"] = (draft, Chain(depth))
            self.modes["plain"] = (_PLAIN, Chain(0))
        self.policy = None
        if config.policy == "measured":
            self.policy = MeasuredPolicy(modes=tuple(self.modes))
        elif config.policy == "cost":  # the step costs are shared by every process on this machine
            from .models import cache_root

            table = CostTable(cache_root() / "step-costs.json", cost_key(model, draft, config.backend, config.tree))
            # chains: τ predicted from the tree's per-depth acceptance until they run; the tree's budgets: observed
            depths = {"chain": own.max_depth, "plain": 0, **{f"chain{d}": d for d in CHAIN_LADDER}}
            budgets = {m: draft_tree(tree).nodes for m, (_, tree) in self.modes.items()
                       if isinstance(draft_tree(tree), DynamicTree)}
            deepest = {m: 1 + max(self.mode(m, b)[1].max_depth for b in {1, config.max_batch}) for m in self.modes}
            self.policy = CostPolicy({m: depths.get(m) for m in self.modes}, table, budgets, deepest)
        self.last_stats: AcceptanceStats | None = None  # of the latest generate call (τ, per-position rates)
        self._choosing = threading.Lock()  # the policy's state (a call's capture lock may be held by a compile)
        self._compiled: set = set()  # bucket keys (_bucket_warmup) whose first call on self.capture has run

    def _moved(self) -> bool:
        """A parameter moved or replaced since compile? Not read while another thread traces (export swaps fakes in)."""
        if not TRACE_LOCK.acquire(blocking=False):
            return False
        try:
            return fingerprint(self.model, self.draft) != self._fingerprint
        finally:
            TRACE_LOCK.release()

    def mode(self, name: str, batch: int) -> tuple:
        """(draft, tree) that mode ``name`` runs for a call of ``batch`` rows (the tree mode: ``tree_for``)."""
        draft, tree = self.modes[name]
        return (draft, self.config.tree_for(batch)) if name == "tree" else (draft, tree)

    @outside_inference_mode
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs):
        """``model.generate`` for decoder-only models, speculating. input_ids / attention_mask
        ``[B, T]`` (left padding; B <= max_batch); ``max_new_tokens`` / ``max_length``,
        ``eos_token_id``, ``pad_token_id``, ``do_sample`` + ``temperature`` / ``top_k`` / ``top_p`` /
        ``min_p``, ``repetition_penalty``, ``generation_config``, ``stopping_criteria``, ``streamer``
        (batch 1); specgraph's own ``seed`` (an int, with do_sample: the tokens plain sampling with that
        seed emits, any draft or tree, kernels/gumbel.py). Returns ``[B, T + new]`` (rows that stop early
        are padded with ``pad_token_id``), or
        with ``return_dict_in_generate`` a ``GenerateDecoderOnlyOutput`` with ``sequences``, ``scores`` /
        ``logits`` (with ``output_scores`` / ``output_logits``) and ``accept_lens`` (per step, per row:
        tokens committed). Any other setting that would change the output raises TypeError."""
        if self._moved():
            raise RuntimeError(CHANGED_SINCE_COMPILE)
        gen = generation_config(self.model, kwargs.get("generation_config"))  # unset fields: the model's
        unknown = unsupported_arguments(kwargs, gen)
        if unknown:
            raise TypeError(f"SpecModel.generate does not support {unknown} yet; they would change the result, "
                            f"so they are refused rather than ignored")
        sampling = sampling_settings(kwargs, gen)
        if sampling is not None and sampling.seed is not None and self.config.verify == "typical":
            raise ValueError(f"seed={sampling.seed} with verify='typical': seeded sampling is exact (the tokens plain "
                             f"sampling with that seed emits); compile with verify='exact' to use it, or drop seed")
        if sampling is not None and parallel.sharded(self.model) is not None:  # every rank draws alike: seeded
            sampling = replace(sampling, seed=parallel.call_seed(parallel.sharded(self.model), sampling.seed))
        if sampling is not None and self.config.verify == "typical":  # lossy, opted in at compile
            sampling = replace(sampling, typical=self.config.typical)
        penalty = repetition_penalty(kwargs, gen)
        as_dict = setting(kwargs, gen, "return_dict_in_generate")
        # scores / logits only come back in a dict (as in model.generate): only then are they gathered
        keep = tuple(bool(as_dict and setting(kwargs, gen, name)) for name in ("output_scores", "output_logits"))
        if not torch.is_tensor(input_ids) or input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or \
                input_ids.dtype == torch.bool or input_ids.is_meta:
            raise TypeError(f"input_ids: a [B, T] tensor of integer token ids (e.g. tokenizer(..., return_tensors='pt')"
                            f".input_ids); got {type(input_ids).__name__}"
                            f"{'' if not torch.is_tensor(input_ids) else ' of ' + str(input_ids.dtype)}")
        if input_ids.dim() != 2 or input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids must be [B, T] with B >= 1 rows of T >= 1 tokens; got {tuple(input_ids.shape)}")
        vocab = self.model.config.get_text_config().vocab_size
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab):
            raise ValueError(f"input_ids hold ids outside the vocabulary 0 .. {vocab - 1} "
                             f"(min {int(input_ids.min())}, max {int(input_ids.max())})")
        if attention_mask is not None and not torch.is_tensor(attention_mask):
            raise TypeError(f"attention_mask: a [B, T] tensor of 0/1 like input_ids (the tokenizer's, with "
                            f"return_tensors='pt'); got {type(attention_mask).__name__}")
        input_ids = input_ids.long()  # the output is int64 whatever the prompt's integer type, as in model.generate
        b, t = input_ids.shape
        if b > self.config.max_batch:
            raise ValueError(f"batch of {b} rows > max_batch={self.config.max_batch} given to specgraph.compile")
        eos_list = token_ids(kwargs.get("eos_token_id", gen.eos_token_id), "eos_token_id")
        given_pad = token_ids(kwargs.get("pad_token_id", gen.pad_token_id), "pad_token_id")
        if len(given_pad) > 1:
            raise ValueError(f"pad_token_id={given_pad}: one token id")
        if attention_mask is None and given_pad and given_pad[0] not in eos_list:
            inferred = input_ids.ne(given_pad[0]).long()  # model.generate infers the mask from the pad id too
            leading = inferred.cummax(1).values  # each row's leading pad ids: left padding
            if not bool(leading.all()):
                attention_mask = leading
            inside = [r for r in range(b) if bool((leading[r] > inferred[r]).any())]
            if inside:  # model.generate would mask them; here they are tokens (the engine pads on the left only)
                warnings.warn(f"input_ids rows {inside} hold pad_token_id={given_pad[0]} inside the prompt: "
                              f"model.generate would mask those positions (its attention_mask inferred from the pad "
                              f"id), here they are read as tokens; pass attention_mask to say which are padding",
                              stacklevel=3)
        if attention_mask is not None and attention_mask.shape == input_ids.shape:
            attention_mask = attention_mask.ne(0).long()  # any nonzero attends, as in model.generate
        prompts = strip_left_padding(input_ids, attention_mask)
        max_new = max_new_tokens(kwargs, gen, t, getattr(self.model.config, "max_position_embeddings", None))
        eos = set(eos_list)
        pad = given_pad[0] if given_pad else eos_list[0] if eos_list else 0  # model.generate pads with eos[0]
        n = self.config.tree_for(b).num_nodes
        too_long = [i for i, p in enumerate(prompts) if len(p) + max_new + n > self.config.max_cache_len]
        if too_long:
            raise ValueError(f"rows {too_long}: prompt + max_new_tokens ({max_new}) + tree ({n} nodes) exceeds "
                             f"max_cache_len={self.config.max_cache_len} given to specgraph.compile; raise it there")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("a row of input_ids is all padding (attention_mask has no 1)")
        streamer = kwargs.get("streamer")
        if streamer is not None and not all(callable(getattr(streamer, m, None)) for m in ("put", "end")):
            raise TypeError(f"streamer={streamer!r}: a transformers streamer (put(tokens) and end()), "
                            f"e.g. TextStreamer")
        if streamer is not None:
            if b != 1:
                raise ValueError("streamer: only batch size 1 can be streamed (as in model.generate)")
            streamer.put(input_ids.cpu())  # the prompt first, as model.generate does (TextStreamer may skip it)
        if self.config.synthetic_accept is not None:
            if sampling is not None:
                raise ValueError("synthetic_accept (benchmarks only) is greedy only: pass do_sample=False")
            warnings.warn(f"synthetic_accept={self.config.synthetic_accept}: acceptance is forced for benchmarking; "
                          f"the output is NOT the model's", stacklevel=2)
        stopping = stopping_criteria(kwargs, gen)
        with self._choosing:
            mode = self.policy.choose(b) if self.policy else "tree"
        capture, guard = self.capture, contextlib.nullcontext()
        key = self._bucket_key(b, mode, sampling, penalty, keep)
        if self.fast_start is not None:  # uncompiled until the bucket's background compile is done
            capture = self.fast_start.serving(key)
            if capture is not self.capture:
                guard = self.fast_start.guard(key)
        elif self.capture.backend == "inductor" and key not in self._compiled:
            guard = TRACE_LOCK  # a bucket's first call compiles: not beside another thread's compile or trace
        with capture.lock, guard:  # SpecModels of one model share its caches: one call at a time
            draft, tree = self.mode(mode, b)
            start = time.perf_counter()
            result = speculative_generate(capture, draft, tree, prompts, max_new, eos,
                                          self.config.max_cache_len, sampling, stopping, streamer,
                                          synthetic_accept=self.config.synthetic_accept, pad_token_id=pad,
                                          padding=[row[: t - len(p)] for row, p in zip(input_ids.tolist(), prompts)],
                                          penalty=penalty, keep=keep, time_steps=isinstance(self.policy, CostPolicy))
            seconds = time.perf_counter() - start  # every row's tokens were read back: the device work is done
            self.last_stats = AcceptanceStats.of(result, tree.max_depth)
        compiled = capture is self.capture  # an uncompiled call's τ counts, its time does not
        if compiled:
            self._compiled.add(key)
        with self._choosing:  # (no steps: every row ended at its first token, the prefill's; nothing to learn)
            if isinstance(self.policy, MeasuredPolicy) and result.accept_lens:
                self.policy.record(b, mode, seconds, sum(map(len, result.sequences)))  # (never uncompiled)
            elif self.policy and result.accept_lens:
                tau, running = self.last_stats.tau, getattr(draft_tree(tree), "nodes", 0)
                budgets = set(self.policy.budgets.values()) if running else set()
                figures = budget_taus(result.accepted_ranks, result.accept_lens, tau, [n for n in budgets if n < running])
                figures.update(confidence_taus(result.confidence, result.accept_lens, tau, running,
                                               [n for n in budgets if n > running]))
                self.policy.record(b, mode, result.decode_seconds if compiled else None,  # the steps' time
                                   len(result.accept_lens), tau, self.last_stats.position_rate, figures,
                                   mean_confidence(result.confidence, result.accept_lens))
        if not compiled:  # served uncompiled: compiled in the background from now (every mode the policy may run)
            for other in [mode] + [m for m in self.modes if m != mode]:
                self.fast_start.after_call(*self._bucket_warmup(b, other, sampling, penalty, keep),
                                           record_fast=other == mode)
        width = max(len(g) for g in result.sequences)
        new = torch.full((b, width), pad, dtype=input_ids.dtype, device=input_ids.device)
        for row, tokens in enumerate(result.sequences):
            new[row, : len(tokens)] = torch.tensor(tokens, dtype=input_ids.dtype)
        sequences = torch.cat([input_ids, new], 1)
        if as_dict:
            return SpecGenerateOutput(sequences=sequences, scores=result.scores, logits=result.logits,
                                      accept_lens=result.accept_lens, acceptance=self.last_stats)
        return sequences

    def _bucket_key(self, b: int, mode: str, sampling: Sampling | None, penalty, keep) -> tuple:
        """A fast start's (and the first-call lock's) name for the compiled bucket a call of ``mode`` needs, as
        ``decode_step`` keys it."""
        return (b, mode, repr(self.mode(mode, b)[1]), verify_rule(sampling), penalty is None, keep)

    def _bucket_warmup(self, b: int, mode: str, sampling: Sampling | None, penalty, keep) -> tuple:
        """(``_bucket_key``, warm): ``warm(capture)`` is the short call that compiles the bucket on ``capture``
        and records its graphs."""
        draft, tree = self.mode(mode, b)
        return self._bucket_key(b, mode, sampling, penalty, keep), lambda capture: speculative_generate(
            capture, draft, tree, [[1] * 8] * b, 2 * (tree.max_depth + 1) + 1, set(), self.config.max_cache_len,
            sampling, synthetic_accept=self.config.synthetic_accept, penalty=penalty, keep=keep)

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """With ``fast_start``: block until the background compiles queued so far are done (True) or
        ``timeout`` seconds passed (False). Without it: True at once."""
        return True if self.fast_start is None else self.fast_start.wait(timeout)

    @outside_inference_mode
    def warmup(self, batch_sizes=(1,), sampling: bool = False) -> dict:
        """Compile now what ``generate`` would compile on first use: every mode ``generate`` may run
        (the tree; with a policy, the chain and plain decoding too), greedy (and sampled with
        ``sampling=True``), at each of ``batch_sizes``. Under ``policy="cost"`` it also times each
        mode's step where the cost table lacks it. Prompts of other lengths may still compile their
        prefill. Returns {(batch, mode): seconds of its first call}."""
        if not isinstance(sampling, bool):
            raise TypeError(f"sampling={sampling!r}: True (also compile the sampled step) or False")
        if not isinstance(batch_sizes, (list, tuple, range)):
            raise TypeError(f"batch_sizes={batch_sizes!r}: a list or tuple of batch sizes, e.g. (1,) or [1, 4]")
        bad = [b for b in batch_sizes if not isinstance(b, int) or isinstance(b, bool) or
               not 1 <= b <= self.config.max_batch]
        if bad or not batch_sizes:
            raise ValueError(f"batch_sizes={list(batch_sizes)}: ints in 1 .. max_batch={self.config.max_batch}")
        if sampling and self.config.synthetic_accept is not None:
            raise ValueError("sampling=True with synthetic_accept (benchmarks only, greedy only): pass sampling=False")
        typical = self.config.typical if self.config.verify == "typical" else None
        samplings = [None] + ([replace(sampling_settings({"do_sample": True}, generation_config(self.model, None)),
                                       typical=typical)] if sampling else [])  # a plain do_sample call's warpers

        def timed_step(draft, tree, b) -> float:  # seconds per step of a 16-token call
            result = speculative_generate(self.capture, draft, tree, [[1] * 8] * b, 16, set(),
                                          self.config.max_cache_len, synthetic_accept=self.config.synthetic_accept,
                                          time_steps=True)
            return result.decode_seconds / max(len(result.accept_lens), 1)

        first = {}
        # it compiles: not beside another thread's compile or trace (TRACE_LOCK, taken after a call's locks)
        with self.capture.lock, TRACE_LOCK, self._choosing:  # (the policy's state: generate chooses under it alone)
            for b in batch_sizes:
                for mode in self.modes:
                    for s in samplings:  # the bucket compiled and its CUDA graphs recorded before the timing
                        key, warm = self._bucket_warmup(b, mode, s, None, (False, False))
                        start = time.perf_counter()
                        warm(self.capture)
                        first.setdefault((b, mode), time.perf_counter() - start)
                        self._compiled.add(key)
                        if self.fast_start is not None:  # compiled now: calls need not wait for the background
                            self.fast_start.mark_ready(key)
                    if isinstance(self.policy, CostPolicy) and self.policy.table.get(b, mode) is None:
                        # the faster of two: a one-off (a late compile, a cache write) lands in one of them
                        self.policy.table.put(b, mode, min(timed_step(*self.mode(mode, b), b) for _ in range(2)))
                    if self.policy is not None:  # compiled now: the policy's next call of it is a measurement
                        self.policy.calls[b, mode] = max(self.policy.calls.get((b, mode), 0), 1)
        log.info("warmed up %s", ", ".join(f"batch {b} {m}: {s:.1f} s" for (b, m), s in first.items()))
        return first

    @outside_inference_mode
    def export(self, path, format: str = "onnx", batch: int = 1):
        """Write the (``batch``, tree nodes) bucket's verify step with explicit KV caches (export.py): ``format``
        "onnx" (opset 20, standard ops only) or "tensorrt" (needs torch-tensorrt). Returns the written path."""
        from .export import export_onnx, export_tensorrt

        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path={path!r}: the file to write (a str or pathlib.Path)")
        exporters = {"onnx": export_onnx, "tensorrt": export_tensorrt}
        if parallel.sharded(self.model) is not None:
            raise ValueError("export of a tensor-parallel target (compile(tp=...)): the exported graph would hold one "
                             "rank's shard and its collectives; compile without tp to export")
        if format not in exporters:
            raise ValueError(f"format={format!r}: one of {sorted(exporters)}")
        if not isinstance(batch, int) or isinstance(batch, bool) or not 1 <= batch <= self.config.max_batch:
            raise ValueError(f"batch={batch!r}: an int in 1 .. max_batch={self.config.max_batch}")
        with self.capture.lock, TRACE_LOCK:  # it traces: not beside a call on this Capture or a background compile
            return exporters[format](self.capture, self.config.tree_for(batch), path, batch)
