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
    questions = mt_bench_questions(2)
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
    batched = acceptance(spec, tokenizer, questions, max_new_tokens=20, batch_size=2)  # rows accept on their own
    assert [batched[k] for k in ("tokens", "steps", "accepted_hist")] == [report[k] for k in ("tokens", "steps",
                                                                                                "accepted_hist")]
    json.dumps(report)
    plot(report, tmp_path / "acceptance.png")
    assert (tmp_path / "acceptance.png").stat().st_size > 10_000
