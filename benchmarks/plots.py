"""Plots for docs/benchmarks.md from saved results.

    python3 benchmarks/plots.py history HEAD_DIR/history.json out.png    # a training run's curves
    python3 benchmarks/plots.py sweep RESULTS_DIR out.png                 # τ per tree from acceptance JSONs
    python3 benchmarks/plots.py compare out.png RUN.json [RUN.json ...]   # per-position acceptance, runs overlaid
    python3 benchmarks/plots.py batch E2E.json out.png                    # e2e batch section: speedup vs batch
    python3 benchmarks/plots.py budget GEN.json out.png                   # generate.py --budgets: speedup vs tree budget
    python3 benchmarks/plots.py policy E2E.json out.png                   # e2e --batch-policy: what policy="cost" chose
    python3 benchmarks/plots.py confidence GEN.json out.png               # sg_eagle3_cost: budget vs draft confidence
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def smooth(values: list[float], window: int = 50) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def history(path: str, out: str) -> None:
    rows = json.loads(Path(path).read_text())
    steps = [r["step"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    left.plot(steps, smooth([r["loss"] for r in rows]), label="train (50-step mean)")
    evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    if evals:
        left.plot(*zip(*evals), "o-", label="held out")
    left.set(xlabel="step", ylabel="loss", title="loss")
    left.legend(fontsize=8)
    accs = sorted(k for k in rows[-1] if k.startswith("acc_step") or k.startswith("top1_head"))
    for k in accs:
        right.plot(steps, smooth([r.get(k, 0.0) for r in rows]), label=k)
    right.set(xlabel="step", ylabel="top-1 accuracy (train batches)", ylim=(0, 1), title="accuracy per draft step")
    right.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def sweep(results: str, out: str) -> None:
    """τ per tree: RESULTS_DIR/summary-T0.json's runs if present, else every greedy acceptance JSON there."""
    summary = Path(results) / "summary-T0.json"
    if summary.is_file():
        reports = json.loads(summary.read_text())["runs"]
    else:
        reports = [json.loads(p.read_text()) for p in sorted(Path(results).glob("*.json"))]
        reports = [r for r in reports if isinstance(r, dict) and r.get("temperature") == 0.0 and "tau" in r]
    reports.sort(key=lambda r: r["tau"])
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(reports) + 1.2))
    labels = [f"{r['tree']} ({r['questions']} q x {r['max_new_tokens']})" for r in reports]
    ax.barh(labels, [r["tau"] for r in reports], color="#4c72b0")
    for i, r in enumerate(reports):
        ax.text(r["tau"] + 0.02, i, f"{r['tau']:.2f}", va="center", fontsize=8)
    ax.set(xlabel="τ (tokens per target step), greedy", title="EAGLE-3 head on SmolLM2: τ per tree, MT-bench turn 1")
    ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def compare(out: str, *runs: str) -> None:
    """Per-position acceptance of several acceptance-report JSONs (tau, position_rate, draft, tree,
    temperature), one line each: T = 0 solid, T = 1 dashed."""
    fig, ax = plt.subplots(figsize=(8, 4))
    for path in runs:
        r = json.loads(Path(path).read_text())
        tree = r["tree"] if len(r["tree"]) < 40 else f"StaticTree ({r['tree'].count('(') - 2} choices)"
        ax.plot(range(1, len(r["position_rate"]) + 1), r["position_rate"], "o-" if r["temperature"] == 0 else "s--",
                label=f"{r['draft']} {tree}, T={r['temperature']:g}: τ {r['tau']:.2f}")
    ax.set(xlabel="draft position (depth)", ylabel="accepted at this depth", ylim=(0, 1),
           title="SmolLM2-135M-Instruct, MT-bench turn 1, 80 questions x 256 tokens")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def batch(path: str, out: str) -> None:
    """Speedup over plain decode vs batch size, one line per tree (e2e.py's batch section)."""
    r = json.loads(Path(path).read_text())
    rows = sorted(((int(k[1:]), v) for k, v in r["batch"].items()), key=lambda kv: kv[0])
    fig, ax = plt.subplots(figsize=(6, 3.6))
    trees = sorted({k[: -len("_speedup")] for _, v in rows for k in v if k.endswith("_speedup")})
    for tree in trees or ["chain"]:
        key = f"{tree}_speedup" if trees else "speedup"  # runs before the tree rows had one chain, "speedup"
        points = [(b, v[key]) for b, v in rows if key in v]
        ax.plot([b for b, _ in points], [s for _, s in points], "o-", label=tree)
    ax.axhline(1.0, color="gray", lw=0.8, ls=":")
    ax.set(xscale="log", xlabel="batch size", ylabel="speedup over plain decode",
           title=f"{r['shape']}, synthetic τ = 4, {r['device']}")
    ax.minorticks_off()
    ax.set_xticks([b for b, _ in rows], [str(b) for b, _ in rows])
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def budget(path: str, out: str) -> None:
    """Tokens/s over specgraph's plain decode (and τ) per tree budget, from generate.py --budgets."""
    r = json.loads(Path(path).read_text())
    methods = r["methods"]
    plain = methods["sg_plain"]["tokens_per_s"]
    points = sorted((int(name.removeprefix("sg_eagle3_tree")), m) for name, m in methods.items()
                    if name.removeprefix("sg_eagle3_tree").isdigit())
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot([n for n, _ in points], [m["tokens_per_s"] / plain for _, m in points], "o-",
            label="EAGLE-3, DynamicTree(8, 8, N)")
    for n, m in points:
        ax.annotate(f"τ {m['tau']:.2f}", (n, m["tokens_per_s"] / plain), fontsize=7, xytext=(3, 4),
                    textcoords="offset points")
    from specgraph.trees import parse_tree  # other tree specs (generate.py --trees): one point each
    for name, m in methods.items():
        if name.startswith("sg_eagle3@"):
            spec = name.removeprefix("sg_eagle3@")
            n, y = parse_tree(spec).num_nodes, m["tokens_per_s"] / plain
            ax.plot([n], [y], "s", color="tab:green")
            ax.annotate(f"{spec} τ {m['tau']:.2f}", (n, y), fontsize=6, xytext=(3, -9), textcoords="offset points")
            points.append((n, m))
    if "hf_static" in methods:
        ax.axhline(methods["hf_static"]["tokens_per_s"] / plain, color="tab:red", lw=0.8, ls="--",
                   label="HF static cache + compile")
    ax.axhline(1.0, color="gray", lw=0.8, ls=":", label="specgraph plain decode")
    ax.set(xscale="log", xlabel="tree budget (nodes)", ylabel="tokens/s over plain decode",
           title=f"SmolLM2-135M bf16, batch 1, {r['gpu']}")
    ticks = sorted({n for n, _ in points})
    ax.minorticks_off()
    ax.set_xticks(ticks, [str(n) for n in ticks])
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def policy(path: str, out: str) -> None:
    """e2e.py --batch-policy: whole-call tokens/s over plain decoding per batch size, of each fixed mode run and of
    policy="cost", and (right) the share of the policy's calls each mode ran."""
    r = json.loads(Path(path).read_text())
    rows = sorted(((int(k[1:]), v) for k, v in r["batch"].items() if "cost_call_tok_s" in v), key=lambda kv: kv[0])
    fixed = [k.removesuffix("_call_tok_s") for k in rows[0][1]
             if k.endswith("_call_tok_s") and not k.startswith("cost")]
    steady = all("cost_steady_call_tok_s" in v for _, v in rows)  # results before the settled window lack it
    modes = sorted({m for _, v in rows for m in v["cost_calls"]})
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    for name in fixed:
        left.plot([b for b, _ in rows], [v[f"{name}_call_tok_s"] / v["plain_call_tok_s"] for _, v in rows], "o--",
                  label=f"fixed: {name}")
    left.plot([b for b, _ in rows], [v["cost_x_plain"] for _, v in rows], "s-", color="black",
              label='policy="cost", first calls' if steady else 'policy="cost"')
    for b, v in rows:
        left.annotate(f"{v['cost_of_best']:.3f} of {v['best_fixed']}", (b, v["cost_x_plain"]), fontsize=7,
                      xytext=(3, -10), textcoords="offset points")
    if steady:
        left.plot([b for b, _ in rows], [v["cost_steady_x_plain"] for _, v in rows], "s-", color="grey",
                  label='policy="cost", settled')
        for b, v in rows:
            left.annotate(f"{v['cost_steady_of_best']:.3f}", (b, v["cost_steady_x_plain"]), fontsize=7,
                          xytext=(3, 4), textcoords="offset points")
    left.set(xscale="log", xlabel="batch size", ylabel="whole-call tokens/s over plain", title="speed")
    bottom = [0.0] * len(rows)
    for mode in modes:
        share = [v["cost_calls"].get(mode, 0) / sum(v["cost_calls"].values()) for _, v in rows]
        right.bar([str(b) for b, _ in rows], share, bottom=bottom, label=mode)
        bottom = [x + y for x, y in zip(bottom, share)]
    right.set(xlabel="batch size", ylabel="share of the policy's calls", title="modes chosen (first calls)" if steady else "modes chosen")
    for ax in (left, right):
        ax.legend(fontsize=7)
    left.minorticks_off()
    left.set_xticks([b for b, _ in rows], [str(b) for b, _ in rows])
    fig.suptitle(f"{r['shape']}, synthetic τ = 4, {r['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def confidence(path: str, out: str) -> None:
    """generate.py sg_eagle3_cost: per call, the budget (nodes) the policy chose against the draft's confidence
    it knew when choosing (the latest DynamicTree call's expected accepted nodes), and (right) each DynamicTree
    call's τ against its own confidence: how well the draft's confidence predicts acceptance."""
    r = json.loads(Path(path).read_text())
    m = r["methods"]["sg_eagle3_cost"]
    nodes, calls = m["policy_nodes"], m["policy_history"]
    known, chose = [], []
    for call in calls:
        if known:  # the first call had no confidence to go on
            chose.append((known[-1], nodes[call["mode"]]))
        if call["confidence"] is not None:
            known.append(call["confidence"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    left.scatter([c for c, _ in chose], [n for _, n in chose], s=12, alpha=0.6)
    left.set(yscale="log", xlabel="draft confidence known when choosing (expected accepted nodes)",
             ylabel="nodes verified by the chosen mode", title=f'policy="cost": {len(calls)} calls')
    left.set_yticks(sorted(set(nodes.values()) - {0}), [str(n) for n in sorted(set(nodes.values()) - {0})])
    trees = [c for c in calls if c["confidence"] is not None]
    right.scatter([c["confidence"] for c in trees], [c["tau"] for c in trees], s=12, alpha=0.6)
    right.set(xlabel="the call's draft confidence", ylabel="τ of the call", title="confidence against acceptance")
    fig.suptitle(f"SmolLM2-135M, shipped EAGLE-3 head, batch 1, {r.get('gpu', '')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    command = sys.argv[1]
    if command == "compare":
        compare(*sys.argv[2:])
    else:
        {"history": history, "sweep": sweep, "batch": batch, "budget": budget, "policy": policy,
         "confidence": confidence}[command](*sys.argv[2:4])
