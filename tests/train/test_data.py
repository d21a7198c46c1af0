"""Training data: ShareGPT parsing (the packaged file is truncated), assistant-only loss masks
under the real SmolLM2 chat template, self-distillation, and the content-hashed cache."""
import json
import time

import pytest
import torch

from specgraph.errors import SettingError
from specgraph.train.data import build, load_sharegpt, regenerate, tokenize

RECORDS = [
    {"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "Hello there."},
                                  {"from": "human", "value": "more?"}, {"from": "gpt", "value": "Sure thing."}]},
    {"id": "b", "conversations": [{"from": "gpt", "value": "starts with the bot"}, {"from": "human", "value": "x"}]},
    {"id": "c", "conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "2+2?"},
                                  {"from": "gpt", "value": "4"}, {"from": "human", "value": "dangling question"}]},
    {"id": "d", "conversations": [{"from": "human", "value": "empty answer"}, {"from": "gpt", "value": ""}]},
]


def write_truncated(path, records, cut: int = 40):
    text = json.dumps(records + [{"id": "z", "conversations": [{"from": "human", "value": "cut here " * 20}]}],
                      indent=2)
    path.write_text(text[:-cut])  # ends inside the last record, like the packaged file
    return path


def test_sharegpt_parsing_keeps_complete_alternating_conversations(tmp_path):
    path = write_truncated(tmp_path / "sharegpt.json", RECORDS)
    with pytest.warns(UserWarning, match="ends inside a record; read 2 complete ones"):
        conversations = load_sharegpt(path)
    assert conversations == [
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello there."},
         {"role": "user", "content": "more?"}, {"role": "assistant", "content": "Sure thing."}],
        [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],  # system and dangling turn dropped
    ]
    assert len(load_sharegpt(path, limit=1)) == 1


@pytest.fixture(scope="module")
def smollm2():
    from specgraph.models import load_gguf

    return load_gguf()


@pytest.mark.model
def test_loss_mask_covers_exactly_the_assistant_turns(smollm2):
    _, tokenizer = smollm2
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello there."},
                    {"role": "user", "content": "more?"}, {"role": "assistant", "content": "Sure thing."}]
    (example,) = tokenize(tokenizer, [conversation], max_length=512)
    ids, mask = example["input_ids"], example["loss_mask"]
    assert ids.tolist() == list(tokenizer.apply_chat_template(conversation, tokenize=True)["input_ids"])
    spans, current = [], []
    for token, keep in zip(ids.tolist(), mask.tolist()):
        if keep:
            current.append(token)
        elif current:
            spans.append(tokenizer.decode(current))
            current = []
    spans += [tokenizer.decode(current)] if current else []
    assert [s.strip() for s in spans] == ["Hello there.<|im_end|>", "Sure thing.<|im_end|>"]
    short = tokenize(tokenizer, [conversation], max_length=10)[0]
    assert len(short["input_ids"]) == 10 and torch.equal(short["loss_mask"], mask[:10])


