"""How large a draft vocabulary a target needs: the share of its own greedy answer tokens inside the K most
frequent tokens of ShareGPT's assistant turns (a draft vocabulary of K tokens can never draft the rest), and
what a draft LM head of K rows costs to read per draft step.

The vocabulary is counted on the original ShareGPT answers under the target's tokenizer, a proxy for the
target's own regenerated answers that training counts on (``specgraph train --draft-vocab K``); the answers it
is checked against are the target's own (greedy, fp32, made with specgraph: token-exact with
``model.generate``), so the figure is what a head trained this way could at most accept at one depth.

    python3 benchmarks/investigations/draft_vocab_size.py --target qwen-coder-1.5b --conversations 6000 \\
        --questions 8 --max-new-tokens 128 --sizes 8192 16384 32768 65536 --out FILE.json
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import MODELS, first_turn_ids, load_target  # noqa: E402

import specgraph  # noqa: E402
from specgraph.drafts import NGram  # noqa: E402
from specgraph.train.data import load_sharegpt  # noqa: E402
from specgraph.train.evaluate import prompt_set  # noqa: E402

COPY_BANDWIDTH = 4.27e12  # bytes/s, the H200's measured copy bandwidth (docs/benchmarks.md)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen-coder-1.5b", help=f"{' | '.join(MODELS)} | a .gguf path")
    parser.add_argument("--conversations", type=int, default=6000, help="ShareGPT conversations counted")
    parser.add_argument("--questions", type=int, default=8, help="per prompt set (MT-bench, HumanEval)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--sizes", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    model, tokenizer = load_target(args.target, torch.float32)
    counts = Counter()
    for conversation in tqdm(load_sharegpt(limit=args.conversations), desc="ShareGPT answers"):
        for message in conversation:
            if message["role"] == "assistant":
                counts.update(tokenizer(message["content"], add_special_tokens=False).input_ids)
    ranked = [token for token, _ in counts.most_common()]
    spec = specgraph.compile(model.eval(), NGram(), tree=specgraph.Chain(8), max_cache_len=args.max_new_tokens + 1536)
    answers = {}
    for name in ("mt-bench", "humaneval"):
        tokens = []
        for question in tqdm(prompt_set(name, args.questions), desc=f"{name} greedy answers"):
            prompt = first_turn_ids(tokenizer, question)
            out = spec.generate(torch.tensor([prompt]), max_new_tokens=args.max_new_tokens,
                                eos_token_id=tokenizer.eos_token_id)
            tokens += out[0, len(prompt):].tolist()
        answers[name] = tokens
    hidden, vocab = model.config.hidden_size, model.config.vocab_size
    report = dict(target=args.target, conversations=args.conversations, distinct_tokens_seen=len(ranked),
                  vocab_size=vocab, questions=args.questions, max_new_tokens=args.max_new_tokens, sizes={})
    print(f"{args.target}: {len(ranked)} distinct tokens in {args.conversations} ShareGPT conversations' answers "
          f"(vocabulary {vocab}); coverage of its own greedy answers ({', '.join(f'{n}: {len(t)} tokens' for n, t in answers.items())})")
    print(f"{'K':>7} " + " ".join(f"{n:>10}" for n in answers) + f" {'head MB':>8} {'us/step':>8}")
    for k in sorted(args.sizes) + [vocab]:
        kept = set(ranked[:k]) if k < vocab else None
        share = {n: 1.0 if kept is None else sum(t in kept for t in toks) / max(len(toks), 1) for n, toks in answers.items()}
        head_bytes = k * hidden * 2  # bf16 rows of the draft LM head, read once a draft step
        report["sizes"][k] = dict(coverage=share, head_mb=head_bytes / 1e6, head_us=head_bytes / COPY_BANDWIDTH * 1e6)
        print(f"{k:>7} " + " ".join(f"{share[n]:>10.4f}" for n in answers)
              + f" {head_bytes / 1e6:>8.1f} {head_bytes / COPY_BANDWIDTH * 1e6:>8.1f}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
