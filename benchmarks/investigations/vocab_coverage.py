"""How much of the target's own answers a draft vocabulary can draft, greedy and sampled: the share of the
answer tokens of self-distilled data (``python -m specgraph.train.distill``'s ``state-{variant}.pt``, each
variant's answers so far) inside a shipped head's draft vocabulary and inside the K most frequent answer
tokens of the training conversations (``train.eagle3.select_vocab``'s rule), counted on the held-out ones.

A token outside the draft vocabulary is never drafted, so at T = 1 (coupled drafts: the target's draw is one
token) the share is a ceiling on the acceptance at every depth; greedy, on the first depth's.

    python3 benchmarks/investigations/vocab_coverage.py --state DIR \\
        --head specgraph/heads/smollm2-135m-instruct-eagle3 --sizes 8192 16384 24576 32768 --out FILE.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specgraph.drafts import Eagle3
from specgraph.train.eagle3 import select_vocab


def answers(state: Path) -> list[list[torch.Tensor]]:
    """Per conversation (distill's shuffled order: training holds out the first ones), its answers' ids."""
    progress = torch.load(state, weights_only=False)
    return [[torch.tensor(turn, dtype=torch.int64) for turn in conversation if turn]
            for conversation in progress["answers"]]


def training_vocab(variants: dict[str, list[list[torch.Tensor]]], held_out: int, size: int,
                   vocab_size: int) -> torch.Tensor:
    """``select_vocab``'s ``size`` tokens over every variant's answers, the first ``held_out`` conversations
    left out."""
    examples = [{"input_ids": turn, "loss_mask": torch.ones_like(turn, dtype=torch.bool)}
                for convs in variants.values() for conversation in convs[held_out:] for turn in conversation]
    return select_vocab(examples, size, vocab_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--state", required=True, type=Path, help="a folder of distill's state-{variant}.pt")
    parser.add_argument("--head", type=Path, help="an EAGLE-3 head folder whose t2d is measured too")
    parser.add_argument("--sizes", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--held-out", type=int, default=200, help="conversations held out (as training does)")
    parser.add_argument("--vocab-size", type=int, default=49152, help="the target's vocabulary")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    variants = {path.stem.removeprefix("state-"): answers(path) for path in sorted(args.state.glob("state-*.pt"))}
    if not variants:
        raise SystemExit(f"--state {args.state}: no state-*.pt (written by python -m specgraph.train.distill)")
    held = {name: torch.cat([t for c in convs[: args.held_out] for t in c]) for name, convs in variants.items()}
    vocabs = {f"top {k}": training_vocab(variants, args.held_out, k, args.vocab_size) for k in args.sizes}
    if args.head is not None:
        inside = Eagle3.from_pretrained(args.head).t2d.nonzero().flatten().cpu()
        vocabs[f"{args.head.name} ({len(inside)})"] = inside
    rows = {}
    for label, ids in vocabs.items():
        inside = torch.zeros(args.vocab_size, dtype=torch.bool)
        inside[ids] = True
        rows[label] = {name: round(inside[tokens].float().mean().item(), 4) for name, tokens in held.items()}
    print(f"held-out answer tokens: {', '.join(f'{n} {len(t):,}' for n, t in held.items())}")
    print(f"{'draft vocabulary':<44}" + "".join(f"{n:>10}" for n in held))
    for label, shares in rows.items():
        print(f"{label:<44}" + "".join(f"{shares[n]:>10.4f}" for n in held))
    if args.out:
        args.out.write_text(json.dumps({"state": str(args.state), "held_out_conversations": args.held_out,
                                        "held_out_tokens": {n: len(t) for n, t in held.items()},
                                        "coverage": rows}, indent=2))


if __name__ == "__main__":
    main()
