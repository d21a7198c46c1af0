"""The HF drop-in: after ``specgraph.attach(model, draft)`` the user's unchanged
``model.generate(...)`` (and so ``pipeline("text-generation", model=model)``) speculates.

    from specgraph.models import load_default_draft
    spec = specgraph.attach(model, load_default_draft())
    out = model.generate(**inputs, max_new_tokens=64)    # token-exact with the original
    specgraph.detach(model)                               # the original method is back

A call the speculative path cannot honour exactly (beam search, ``no_repeat_ngram_size``,
attentions in the output, a batch over ``max_batch``, a prompt too long for ``max_cache_len``, ...) runs the
original ``generate`` instead, with a warning naming what made it fall back (once per reason),
never a silently different result.
"""
from __future__ import annotations

import functools
import warnings

import torch

from .api import SpecModel, compile
from .capture import TRACE_LOCK
from .generate_args import generation_config as merged_config, max_new_tokens, unsupported_arguments
from .spec_config import DEFAULT_CACHE_LEN, cache_len_argument

_ATTR = "_specgraph_original_generate"


def attach(model, draft=None, tree=None, backend: str = "auto", max_batch: int = 8,
           max_cache_len: int = DEFAULT_CACHE_LEN, *, fast_start: bool | None = None,
           max_length: int | None = None) -> SpecModel:
    """Compile ``model`` with ``draft`` (arguments as ``specgraph.compile``; ``max_length=`` is the old
    spelling of ``max_cache_len=``) and route its own ``generate`` through the result. Returns the SpecModel."""
    max_cache_len = cache_len_argument(max_cache_len, max_length, "specgraph.attach")
    if hasattr(model, _ATTR):
        raise RuntimeError("specgraph is already attached to this model; call specgraph.detach(model) first")
    spec = compile(model, draft, tree=tree, backend=backend, max_batch=max_batch, max_cache_len=max_cache_len,
                   fast_start=fast_start)
    original = model.generate  # the bound method of the model's class
    warned: set[str] = set()

    @functools.wraps(original)
    def generate(inputs=None, generation_config=None, **kwargs):
        input_ids = kwargs.pop("input_ids", inputs)
        reasons = _fallback_reasons(spec, input_ids, generation_config, kwargs)
        if reasons:
            new = [r for r in reasons if r not in warned]
            if new:
                warnings.warn(f"specgraph: falling back to the original generate for {', '.join(new)}", stacklevel=2)
                warned.update(new)
            # HF's generate runs the model's modules eagerly: not while another thread captures or compiles
            with TRACE_LOCK:
                return original(input_ids, generation_config=generation_config, **kwargs)
        want_dict = kwargs.pop("return_dict_in_generate", None)
        if want_dict is None:
            want_dict = merged_config(model, generation_config).return_dict_in_generate
        return spec.generate(input_ids, generation_config=generation_config, return_dict_in_generate=want_dict,
                             **kwargs)

    setattr(model, _ATTR, original)
    model.generate = generate
    model._specgraph_spec = spec
    return spec


def detach(model) -> None:
    """Undo ``attach``: ``model.generate`` is the model's own again."""
    if not hasattr(model, _ATTR):
        raise RuntimeError("specgraph is not attached to this model")
    delattr(model, _ATTR)
    del model.generate  # the instance attribute goes; the class's method shows through
    del model._specgraph_spec


def _fallback_reasons(spec: SpecModel, input_ids, generation_config, kwargs: dict) -> list[str]:
    gen = merged_config(spec.model, generation_config)
    reasons = unsupported_arguments({k: v for k, v in kwargs.items() if v is not None
                                     and k != "return_dict_in_generate"}, gen)
    if not torch.is_tensor(input_ids) or input_ids.dim() != 2:
        return reasons + ["input_ids that are not a [B, T] tensor"]
    b, t = input_ids.shape
    if b > spec.config.max_batch:
        reasons.append(f"batch {b} > max_batch={spec.config.max_batch}")
    mask = kwargs.get("attention_mask")
    if torch.is_tensor(mask) and mask.shape == input_ids.shape and bool((mask[:, 1:].eq(0) & mask[:, :-1].ne(0)).any()):
        reasons.append("padding on the right (or inside) of a row")  # the engine pads on the left only
    positions = getattr(spec.model.config, "max_position_embeddings", None)
    if t + max_new_tokens(kwargs, gen, t, positions) + spec.config.tree_for(b).num_nodes > spec.config.max_cache_len:
        reasons.append(f"prompt + max_new_tokens beyond max_cache_len={spec.config.max_cache_len}")
    return reasons
