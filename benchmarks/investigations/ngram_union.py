"""How much an n-gram branch beside the EAGLE-3 tree could add: the target's own greedy answers repeat
themselves (SmolLM2 loops in most long answers), and prompt lookup accepts a repeat whole where the head
stops at its tree's depth.

Runs the real SmolLM2-135M-Instruct (fp32, CPU or GPU) with the shipped EAGLE-3 head on a DynamicTree and
records every verify step's start position and accepted length. At each step start, ``NGram.propose`` (the
host reference of the device draft) proposes ``--ngram-depth`` tokens from the sequence so far; its accepted
length is 1 + the prefix of them that the (greedy, fixed) continuation matches. A tree holding both (the
n-gram chain as one more branch of the root) accepts the longer of the two. Reported per prompt set: τ of the
tree, of the n-gram chain at the same positions, and of the union. An upper estimate: the union's steps
start at other positions than the tree's, and averaging over the tree's steps weights the stretches where
the tree needs many steps (a loop, which lookup takes whole) more than a run of the union does. The run
itself: ``specgraph.WithLookup`` (``acceptance.py --sweep-trees dynamic:4,4,16+lookup8``).

    python3 benchmarks/investigations/ngram_union.py --questions 20 --max-new-tokens 128 --out FILE.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import first_turn_ids, load_target  # noqa: E402

import specgraph  # noqa: E402
from specgraph.drafts import NGram  # noqa: E402
from specgraph.models import load_default_draft  # noqa: E402
from specgraph.train.evaluate import PROMPT_SETS, prompt_set  # noqa: E402
from specgraph.trees import parse_tree  # noqa: E402


def union_steps(prompt: list[int], answer: list[int], accept_lens: list[int], depth: int) -> list[tuple[int, int]]:
    """Per verify step of the tree: (its accepted length, the n-gram chain's at the same start); the
    answer's first token is the prefill's."""
    ngram, out, start = NGram(), [], 1
    for accepted in accept_lens:
        if start >= len(answer):
            break
        proposal = ngram.propose(prompt + answer[:start], depth)  # the root: the last committed token
        want = answer[start:start + depth + 1]
        matched = 0
        while matched < min(depth, len(want) - 1) and proposal[matched] == want[matched]:
            matched += 1
        out.append((accepted, 1 + matched))
        start += accepted
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", default="mt-bench", choices=list(PROMPT_SETS))
    parser.add_argument("--questions", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--tree", default="dynamic:4,4,16", type=parse_tree)
    parser.add_argument("--ngram-depth", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer = load_target("smollm2", torch.float32)
    model = model.to(device).eval()
    spec = specgraph.compile(model, load_default_draft().to(device), tree=args.tree, max_cache_len=1024)
    steps = {d: [] for d in args.ngram_depth}
    started = time.time()
    for question in tqdm(prompt_set(args.prompts, args.questions), desc="prompts"):
        prompt = first_turn_ids(tokenizer, question)
        out = spec.generate(torch.tensor([prompt], device=device), max_new_tokens=args.max_new_tokens,
                            eos_token_id=tokenizer.eos_token_id, return_dict_in_generate=True)
        answer = out["sequences"][0, len(prompt):].tolist()
        lens = [step[0] for step in out["accept_lens"]]
        for depth in args.ngram_depth:
            steps[depth] += union_steps(prompt, answer, lens, depth)
    report = dict(prompts=args.prompts, questions=args.questions, max_new_tokens=args.max_new_tokens,
                  tree=str(args.tree), device=device, seconds=round(time.time() - started, 1), union={})
    for depth, pairs in steps.items():
        n = len(pairs)
        report["union"][depth] = dict(steps=n, tau_tree=sum(a for a, _ in pairs) / n,
                                      tau_ngram=sum(g for _, g in pairs) / n,
                                      tau_union=sum(max(a, g) for a, g in pairs) / n,
                                      ngram_longer=sum(g > a for a, g in pairs) / n)
        r = report["union"][depth]
        print(f"n-gram depth {depth:2d}: {n} steps | tau tree {r['tau_tree']:.2f} | n-gram {r['tau_ngram']:.2f} | "
              f"union {r['tau_union']:.2f} | n-gram longer at {100 * r['ngram_longer']:.0f}% of steps")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
