"""Self-distillation at scale (specgraph.train.distill): every turn answered by the target's own
greedy decoding (oracle: ``model.generate`` on each turn's prompt, built here from the chat
template), batches padded to one bucket, long prompts closing a conversation, resume after a
deadline, seeded sampling, and the token shards' round trip."""
import json
import time

import numpy as np
import pytest
import torch

from specgraph.errors import SettingError
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from specgraph.train.distill import (DistillConfig, Progress, distill, first_answers, load_shards, mask_repeats,
                                     split_held_out, variant_name, write_shards)

pytestmark = pytest.mark.model

RECORDS = [
    {"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "old"},
                                  {"from": "human", "value": "and then?"}, {"from": "gpt", "value": "old"}]},
    {"id": "b", "conversations": [{"from": "human", "value": "Name a colour."}, {"from": "gpt", "value": "old"}]},
    {"id": "c", "conversations": [{"from": "human", "value": "word " * 120}, {"from": "gpt", "value": "old"}]},
    {"id": "d", "conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "old"},
                                  {"from": "human", "value": "why?"}, {"from": "gpt", "value": "old"}]},
]
CONFIG = DistillConfig(temperatures=(0.0,), batch_size=2, max_new_tokens=5, max_prompt_tokens=60, max_length=256,
                       backend="eager")


@pytest.fixture(scope="module")
def target():
    from capture_harness import tiny_target_for
    from specgraph.models import load_gguf

    _, tokenizer = load_gguf()
    return tiny_target_for(tokenizer), tokenizer


def test_every_turn_is_the_targets_greedy_answer_to_its_own_conversation(target, tmp_path):
    model, tokenizer = target
    source = tmp_path / "sharegpt.json"
    source.write_text(json.dumps(RECORDS))
    summary = distill(model, tokenizer, tmp_path / "out", CONFIG, source, workers=1)
    state = Progress(**torch.load(tmp_path / "out" / "state-greedy.pt"))
    order = torch.randperm(4, generator=torch.Generator().manual_seed(0)).tolist()
    eos = model.generation_config.eos_token_id
    for c, record in enumerate(RECORDS[i] for i in order):
        users = [t["value"] for t in record["conversations"][::2]]
        chat, want = [], []
        for user in users:
            chat.append({"role": "user", "content": user})
            prompt = tokenizer.apply_chat_template(chat, tokenize=True, add_generation_prompt=True,
                                                   return_dict=True)["input_ids"]
            if len(prompt) > CONFIG.max_prompt_tokens:
                break
            ids = torch.tensor([prompt])
            new = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=CONFIG.max_new_tokens,
                                 do_sample=False, eos_token_id=eos, pad_token_id=eos)[0, len(prompt):].tolist()
            answer = new[: new.index(eos)] if eos in new else new
            want.append(answer)
            chat.append({"role": "assistant", "content": tokenizer.decode(answer, skip_special_tokens=True).strip()
                         or "…"})
        assert state.answers[c] == want, record["id"]
    assert all(state.closed) and sum(map(len, state.answers)) == 5  # "c" opens with a prompt over the cap
    greedy = summary["variants"]["greedy"]
    assert greedy["finished"] and greedy["turns"] == 5 and greedy["conversations"] == greedy["examples"] == 3
    # answer tokens over the rows' decode steps: a share, and every generated token counted
    assert 0 < greedy["row_utilization"] <= 1 and state.stats["stream_tokens"] == greedy["generated_tokens"]
    examples = load_shards(tmp_path / "out")
    assert len(examples) == 3 and {e["variant"] for e in examples} == {"greedy"}
    assert sum(int(e["loss_mask"].sum()) for e in examples) == greedy["loss_tokens"] > 0


