"""How much of a text repeats itself: the share of answer tokens inside a W-token span the same answer
already had (what ``specgraph train --mask-repeats W`` drops). Of a self-distilled training set (overall
and within the first 256 tokens of each conversation's first answer), or of the target's own greedy
answers to a prompt set (HF ``generate``, fp32, batches of 20, eos stops):

    python3 benchmarks/repeats.py --shards DIR [--window 16] [--variants greedy]
    python3 benchmarks/repeats.py --prompt-set mt-bench humaneval --prompts 80 40 [--max-new-tokens 256]
"""
import argparse

import torch

from common import load_target  # first: sys.path
from specgraph.train.distill import load_shards, mask_repeats  # noqa: E402
from specgraph.train.evaluate import prompt_set as questions  # noqa: E402


def share(examples: list[dict], window: int, first: int | None = None) -> tuple[int, int]:
    """(repeated, total) loss tokens; ``first``: only the first ``first`` tokens of each first answer."""
    repeated = total = 0
    for before, after in zip(examples, mask_repeats(examples, window)):
        mask = before["loss_mask"]
        if first is not None and mask.any():
            start = int(mask.int().argmax())
            end = start + int(mask[start:].int().cumprod(0).sum().clamp(max=first))
            mask, kept = mask[start:end], after["loss_mask"][start:end]
        else:
            kept = after["loss_mask"]
        total += int(mask.sum())
        repeated += int(mask.sum()) - int(kept.sum())
    return repeated, total


def greedy_answers(prompt_set: str, n: int, max_new_tokens: int) -> list[dict]:
    model, tokenizer = load_target("smollm2", torch.float32)
    tokenizer.padding_side = "left"
    rows = [tokenizer.apply_chat_template([{"role": "user", "content": q["turns"][0]}], add_generation_prompt=True,
                                          tokenize=False) for q in questions(prompt_set, n)]
    answers = []
    for i in range(0, len(rows), 20):
        batch = tokenizer(rows[i:i + 20], return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.eval().generate(**batch, do_sample=False, max_new_tokens=max_new_tokens,
                                        pad_token_id=tokenizer.pad_token_id)
        for row in out[:, batch.input_ids.shape[1]:].tolist():
            row = row[: row.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in row else row
            answers.append({"input_ids": torch.tensor(row), "loss_mask": torch.ones(len(row), dtype=torch.bool)})
    return answers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", help="a folder written by python -m specgraph.train.distill")
    parser.add_argument("--variants", nargs="+", default=None)
    parser.add_argument("--prompt-set", nargs="*", default=[])
    parser.add_argument("--prompts", type=int, nargs="*", default=[80])
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--window", type=int, default=16)
    parser.add_argument("--first", type=int, default=256, help="tokens of each first answer (--shards)")
    args = parser.parse_args()
    if args.shards:
        examples = load_shards(args.shards, args.variants)
        for label, first in (("all answers", None), (f"first {args.first} tokens of first answers", args.first)):
            repeated, total = share(examples, args.window, first)
            print(f"{args.shards}, {label}: {repeated:,} of {total:,} loss tokens ({repeated / total:.1%}) inside a "
                  f"{args.window}-token span the answer already had")
    for name, n in zip(args.prompt_set, args.prompts * len(args.prompt_set) if len(args.prompts) == 1 else args.prompts):
        repeated, total = share(greedy_answers(name, n, args.max_new_tokens), args.window)
        print(f"{name}, {n} greedy answers of up to {args.max_new_tokens} tokens: {repeated:,} of {total:,} tokens "
              f"({repeated / total:.1%}) inside a {args.window}-token span the answer already had")


if __name__ == "__main__":
    main()
