"""What ``specgraph.compile`` refuses, argument by argument: each function returns its blockers (empty: none),
so compile can list them all at once."""
from __future__ import annotations

import math
import os

import torch

from .capture import TargetInfo
from .drafts.ngram import NGram
from .errors import CompileError
from .trees import Chain, DynamicTree, StaticTree, WithLookup

BACKENDS = ("auto", "eager", "inductor", "cudagraphs")  # "tensorrt" arrives with the compiled-backends issue
VERIFY = ("exact", "typical")  # "typical": Medusa's typical acceptance, LOSSY when sampling
TYPICAL_DEFAULT = (0.09, 0.3)  # (posterior_threshold, posterior_alpha): FasterDecoding/Medusa medusa_generate


def auto_backend(on_cuda: bool) -> str:
    """What backend "auto" means: the compiled whole step on CUDA, eager elsewhere (compiling costs more
    than it saves on a CPU)."""
    return "inductor" if on_cuda else "eager"


def fast_start_default(backend, on_cuda: bool, policy, tp, capture_cache_on: bool) -> bool:
    """``fast_start=None``: on where specgraph picks the backend and it picks inductor (``"auto"`` on
    CUDA), with policy "fixed" and the capture cache on: then the background worker loads each bucket's
    captured graph from the cache (the serving thread captured it first) and never runs torch.export,
    which swaps fake tensors into the model's modules and hooks every thread's module calls while it
    traces (runtime/fast_start.py). Off where the user named a backend, a policy or tp."""
    return backend == "auto" and on_cuda and policy == "fixed" and tp is None and capture_cache_on


def fast_start_problems(fast_start, backend, on_cuda: bool, policy, tp) -> list[str]:
    """What keeps ``fast_start`` from running (empty: nothing)."""
    if not isinstance(fast_start, bool):
        return [f"fast_start={fast_start!r}: True, False, or None (on with backend 'auto' on CUDA)"]
    problems = []
    if (backend if backend != "auto" else auto_backend(on_cuda)) != "inductor":
        problems.append(f"fast_start=True with backend={backend!r}: it serves uncompiled while inductor compiles; "
                        f"pass backend='inductor' (or 'auto' with the model on CUDA)")
    if policy == "measured":
        problems.append("fast_start=True with policy='measured': it times whole calls, and the first ones would run "
                        "uncompiled; use policy='cost' (it learns τ from uncompiled calls and costs from compiled "
                        "ones) or 'fixed'")
    if tp is not None:
        problems.append("fast_start=True with tp: the ranks would switch to their compiled step at different calls")
    return problems


def model_problems(model) -> list[str]:
    """Why ``model`` cannot be captured at all (empty: it can): not a transformers model, weights not loaded
    (meta tensors) or made under ``torch.inference_mode()`` (torch.export cannot trace them)."""
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        hint = " (a hub id? load it first: AutoModelForCausalLM.from_pretrained(id))" if isinstance(model, str) else ""
        return [f"model={type(model).__name__}: a transformers causal LM module, e.g. "
                f"AutoModelForCausalLM.from_pretrained(...){hint}"]
    tensors = [*model.parameters(), *model.buffers()]
    problems = []
    if any(t.is_meta for t in tensors):
        problems.append("the model's weights are not loaded (meta tensors): load them (from_pretrained without "
                        "a meta-device init, or model.to_empty(...) then load_state_dict) before compile")
    if any(t.is_inference() for t in tensors):
        problems.append("the model's weights were made under torch.inference_mode() (inference tensors cannot be "
                        "traced): create or load the model outside it (torch.inference_mode around generate is fine)")
    return problems


def cache_memory_problems(model, max_cache_len, max_batch) -> list[str]:
    """A KV cache (``max_batch`` rows of ``max_cache_len`` slots) larger than the device's memory: refused
    before any work, naming the argument."""
    if not isinstance(max_cache_len, int) or not isinstance(max_batch, int) or max_batch < 1:
        return []  # refused by name elsewhere
    try:
        info = TargetInfo.from_model(model)
    except CompileError:
        return []  # the model's own refusal says why
    elem = torch.empty((), dtype=info.dtype).element_size()
    need = 2 * info.num_layers * info.num_kv_heads * info.head_dim * elem * max_cache_len * max_batch
    device = next(model.parameters()).device
    if device.type == "cuda":
        have = torch.cuda.get_device_properties(device).total_memory
    else:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else None
    if have is None or need <= have:
        return []
    return [f"max_cache_len={max_cache_len} with max_batch={max_batch}: the KV cache alone needs "
            f"{need / 2**30:,.1f} GiB, more than the {device.type} device's {have / 2**30:,.1f} GiB; lower them"]


def tree_blockers(model, draft, tree, max_cache_len) -> list[str]:
    """Why ``tree`` cannot run (empty: it can): the draft cannot fill it, the cache cannot hold it, or a
    sliding window of ``model`` is narrower (or the model itself is refused)."""
    blockers = []
    if isinstance(draft, NGram) and not isinstance(tree, Chain):
        blockers.append(f"tree={tree}: an NGram draft proposes one continuation; use tree=specgraph.Chain(k)")
    drafted = draft_tree(tree)
    blockers += draft.tree_problems(drafted)
    if not isinstance(max_cache_len, int) or max_cache_len <= tree.num_nodes:
        blockers.append(f"max_cache_len={max_cache_len!r}: an int larger than the tree ({tree.num_nodes} nodes)")
    try:
        info = TargetInfo.from_model(model)
    except CompileError as err:
        return blockers + err.blockers
    blockers += [f"layer {i}: sliding window {w} <= tree of {tree.num_nodes} nodes; use a smaller tree"
                 for i, w in info.narrow_windows(tree.num_nodes)]
    widest = drafted.topk if isinstance(drafted, (StaticTree, DynamicTree)) else 1
    ranked = draft.ranked_vocab_size(info.vocab_size)
    if widest > ranked:
        blockers.append(f"tree={tree}: a node's children are the draft's top {widest}, more than the {ranked} tokens "
                        f"it ranks among (its vocabulary); lower topk (a StaticTree's sibling ranks)")
    return blockers


def draft_tree(tree):
    """The part of ``tree`` the draft proposes: a WithLookup's own tree, else the tree itself."""
    return tree.tree if isinstance(tree, WithLookup) else tree


def verify_problems(verify, typical, synthetic_accept) -> list[str]:
    """What is wrong with compile's ``verify`` / ``typical`` (empty: nothing)."""
    if verify not in VERIFY:
        return [f"verify={verify!r}: 'exact' (lossless, the default) or 'typical' (Medusa's typical "
                f"acceptance when sampling: LOSSY, opt-in)"]
    if verify == "exact":
        return [] if typical is None else [f"typical={typical!r} has no effect with verify='exact': pass "
                                           f"verify='typical' as well to opt in to lossy typical acceptance"]
    problems = [] if synthetic_accept is None else ["verify='typical' with synthetic_accept: forced acceptance "
                                                    "(greedy) has no typical rule; drop one of them"]
    if typical is not None:
        ok = isinstance(typical, (tuple, list)) and len(typical) == 2 and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in typical)
        if not ok or not 0 <= typical[0] <= 1 or typical[1] < 0:
            problems.append(f"typical={typical!r}: (posterior_threshold in [0, 1], posterior_alpha >= 0), e.g. "
                            f"Medusa's {TYPICAL_DEFAULT}")
    return problems