@pytest.mark.model
def test_self_distillation_and_the_cache(smollm2, tmp_path):
    """The real chat template and tokenizer; a tiny random target over its vocabulary (the check is the
    plumbing: each rewritten answer is that target's own greedy reply, both engines agree)."""
    from capture_harness import tiny_target_for

    _, tokenizer = smollm2
    model = tiny_target_for(tokenizer)
    conversations = [[{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "(old)"}],
                     [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "(old)"},
                      {"role": "user", "content": "Again."}, {"role": "assistant", "content": "(old)"}],
                     [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "(old)"},
                      {"role": "user", "content": "Thanks."}],  # a trailing user turn stays as it is
                     [{"role": "user", "content": "Unanswered."}]]
    new = regenerate(model, tokenizer, conversations, max_new_tokens=6, batch_size=2)  # specgraph's engine
    assert regenerate(model, tokenizer, conversations, max_new_tokens=6, batch_size=2, engine="hf") == new
    assert new[2][2] == conversations[2][2] and new[3] == conversations[3]
    for conversation, rewritten in zip(conversations, new):
        assert [m["role"] for m in rewritten] == [m["role"] for m in conversation]
        for i in range(1, len(rewritten), 2):  # each answer is the target's own greedy reply to what precedes it
            ids = tokenizer.apply_chat_template(rewritten[:i], add_generation_prompt=True, return_tensors="pt")
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
            want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
            assert rewritten[i]["content"] == tokenizer.decode(want[0, ids.shape[1]:], skip_special_tokens=True).strip()
    source = tmp_path / "sharegpt.json"
    source.write_text(json.dumps(RECORDS))
    first = build(tokenizer, tmp_path / "cache", limit=2, max_length=64, source=source)
    assert len(list((tmp_path / "cache").glob("examples-*.pt"))) == 1
    again = build(tokenizer, tmp_path / "cache", limit=2, max_length=64, source=source)
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(first, again))
    build(tokenizer, tmp_path / "cache", limit=2, max_length=32, source=source)  # another setting, another file
    assert len(list((tmp_path / "cache").glob("examples-*.pt"))) == 2
    edited = json.dumps(RECORDS).replace("Hello there.", "Hey, friend.")  # the same size, other text
    assert len(edited) == len(json.dumps(RECORDS))
    source.write_text(edited)
    changed = build(tokenizer, tmp_path / "cache", limit=2, max_length=64, source=source)
    assert len(list((tmp_path / "cache").glob("examples-*.pt"))) == 3
    assert any(not torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(first, changed))


@pytest.mark.model
def test_regeneration_resumes_from_its_chunks(smollm2, tmp_path, monkeypatch):
    import specgraph.train.data as data
    from capture_harness import tiny_target_for

    _, tokenizer = smollm2
    model = tiny_target_for(tokenizer)  # the chunks' bookkeeping is under test, not the model
    source = tmp_path / "sharegpt.json"
    source.write_text(json.dumps(RECORDS))
    calls = []
    real = data.regenerate
    monkeypatch.setattr(data, "regenerate", lambda *a, **k: calls.append(len(a[2])) or real(*a, **k))
    kw = dict(max_length=64, max_new_tokens=4, source=source, chunk=1, batch_size=1)
    first = build(tokenizer, tmp_path / "cache", model, limit=2, **kw)
    assert calls == [1, 1] and len(list((tmp_path / "cache").glob("regen-*.pt"))) == 2
    for f in (tmp_path / "cache").glob("examples-*.pt"):  # as if killed after regenerating, before tokenizing
        f.unlink()
    again = build(tokenizer, tmp_path / "cache", model, limit=2, **kw)
    assert calls == [1, 1]  # nothing regenerated twice
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(first, again))
    # a chunk cut short by a smaller limit is completed, not redone, when the limit grows
    kw["chunk"] = 2
    build(tokenizer, tmp_path / "grow", model, limit=1, **kw)
    grown = build(tokenizer, tmp_path / "grow", model, limit=2, **kw)
    assert calls == [1, 1, 1, 1] and len(list((tmp_path / "grow").glob("regen-*.pt"))) == 1
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(first, grown))
    with pytest.raises(data.OutOfTime):  # past the deadline: stops before regenerating anything
        build(tokenizer, tmp_path / "late", model, limit=2, deadline=time.time() - 1, **kw)
    assert calls == [1, 1, 1, 1]


@pytest.mark.parametrize("content, message", [
    ('{"a": 1}', "a JSON array of records"), ("[[1, 2], [3]]", "record 0 is not a ShareGPT record"),
    ('[{"conversations": "hello"}]', "record 0 is not a ShareGPT record"), (b"\x80\x81[", "not a UTF-8"),
])
def test_a_file_that_is_not_sharegpt_is_named(tmp_path, content, message):
    path = tmp_path / "data.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(SettingError, match=message):
        load_sharegpt(path)


def test_a_turn_whose_value_is_not_text_skips_its_conversation(tmp_path):
    path = tmp_path / "data.json"
    good = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    bad = {"conversations": [{"from": "human", "value": 5}, {"from": "gpt", "value": "x"}]}
    path.write_text(json.dumps([bad, good]))
    assert load_sharegpt(path) == [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]]
