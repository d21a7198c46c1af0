"""What a SpecModel checks about the model and draft it serves, every call: that they are still the ones
its graphs were captured from (``fingerprint``), that calls work inside or outside the caller's
``torch.inference_mode`` (``outside_inference_mode``), and that a draft serves one live target at a time
(``bound_elsewhere``, ``bind_to``)."""
from __future__ import annotations

import functools
import weakref

import torch

CHANGED_SINCE_COMPILE = (
    "the model's or the draft's parameters were moved or replaced, or its modules or forward hooks changed, since "
    "specgraph.compile (model.to(...), .half(), a new layer, a hook added or removed, ...): the captured graphs "
    "still run the old ones. Call specgraph.compile again after the change (after attach: specgraph.detach(model), "
    "then attach again)")
COPY_REFUSED = ("a SpecModel cannot be copied or pickled: its captured graphs and caches are tied to the model's "
                "storage. Copy the model (copy.deepcopy(model)) and specgraph.compile the copy")
# a draft module -> the SpecModel it was last compiled for: binding borrows that target's modules
_BOUND: "weakref.WeakKeyDictionary[torch.nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()


def _inert(hook) -> bool:
    """transformers' own output-capturing hook (installed for good the first time a call asks for hidden states
    or attentions): it records outputs only while a collector is active, so traces and graphs ignore it."""
    return getattr(hook, "__name__", "") == "output_capturing_hook" and \
        getattr(hook, "__module__", "") == "transformers.utils.output_capturing"


def forward_hooks(module: torch.nn.Module) -> tuple:
    """The handles of ``module``'s forward and forward-pre hooks that can change what it computes."""
    return tuple(k for hooks in (module._forward_hooks, module._forward_pre_hooks) for k, h in hooks.items()
                 if not _inert(h))


def bound_elsewhere(draft, model) -> list[str]:
    """Why ``draft`` cannot be compiled for ``model``: it serves another model's live SpecModel (its bind
    would point the draft's borrowed LM head and embedding, dtype and device at this model, breaking that one)."""
    owner = _BOUND.get(draft) if isinstance(draft, torch.nn.Module) else None
    other = owner() if owner is not None else None
    if other is None or other.model is model:
        return []
    return [f"draft={type(draft).__name__}: already compiled with another model (a live SpecModel), whose LM head, "
            f"embedding, dtype and device it shares; load a second copy of the draft for this model (e.g. "
            f"{type(draft).__name__}.from_pretrained(path) again)"]


def bind_to(draft, spec) -> None:
    """Record that ``draft`` now serves ``spec`` (until ``spec`` is gone)."""
    if isinstance(draft, torch.nn.Module):
        _BOUND[draft] = weakref.ref(spec)


def outside_inference_mode(method):
    """Run ``method`` with inference mode off: the caches and buffers a call makes outlive it, and a later
    call outside the caller's ``torch.inference_mode()`` writes them in place (inference tensors refuse it)."""
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        with torch.inference_mode(False):
            return method(*args, **kwargs)
    return wrapper


def fingerprint(*modules) -> tuple:
    """Where every parameter of ``modules`` lives (address, dtype), and what a trace of them ran: every
    submodule (identity), its forward hooks and a ``forward`` set on the instance: changes when a parameter
    is moved or replaced, a module swapped, a hook added or removed. (A walk of ``_modules``: twice as fast
    as ``parameters()`` alone, and it runs every call.)"""
    hooks = torch.nn.modules.module
    out = [tuple(hooks._global_forward_hooks), tuple(hooks._global_forward_pre_hooks)]

    def walk(module):
        out.append((id(module), forward_hooks(module), id(module.__dict__.get("forward"))))
        out.extend((p.data_ptr(), p.dtype) for p in module._parameters.values() if p is not None)
        for child in module._modules.values():
            if child is not None:
                walk(child)

    for m in modules:
        if isinstance(m, torch.nn.Module):
            walk(m)
    return tuple(out)
