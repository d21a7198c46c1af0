"""Decode cost of a tensor-parallel target: plain and speculative ms per token at TP 1, 2, 4, 8.

    torchrun --nproc-per-node 8 benchmarks/tp.py [--tp 1 2 4 8] [--accept 4] [--prompt 512] [--out DIR]
    torchrun --nproc-per-node 2 benchmarks/tp.py --tiny          # CPU, gloo: a check of the script
    torchrun --nproc-per-node 1 benchmarks/tp.py --tp 1 --one-rank-group   # one GPU: the sharded path too

A Llama-3.1-8B-shaped target with random bf16 weights (``--tiny``: 4 layers, float32, CPU) on
every rank of a process group of each TP size (ranks 0 .. TP-1 of the launch; the others wait),
sharded by ``specgraph.compile(..., tp=group)`` (TP 1: no tp, the single-device engine). Per TP
size, on the same model:
  plain        compile(model, None): ms per decoded token
  speculative  an EAGLE-3-shaped head (random, full vocabulary, replicated on every rank) on
               Chain(--accept), synthetic_accept=--accept (tau = --accept: FORCED acceptance, the
               output is NOT the model's; benchmarks only, as e2e.py's synthetic section): ms per
               step and per token, and the speedup over plain at this TP size
Steady state: the difference of two generation lengths (prefill and the first step drop out), the
median of --repeats pairs, after a warm-up call (compile, CUDA-graph record). NCCL on GPUs (one
GPU per rank: LOCAL_RANK), gloo on CPUs. Rank 0 prints the table and writes DIR/tp-DATE.json.
``--one-rank-group``: TP 1 also through the sharded path, ``compile(..., tp=)`` over a group of one rank (the
all-reduce pass, the collectives inside the compiled step and its CUDA graph; what one GPU can run of TP),
against the single-device engine on the same model.
"""
from __future__ import annotations

import argparse
import json
import os
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from common import LLAMA_8B, step_ms  # first: sys.path (common.py)
import specgraph  # noqa: E402
from specgraph.drafts import Eagle3  # noqa: E402

warnings.filterwarnings("ignore", message="synthetic_accept")
TINY = dict(LLAMA_8B, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=8, vocab_size=1024)  # 8 KV heads: shardable up to TP 8


def make_target(shape: dict, device: torch.device, dtype: torch.dtype):
    """The same random model on every rank: made on its device from one seed (the same generator
    state on every device; compile's checksum comparison across ranks would refuse it otherwise)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**shape, torch_dtype=dtype)).to(dtype)
    return model.eval()


def measure(tp: int, group, args, shape, device, dtype, sharded: bool) -> list[dict]:
    """Plain and speculative figures at one TP size (every rank of ``group`` runs this); ``sharded``: through
    ``compile(..., tp=group)`` (always past TP 1), else the single-device engine."""
    tp_arg = group if sharded else None
    rows = []
    model = make_target(shape, device, dtype)
    torch.manual_seed(1)
    head = Eagle3.for_target(model).to(device, dtype)  # the same random head on every rank
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(3, shape["vocab_size"], (1, args.prompt), generator=g).to(device)
    max_length = args.prompt + args.long + 64
    for mode in ("plain", "speculative"):
        if mode == "plain":
            spec = specgraph.compile(model, None, backend=args.backend, max_cache_len=max_length, tp=tp_arg)
        else:
            spec = specgraph.compile(model, head, tree=specgraph.Chain(args.accept), backend=args.backend,
                                     max_cache_len=max_length, synthetic_accept=args.accept, tp=tp_arg)
        ms, tokens = step_ms(spec, prompt, args.short, args.long, device, args.repeats)
        rows.append(dict(tp=tp, sharded=sharded, mode=mode, ms_per_step=ms, tokens_per_step=tokens,
                         ms_per_token=ms / tokens))
        del spec
    rows[1]["speedup_over_plain"] = rows[0]["ms_per_token"] / rows[1]["ms_per_token"]
    specgraph.capture.Capture.release(model)
    del model, head
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8], help="TP sizes (each <= the launch's ranks)")
    parser.add_argument("--accept", type=int, default=4, help="the chain's depth = the forced tokens per step")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--short", type=int, default=64)
    parser.add_argument("--long", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backend", default="auto", help="compile's backend (auto: inductor on CUDA)")
    parser.add_argument("--tiny", action="store_true", help="a 4-layer float32 model on the CPU (gloo): a check")
    parser.add_argument("--one-rank-group", action="store_true",
                        help="TP 1 also sharded over a group of one rank (the TP code path on one device)")
    parser.add_argument("--out", type=Path, default=Path("docs/results"))
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    shape, dtype = (TINY, torch.float32) if args.tiny else (LLAMA_8B, torch.bfloat16)
    if args.tiny:
        args.prompt, args.short, args.long, args.repeats = min(args.prompt, 48), 8, 24, 1
    sizes = [tp for tp in args.tp if tp <= world]
    if rank == 0 and len(sizes) < len(args.tp):
        print(f"skipping TP sizes {[tp for tp in args.tp if tp > world]}: the launch has {world} ranks")
    results = []
    for tp in sizes:
        group = dist.new_group(list(range(tp)))  # every rank takes part in making each group
        if rank < tp:
            for sharded in ([False, True] if tp == 1 and args.one_rank_group else [tp > 1]):
                results += measure(tp, group, args, shape, device, dtype, sharded)
        dist.barrier()
    if rank == 0:
        print(f"{'TP':>3} {'sharded':>7} {'mode':<12} {'ms/step':>9} {'tok/step':>8} {'ms/token':>9} {'x plain':>8}")
        for r in results:
            print(f"{r['tp']:>3} {str(r['sharded']):>7} {r['mode']:<12} {r['ms_per_step']:>9.3f} {r['tokens_per_step']:>8.2f} "
                  f"{r['ms_per_token']:>9.3f} {r.get('speedup_over_plain', 1.0):>8.2f}")
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"tp{'-tiny' if args.tiny else ''}-{time.strftime('%Y%m%d-%H%M%S')}.json"
        device_name = torch.cuda.get_device_name() if cuda else "cpu"
        path.write_text(json.dumps(dict(shape="tiny" if args.tiny else "Llama-3.1-8B", device=device_name,
                                        world=world, backend=args.backend, args={k: str(v) for k, v in
                                                                                 vars(args).items()},
                                        results=results), indent=1))
        print(f"wrote {path}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
