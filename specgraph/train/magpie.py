"""Prompts the target writes itself (Magpie: Xu et al., 2024), to answer with ``specgraph.train.distill``.

    python -m specgraph.train.magpie --out prompts.json.gz [--target MODEL] [--prompts 20000] [--temperature 1]
        [--max-prompt-tokens 256] [--batch-size 256] [--seed 0] [--max-minutes M]

A chat model given only its template's opening of a user turn (the *pre-query*: for SmolLM2
``<|im_start|>system\\n...<|im_end|>\\n<|im_start|>user\\n``) writes a user's message, sampled, and closes the
turn with its end-of-turn token. Rows of that pre-query decoded together on specgraph's plain decoding
(seeded sampling: every row its own stream) give that many prompts; a row that ends without closing the
turn (``max_prompt_tokens`` reached) is dropped as cut off, and so are empty and repeated prompts. They are
written as a ShareGPT file of one-turn conversations whose answers are "…"
(``train.data.write_sharegpt(prompts_only=True)``), which ``python -m specgraph.train.distill --data FILE``
answers as it answers ShareGPT's: prompts beyond ShareGPT's 11k conversations, drawn from the target's own
idea of a user, where more passes over the same conversations fit them and nothing else.
"""
from __future__ import annotations

import argparse
import logging
import time
from dataclasses import asdict, dataclass

import torch
from tqdm import tqdm

from ..errors import SettingError
from .distill import cache_length, stop_ids

log = logging.getLogger(__name__)
MARK = "\x00specgraph-user-text\x00"  # stands for the user's text while the template is rendered


def pre_query(tokenizer) -> list[int]:
    """The chat template up to where a user's first message starts (its default system turn included)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": MARK}], tokenize=False)
    if MARK not in text:
        raise SettingError("the tokenizer's chat template does not place the user's text verbatim: a pre-query "
                           "cannot be cut from it (a target with a chat template that does)")
    return tokenizer(text[: text.index(MARK)], add_special_tokens=False)["input_ids"]


@dataclass
class PromptStats:
    rows: int = 0  # rows decoded
    cut_off: int = 0  # rows that reached max_prompt_tokens without closing the turn
    empty: int = 0
    repeated: int = 0  # prompts already kept
    kept: int = 0  # distinct new prompts (the first ``prompts`` of them returned)
    tokens: int = 0  # tokens decoded in kept and dropped rows
    seconds: float = 0.0


def complete_prompts(rows: list[list[int]], eos_ids: set[int], tokenizer, seen: set[str],
                     stats: PromptStats) -> list[str]:
    """The rows' new prompts: each row's text before its first end-of-turn token, stripped; rows without one
    (cut off), empty ones and those in ``seen`` (which grows) are dropped and counted in ``stats``."""
    out = []
    for row in rows:
        stats.rows += 1
        end = next((i for i, t in enumerate(row) if t in eos_ids), None)
        stats.tokens += len(row) if end is None else end + 1
        if end is None:
            stats.cut_off += 1
            continue
        text = tokenizer.decode(row[:end], skip_special_tokens=True).strip()
        if not text:
            stats.empty += 1
        elif text in seen:
            stats.repeated += 1
        else:
            seen.add(text)
            out.append(text)
    stats.kept += len(out)
    return out


@torch.no_grad()
def self_prompts(spec, tokenizer, prompts: int, temperature: float = 1.0, max_prompt_tokens: int = 256,
                 batch_size: int = 256, seed: int = 0, deadline: float | None = None,
                 idle_rounds: int = 3) -> tuple[list[str], PromptStats]:
    """Up to ``prompts`` distinct prompts from ``spec`` (a ``specgraph.compile`` of the target, no draft): rounds
    of ``batch_size`` rows of the pre-query, round k sampled with seed ``seed * 2**32 + k`` (no two seeds share a
    round; temperature 0: greedy, one round), until enough are kept, ``deadline`` (a ``time.time()``) passes,
    or ``idle_rounds`` rounds in a row keep none (a target that does not close its turns within
    ``max_prompt_tokens``, or only repeats)."""
    eos_ids = stop_ids(spec.model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos_ids)
    device = next(spec.model.parameters()).device
    ids = torch.tensor([pre_query(tokenizer)] * batch_size, device=device)
    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else {}
    kept, seen, stats, start, k, idle = [], set(), PromptStats(), time.time(), 0, 0
    bar = tqdm(total=prompts, desc="prompts", unit="prompt")
    while len(kept) < prompts and idle < idle_rounds and (deadline is None or time.time() < deadline):
        out = spec.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_prompt_tokens,
                            eos_token_id=sorted(eos_ids), pad_token_id=pad,
                            **({**sampling, "seed": (seed % 2**32) << 32 | k} if sampling else {}))
        new = complete_prompts(out[:, ids.shape[1]:].tolist(), eos_ids, tokenizer, seen, stats)
        kept += new[: prompts - len(kept)]
        idle = 0 if new else idle + 1
        bar.update(min(len(new), bar.total - bar.n))
        bar.set_postfix(cut_off=stats.cut_off, repeated=stats.repeated)
        k += 1
        if not sampling:  # greedy: every round writes the same rows
            break
    bar.close()
    stats.seconds = time.time() - start
    return kept, stats


def main(argv: list[str] | None = None) -> int:
    """``python -m specgraph.train.magpie``: see the module docstring. Exit status 3: fewer than ``--prompts``
    kept (out of time, or rounds that kept none; those kept are written)."""
    import specgraph

    from ..cli_args import number, whole_number
    from ..cli_io import generation_target
    from .data import write_sharegpt

    positive = whole_number(1)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", required=True, help="the ShareGPT file to write (FILE.json or FILE.json.gz)")
    parser.add_argument("--target", default=None, help="a .gguf file, HF directory or hub id (default: SmolLM2)")
    parser.add_argument("--prompts", type=positive, default=20000)
    parser.add_argument("--temperature", type=number(0.0), default=1.0, help="0: greedy (one prompt)")
    parser.add_argument("--max-prompt-tokens", type=positive, default=256)
    parser.add_argument("--batch-size", type=positive, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", default="inductor", choices=["eager", "inductor"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--max-minutes", type=number(0.0, above=True), default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    deadline = None if args.max_minutes is None else time.time() + 60 * args.max_minutes
    model, tokenizer = generation_target(args.target, args.dtype)
    spec = specgraph.compile(model, None, backend=args.backend, max_batch=args.batch_size,
                             max_cache_len=cache_length(len(pre_query(tokenizer)) + args.max_prompt_tokens))
    kept, stats = self_prompts(spec, tokenizer, args.prompts, args.temperature, args.max_prompt_tokens,
                               args.batch_size, args.seed, deadline)
    write_sharegpt([[{"role": "user", "content": p}, {"role": "assistant", "content": ""}] for p in kept], args.out,
                   prompts_only=True)
    print(f"wrote {len(kept)} prompts to {args.out}: {asdict(stats)}")
    return 0 if len(kept) >= args.prompts else 3


if __name__ == "__main__":
    raise SystemExit(main())
