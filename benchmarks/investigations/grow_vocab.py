"""A trained EAGLE-3 head with a larger draft vocabulary and no further training: the K most frequent answer tokens
of self-distilled data (``python -m specgraph.train.distill``'s ``state-{variant}.pt``, the held-out conversations
left out: ``vocab_coverage.training_vocab``), the head's own LM-head rows carried by token id, and the new tokens' rows
either mapped from the target's LM-head rows (``train.eagle3.warm_start`` as ``specgraph train --init-from``
does) or left at a random initialisation. Measure the result with ``benchmarks/acceptance.py --eagle3 OUT``.

    python3 benchmarks/investigations/grow_vocab.py --state DIR --size 16384 --init mapped --out DIR
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from specgraph.drafts import Eagle3
from specgraph.models import default_draft_path, load_gguf
from specgraph.train.eagle3 import warm_start
from vocab_coverage import answers, training_vocab  # this folder's


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--state", required=True, type=Path, help="a folder of distill's state-{variant}.pt")
    parser.add_argument("--head", type=Path, default=default_draft_path(), help="the head to grow (default: shipped)")
    parser.add_argument("--size", type=int, default=16384, help="draft vocabulary of the grown head")
    parser.add_argument("--init", choices=("mapped", "random"), default="mapped", help="the new tokens' rows")
    parser.add_argument("--held-out", type=int, default=200, help="conversations left out of the count")
    parser.add_argument("--seed", type=int, default=0, help="the random initialisation's")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()

    target, _ = load_gguf()
    source = Eagle3.from_pretrained(args.head)
    variants = {path.stem: answers(path) for path in sorted(args.state.glob("state-*.pt"))}
    vocab = training_vocab(variants, args.held_out, args.size, target.config.vocab_size)
    torch.manual_seed(args.seed)
    grown = Eagle3.for_target(target, draft_vocab=vocab, aux_layer_ids=source.aux_layer_ids,
                              aux_convention=source.aux_convention)
    rows = target.get_output_embeddings().weight if args.init == "mapped" else None
    print("\n".join(warm_start(grown, source, rows)[-2:]))
    grown.save_pretrained(args.out)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
