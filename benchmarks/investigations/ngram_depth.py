"""How deep prompt lookup should draft: τ of ``NGram`` chains of several depths and n-gram sizes on a
real target's own greedy answers.

Greedy speculation emits the target's greedy answer whatever the draft, and an n-gram proposal depends
only on the tokens committed so far, so a chain's run is a function of the answer: a step at position p
proposes ``NGram(max_ngram).propose(prompt + answer[:p], depth)`` and commits 1 + the prefix of it that
the answer continues with. This replays every step exactly, for every (depth, max_ngram), from one
greedy answer per prompt (made with specgraph itself, token-exact with ``model.generate`` in fp32).

    python3 benchmarks/investigations/ngram_depth.py --target qwen-coder-1.5b --prompts humaneval \\
        --questions 10 --max-new-tokens 256 --depths 4 8 16 32 --max-ngram 2 3 4 --out FILE.json
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
from common import MODELS, first_turn_ids, load_target  # noqa: E402

import specgraph  # noqa: E402
from specgraph.drafts import NGram  # noqa: E402
from specgraph.train.evaluate import PROMPT_SETS, prompt_set  # noqa: E402


def chain_steps(prompt: list[int], answer: list[int], depth: int, max_ngram: int) -> int:
    """Target steps an NGram(max_ngram) chain ``depth`` deep takes to emit ``answer`` after ``prompt`` (its
    first token the prefill's)."""
    draft, pos, steps = NGram(max_ngram=max_ngram), 1, 0
    while pos < len(answer):
        proposal = draft.propose(prompt + answer[:pos], depth)
        matched = 0
        while matched < depth and pos + matched + 1 < len(answer) and proposal[matched] == answer[pos + matched]:
            matched += 1
        pos, steps = pos + 1 + matched, steps + 1
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2", help=f"{' | '.join(MODELS)} | a .gguf path")
    parser.add_argument("--prompts", default="humaneval", choices=list(PROMPT_SETS))
    parser.add_argument("--questions", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--depths", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--max-ngram", type=int, nargs="+", default=[3])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer = load_target(args.target, torch.float32)
    model = model.to(device).eval()
    # the answers come from an n-gram chain itself: token-exact with greedy decoding, and faster on code
    spec = specgraph.compile(model, NGram(), tree=specgraph.Chain(8), max_cache_len=args.max_new_tokens + 1536)
    started, rows, engine_steps = time.time(), [], 0
    for question in tqdm(prompt_set(args.prompts, args.questions), desc="greedy answers"):
        prompt = first_turn_ids(tokenizer, question)
        out = spec.generate(torch.tensor([prompt], device=device), max_new_tokens=args.max_new_tokens,
                            eos_token_id=tokenizer.eos_token_id, return_dict_in_generate=True)
        rows.append((prompt, out.sequences[0, len(prompt):].tolist()))
        engine_steps += len(out.accept_lens)
    tokens = sum(len(a) - 1 for _, a in rows)  # the steps' tokens: each answer's first is the prefill's
    replayed = sum(chain_steps(p, a, 8, NGram().max_ngram) for p, a in rows)
    if replayed != engine_steps:  # the replay must be the engine's own run where both exist
        raise RuntimeError(f"replayed NGram Chain(8): {replayed} steps; the engine took {engine_steps}")
    report = dict(target=args.target, prompts=args.prompts, questions=len(rows), max_new_tokens=args.max_new_tokens,
                  device=device, generated_tokens=tokens, answer_seconds=round(time.time() - started, 1), tau={})
    print(f"{args.target}, {len(rows)} {args.prompts} prompts, {tokens} greedy tokens; tau of NGram chains:")
    print(f"{'max_ngram':>9} " + " ".join(f"{'depth ' + str(d):>9}" for d in args.depths))
    for n in args.max_ngram:
        taus = [tokens / sum(chain_steps(p, a, d, n) for p, a in rows) for d in args.depths]
        report["tau"][n] = dict(zip(args.depths, taus))
        print(f"{n:>9} " + " ".join(f"{t:>9.2f}" for t in taus))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