def test_a_run_stopped_by_its_deadline_resumes_to_the_same_answers(target, tmp_path):
    model, tokenizer = target
    source = tmp_path / "sharegpt.json"
    source.write_text(json.dumps(RECORDS))
    config = DistillConfig(**{**CONFIG.__dict__, "temperatures": (0.0, 1.0)})
    late = distill(model, tokenizer, tmp_path / "resumed", config, source, workers=1, deadline=time.time() - 1)
    assert not late["variants"]["greedy"]["finished"] and late["variants"]["greedy"]["turns"] == 0
    assert "t1" not in late["variants"]  # the next variant waits for the unfinished one
    resumed = distill(model, tokenizer, tmp_path / "resumed", config, source, workers=1)
    straight = distill(model, tokenizer, tmp_path / "straight", config, source, workers=1)
    for name in ("greedy", "t1"):
        a = torch.load(tmp_path / "resumed" / f"state-{name}.pt")["answers"]
        b = torch.load(tmp_path / "straight" / f"state-{name}.pt")["answers"]
        assert a == b, name  # greedy, and sampling seeded per (seed, variant, answers so far)
        assert resumed["variants"][name]["finished"] and straight["variants"][name]["finished"]
    # a run of another variant into the same folder keeps the summary of the variants made before it
    again = distill(model, tokenizer, tmp_path / "straight", DistillConfig(**{**CONFIG.__dict__,
                                                                              "temperatures": (0.5,)}),
                    source, workers=1)
    assert set(again["variants"]) == {"greedy", "t1", "t0.5"} and again["variants"]["t1"] == straight["variants"]["t1"]
    assert json.loads((tmp_path / "straight" / "summary.json").read_text())["variants"] == again["variants"]
    greedy = torch.load(tmp_path / "straight" / "state-greedy.pt")["answers"]
    sampled = torch.load(tmp_path / "straight" / "state-t1.pt")["answers"]
    assert greedy != sampled  # T = 1 does sample
    assert variant_name(0.0) == "greedy" and variant_name(0.8) == "t0.8"
    for changed in (dict(max_new_tokens=7), dict(seed=1)):  # the answers already made would not be these
        with pytest.raises(SettingError, match=f"{next(iter(changed))}: .* -> "):
            distill(model, tokenizer, tmp_path / "straight", DistillConfig(**{**config.__dict__, **changed}), source,
                    workers=1)


def test_shards_only_writes_the_saved_answers_shards_without_generating(target, tmp_path, monkeypatch):
    """A state carried to a new machine: its shards, every saved variant, the model never called; a variant
    with no saved answers is skipped, none at all is refused by name."""
    import shutil

    model, tokenizer = target
    source = tmp_path / "sharegpt.json"
    source.write_text(json.dumps(RECORDS))
    config = DistillConfig(**{**CONFIG.__dict__, "temperatures": (0.0, 1.0)})
    made = distill(model, tokenizer, tmp_path / "made", config, source, workers=1)
    carried = tmp_path / "carried"
    carried.mkdir()
    for name in ("state-greedy.pt", "state-t1.pt"):
        shutil.copy(tmp_path / "made" / name, carried / name)

    def no_forward(*args, **kwargs):
        raise AssertionError("--shards-only generated")

    monkeypatch.setattr(model, "forward", no_forward)
    wider = DistillConfig(**{**config.__dict__, "temperatures": (0.0, 1.0, 0.5)})  # t0.5 has no saved answers
    summary = distill(model, tokenizer, carried, wider, source, workers=1, generate=False)
    assert set(summary["variants"]) == {"greedy", "t1"}
    for name in ("greedy", "t1"):
        assert {k: v for k, v in summary["variants"][name].items() if k != "seconds"} == \
            {k: v for k, v in made["variants"][name].items() if k != "seconds"}
    want, got = load_shards(tmp_path / "made"), load_shards(carried)
    assert len(got) == len(want) == 6
    for a, b in zip(sorted(want, key=lambda e: (e["variant"], e["conversation"])),
                    sorted(got, key=lambda e: (e["variant"], e["conversation"]))):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
    with pytest.raises(SettingError, match="no state-.*--shards-only"):
        distill(model, tokenizer, tmp_path / "empty", config, source, workers=1, generate=False)


