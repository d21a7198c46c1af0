"""Sampled acceptance of one tree level under three lossless rules, offline, on the target's own sampled text.

    python3 benchmarks/investigations/multi_draft_rules.py [--prompt-set mt-bench humaneval] [--prompts 20]
        [--max-new-tokens 128] [--temperature 1.0] [--children 1 2 4 8] [--steps 3] [--draws 64] [--out FILE]

At every answer position of the target's own T-sampled answers (fp32, ``model.generate(do_sample=True,
top_k=0)``), p = the target's distribution of the next token and q_j = the shipped EAGLE-3 head's, TTT step j
(step j sees the true tokens before it: the level's acceptance given that the levels above accepted). For k
children the probability that the level accepts one of them:

- ``coupled``: what the engine does at T > 0 (``DraftSession.couple``): the children are the top k of
  log q + g, the target's draw is argmax log p + g, with the same Gumbel noise g; accepted iff the draw is a
  child (Monte Carlo over ``--draws`` noises).
- ``top_k``: deterministic children (the top k of q), each node draws from p: Σ p over the children (exact).
- ``rrs``: SpecInfer's recursive rejection sampling with k children drawn from q without replacement
  (``verify_sample`` with draft distributions): try each, accept x with min(1, r(x)/q_i(x)), else
  r <- norm(max(r - q_i, 0)); exact given the children, Monte Carlo over the children's draws. For k = 1 it
  is 1 - TV(p, q), the best any rule can do with one child.

Only speed differs between the rules (all are exact in distribution); this measures which one accepts more
per level, to decide whether the draft's own distribution should drive sampled verification.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import first_turn_ids, load_target  # noqa: E402
from specgraph.models import load_default_draft  # noqa: E402
from specgraph.train.eagle3 import tap_states, ttt_forward  # noqa: E402
from specgraph.train.evaluate import prompt_set  # noqa: E402


def sampled_answer(model, tokenizer, question: dict, max_new_tokens: int, temperature: float, seed: int):
    prompt = first_turn_ids(tokenizer, question)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), do_sample=True, temperature=temperature, top_k=0,
                             top_p=1.0, max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id)
    return out[0], len(prompt)


def level_pairs(model, head, ids: torch.Tensor, prompt: int, steps: int, temperature: float):
    """[(p [M, V_draft + 1], q [M, V_draft + 1])] per TTT step j: the target's and the draft's distributions of
    x_{t+2+j} at every row t whose x_{t+2+j} is an answer token, over the draft vocabulary and one last bin for
    every token outside it (q = 0 there: never a child; by Gumbel-max's max-stability the bin's draws and every
    rule's acceptance are exactly those of its tokens apart)."""
    with torch.no_grad():
        out = model(input_ids=ids[None], output_hidden_states=True)
        features = tap_states(out.hidden_states, head.aux_layer_ids, head.aux_convention)
        teacher = torch.softmax(out.logits[0].double() / temperature, -1)  # row s: x_{s+1}
        inside = head.t2d.nonzero().squeeze(1)  # the draft vocabulary's target ids
        teacher = torch.cat([teacher[:, inside], 1 - teacher[:, inside].sum(-1, keepdim=True)], -1).clamp_min(0)
        pairs = []
        for j, logits in enumerate(ttt_forward(head, ids[None], features, steps)):
            rows = torch.arange(max(prompt - 2 - j, 0), len(ids) - 2 - j)  # x_{t+2+j} an answer token
            q = torch.softmax(logits[0, rows].double() / temperature, -1)
            pairs.append((teacher[rows + 1 + j], torch.cat([q, q.new_zeros(len(rows), 1)], -1)))
    return pairs


def gumbel(shape, generator) -> torch.Tensor:
    u = torch.rand(shape, dtype=torch.float64, generator=generator).clamp_(1e-300, 1.0)
    return -torch.log(-torch.log(u))


def coupled(p, q, k: int, draws: int, generator) -> torch.Tensor:
    """[M]: P(argmax log p + g is among the top k of log q + g)."""
    hits = torch.zeros(p.shape[0], dtype=torch.float64)
    for _ in range(draws):
        g = gumbel(p.shape, generator)
        sample = (p.log() + g).argmax(-1, keepdim=True)
        children = (q.log() + g).topk(k, -1).indices
        hits += (children == sample).any(-1)
    return hits / draws


def top_k(p, q, k: int) -> torch.Tensor:
    return p.gather(-1, q.topk(k, -1).indices).sum(-1)


def rrs(p, q, k: int, draws: int, generator) -> torch.Tensor:
    """[M]: recursive rejection with k children of q without replacement, exact given the children (the
    acceptance probability itself, where ``kernels.verify.verify_sample`` draws one verdict: less noise)."""
    total = torch.zeros(p.shape[0], dtype=torch.float64)
    rows = torch.arange(p.shape[0])
    for _ in range(draws):
        children = (q.log() + gumbel(q.shape, generator)).topk(k, -1).indices  # k draws without replacement
        r, left, rejected_so_far = p.clone(), q.clone(), torch.ones_like(total)
        accepted = torch.zeros_like(total)
        for i in range(k):
            qi = left / left.sum(-1, keepdim=True).clamp_min(1e-300)  # the distribution child i was drawn from
            x = children[:, i]
            a = torch.clamp(r[rows, x] / qi[rows, x].clamp_min(1e-300), max=1.0)
            accepted += rejected_so_far * a
            rejected_so_far = rejected_so_far * (1 - a)
            residual = (r - qi).clamp_min(0)
            mass = residual.sum(-1, keepdim=True)
            r = torch.where(mass > 0, residual / mass.clamp_min(1e-300), r)
            left[rows, x] = 0
        total += accepted
    return total / draws


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-set", nargs="+", default=["mt-bench", "humaneval"])
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--children", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--steps", type=int, default=3, help="TTT steps: tree levels")
    parser.add_argument("--draws", type=int, default=64, help="Monte Carlo draws per position")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out")
    args = parser.parse_args()
    model, tokenizer = load_target("smollm2", torch.float32)
    model.eval().requires_grad_(False)
    head = load_default_draft()
    problems = head.bind(model)  # the target's embedding where the checkpoint leaves it out
    if problems:
        raise SystemExit("; ".join(problems))
    head.eval()
    generator = torch.Generator().manual_seed(args.seed)
    results = {"command": " ".join(sys.argv), "sets": {}}
    for name in args.prompt_set:
        sums: dict[str, float] = {}
        positions = [0] * args.steps
        for n, question in enumerate(tqdm(prompt_set(name, args.prompts), desc=name)):
            ids, prompt = sampled_answer(model, tokenizer, question, args.max_new_tokens, args.temperature,
                                         args.seed * 100_003 + n)
            for j, (p, q) in enumerate(level_pairs(model, head, ids, prompt, args.steps, args.temperature)):
                positions[j] += p.shape[0]
                for k in args.children:
                    for rule, value in (("coupled", coupled(p, q, k, args.draws, generator)), ("top_k", top_k(p, q, k)),
                                        ("rrs", rrs(p, q, k, args.draws, generator))):
                        key = f"step{j}/k{k}/{rule}"
                        sums[key] = sums.get(key, 0.0) + float(value.sum())
        table = {key: total / positions[int(key.split("/")[0][4:])] for key, total in sums.items()}
        results["sets"][name] = {"positions": positions, "acceptance": table}
        print(f"\n{name}: positions per level {positions}")
        print(f"{'level':>5} {'k':>3} {'coupled':>8} {'top_k':>8} {'rrs':>8}")
        for j in range(args.steps):
            for k in args.children:
                row = [table[f"step{j}/k{k}/{rule}"] for rule in ("coupled", "top_k", "rrs")]
                print(f"{j:>5} {k:>3} " + " ".join(f"{v:8.4f}" for v in row))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
