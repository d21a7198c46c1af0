"""Where a sampled step's time goes: plain decoding of SmolLM2 (bf16, CUDA, inductor), greedy against T = 1
(``top_k=0``; transformers' default ``top_k=50``; with ``top_p=0.9``; seeded), one generate each timed and one under torch.profiler
(device-time tables). ``--random-weights``: SmolLM2's config with random weights (no GGUF needed; the sampling
kernels' cost does not depend on the weights).

    python3 benchmarks/investigations/sampling_profile.py [--tokens 256] [--random-weights] [--speculative] --out DIR
"""
import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import specgraph

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/common.py
from common import SMOLLM2, load_target  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--random-weights", action="store_true")
    parser.add_argument("--speculative", action="store_true",
                        help="the shipped EAGLE-3 head of this checkout on compile's default tree (many sampled rows a step)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.random_weights:
        import transformers

        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMOLLM2)).to("cuda", torch.bfloat16).eval()
        ids = torch.randint(3, SMOLLM2["vocab_size"], (1, 32), device="cuda")
    else:
        model, tokenizer = load_target("smollm2", torch.bfloat16)
        model = model.to("cuda")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": "Write a story about a lighthouse keeper."}],
                                            add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"].to("cuda")
    # this checkout's head, not the imported package's: an older specgraph on PYTHONPATH (the baseline) ships none
    head = Path(__file__).resolve().parents[2] / "specgraph" / "heads" / "smollm2-135m-instruct-eagle3"
    draft = specgraph.drafts.Eagle3.from_pretrained(head).to("cuda") if args.speculative else None
    spec = specgraph.compile(model, draft, backend="inductor")
    prefix = "spec-" if args.speculative else ""
    settings = {"greedy": dict(do_sample=False), "T1": dict(do_sample=True, temperature=1.0, top_k=0),
                "T1-top_k50": dict(do_sample=True, temperature=1.0, top_k=50),
                "T1-top_k50-top_p0.9": dict(do_sample=True, temperature=1.0, top_k=50, top_p=0.9),
                "T1-seeded": dict(do_sample=True, temperature=1.0, top_k=0, seed=0),
                "T1-top_k50-seeded": dict(do_sample=True, temperature=1.0, top_k=50, seed=0)}
    for name, kwargs in settings.items():
        run = lambda: spec.generate(ids, max_new_tokens=args.tokens, eos_token_id=None, **kwargs)  # noqa: E731
        tokens = run()[0, ids.shape[1]:].tolist()  # seeded: the same tokens on any code that samples alike
        run()
        torch.cuda.synchronize()
        begin = time.perf_counter()
        run()
        torch.cuda.synchronize()
        ms = (time.perf_counter() - begin) * 1e3 / args.tokens
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=90)
        (args.out / f"sampling-profile-{prefix}{name}.txt").write_text(f"{name}: {ms:.3f} ms per token\n\n{table}\n")
        print(f"{prefix}{name}: {ms:.3f} ms per token; tokens {tokens[:12]}", flush=True)


if __name__ == "__main__":
    main()
