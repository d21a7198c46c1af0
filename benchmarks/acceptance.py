"""Acceptance of trained heads on SmolLM2-135M-Instruct (or ``--target``), MT-bench turn 1: a tree sweep, then the
full report (all questions, greedy and T=1) for the best tree, a chain and the Medusa head.

    python3 benchmarks/acceptance.py --eagle3 DIR [--medusa DIR] --out DIR [--target MODEL]
        [--trees dynamic:8,8,64 chain7] [--skip RUN ...]

Phase 1 (greedy, ``--sweep-questions`` x ``--sweep-tokens``) runs the EAGLE-3 head on every tree
in SWEEP (or ``--sweep-trees``) and picks the highest τ among trees of at most 64 nodes; phase 2 runs all
``--questions`` at ``--max-new-tokens`` for: EAGLE-3 on the best tree and on the best chain,
Medusa on its own mc_sim_7b_63 tree and a chain, each greedy and T=1. Questions go
``--batch-size`` at a time (each row accepts on its own: greedy τ is that of batch 1).
``--trees BEST CHAIN`` skips the sweep (the trees a previous sweep picked); ``--skip`` leaves out
runs by name (e.g. ``eagle3-dyn8-8-64-T0``, measured before). The target runs in fp32 so greedy acceptance is the target's own. Writes one JSON and PNG per run
and summary.json; prints a table last. ``--budget-s`` stops between runs (what ran is kept).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

from common import MODELS, load_target  # first: sys.path (common.py)
import specgraph  # noqa: E402
from specgraph import Chain, DynamicTree  # noqa: E402
from specgraph.models import default_draft_path  # noqa: E402
from specgraph.train.evaluate import PROMPT_SETS, acceptance, plot, prompt_set  # noqa: E402
from specgraph.trees import NAMED_TREES, WithLookup, parse_tree  # noqa: E402

SWEEP = [Chain(3), Chain(5), Chain(7), DynamicTree(4, 4, 16), DynamicTree(5, 8, 32), DynamicTree(6, 8, 48),
         DynamicTree(6, 8, 64), DynamicTree(8, 8, 64), DynamicTree(10, 6, 64)]


def tree_name(tree) -> str:
    if isinstance(tree, WithLookup):
        return f"{tree_name(tree.tree)}-lookup{tree.depth}{'-shared' if tree.shared else ''}"
    if isinstance(tree, Chain):
        return f"chain{tree.depth}"
    if isinstance(tree, DynamicTree):
        return f"dyn{tree.steps}-{tree.topk}-{tree.nodes}"
    named = {"medusa": "mc_sim_7b_63", "eagle1": "eagle1"}  # the Medusa tree's name as in earlier results
    return next((named.get(name, name) for name, t in NAMED_TREES.items() if t == tree), f"static{tree.num_nodes}")


def slug(draft: str, tree, temperature: float) -> str:
    return f"{draft}-{tree_name(tree)}-T{temperature:g}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2", help=f"{' | '.join(MODELS)} | a .gguf path (default smollm2)")
    parser.add_argument("--eagle3", default=str(default_draft_path()), help="EAGLE-3 head directory (default: the shipped "
                        "SmolLM2 head)")
    parser.add_argument("--medusa", default=None, help="Medusa head directory")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--questions", type=int, default=80, help="the first N of the prompt set")
    parser.add_argument("--prompts", default="mt-bench", choices=list(PROMPT_SETS),
                        help="MT-bench first turns, HumanEval's function prompts (code no head trained on), "
                        "or the first turns of the ShareGPT conversations training holds out")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--sweep-questions", type=int, default=40)
    parser.add_argument("--sweep-tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--backend", default="eager", choices=["eager", "inductor"])
    parser.add_argument("--budget-s", type=float, default=1e9)
    parser.add_argument("--trees", nargs=2, type=parse_tree, metavar=("BEST", "CHAIN"), default=None,
                        help="skip the sweep: the EAGLE-3 tree and chain for the final runs")
    parser.add_argument("--skip", nargs="*", default=[], help="final runs to leave out, by name")
    parser.add_argument("--sweep-trees", nargs="+", type=parse_tree, default=None, metavar="TREE",
                        help="the trees phase 1 sweeps (chainK, dynamic:STEPS,TOPK,NODES, any of them +lookupK; "
                             "default: SWEEP)")
    parser.add_argument("--sweep-only", action="store_true", help="stop after phase 1")
    args = parser.parse_args()
    start = time.time()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer = load_target(args.target, torch.float32)
    model = model.to(device).eval()
    heads = {"eagle3": specgraph.drafts.Eagle3.from_pretrained(args.eagle3).to(device)}
    if args.medusa:
        heads["medusa"] = specgraph.drafts.Medusa.from_pretrained(args.medusa).to(device)
    args.out.mkdir(parents=True, exist_ok=True)
    summary = dict(prompts=args.prompts, date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
                   torch=torch.__version__, target=f"{args.target} (fp32)", eagle3=args.eagle3, runs={})
    specs = {}

    def run(draft: str, tree, temperature: float, questions: int, tokens: int, prefix: str = "") -> dict | None:
        name = prefix + slug(draft, tree, temperature)
        if name in args.skip:
            return None
        if time.time() - start > args.budget_s:
            tqdm.write(f"{name}: skipped (out of budget)")
            return None
        key = (draft, repr(tree))
        if key not in specs:
            specs[key] = specgraph.compile(model, heads[draft], tree=tree, backend=args.backend,
                                           max_batch=args.batch_size, max_cache_len=tokens + 1024)
        report = acceptance(specs[key], tokenizer, prompt_set(args.prompts, questions), tokens, temperature,
                            batch_size=args.batch_size)
        summary["runs"][name] = report
        (args.out / f"{name}.json").write_text(json.dumps(report, indent=2))
        (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
        tqdm.write(f"{name}: tau {report['tau']:.3f}, per-position {[round(r, 2) for r in report['position_rate']]}")
        return report

    sweep = {}
    for tree in tqdm((args.sweep_trees or SWEEP) if args.trees is None else [], desc="tree sweep"):
        report = run("eagle3", tree, 0.0, args.sweep_questions, args.sweep_tokens, prefix="sweep-")
        if report:
            sweep[repr(tree)] = (report["tau"], tree)
    summary["sweep"] = {k: v[0] for k, v in sweep.items()}
    if args.sweep_only:
        for name, r in summary["runs"].items():
            print(f"{name:<48} {r['questions']:>4} questions  tau {r['tau']:.3f}")
        return
    if args.trees:
        best, best_chain = args.trees
    else:
        best = max(sweep.values(), key=lambda v: v[0])[1]
        chains = [v for v in sweep.values() if isinstance(v[1], Chain)]
        best_chain = max(chains, key=lambda v: v[0])[1] if chains else Chain(best.max_depth)
    summary["best_tree"], summary["best_chain"] = repr(best), repr(best_chain)
    final = [("eagle3", best), ("eagle3", best_chain)]
    if "medusa" in heads:
        final += [("medusa", specgraph.MEDUSA_MC_SIM_7B_63), ("medusa", Chain(heads["medusa"].num_heads))]
    for temperature in (0.0, 1.0):
        for draft, tree in tqdm(final, desc=f"final T={temperature:g}"):
            report = run(draft, tree, temperature, args.questions, args.max_new_tokens)
            if report:
                plot(report, args.out / f"{slug(draft, tree, temperature)}.png")
    print(f"\n{'run':<42} {'questions':>9} {'tau':>6}  per-position acceptance")
    for name, r in summary["runs"].items():
        print(f"{name:<42} {r['questions']:>9} {r['tau']:>6.3f}  {[round(x, 2) for x in r['position_rate']]}")
        if len(r["per_category"]) > 1:
            print("    tau per category: " + ", ".join(f"{c} {v['tau']:.2f}" for c, v in r["per_category"].items()))
    print(f"best tree {summary['best_tree']}; {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
