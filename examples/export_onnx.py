"""Export the verify step to ONNX and speculate in onnxruntime, token-exact with model.generate.

    python examples/export_onnx.py [--max-new-tokens 32] [--out step.onnx] [--layers N]

spec.export writes one (batch, tree nodes) bucket of the target's verify step: the target over a
tree, greedy verification and KV compaction, with the KV cache as an explicit input and output and
specgraph's ops lowered to standard ONNX ops (docs/export.md). The exported graph holds no draft:
here the host drafts with prompt lookup (specgraph.drafts.NGram) and onnxruntime verifies.
"""
import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

import specgraph
from specgraph.models import load_gguf

NODES = 8  # tree nodes per verify step: the root (last committed token) + 7 drafted tokens in a chain


def chain(tokens: list[int], start: int) -> dict:
    """One verify step's inputs for a chain of NODES tokens whose root sits at cache length ``start``."""
    return {"input_ids": np.array([tokens]), "positions": np.arange(start, start + NODES)[None],
            "cache_len": np.array([start]), "tree_mask": np.array([[(1 << (i + 1)) - 1 for i in range(NODES)]]),
            "parents": np.arange(-1, NODES - 1)[None]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp()) / "step.onnx")
    parser.add_argument("--layers", type=int, default=None, help="keep only the first N decoder layers (a quick run)")
    args = parser.parse_args()

    model, tokenizer = load_gguf()
    if args.layers:  # a shorter model of the same kind: export time grows with depth
        model.model.layers = model.model.layers[: args.layers]
        model.config.num_hidden_layers = args.layers
    spec = specgraph.compile(model, specgraph.drafts.NGram(), tree=specgraph.Chain(NODES - 1), max_cache_len=256)
    start = time.perf_counter()
    spec.export(args.out, format="onnx", batch=1)
    print(f"exported {args.out} ({args.out.stat().st_size / 1e6:.0f} MB) in {time.perf_counter() - start:.0f} s")
    session = ort.InferenceSession(str(args.out), providers=["CPUExecutionProvider"])
    kv = np.zeros(next(i.shape for i in session.get_inputs() if i.name == "kv"), dtype=np.float32)

    messages = [{"role": "user", "content": "List the days of the week, then list them again in reverse order."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                           return_dict=True)["input_ids"]
    # Prefill: every prompt token but the last goes into the cache, NODES at a time (a chain of real
    # tokens; the padding of the last chunk writes slots past cache_len, which are never read).
    cache_len = 0
    for i in range(0, len(prompt) - 1, NODES):
        piece = prompt[i:min(i + NODES, len(prompt) - 1)]
        kv = session.run(None, {**chain(piece + [0] * (NODES - len(piece)), cache_len), "kv": kv})[3]
        cache_len += len(piece)
    # Decode: the host drafts, onnxruntime verifies; accept_len tokens are committed per step.
    sequence, steps, draft = list(prompt), [], specgraph.drafts.NGram()
    while len(sequence) - len(prompt) < args.max_new_tokens:
        guess = draft.propose(sequence, NODES - 1)
        tokens = [sequence[-1]] + guess + [0] * (NODES - 1 - len(guess))
        _, accept_len, emitted, kv = session.run(None, {**chain(tokens, cache_len), "kv": kv})
        sequence += emitted[0, : accept_len[0]].tolist()
        cache_len += int(accept_len[0])
        steps.append(int(accept_len[0]))
    new = sequence[len(prompt):][: args.max_new_tokens]

    ids = torch.tensor([prompt])
    want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                          do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    print(tokenizer.decode(new, skip_special_tokens=True))
    print(f"\n{len(new)} tokens in {len(steps)} onnxruntime verify steps (accepted per step: {steps})")
    print(f"token-exact with model.generate: {new == want}")
    if new != want:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
