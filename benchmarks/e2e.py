"""End-to-end decode cost on a Llama-3.1-8B-shaped target (or --shape smollm2) with random bf16 weights (GPU).

    python benchmarks/e2e.py [--sections floor cublas plain verify synthetic batch profile] [--prompt 1024]
                             [--budget-s 500] [--out DIR] [--shape llama8b|smollm2|qwen1.5b|tiny]

Every figure is measured in this run, on the same model:
  floor      bytes streamed per decode step (all weights but the embedding table, plus the KV cache
             at the prompt length) / the copy bandwidth measured now
  cublas     the bare chain of the step's matrix products (F.linear on the model's own weights,
             M = 1) captured as one CUDA graph: what a perfect engine would still pay; and the same
             with q/k/v and gate/up each one product (fused_chain_ms: what fuse_projections runs)
  plain      specgraph.compile(model, None, backend="inductor"), whole step, CUDA graphs:
             ms per decoded token (steady state: the difference of two generation lengths), and
             replay_ms_per_token: the recorded step graph replayed back to back (device time, no host)
  verify     the same engine verifying N = 8 and N = 64 nodes per step (NGram draft, chain,
             synthetic_accept=1 so each step emits one token): ms per step, and / plain; and the
             recorded step graph replayed back to back (device time), and / plain's replay
  synthetic  an EAGLE-3-shaped head (random, full vocabulary) on Chain(4), synthetic_accept=4
             (tau = 4): the measured speedup over plain, against the ideal
             tau / (t_verify(N) / t_decode + S * c), c = draft bytes / target bytes per step
  batch      plain, and the synthetic head (tau = 4) on Chain(4) and on an EAGLE-2 DynamicTree(4, 4, 16),
             at B = 1, 4, 16, 64 (--batches; --batch-trees picks the trees, tree8 the same drafting with 8 nodes
             verified): tokens/s and speedup, saved after every figure (plot: plots.py batch); --batch-policy:
             also policy="cost" over the 16-node tree (its modes: 16 and 8 nodes, a chain of 4, plain)
             under the same forced τ, after its warmup: tokens/s over its first 12 whole calls (prefill
             included; it learns each mode's τ) and over the 36 after them (settled), against 4 whole calls
             of each fixed mode run (plain and --batch-trees), and the modes it ran in each window
  profile    torch.profiler over --profile-steps plain decode steps at the prompt's context (the
             recorded step graph replayed back to back): device time per step by kernel kind
             (matmul, attention, copy, reduction, elementwise, other) against the wall time per
             step; the top ops by self CPU and device time in DIR/e2e-profile-DATE.txt
  profile_verify  the same for verify steps of each --profile-verify-n nodes (NGram chain,
             synthetic_accept=1): where the verify step's time over plain decode goes
             (DIR/e2e-profile-verify-nN-DATE.txt)
  profile_draft  the same for whole speculative steps with an EAGLE-3 head on each --profile-draft-trees
             tree (synthetic_accept=1): verify, accept, commit and the draft's levels; against
             profile_verify at the tree's node count, what drafting costs. --shape smollm2 uses the
             shipped SmolLM2 head (its 8,192-token draft vocabulary), others a random full-vocabulary one
             (DIR/e2e-profile-draft-TREE-DATE.txt)
--shape smollm2: SmolLM2-135M's config with random weights (the small-model regime, where launches
and not bytes set the step's time); --shape qwen1.5b: Qwen2.5-Coder-1.5B's products (Llama-shaped, no
q/k/v biases), between the two; --tiny: a 4-layer model of the same kinds (for a quick check of
the script, not for numbers).
--inductor KEY=VALUE ...: torch._inductor.config values for an experiment (combo_kernels=1,
triton.enable_pdl=1), recorded in the JSON.
Sections run in order until --budget-s is spent; what ran is written to DIR/e2e-DATE.json.
SPECGRAPH_SKIP_PASSES=fold_rotary (any speed-up pass) runs the same sections without it, for an A/B
(SPECGRAPH_SKIP_FAST_PATHS=topk,fuse_projections: the draft-side fast paths off, specgraph/fast_paths.py);
the JSON records them, with the argmax's chunk and fold_rotary's row limits.
synthetic_accept output is NOT the model's (benchmarks only).
"""
from __future__ import annotations

import json
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from common import (LLAMA_8B, QWEN_1_5B, SMOLLM2, TINY, copy_bandwidth, run_settings,  # first: sys.path
                    set_inductor_options, set_tile_overrides, step_ms, sync)
