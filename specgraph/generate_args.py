"""``SpecModel.generate``'s arguments read as ``model.generate`` reads them: which are supported, the
length to generate, token ids in any of HF's forms, sampling settings, stopping criteria, the
repetition penalty and left padding. Checked before any work, each error naming the argument."""
from __future__ import annotations

import copy
import math
import numbers
import operator

import torch

from .kernels.gumbel import check_seed
from .runtime.generate import Sampling

GENERATE_ARGS = {"input_ids", "attention_mask", "max_new_tokens", "max_length", "eos_token_id", "pad_token_id",
                 "do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "generation_config",
                 "return_dict_in_generate", "output_scores", "output_logits", "stopping_criteria", "stop_strings",
                 "tokenizer", "streamer", "use_cache",
                 "seed"}  # specgraph's own (HF has none): seeded sampling, kernels/gumbel.py


# generation_config fields that change what generate returns and that the speculative path does not
# implement: a non-default value is refused by SpecModel.generate (attach falls back to HF for it)
UNSUPPORTED_CONFIG = ("bad_words_ids", "begin_suppress_tokens", "constraints", "diversity_penalty", "dola_layers",
                      "epsilon_cutoff", "eta_cutoff", "exponential_decay_length_penalty", "force_words_ids",
                      "forced_bos_token_id", "forced_eos_token_id", "guidance_scale", "max_time", "min_length",
                      "min_new_tokens", "no_repeat_ngram_size", "num_beam_groups", "num_beams",
                      "num_return_sequences", "output_attentions", "output_hidden_states",
                      "penalty_alpha", "renormalize_logits", "sequence_bias",
                      "suppress_tokens", "token_healing", "top_h", "typical_p", "watermarking_config",
                      "encoder_no_repeat_ngram_size", "encoder_repetition_penalty", "remove_invalid_values")


# model.generate arguments whose default changes nothing here: accepted when given as that default
HF_DEFAULTS = {"synced_gpus": False}

# the value of a numeric setting that means "off" (0 for the rest)
_OFF = {"num_beams": 1, "num_beam_groups": 1, "num_return_sequences": 1, "encoder_repetition_penalty": 1.0,
        "typical_p": 1.0, "guidance_scale": 1.0}


def _is_off(name: str, value) -> bool:
    if value is None:
        return True
    if name in ("forced_bos_token_id", "forced_eos_token_id"):  # any token id, 0 included, is a setting
        return False
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value == _OFF.get(name, 0)
    return hasattr(value, "__len__") and len(value) == 0


def generation_config(model, given):
    """The generation config a call runs with, as model.generate makes it: ``given`` (a user's
    GenerationConfig) with every setting it leaves unset (None) taken from ``model.generation_config``
    (its eos and pad ids, say); None -> the model's own."""
    if given is None:
        return model.generation_config
    merged = copy.deepcopy(given)
    merged.update(**model.generation_config.to_dict(), defaults_only=True)
    return merged


def _given(value) -> bool:
    """An argument set to something: None and an empty list of processors or criteria are HF's defaults."""
    return value is not None and not (isinstance(value, (list, tuple)) and len(value) == 0)


def unsupported_arguments(kwargs: dict, generation_config) -> list[str]:
    """Every argument or generation_config setting of a generate call that the speculative path
    would not honour, as ``name=value`` (empty: it can run)."""
    problems = [f"{k}={_show(kwargs[k])}" for k in sorted(set(kwargs) - GENERATE_ARGS - set(UNSUPPORTED_CONFIG))
                if _given(kwargs[k]) and not (k in HF_DEFAULTS and kwargs[k] is HF_DEFAULTS[k])]
    for name in UNSUPPORTED_CONFIG:
        value = kwargs[name] if name in kwargs else getattr(generation_config, name, None)
        if not _is_off(name, value):
            problems.append(f"{name}={_show(value)}")
    return problems