def test_a_resumed_run_knows_its_target_by_the_weights_not_the_path(target, tmp_path):
    """A converted GGUF's folder is named after the file's mtime: the same weights under another path resume;
    one changed weight is refused by name."""
    import copy

    model, tokenizer = target
    source = tmp_path / "sharegpt.json"
    source.write_text(json.dumps(RECORDS))
    distill(model, tokenizer, tmp_path / "out", CONFIG, source, workers=1, deadline=time.time() - 1)
    moved = copy.deepcopy(model)
    moved.name_or_path = "/elsewhere/converted/smollm2-0123456789abcdef"
    assert distill(moved, tokenizer, tmp_path / "out", CONFIG, source, workers=1)["variants"]["greedy"]["finished"]
    with torch.no_grad():
        next(moved.parameters()).view(-1)[0] += 1.0
    with pytest.raises(SettingError, match="target_weights: .* -> "):
        distill(moved, tokenizer, tmp_path / "out", CONFIG, source, workers=1)


def test_a_run_stopped_mid_stream_keeps_its_answers_and_resumes_to_the_greedy_ones(target, tmp_path, monkeypatch):
    """The deadline passes after the second answer: the rows still decoding are dropped, the answers made are
    kept, and the next run answers the rest: the same greedy answers as one uninterrupted run."""
    import specgraph.train.distill as distill_module

    model, tokenizer = target
    source = tmp_path / "sharegpt.json"
    source.write_text(json.dumps(RECORDS))
    straight = distill(model, tokenizer, tmp_path / "straight", CONFIG, source, workers=1)
    calls = []

    class Clock:  # time.time() passes the deadline (1.0) from its third reading on: after the second answer
        perf_counter = staticmethod(time.perf_counter)

        @staticmethod
        def time():
            calls.append(1)
            return 0.0 if len(calls) <= 2 else 2.0

    monkeypatch.setattr(distill_module, "time", Clock)
    stopped = distill(model, tokenizer, tmp_path / "resumed", CONFIG, source, workers=1, deadline=1.0)
    monkeypatch.undo()
    assert not stopped["variants"]["greedy"]["finished"] and stopped["variants"]["greedy"]["turns"] == 2
    distill(model, tokenizer, tmp_path / "resumed", CONFIG, source, workers=1)
    assert torch.load(tmp_path / "resumed" / "state-greedy.pt")["answers"] == \
        torch.load(tmp_path / "straight" / "state-greedy.pt")["answers"]
    assert straight["variants"]["greedy"]["turns"] == 5


def test_shards_round_trip_under_their_size_limit(tmp_path):
    g = torch.Generator().manual_seed(0)
    examples = [{"input_ids": torch.randint(0, 60000, (n,), generator=g).numpy(),
                 "loss_mask": (torch.rand(n, generator=g) > 0.3).numpy(), "conversation": c}
                for c, n in enumerate([300, 17, 1, 900, 450, 64])]
    paths = write_shards(examples, tmp_path / "greedy", vocab_size=60000, max_bytes=2500, metadata={"k": 1})
    from safetensors.numpy import load_file

    sizes = [(p.stat().st_size, len(load_file(str(p))["conversation"])) for p in paths]
    assert len(paths) > 2 and all(size < 2500 or count == 1 for size, count in sizes), sizes
    loaded = load_shards(tmp_path)
    assert len(loaded) == len(examples)
    for e, got in zip(examples, loaded):
        assert got["input_ids"].tolist() == e["input_ids"].tolist() and got["input_ids"].dtype == torch.int64
        assert got["loss_mask"].tolist() == e["loss_mask"].tolist()
        assert got["conversation"] == e["conversation"] and got["variant"] == "greedy"
    assert load_file(str(paths[0]))["input_ids"].dtype == np.uint16
    write_shards(examples[:1], tmp_path / "wide", vocab_size=151_936)
    assert load_file(str(tmp_path / "wide" / "shard-00000.safetensors"))["input_ids"].dtype == np.int32
    with pytest.raises(FileNotFoundError, match="specgraph.train.distill"):
        load_shards(tmp_path / "nothing")