import specgraph  # noqa: E402
from specgraph import config  # noqa: E402
from specgraph.cli_args import Parser, RawDescriptionDefaultsShown  # noqa: E402
from specgraph.drafts import Eagle3, NGram  # noqa: E402
from specgraph.models import load_default_draft  # noqa: E402
from specgraph.trees import parse_tree  # noqa: E402

warnings.filterwarnings("ignore", message="synthetic_accept")
SECTIONS = ("floor", "cublas", "plain", "verify", "synthetic", "batch", "profile", "profile_verify",
            "profile_draft")
SHAPES = {"llama8b": ("Llama-3.1-8B", LLAMA_8B), "smollm2": ("SmolLM2-135M", SMOLLM2),
          "qwen1.5b": ("Qwen2.5-1.5B", QWEN_1_5B), "tiny": ("tiny", TINY)}
BATCH_TREES = {"chain": specgraph.Chain(4), "tree": specgraph.DynamicTree(steps=4, topk=4, nodes=16),
               "tree8": specgraph.DynamicTree(steps=4, topk=4, nodes=8)}
POLICY_CALLS = 12  # timed generate calls of the cost policy per batch size, right after its warmup (it learns τ)
POLICY_STEADY_CALLS = 36  # then timed again: the policy settled, refreshing other modes' τ ever less often
FIXED_CALLS = 4  # whole calls of each fixed mode, timed the same way (their speed does not drift)


def calls_tok_s(spec, ids: torch.Tensor, new_tokens: int, device, calls: int) -> float:
    """Tokens/s over ``calls`` whole generate calls (prefill included), as a user times them; compiled
    and recorded already (the caller warmed the spec up)."""
    sync(device)
    start = time.perf_counter()
    tokens = sum(spec.generate(ids, max_new_tokens=new_tokens, eos_token_id=None).shape[1] - ids.shape[1]
                 for _ in range(calls)) * ids.shape[0]
    sync(device)
    return tokens / (time.perf_counter() - start)


def policy_row(spec, ids: torch.Tensor, new_tokens: int, device, fixed_call_tok_s: dict[str, float]) -> dict:
    """policy="cost" after ``warmup`` (every mode compiled, its step timed into the cost table): tokens/s
    over POLICY_CALLS whole calls, against each fixed mode's (``fixed_call_tok_s``, the same calls), and
    how many calls each mode ran."""
    b = ids.shape[0]
    spec.warmup((b,))
    best = max(fixed_call_tok_s, key=fixed_call_tok_s.get)
    row = dict(best_fixed=best)
    for prefix, calls in (("cost", POLICY_CALLS), ("cost_steady", POLICY_STEADY_CALLS)):
        before = dict(spec.policy.calls)
        tok_s = calls_tok_s(spec, ids, new_tokens, device, calls)
        row.update({f"{prefix}_call_tok_s": tok_s, f"{prefix}_x_plain": tok_s / fixed_call_tok_s["plain"],
                    f"{prefix}_of_best": tok_s / fixed_call_tok_s[best],
                    f"{prefix}_calls": {m: n - before.get((bb, m), 0) for (bb, m), n in spec.policy.calls.items()
                                        if bb == b and n > before.get((bb, m), 0)}})
    row["cost_ms_per_step"] = {m: spec.policy.table.get(b, m) * 1e3 for m in spec.modes
                               if spec.policy.table.get(b, m) is not None}
    return row


def make_target(shape: dict, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**shape, torch_dtype="bfloat16")).to(torch.bfloat16)
    return model.eval()


def streamed_bytes(model, context: int) -> tuple[int, int]:
    """(weight bytes read per decode step: all but the input embedding table, which a tied LM head
    streams whole, KV bytes at ``context``)."""
    embed = model.get_input_embeddings().weight
    weights = sum(p.numel() * p.element_size() for p in model.parameters() if p is not embed)
    if model.get_output_embeddings().weight is embed:  # tied: the LM head reads the table every step
        weights += embed.numel() * embed.element_size()
    c = model.config
    kv = 2 * c.num_hidden_layers * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * context * 2
    return weights, kv


def cublas_chain_ms(model, fused: bool = False, iters: int = 50) -> float:
    """The decode step's matrix products alone (q/k/v/o, gate/up/down, LM head at M = 1), one CUDA graph.
    ``fused``: q/k/v and gate/up each as one product on a concatenated copy of their weights (what the
    fuse_projections pass makes of the step)."""
    from specgraph.passes.fuse_projections import projection_groups

    weights, grouped = [], set()
    for linears in projection_groups(model) if fused else ():
        weights.append(torch.cat([m.weight.detach() for m in linears]))
        grouped.update(id(m) for m in linears)
    weights += [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear) and id(m) not in grouped]
    x = {w.shape[1]: torch.randn(1, w.shape[1], device="cuda", dtype=w.dtype) for w in weights}

    def chain():
        for w in weights:
            F.linear(x[w.shape[1]], w)

    chain()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    return replay_ms(graph.replay, iters)


