"""Sampled acceptance with and without coupled drafts (kernels/gumbel.py, ``DraftSession.couple``).

    python3 benchmarks/investigations/coupled_drafts.py [--prompts mt-bench] [--questions 20] [--max-new-tokens 64]
        [--temperature 1.0] [--trees chain4 dynamic:2,8,8 dynamic:2,8,8+lookup8] [--device cpu] [--out FILE.json]

The shipped EAGLE-3 head on SmolLM2 (fp32 on the CPU, bf16 on CUDA), unseeded sampling (``top_k=0``), each tree
twice in one process: coupled (the head ranks its candidates with the target's seeded noise; the step verifies
with the seeded draws) and not (the head's own top-k; block verification on a chain, token-wise rejection on a
tree: what every sampled call did before coupling). τ = generated tokens per target step
(``train.evaluate.acceptance``). Both are exact in distribution; only how many tokens a step commits differs.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

import specgraph
from specgraph.drafts.autoregressive import ARSession
from specgraph.models import load_default_draft, load_gguf
from specgraph.train.evaluate import acceptance, prompt_set
from specgraph.trees import parse_tree


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
    args = parser.parse_args()
    model, tokenizer = load_gguf()
    if args.device == "cuda":
        model = model.to("cuda", torch.bfloat16)
    draft, questions = load_default_draft(), prompt_set(args.prompts, args.questions)
    couple = ARSession.couple
    rows = []
    for spelling in args.trees:
        for coupled in (False, True):
            ARSession.couple = couple if coupled else (lambda self, keys, temperature: False)
            spec = specgraph.compile(model, draft, tree=parse_tree(spelling), max_batch=args.batch_size)
            spec.capture.decode_steps.clear()  # the buckets were made under the other setting
            begin = time.perf_counter()
            report = acceptance(spec, tokenizer, questions, args.max_new_tokens, args.temperature,
                                batch_size=args.batch_size)
            rows.append({"tree": spelling, "coupled": coupled, "tau": report["tau"], "seconds": time.perf_counter() - begin})
            print(f"{spelling:24s} {'coupled' if coupled else 'not coupled':12s} tau {report['tau']:.3f}", flush=True)
    ARSession.couple = couple
    if args.out:
        import subprocess

        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "commit": commit, "torch": torch.__version__,
                                        "command": "python3 benchmarks/investigations/coupled_drafts.py " + " ".join(sys.argv[1:]),
                                        "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
