"""What one EAGLE-3 training step costs on SmolLM2-135M's shape (random weights; GPU), and whether the
sampled plain-decoding step compiles at the batch self-distillation uses.

    python3 benchmarks/train_step.py [--vocab 0 16384] [--batch 6 16] [--steps 12] [--sampled-batch 256]

Per (draft vocabulary, batch): the step ``specgraph train eagle3`` takes (the frozen target's forward
under bf16 autocast, the 7-step training-time-test unroll, the soft cross-entropy, backward, AdamW),
on examples whose lengths follow the self-distilled ShareGPT data (uniform 200-2048 tokens, the
first fifth without loss). Prints steps/s, tokens/s and peak memory; ``--profile`` adds the top
operators of one step by CUDA and by CPU time. ``--shards DIR``: the real SmolLM2 (``SPECGRAPH_GGUF``)
on the first examples of the self-distilled shards instead (how many rows a reduced vocabulary keeps
depends on the target's own argmax). ``--sampled-batch B``: ``compile(model, None, backend="inductor",
max_batch=B)`` then a sampled generate (T = 0.8), as ``python -m specgraph.train.distill`` runs it.
"""
from __future__ import annotations

import argparse
import time

import torch

from common import SMOLLM2  # first: sys.path (common.py)
from specgraph.train.eagle3 import eagle3_loss, new_eagle3_for  # noqa: E402
from specgraph.train.loop import collate  # noqa: E402


def target(dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**SMOLLM2)).to(dtype).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def examples(n: int, vocab: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(200, 2049, (1,), generator=g))
        mask = torch.arange(length) >= length // 5
        out.append({"input_ids": torch.randint(0, vocab, (length,), generator=g), "loss_mask": mask})
    return out


def time_training(model, vocab: int, batch: int, steps: int, profile: bool, real: list[dict] | None = None) -> dict:
    data = real[:batch * (steps + 3)] if real else examples(batch * (steps + 3), SMOLLM2["vocab_size"])
    draft = new_eagle3_for(model, data, draft_vocab_size=vocab)
    loss_fn = eagle3_loss(model, draft, steps=7)
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    torch.cuda.reset_peak_memory_stats()

    def step(i):
        chosen = sorted(data[i * batch:(i + 1) * batch], key=lambda e: len(e["input_ids"]))
        b = {k: v.cuda() for k, v in collate(chosen).items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, _ = loss_fn(b)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        optimizer.step()
        return int(b["input_ids"].numel())

    for i in range(3):
        step(i)
    torch.cuda.synchronize()
    start, tokens = time.perf_counter(), 0
    for i in range(3, steps + 3):
        tokens += step(i)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    if profile:
        from torch.profiler import ProfilerActivity, profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step(3)
            torch.cuda.synchronize()
        for key in ("cuda_time_total", "cpu_time_total"):
            print(prof.key_averages().table(sort_by=key, row_limit=15, max_name_column_width=60))
    return {"vocab": vocab or "target LM head", "batch": batch, "steps_per_s": steps / seconds,
            "tokens_per_s": tokens / seconds, "peak_gb": torch.cuda.max_memory_allocated() / 1e9}


def sampled_compile(batch: int) -> str:
    import specgraph

    model = target(torch.bfloat16)
    spec = specgraph.compile(model, None, backend="inductor", max_batch=batch, max_cache_len=256)
    ids = torch.randint(0, SMOLLM2["vocab_size"], (batch, 40), device="cuda")
    start = time.perf_counter()
    try:
        out = spec.generate(ids, max_new_tokens=16, do_sample=True, temperature=0.8, top_k=0, top_p=1.0,
                            eos_token_id=None, pad_token_id=0)
    except Exception as err:  # the finding is whether it compiles: report, do not hide
        return f"FAILED after {time.perf_counter() - start:.0f} s: {type(err).__name__}: {str(err)[:300]}"
    return f"ok: {tuple(out.shape)} in {time.perf_counter() - start:.0f} s (compile included)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[0, 16384], help="0: the target's LM head")
    parser.add_argument("--batch", type=int, nargs="+", default=[6, 16])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--sampled-batch", type=int, default=None)
    parser.add_argument("--shards", default=None, help="self-distilled shards: the real target on real examples")
    args = parser.parse_args()
    rows = []
    real = None
    if args.shards:
        import random

        from specgraph.train.distill import load_shards

        real = load_shards(args.shards, ["greedy"])
        random.Random(0).shuffle(real)
    if args.vocab and args.batch:
        if real:
            from specgraph.models import load_gguf

            model = load_gguf()[0].cuda().eval()
            for p in model.parameters():
                p.requires_grad_(False)
        else:
            model = target(torch.float32)  # as `specgraph train` holds it: fp32 weights, bf16 autocast
        for vocab in args.vocab:
            for batch in args.batch:
                try:
                    rows.append(time_training(model, vocab, batch, args.steps, args.profile, real))
                except torch.OutOfMemoryError:
                    rows.append({"vocab": vocab, "batch": batch, "steps_per_s": 0, "tokens_per_s": 0,
                                 "peak_gb": float("nan")})
                torch.cuda.empty_cache()
        del model
    print(f"{'draft vocabulary':>18} {'batch':>6} {'steps/s':>8} {'tokens/s':>10} {'peak GB':>8}")
    for r in rows:
        print(f"{r['vocab']!s:>18} {r['batch']:>6} {r['steps_per_s']:>8.2f} {r['tokens_per_s']:>10.0f} "
              f"{r['peak_gb']:>8.1f}")
    if args.sampled_batch:
        print(f"sampled plain decoding at batch {args.sampled_batch}, inductor: {sampled_compile(args.sampled_batch)}")


if __name__ == "__main__":
    main()