def replay_ms(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def step_graph_ms(spec, steps: int = 64) -> float | None:
    """Device time per decode step with no host loop: the bucket's recorded CUDA graph replayed
    back to back (``replay_ms``): the same kernels and bytes as a step (its token inputs stay the last
    step's; it writes the next cache slots, and max_cache_len leaves 128 past the longest generate).
    None without a recorded graph."""
    graph = recorded_graph(spec)
    return replay_ms(graph.replay, steps) if graph is not None else None


def recorded_graph(spec):
    """The CUDA graph of the bucket this section's generate built last (the Capture, shared across
    compiles, keeps earlier ones); None without one."""
    graphs = [b.run.graph for b in spec.capture.decode_steps.values() if getattr(b.run, "graph", None) is not None]
    return graphs[-1] if graphs else None


def decode_figures(spec, prompt, args, device, res) -> dict:
    """ms per token through generate (host loop included) and per graph replay (device only), each
    against the floor and the cuBLAS chains measured earlier in the run."""
    ms, tau = step_ms(spec, prompt, args.short, args.long, device)
    out = dict(ms_per_token=ms, tau=tau)
    device_ms = step_graph_ms(spec)  # None off CUDA: nothing recorded
    if device_ms is not None:
        out["replay_ms_per_token"] = device_ms
    for k, v in (("floor", "floor_ms"), ("cublas", "chain_ms"), ("cublas", "fused_chain_ms")):
        if k in res:
            out[f"x_{k}_{v}"] = ms / res[k][v]
            if device_ms is not None:
                out[f"replay_x_{k}_{v}"] = device_ms / res[k][v]
    return out


KERNEL_KINDS = (  # (kind, substrings of kernel names), first match wins
    ("attention", ("tree_attention", "merge_splits")),
    ("matmul", ("gemm", "nvjet", "cutlass", "splitk", "cublas", "sm90_xmma", "fused_linear")),
    ("reduction", ("triton_red", "triton_per")),  # before copy: inductor's names hold "_to_copy"
    ("elementwise", ("triton_poi",)),
    ("copy", ("memcpy", "memset", "copy", "kv_write", "compact_kv")),
)


def profile_steps(spec, prompt: torch.Tensor, steps: int, device: str):
    """torch.profiler over ``steps`` decode steps at the prompt's full context: on CUDA the bucket's
    recorded step graph replayed back to back (device work only, as ``step_graph_ms``); elsewhere
    ``generate`` itself. Returns ({kind}_ms: device time per step by kernel kind, and the wall time
    per step), and the profiler's key averages."""
    spec.generate(prompt, max_new_tokens=steps, eos_token_id=None)  # compiled and recorded
    graph = recorded_graph(spec)
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if device == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        if graph is not None:
            for _ in range(steps):
                graph.replay()
            taken = steps
        else:
            out = spec.generate(prompt, max_new_tokens=steps, eos_token_id=None, return_dict_in_generate=True)
            taken = len(out["accept_lens"])
        sync(device)
        wall = time.perf_counter() - start
    per_kind = {kind: 0.0 for kind, _ in KERNEL_KINDS} | {"other": 0.0}
    for event in prof.events():  # the device's own events (kernels, copies): no double counting
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = event.name.lower()
        kind = next((k for k, keys in KERNEL_KINDS if any(x in name for x in keys)), "other")
        per_kind[kind] += event.time_range.elapsed_us() / 1e3 / taken
    table = prof.key_averages()
    ms = {f"{kind}_ms": value for kind, value in per_kind.items()}
    ms.update(device_ms=sum(per_kind.values()), wall_ms=wall * 1e3 / taken, replayed=graph is not None)
    return ms, table


def profile_section(spec, prompt, args, device, label: str, **extra) -> dict:
    """profile_steps' figures, its two tables written to DIR/e2e-LABEL-DATE.txt."""
    ms, kernels = profile_steps(spec, prompt, args.profile_steps, device)
    text = (kernels.table(sort_by="self_cpu_time_total", row_limit=40) + "\n\n" +
            kernels.table(sort_by="self_cuda_time_total" if device == "cuda" else "self_cpu_time_total",
                          row_limit=60, max_name_column_width=160))
    name = f"e2e-{label}-{time.strftime('%Y-%m-%d')}.txt"
    (args.out / name).write_text(text)
    return dict(file=name, steps=args.profile_steps, **extra, **ms)


def main() -> None:
    parser = Parser(description=__doc__, formatter_class=RawDescriptionDefaultsShown)  # defaults in --help
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS)
    parser.add_argument("--prompt", type=int, default=1024, help="prompt tokens (random ids)")
    parser.add_argument("--short", type=int, default=16, help="new tokens of the shorter timed generation")
    parser.add_argument("--long", type=int, default=144, help="new tokens of the longer timed generation")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--batch-policy", action="store_true", help="batch: also policy='cost' (see above)")
    parser.add_argument("--batch-trees", nargs="+", default=list(BATCH_TREES), choices=list(BATCH_TREES),
                        help="the trees the batch section runs (each against plain decode)")
    parser.add_argument("--budget-s", type=float, default=1e9)
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--shape", default="llama8b", choices=SHAPES,
                        help="the target's config (random bf16 weights): llama8b, smollm2 (SmolLM2-135M), qwen1.5b, tiny")
    parser.add_argument("--tiny", action="store_true", help="= --shape tiny")
    parser.add_argument("--profile-steps", type=int, default=32, help="decode steps the profile section records")
    parser.add_argument("--profile-verify-n", type=int, nargs="+", default=[64],
                        help="nodes per step profile_verify records (one profile each)")
    parser.add_argument("--profile-draft-trees", nargs="+", default=["chain4", "dynamic:8,8,64"],
                        help="trees profile_draft records (chainK, dynamic:STEPS,TOPK,NODES)")
    parser.add_argument("--inductor", nargs="*", default=[], metavar="KEY=VALUE",
                        help="torch._inductor.config values for an experiment, e.g. combo_kernels=1 triton.enable_pdl=1")
    parser.add_argument("--tiles", nargs="*", default=[], metavar="[M,]N,K=TILE",
                        help="fused_linear's tile for an [N, K] weight's products at M rows (all row counts without "
                        "M): BLOCK_M,BLOCK_N,BLOCK_K,WARPS,STAGES[,SPLIT_K], e.g. 32,576,1536=32,16,128,4,3,3")
    args = parser.parse_args()
    inductor = set_inductor_options(args.inductor)
    set_tile_overrides(args.tiles)
    begin = time.time()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape_name, shape = SHAPES["tiny" if args.tiny else args.shape]
    model = make_target(shape, device)
    cache_len = args.prompt + args.long + 128
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt), device=device)
    res = dict(date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
               torch=torch.__version__, shape=shape_name, prompt=args.prompt,
               cuda_graphs="1" if config.cuda_graphs else "0", inductor=inductor, **run_settings())
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"e2e-{res['date']}.json"

    def save(section: str, **values) -> None:
        res[section] = values
        path.write_text(json.dumps(res, indent=2))
        show = lambda v: f"{v:.4g}" if isinstance(v, float) else (  # noqa: E731
            "{" + ", ".join(f"{k} {show(x)}" for k, x in v.items()) + "}" if isinstance(v, dict) else str(v))
        tqdm.write(f"{section}: {show(values)}")

    def spec_for(draft, tree, batch=1, accept=None, policy="fixed"):
        return specgraph.compile(model, draft, tree=tree, backend="inductor", max_batch=batch,
                                 max_cache_len=cache_len, synthetic_accept=accept, policy=policy)

    for section in tqdm(args.sections, desc="sections"):
        if time.time() - begin > args.budget_s:
            tqdm.write(f"{section}: skipped (out of budget)")
            continue
        if section == "floor":
            weights, kv = streamed_bytes(model, args.prompt)
            bw = copy_bandwidth() if device == "cuda" else float("nan")
            save("floor", weight_gb=weights / 1e9, kv_gb=kv / 1e9, copy_tbs=bw / 1e12,
                 floor_ms=(weights + kv) / bw * 1e3, weights_only_floor_ms=weights / bw * 1e3)
        elif section == "cublas" and device == "cuda":
            save("cublas", chain_ms=cublas_chain_ms(model), fused_chain_ms=cublas_chain_ms(model, fused=True))
        elif section == "plain":
            save("plain", **decode_figures(spec_for(None, None), prompt, args, device, res))
        elif section == "verify":
            out = {}
            for n in (8, 64):
                spec = spec_for(NGram(), specgraph.Chain(n - 1), accept=1)
                ms, _ = step_ms(spec, prompt, args.short, args.short + 64, device)
                out[f"n{n}_ms"] = ms
                if "plain" in res:
                    out[f"n{n}_x_decode"] = ms / res["plain"]["ms_per_token"]
                device_ms = step_graph_ms(spec)  # None off CUDA: nothing recorded
                if device_ms is not None:
                    out[f"n{n}_replay_ms"] = device_ms
                    if "replay_ms_per_token" in res.get("plain", {}):
                        out[f"n{n}_replay_x_decode"] = device_ms / res["plain"]["replay_ms_per_token"]
            save("verify", **out)
        elif section == "synthetic":
            head = Eagle3.for_target(model).to(device, torch.bfloat16)
            ms, tau = step_ms(spec_for(head, specgraph.Chain(4), accept=4), prompt, args.short, args.long, device)
            draft_bytes = sum(p.numel() * p.element_size() for n, p in head.named_parameters() if "embed" not in n)
            values = dict(ms_per_step=ms, tau=tau, draft_gb=draft_bytes / 1e9)
            if "plain" in res:
                decode = res["plain"]["ms_per_token"]
                speedup = tau * decode / ms
                c = draft_bytes / sum(streamed_bytes(model, args.prompt))
                verify_ratio = res.get("verify", {}).get("n8_x_decode", 1.0)  # N = 5 verifies about as N = 8
                ideal = tau / (verify_ratio + 4 * c)
                values.update(speedup=speedup, ideal=ideal, of_ideal=speedup / ideal, c=c)
            if "floor" in res:  # no step can beat its bytes: verify's weights and KV, plus S draft passes
                bound = res["floor"]["floor_ms"] + 4 * draft_bytes / (res["floor"]["copy_tbs"] * 1e12) * 1e3
                values.update(bytes_floor_ms=bound, below_bytes_floor=ms < bound)
            save("synthetic", **values)
        elif section == "batch":
            rows = {}
            for b in tqdm(args.batches, desc="batch", leave=False):
                if time.time() - begin > args.budget_s:
                    break
                ids = prompt.expand(b, -1).contiguous()
                plain_spec = spec_for(None, None, b)
                plain, _ = step_ms(plain_spec, ids, args.short, args.long, device)
                head = Eagle3.for_target(model).to(device, torch.bfloat16)
                rows[f"b{b}"] = row = dict(plain_ms_per_step=plain, plain_tok_s=b * 1e3 / plain)
                calls = {}  # whole calls of each fixed mode, for the policy's comparison
                if args.batch_policy:
                    calls["plain"] = row["plain_call_tok_s"] = calls_tok_s(plain_spec, ids, args.long, device,
                                                                           FIXED_CALLS)
                save("batch", **rows)  # after every figure: a run stopped by its time limit keeps what it measured
                for name in args.batch_trees:  # the same head, the same forced depth 4
                    spec = spec_for(head, BATCH_TREES[name], b, accept=4)
                    step, tau = step_ms(spec, ids, args.short, args.long, device)
                    row.update({f"{name}_ms_per_step": step, f"{name}_tau": tau,
                                f"{name}_tok_s": b * tau * 1e3 / step, f"{name}_speedup": tau * plain / step})
                    if args.batch_policy:
                        calls[name] = row[f"{name}_call_tok_s"] = calls_tok_s(spec, ids, args.long, device,
                                                                              FIXED_CALLS)
                    save("batch", **rows)
                if args.batch_policy:
                    row.update(policy_row(spec_for(head, BATCH_TREES["tree"], b, accept=4, policy="cost"), ids,
                                          args.long, device, calls))
                    save("batch", **rows)
        elif section == "profile":  # plain decode
            save(section, **profile_section(spec_for(None, None), prompt, args, device, "profile"))
        elif section == "profile_verify":  # verifying N nodes (one accepted), for each N asked
            save(section, **{f"n{n}": profile_section(spec_for(NGram(), specgraph.Chain(n - 1), accept=1), prompt, args,
                                                       device, f"profile-verify-n{n}", nodes=n)
                             for n in args.profile_verify_n})
        elif section == "profile_draft":  # whole speculative steps: verify + commit + draft levels
            head = (load_default_draft() if args.shape == "smollm2" and not args.tiny else Eagle3.for_target(model))
            head = head.to(device, torch.bfloat16)
            trees = {text: parse_tree(text) for text in args.profile_draft_trees}
            save(section, **{text: profile_section(spec_for(head, tree, accept=1), prompt, args, device,
                                                   f"profile-draft-{text.replace(':', '').replace(',', '-').replace('+', '_')}",
                                                   nodes=tree.num_nodes)
                             for text, tree in trees.items()})
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