def _show(value) -> str:
    """A value as an error or warning names it: a tensor by its shape (the same reason reads the same
    whatever its data, so attach warns once per reason)."""
    if torch.is_tensor(value):
        return f"<tensor {tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}>"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


HF_DEFAULT_NEW_TOKENS = 20  # what model.generate makes when neither the call nor the generation config sets a length


def max_new_tokens(kwargs: dict, generation_config, prompt_width: int, max_positions: int | None = None) -> int:
    """How many tokens a generate call asks for, as model.generate reads its arguments (an argument given,
    even as None, overrides the generation config; with no length anywhere, 20 new tokens, the prompt and
    them within ``max_positions``, the model's ``max_position_embeddings``); a length that leaves none to
    generate is refused (as model.generate refuses it)."""
    max_new = setting(kwargs, generation_config, "max_new_tokens")
    if max_new is not None:
        whole = _whole(max_new) if not _integral_float(max_new) else int(max_new)  # 4.0: as model.generate
        if whole is None or whole < 1:
            raise ValueError(f"max_new_tokens={max_new!r}: a whole number >= 1")
        return whole
    max_length = setting(kwargs, generation_config, "max_length")
    if max_length is None:  # transformers' default: 20 new tokens, within the model's positions
        new = HF_DEFAULT_NEW_TOKENS if max_positions is None else \
            min(HF_DEFAULT_NEW_TOKENS, max_positions - prompt_width)
        if new < 1:
            raise ValueError(f"the prompt of {prompt_width} tokens fills the model's max_position_embeddings="
                             f"{max_positions}: pass max_new_tokens (no length was given anywhere)")
        return new
    if _whole(max_length) is None and not _integral_float(max_length):
        raise ValueError(f"max_length={max_length!r}: a whole number of tokens, prompt included")
    max_length = int(max_length)
    if max_length <= prompt_width:
        raise ValueError(f"max_length={max_length} leaves no room after the prompt of {prompt_width} tokens: "
                         f"pass max_new_tokens, or a max_length above the prompt's length")
    return max_length - prompt_width


def _integral_float(value) -> bool:
    """A Python or numpy float with an integer value (4.0), which model.generate takes as a length."""
    return isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral) and float(value).is_integer()


def _whole(value) -> int | None:
    """``value`` as an int when it is an integer (a Python or numpy integer, a 0-d integer tensor), else None."""
    if isinstance(value, bool) or (torch.is_tensor(value) and (value.dim() or value.dtype.is_floating_point)):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def token_ids(value, name: str) -> list[int]:
    """An eos/pad setting as a list of token ids (order kept): an int, a sequence of ints, a 0-d or 1-d
    integer tensor or a numpy integer; None -> []."""
    if value is None:
        return []
    if torch.is_tensor(value):
        if value.dtype.is_floating_point or value.dim() > 1:
            raise TypeError(f"{name}={value!r}: an integer token id or a 1-d tensor of them")
        return [int(v) for v in value.reshape(-1).tolist()]
    if isinstance(value, (list, tuple)):
        return [i for v in value for i in token_ids(v, name)]
    if type(value).__module__ == "numpy" and getattr(value, "ndim", 0) > 0:  # an array: its ids as a list
        return token_ids(value.tolist(), name)
    if hasattr(value, "__index__") and not isinstance(value, bool):
        return [int(value.__index__())]
    raise TypeError(f"{name}={value!r}: an integer token id, a list of them, or a tensor of them")


