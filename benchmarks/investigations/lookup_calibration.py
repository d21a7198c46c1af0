"""How often a prompt-lookup proposal is accepted, by the length of the n-gram it matched: the rates a shared
lookup branch is ranked by (``drafts/lookup.py`` ``LOOKUP_FIRST``, ``LOOKUP_GO_ON``), measured on self-distilled answers.

    python3 benchmarks/investigations/lookup_calibration.py --shards DIR [--examples 2000] [--every 3]
        [--depth 12] [--out FILE]

DIR: ``python -m specgraph.train.distill``'s output (its greedy shards: the target's own answers to ShareGPT, not
the benchmarks' prompts). At every ``--every``-th answer token t of each example, the lookup runs over the
tokens before t exactly as ``NGramSession`` does (``lookup_on_device``, max_ngram 3, min_ngram 1) and its
``--depth`` proposed tokens are compared with the answer's own t, t+1, ...: under greedy verification a
proposal is accepted up to its first mismatch. Per matched n (0: none): how many positions, the share whose
first token is accepted, and the share that goes on from each accepted token to the next (tokens d >= 2 over
tokens d >= 1 accepted, up to ``--depth``): the two numbers a geometric score ``log first + (d - 1) log go_on``
needs.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tqdm import tqdm

from specgraph.drafts.ngram import lookup_on_device
from specgraph.train.distill import load_shards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=Path, required=True)
    parser.add_argument("--examples", type=int, default=2000)
    parser.add_argument("--every", type=int, default=3, help="every k-th answer token")
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--rows", type=int, default=256, help="positions looked up at once")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    examples = load_shards(args.shards, ["greedy"])
    step = max(1, len(examples) // args.examples)
    examples = examples[::step][: args.examples]
    k = args.depth
    # per n: positions, accepted[d] = positions whose first d + 1 proposed tokens were all accepted
    counts = {n: [0, [0] * k] for n in range(4)}
    for ex in tqdm(examples, desc="examples"):
        ids, mask = ex["input_ids"], ex["loss_mask"]
        answer = mask.nonzero().flatten()
        positions = answer[answer >= 1][:: args.every]
        for chunk in positions.split(args.rows):
            seq = ids.expand(len(chunk), -1).contiguous()
            proposal, n = lookup_on_device(seq, chunk, k, 3, 1)  # the tokens before t: length t, root ids[t - 1]
            ahead = (chunk.view(-1, 1) + torch.arange(k)).clamp(max=len(ids) - 1)
            truth = ids[ahead]
            inside = mask[ahead] & (chunk.view(-1, 1) + torch.arange(k) < len(ids))  # the same answer only
            good = ((proposal == truth) & inside).to(torch.int64).cumprod(1)  # [P, K]: accepted so far
            for value in range(4):
                rows = n.clamp(max=3) == value
                counts[value][0] += int(rows.sum())
                sums = good[rows].sum(0).tolist()
                counts[value][1] = [a + b for a, b in zip(counts[value][1], sums)]
    table = {}
    print(f"{len(examples)} examples of {args.shards}, every {args.every}th answer token, {k}-token proposals")
    print(f"{'n':>3} {'positions':>10} {'first':>7} {'go on':>7}   accepted >= d, d = 1 ..")
    for n, (total, accepted) in counts.items():
        first = accepted[0] / max(total, 1)
        go_on = sum(accepted[1:]) / max(sum(accepted[:-1]), 1)
        table[n] = dict(positions=total, first=first, go_on=go_on, accepted=[a / max(total, 1) for a in accepted])
        print(f"{n:>3} {total:>10} {first:>7.3f} {go_on:>7.3f}   "
              + " ".join(f"{a / max(total, 1):.2f}" for a in accepted))
    if args.out:
        args.out.write_text(json.dumps(dict(shards=str(args.shards), examples=len(examples), every=args.every,
                                            depth=k, by_match_length=table), indent=1))


if __name__ == "__main__":
    main()
