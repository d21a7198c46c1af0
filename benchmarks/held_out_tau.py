"""EAGLE-3 heads scored offline, as training scores them: the unrolled TTT forward over the target's own
greedy answers, without generating. Per head: ``tau`` (tokens per step of a greedy chain writing the
answers: ``train.eagle3.chain_walk``), ``tau_rows`` (the mean accepted length over every answer row: the
held-out τ training reported before, which weighs a stretch by its length, not by the steps spent on it),
the held-out loss and step-0 accuracy.

    python3 benchmarks/held_out_tau.py --heads shipped=specgraph/heads/smollm2-135m-instruct-eagle3 new=DIR \\
        --shards WORK/data --limit 60 --prompt-set mt-bench --prompts 30 --max-new-tokens 128 --out results.json

``--shards``: the held-out conversations of a ``python -m specgraph.train.distill`` folder (the first
``--held-out`` of its seeded order, their greedy variant, as ``specgraph train`` holds them out; with
``--first-answer N`` only the first N tokens of each first answer).
``--prompt-set``: first turns answered here by the target (fp32, greedy, ``model.generate``; ``--prompt-file``:
the first turns of ShareGPT-format files too); with
``--generate`` the chain also runs end to end (``specgraph.compile(target, head, tree=Chain(steps))``) on
the same prompts, whose τ the offline ``tau`` should equal (fp32: the same greedy tokens).
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
from tqdm import tqdm

from common import first_turn_ids, load_target  # first: sys.path
from specgraph.drafts import Eagle3  # noqa: E402
from specgraph.train.data import load_sharegpt  # noqa: E402
from specgraph.train.eagle3 import eagle3_loss  # noqa: E402
from specgraph.train.evaluate import prompt_set  # noqa: E402
from specgraph.train.loop import evaluate  # noqa: E402


def greedy_examples(model, tokenizer, name: str, n: int, max_new_tokens: int,
                    questions: list[dict] | None = None) -> list[dict]:
    """Prompt + the target's greedy answer (eos included, as generation commits it), loss on the answer, for
    the first ``n`` of prompt set ``name`` (or of ``questions``). One prompt a call: padding moves near-ties,
    and the chain would then write another answer."""
    out = []
    for question in tqdm(questions[:n] if questions is not None else prompt_set(name, n), desc=f"{name} answers",
                         leave=False):
        prompt = first_turn_ids(tokenizer, question)
        with torch.no_grad():
            answer = model.generate(input_ids=torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens,
                                    eos_token_id=tokenizer.eos_token_id)[0, len(prompt):].tolist()
        if tokenizer.eos_token_id in answer:
            answer = answer[: answer.index(tokenizer.eos_token_id) + 1]
        ids = torch.tensor(prompt + answer)
        out.append({"input_ids": ids, "loss_mask": torch.arange(len(ids)) >= len(prompt)})
    return out


def held_out_examples(shards: str, conversations: int, limit: int | None, first_answer: int | None) -> list[dict]:
    from specgraph.train.distill import first_answers, load_shards, split_held_out

    _, held = split_held_out(load_shards(shards), conversations)
    return (first_answers(held, first_answer) if first_answer else held)[:limit]


def chain_tau(model, head: Eagle3, examples: list[dict], steps: int) -> tuple[float, int]:
    """Tokens per step of ``Chain(steps)`` generating each example's answer from its prompt (one row a call),
    and how many answers it wrote otherwise (a near-tie decided apart from the batched ``model.generate``)."""
    import specgraph

    spec = specgraph.compile(model, head, tree=specgraph.Chain(steps),
                             max_cache_len=max(len(e["input_ids"]) for e in examples) + 2 * steps + 2)
    tokens = calls = other = 0
    for e in tqdm(examples, desc="chain, end to end", leave=False):
        prompt = int((~e["loss_mask"]).sum())
        n = len(e["input_ids"]) - prompt
        out = spec.generate(e["input_ids"][None, :prompt], max_new_tokens=n, eos_token_id=None,
                            return_dict_in_generate=True)
        other += out["sequences"][0].tolist() != e["input_ids"].tolist()
        lens = [step[0] for step in out["accept_lens"]]
        # the first token is the prefill's; the last step's tokens past n are not committed
        tokens, calls = tokens + n - 1, calls + len(lens)
    return tokens / calls, other


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", nargs="+", required=True, metavar="NAME=DIR")
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--shards", help="a python -m specgraph.train.distill folder: its held-out conversations")
    parser.add_argument("--held-out", type=int, default=200, help="conversations held out (specgraph train's default)")
    parser.add_argument("--limit", type=int, default=None, help="the first N held-out examples")
    parser.add_argument("--first-answer", type=int, default=None, metavar="N",
                        help="held-out examples cut after N tokens of their first answer (specgraph train "
                        "--held-out-first-answer)")
    parser.add_argument("--prompt-set", nargs="*", default=[], help="mt-bench, humaneval, sharegpt-held-out")
    parser.add_argument("--prompt-file", nargs="*", default=[], metavar="FILE",
                        help="ShareGPT-format files whose first turns are prompt sets too (e.g. python -m "
                        "specgraph.train.magpie's)")
    parser.add_argument("--prompts", type=int, default=30)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=7, help="TTT steps: the chain's depth")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--generate", action="store_true", help="also run the chain end to end on --prompt-set")
    parser.add_argument("--out", help="results JSON")
    args = parser.parse_args()
    model, tokenizer = load_target(args.target, torch.float32)
    model.eval().requires_grad_(False)
    sets = {}
    if args.shards:
        sets["held-out shards"] = held_out_examples(args.shards, args.held_out, args.limit, args.first_answer)
    for name in args.prompt_set:
        sets[name] = greedy_examples(model, tokenizer, name, args.prompts, args.max_new_tokens)
    for path in args.prompt_file:
        questions = [{"turns": [c[0]["content"]]} for c in load_sharegpt(path)]
        sets[path] = greedy_examples(model, tokenizer, path, args.prompts, args.max_new_tokens, questions)
    results = []
    for spec in args.heads:
        label, _, path = spec.partition("=")
        head = Eagle3.from_pretrained(path)
        problems = head.bind(model)  # the target's embedding (and LM head) where the checkpoint leaves them out
        if problems:
            raise SystemExit(f"--heads {spec}: {'; '.join(problems)}")
        loss_fn = eagle3_loss(model, head, steps=args.steps)
        for set_name, examples in sets.items():
            row = {"head": label, "set": set_name, "examples": len(examples),
                   **evaluate(head, loss_fn, examples, args.batch_size, torch.device("cpu"))}
            if args.generate and set_name != "held-out shards":
                row["tau_generated"], row["generated_otherwise"] = chain_tau(model, head, examples, args.steps)
            results.append(row)
            print(f"{label:>10} {set_name:>16} ({len(examples)}): tau {row['tau']:.3f}, tau_rows {row['tau_rows']:.3f}"
                  + (f", generated {row['tau_generated']:.3f} ({row['generated_otherwise']} answers differ)"
                     if "tau_generated" in row else "")
                  + f", loss {row['loss']:.3f}, acc_step0 {row['acc_step0']:.3f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
