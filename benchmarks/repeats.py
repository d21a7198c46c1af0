"""How much of a self-distilled training set repeats itself: the share of loss tokens inside a W-token span
the same answer already had (what ``specgraph train --mask-repeats W`` drops), overall and within the first
256 tokens of each conversation's first answer (the regime of a 256-token benchmark's first turns).

    python3 benchmarks/repeats.py SHARDS_DIR [--window 16] [--variants greedy]
"""
import argparse

from specgraph.train.distill import load_shards, mask_repeats


def first_answer_tokens(mask, limit: int) -> slice:
    """The first ``limit`` tokens of the first run of loss tokens."""
    start = int(mask.int().argmax())
    end = start
    while end < len(mask) and mask[end] and end - start < limit:
        end += 1
    return slice(start, end)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shards", help="a folder written by python -m specgraph.train.distill")
    parser.add_argument("--window", type=int, default=16)
    parser.add_argument("--variants", nargs="+", default=None)
    parser.add_argument("--first", type=int, default=256, help="tokens of each first answer")
    args = parser.parse_args()
    examples = load_shards(args.shards, args.variants)
    masked = mask_repeats(examples, args.window)
    total = sum(int(e["loss_mask"].sum()) for e in examples)
    kept = sum(int(e["loss_mask"].sum()) for e in masked)
    first_total = first_kept = 0
    for before, after in zip(examples, masked):
        if before["loss_mask"].any():
            span = first_answer_tokens(before["loss_mask"], args.first)
            first_total += span.stop - span.start
            first_kept += int(after["loss_mask"][span].sum())
    print(f"{len(examples)} examples, {total:,} loss tokens; inside a {args.window}-token span the answer already had: "
          f"{total - kept:,} ({(total - kept) / total:.1%}); in the first {args.first} tokens of first answers: "
          f"{first_total - first_kept:,} of {first_total:,} ({(first_total - first_kept) / first_total:.1%})")


if __name__ == "__main__":
    main()
