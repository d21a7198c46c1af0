"""Sampled acceptance with and without coupled drafts (kernels/gumbel.py, ``DraftSession.couple``).

    python3 benchmarks/investigations/coupled_drafts.py [--prompts mt-bench] [--questions 20] [--max-new-tokens 64]
        [--temperature 1.0] [--trees chain4 dynamic:2,8,8 dynamic:2,8,8+lookup8] [--device cpu] [--out FILE.json]
        [--sharpen 1.0 0.7 ...] [--confident P] [--coupled-only]

The shipped EAGLE-3 head on SmolLM2 (fp32 on the CPU, bf16 on CUDA), unseeded sampling (``top_k=0``), each tree
twice in one process: coupled (the head ranks its candidates with the target's seeded noise; the step verifies
with the seeded draws) and not (the head's own top-k; block verification on a chain, token-wise rejection on a
tree: what every sampled call did before coupling). τ = generated tokens per target step
(``train.evaluate.acceptance``). Both are exact in distribution; only how many tokens a step commits differs.
``--sharpen S ...``: coupled runs also rank by logits / (S T) + the target's noise (S < 1: the draft's own
distribution sharpened; ``--confident P``: only where the draft's top probability exceeds P); the target's
draws, hence the generated tokens, are the same in every run.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

import specgraph
from specgraph.drafts import autoregressive
from specgraph.drafts.autoregressive import ARSession
from specgraph.models import load_default_draft, load_gguf
from specgraph.train.evaluate import acceptance, prompt_set
from specgraph.trees import parse_tree


def sharpened(logits: torch.Tensor, temperature, sharpen: float, confident: float):
    """The temperature the draft's candidates are ranked at: T * sharpen where its top probability > confident."""
    top = torch.softmax(logits.float() / temperature, -1).amax(-1, keepdim=True)  # [B, ..., 1]
    return temperature * torch.where(top > confident, sharpen, 1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", default="mt-bench")
    parser.add_argument("--questions", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--trees", nargs="+", default=["chain4", "dynamic:2,8,8", "dynamic:2,8,8+lookup8"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--sharpen", type=float, nargs="+", default=[1.0])
    parser.add_argument("--confident", type=float, default=0.0)
    parser.add_argument("--coupled-only", action="store_true")
    args = parser.parse_args()
    model, tokenizer = load_gguf()
    if args.device == "cuda":
        model = model.to("cuda", torch.bfloat16)
    draft, questions = load_default_draft(), prompt_set(args.prompts, args.questions)
    couple, scores = ARSession.couple, autoregressive.coupled_scores
    rows = []
    settings = ([] if args.coupled_only else [(False, 1.0)]) + [(True, s) for s in args.sharpen]
    for spelling in args.trees:
        for coupled, sharpen in settings:
            ARSession.couple = couple if coupled else (lambda self, keys, temperature: False)
            autoregressive.coupled_scores = (lambda logits, keys, positions, temperature, tokens=None, s=sharpen:
                                             scores(logits, keys, positions, sharpened(logits, temperature, s,
                                                                                      args.confident), tokens))
            spec = specgraph.compile(model, draft, tree=parse_tree(spelling), max_batch=args.batch_size)
            spec.capture.decode_steps.clear()  # the buckets were made under the other setting
            begin = time.perf_counter()
            report = acceptance(spec, tokenizer, questions, args.max_new_tokens, args.temperature,
                                batch_size=args.batch_size)
            rows.append({"tree": spelling, "coupled": coupled, "sharpen": sharpen, "tau": report["tau"],
                         "seconds": time.perf_counter() - begin})
            print(f"{spelling:24s} {'coupled' if coupled else 'not coupled':12s} sharpen {sharpen:g} tau {report['tau']:.3f}",
                  flush=True)
    ARSession.couple, autoregressive.coupled_scores = couple, scores
    if args.out:
        import subprocess

        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "commit": commit, "torch": torch.__version__,
                                        "command": "python3 benchmarks/investigations/coupled_drafts.py " + " ".join(sys.argv[1:]),
                                        "confident": args.confident, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
