"""Attach specgraph to code that already calls model.generate or a text-generation pipeline.

    python examples/attach.py [--max-new-tokens 48]

After specgraph.attach(model, draft) the unchanged calls speculate with the draft (here the
EAGLE-3 head that ships with specgraph for SmolLM2-135M-Instruct) and return what they returned
before; specgraph.detach(model) puts the original generate back.
"""
import argparse

import torch
import transformers

import specgraph
from specgraph.models import load_default_draft, load_gguf


def existing_code(model, tokenizer, max_new_tokens: int):
    """Stands for the user's code: it knows nothing of specgraph."""
    tokenizer.padding_side = "left"
    batch = tokenizer(["The three primary colors are", "A haiku about autumn:", "Paris is"], return_tensors="pt",
                      padding=True)  # three rows of different lengths, left-padded
    sequences = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False)
    pipe = transformers.pipeline("text-generation", model=model, tokenizer=tokenizer)
    text = pipe("Tips for a first marathon:", max_new_tokens=max_new_tokens, do_sample=False)[0]["generated_text"]
    return sequences, text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args()

    model, tokenizer = load_gguf()
    before = existing_code(model, tokenizer, args.max_new_tokens)

    spec = specgraph.attach(model, load_default_draft(), tree=specgraph.DynamicTree(3, 4, 8), max_batch=4,
                            max_cache_len=128 + args.max_new_tokens)
    after = existing_code(model, tokenizer, args.max_new_tokens)
    specgraph.detach(model)

    print(after[1])
    same = torch.equal(before[0], after[0]) and before[1] == after[1]
    print(f"\nspeculated through the unchanged calls ({len(spec.capture.decode_steps)} decode-step buckets built); "
          f"same output as without specgraph: {same}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