def stopping_criteria(kwargs: dict, gen):
    """The call's stopping criteria, with ``stop_strings`` as transformers' StopStringCriteria (which,
    as in model.generate, needs ``tokenizer=``)."""
    criteria = kwargs.get("stopping_criteria")
    if criteria is not None:
        from transformers import StoppingCriteriaList

        if isinstance(criteria, (list, tuple)) and not isinstance(criteria, StoppingCriteriaList):
            criteria = StoppingCriteriaList(criteria)  # model.generate takes a plain list too
        if not isinstance(criteria, StoppingCriteriaList) or not all(callable(c) for c in criteria):
            raise TypeError(f"stopping_criteria={kwargs['stopping_criteria']!r}: a StoppingCriteriaList or a list of "
                            f"StoppingCriteria (callables of (input_ids, scores))")
    stop_strings = kwargs.get("stop_strings") or getattr(gen, "stop_strings", None)
    if not stop_strings:
        return criteria
    tokenizer = kwargs.get("tokenizer")
    if tokenizer is None:
        raise ValueError("stop_strings needs the tokenizer too: generate(..., stop_strings=..., tokenizer=tokenizer), "
                         "as model.generate asks")
    from transformers import StoppingCriteriaList, StopStringCriteria

    return StoppingCriteriaList([*(criteria or []), StopStringCriteria(tokenizer, stop_strings)])


def setting(kwargs: dict, gen, name: str):
    """A generate argument, else the generation config's value (None: neither sets it). An argument given as
    None overrides the config, as in model.generate (its kwargs update the config, None included)."""
    return kwargs[name] if name in kwargs else getattr(gen, name, None)


def repetition_penalty(kwargs: dict, gen) -> float | None:
    """The call's repetition penalty (None: off, as 1.0 is), checked as transformers checks it."""
    penalty = setting(kwargs, gen, "repetition_penalty")
    if penalty is None or (penalty == 1.0 and not isinstance(penalty, bool)):
        return None
    if isinstance(penalty, bool) or not isinstance(penalty, numbers.Real) or not 0 < penalty < math.inf:
        raise ValueError(f"repetition_penalty={penalty!r}: a finite number > 0 (1.0: no penalty; above 1 "
                         f"discourages repeats, below 1 encourages them)")
    return float(penalty)


def sampling_settings(kwargs: dict, gen) -> Sampling | None:
    """The call's sampling settings (``do_sample`` off: None), checked as model.generate checks them."""
    if not setting(kwargs, gen, "do_sample"):
        if kwargs.get("seed") is not None:
            raise ValueError(f"seed={kwargs['seed']!r} applies to sampling: pass do_sample=True with it (greedy "
                             f"decoding is deterministic and takes no seed)")
        return None
    off = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}  # an argument given as None: no such warper

    def pick(name, default):  # the argument (None: off), else the config's value, else transformers' default
        if name in kwargs:
            return off[name] if kwargs[name] is None else kwargs[name]
        return getattr(gen, name, None) if getattr(gen, name, None) is not None else default

    temperature, top_k, top_p = pick("temperature", 1.0), pick("top_k", 50), pick("top_p", 1.0)
    min_p = pick("min_p", 0.0)
    real = lambda x: isinstance(x, numbers.Real) and not isinstance(x, bool)  # noqa: E731 (numpy floats too)
    if not real(temperature) or not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"temperature={temperature!r} with do_sample=True: a finite number > 0 (do_sample=False "
                         f"for greedy)")
    if _whole(top_k) is None or top_k < 0:
        raise ValueError(f"top_k={top_k!r}: a whole number >= 0 (0: no top-k filter)")
    if not real(top_p) or not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p!r}: a number in (0, 1] (1: no top-p filter)")
    if not real(min_p) or not 0 <= min_p <= 1:
        raise ValueError(f"min_p={min_p!r}: a number in [0, 1] (0: no min-p filter)")
    seed = None if kwargs.get("seed") is None else check_seed(kwargs["seed"])
    return Sampling(float(temperature), int(top_k), float(top_p), float(min_p), seed=seed)


def strip_left_padding(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[list[int]]:
    if attention_mask is None:
        return input_ids.tolist()
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} must match input_ids {tuple(input_ids.shape)}")
    prompts = []
    for row, mask in zip(input_ids.tolist(), attention_mask.tolist()):
        first = mask.index(1) if 1 in mask else len(mask)
        if any(m == 0 for m in mask[first:]):
            raise ValueError("attention_mask has padding after tokens: pad on the left (tokenizer.padding_side='left')")
        prompts.append(row[first:])
    return prompts