def test_held_out_conversations_stay_out_of_training_in_every_variant():
    examples = [{"conversation": c, "variant": v} for v in ("greedy", "t0.8") for c in range(10)]
    train, held = split_held_out(examples, 3)
    assert sorted(e["conversation"] for e in held) == [0, 1, 2] and {e["variant"] for e in held} == {"greedy"}
    assert len(train) == 14 and min(e["conversation"] for e in train) == 3


def _masked_by_hand(ids: list[int], mask: list[bool], window: int) -> list[bool]:
    """The oracle, written out: per answer (a run of loss tokens), every span of ``window`` tokens that starts
    at an earlier position of the same answer too has its tokens' loss dropped."""
    out, t = list(mask), 0
    while t < len(ids):
        if not mask[t]:
            t += 1
            continue
        end = t
        while end < len(ids) and mask[end]:
            end += 1
        for i in range(t, end - window + 1):
            if any(ids[j:j + window] == ids[i:i + window] for j in range(t, i)):
                out[i:i + window] = [False] * window
        t = end
    return out


@hypothesis_settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=60), st.lists(st.booleans(), min_size=60, max_size=60),
       st.integers(2, 5))
def test_mask_repeats_drops_exactly_the_repeated_spans_of_each_answer(ids, mask, window):
    mask = mask[: len(ids)]
    example = {"input_ids": torch.tensor(ids), "loss_mask": torch.tensor(mask), "conversation": 3}
    (out,) = mask_repeats([example], window)
    assert out["loss_mask"].tolist() == _masked_by_hand(ids, mask, window)
    assert out["input_ids"] is example["input_ids"] and out["conversation"] == 3  # context and the rest kept
    assert example["loss_mask"].tolist() == mask  # the input untouched


def test_mask_repeats_keeps_a_loop_s_first_copy_and_answers_apart():
    """A loop's first copy keeps its loss, its repeats lose it; the same span in another answer (or in the
    prompt) is no repeat; an answer without repeats is unchanged (negative control)."""
    loop, other = [5, 6, 7], [9, 8, 1, 2]
    ids = [1, 2, 3] + loop * 3 + [0] + loop + other
    mask = [False] * 3 + [True] * 9 + [False] + [True] * 7
    (out,) = mask_repeats([{"input_ids": torch.tensor(ids), "loss_mask": torch.tensor(mask)}], 3)
    assert out["loss_mask"].tolist() == [False] * 3 + [True] * 3 + [False] * 6 + [False] + [True] * 7


@pytest.mark.parametrize("tokens, end", [(2, 5), (4, 7), (10, 7)])
def test_first_answers_keep_the_prompt_and_the_first_tokens_of_the_first_answer(tokens, end):
    """Cut after ``tokens`` tokens of the first answer, never into the next turn; an example without an
    answer is left out."""
    ids = torch.arange(12)
    mask = torch.tensor([0, 0, 0, 1, 1, 1, 1, 0, 0, 1, 1, 1], dtype=torch.bool)  # answers at 3-6 and 9-11
    out = first_answers([{"input_ids": ids, "loss_mask": mask, "conversation": 4},
                         {"input_ids": ids, "loss_mask": torch.zeros(12, dtype=torch.bool), "conversation": 5}], tokens)
    assert len(out) == 1 and out[0]["conversation"] == 4
    assert out[0]["input_ids"].tolist() == list(range(end))
    assert out[0]["loss_mask"].tolist() == mask[:end].tolist()


def test_progress_saves_whole_and_round_trips(tmp_path, monkeypatch):
    """A save is written beside the state and moved into place: a save that fails half way (here: the
    pickling raises) leaves the previous state readable; a saved state loads back equal."""
    progress = Progress.new(3)
    progress.answers[1].append([5, 6, 7])
    progress.stats["steps"] = 4
    state = tmp_path / "state-greedy.pt"
    progress.save(state)
    assert Progress(**torch.load(state)) == progress and not list(tmp_path.glob("*.part"))
    progress.answers[2].append([8])
    real_save = torch.save

    def dies_half_way(obj, path):
        real_save({"answers": "half"}, path)
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        progress.save(state)
    assert Progress(**torch.load(state)).answers == [[], [[5, 6, 7]], []]
