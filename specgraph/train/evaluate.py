"""Acceptance evaluation: how much a draft buys on MT-bench turn-1 questions.

    report = acceptance(spec, tokenizer, max_new_tokens=256)   # greedy; temperature=1.0 samples
    plot(report, "acceptance.png")

τ = tokens emitted per target verify step (the bonus token included);
``accepted_hist[k]`` = steps that accepted exactly k drafted tokens;
``position_rate[k]`` = fraction of steps whose (k+1)-th drafted token was
accepted, and ``position_conditional[k]`` the same given the k-th was.
The prompts use the target's chat template (pinned by the tokenizer that
ships with the model); generation stops at the tokenizer's eos.
"""
from __future__ import annotations

import json
import time
from importlib import resources
from pathlib import Path

import torch
from tqdm import tqdm

from ..runtime.generate import accepted_histogram, position_rates


def _jsonl(name: str) -> list[dict]:
    text = resources.files("specgraph").joinpath("data", name).read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def mt_bench_questions(limit: int | None = None) -> list[dict]:
    """The 80 MT-bench questions shipped with specgraph (see specgraph/data/NOTICE)."""
    return _jsonl("mt_bench_questions.jsonl")[:limit]


HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with the whole function in one code block."


def humaneval_questions(limit: int | None = None) -> list[dict]:
    """The 164 HumanEval problems (their prompts only; see specgraph/data/NOTICE) as one-turn questions:
    ``{"question_id", "turns": [instruction + the prompt in a code block]}``. Code the draft heads never
    trained on (they learn from ShareGPT)."""
    return [{"question_id": row["task_id"], "category": "code",
             "turns": [f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{row['prompt']}```"]}
            for row in _jsonl("humaneval_prompts.jsonl")[:limit]]


SHAREGPT_MAX_CHARS = 1500  # first turns up to this long (about 400 tokens): the prompt fits a benchmark's cache


def sharegpt_held_out_questions(limit: int | None = None) -> list[dict]:
    """First turns of the ShareGPT conversations that training holds out: the first
    ``HELD_OUT_CONVERSATIONS`` of ``specgraph.train.distill``'s seeded shuffle (its default seed), those of at most
    ``SHAREGPT_MAX_CHARS`` characters that open no trained conversation, as one-turn questions:
    in-distribution prompts the heads never saw (needs the ``train`` extra)."""
    from .data import load_sharegpt
    from .distill import HELD_OUT_CONVERSATIONS, DistillConfig, conversation_order

    conversations = load_sharegpt()
    order = conversation_order(len(conversations), DistillConfig.seed)
    trained = {conversations[i][0]["content"] for i in order[HELD_OUT_CONVERSATIONS:]}  # ShareGPT repeats some
    firsts = [conversations[i][0]["content"] for i in order[:HELD_OUT_CONVERSATIONS]]
    out = [{"question_id": f"sharegpt-{n}", "category": "sharegpt", "turns": [text]} for n, text in enumerate(firsts)
           if len(text) <= SHAREGPT_MAX_CHARS and text not in trained]
    return out[:limit]


PROMPT_SETS = {"mt-bench": mt_bench_questions, "humaneval": humaneval_questions,
               "sharegpt-held-out": sharegpt_held_out_questions}


def prompt_set(name: str, limit: int | None = None) -> list[dict]:
    """One of ``PROMPT_SETS`` (first turns), the first ``limit`` of them."""
    if name not in PROMPT_SETS:
        raise ValueError(f"prompt set {name!r}: one of {', '.join(PROMPT_SETS)}")
    return PROMPT_SETS[name](limit)


@torch.no_grad()
def acceptance(spec, tokenizer, questions: list[dict] | None = None, max_new_tokens: int = 256,
               temperature: float = 0.0, seed: int = 0, batch_size: int = 1) -> dict:
    """Generate turn 1 of each question with ``spec`` (a SpecModel); returns the report dict.

    ``batch_size`` > 1 generates that many questions at once (left-padded): each row speculates and
    accepts on its own, so greedy τ and the histograms are those of batch 1 (tokens/s is not)."""
    questions = questions if questions is not None else mt_bench_questions()
    device = spec.capture.kv_device
    depth = spec.config.tree.max_depth
    hist = [0] * (depth + 1)
    elapsed = 0.0
    per_category: dict[str, dict] = {}  # category -> questions, tokens, steps (then tau)
    torch.manual_seed(seed)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q["turns"][0]}], tokenize=True,
                                             add_generation_prompt=True, return_dict=True)["input_ids"]
               for q in questions]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    sample = dict(do_sample=True, temperature=temperature, top_k=0) if temperature > 0 else dict(do_sample=False)
    for start in tqdm(range(0, len(prompts), batch_size), desc="acceptance", leave=False):
        rows = prompts[start:start + batch_size]
        width = max(map(len, rows))
        ids = torch.tensor([[pad] * (width - len(r)) + list(r) for r in rows], device=device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
        begin = time.perf_counter()
        out = spec.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=pad, return_dict_in_generate=True,
                            **sample)
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed += time.perf_counter() - begin
        generated = out["sequences"][:, width:].tolist()
        for row in range(len(rows)):
            lens = [step[row] for step in out["accept_lens"] if step[row] > 0]  # 0: the row had finished
            ends = [i + 1 for i, t in enumerate(generated[row]) if t == tokenizer.eos_token_id][:1]
            cat = per_category.setdefault(questions[start + row].get("category", "all"),
                                          {"questions": 0, "tokens": 0, "steps": 0})
            cat["questions"] += 1
            # the steps' tokens: the first is the prefill's, and a step's tokens after eos are not emitted
            cat["tokens"] += min([sum(lens), max_new_tokens - 1] + [e - 1 for e in ends])
            cat["steps"] += len(lens)
            hist = [a + b for a, b in zip(hist, accepted_histogram(lens, depth))]
    rate, conditional = position_rates(hist)
    tokens, steps = (sum(cat[k] for cat in per_category.values()) for k in ("tokens", "steps"))
    for cat in per_category.values():
        cat["tau"] = cat["tokens"] / max(cat["steps"], 1)
    return {
        "questions": len(questions), "max_new_tokens": max_new_tokens, "temperature": temperature,
        "tree": str(spec.config.tree), "draft": type(spec.draft).__name__, "backend": spec.config.backend,
        "batch_size": batch_size, "tokens": tokens, "steps": steps, "tau": tokens / max(steps, 1),
        "tokens_per_s": tokens / max(elapsed, 1e-9), "accepted_hist": hist,
        "position_rate": rate, "position_conditional": conditional, "per_category": per_category,
    }


def plot(report: dict, path: str | Path) -> None:
    """Accepted-length histogram and per-position acceptance, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    hist = report["accepted_hist"]
    left.bar(range(len(hist)), [h / max(sum(hist), 1) for h in hist], color="#4c72b0")
    left.set_xticks(range(len(hist)))
    right.set_xticks(range(1, len(hist)))
    left.set(xlabel="drafted tokens accepted per step", ylabel="fraction of steps",
             title=f"τ = {report['tau']:.2f} tokens/step")
    positions = range(1, len(report["position_rate"]) + 1)
    right.plot(positions, report["position_rate"], "o-", label="accepted at this depth")
    right.plot(positions, report["position_conditional"], "s--", label="given the previous one")
    right.set(xlabel="draft position (depth)", ylabel="acceptance rate", ylim=(0, 1.02),
              title=f"{report['draft']} on {report['tree']}"[:60])
    right.legend(fontsize=8)
    fig.suptitle(f"MT-bench turn 1, {report['questions']} questions, T={report['temperature']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
