"""Prompts the target writes itself (specgraph.train.magpie): the pre-query is where the chat template puts a
user's text; a greedy round is HF greedy decoding of the pre-query cut at the end-of-turn token; seeded rounds
repeat themselves and only themselves; rows cut off, empty or repeated are dropped; the file reads back as
ShareGPT one-turn conversations."""
import pytest
import torch

from specgraph.train.magpie import PromptStats, complete_prompts, pre_query, self_prompts

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def target():
    from capture_harness import tiny_target_for
    from specgraph.models import load_gguf

    _, tokenizer = load_gguf()
    return tiny_target_for(tokenizer), tokenizer


def test_the_pre_query_is_where_every_user_message_starts(target):
    _, tokenizer = target
    prefix = pre_query(tokenizer)
    assert tokenizer.decode(prefix).endswith("<|im_start|>user\n")  # SmolLM2's template, its system turn first
    for text in ("Hello!", "Write a haiku about the sea.", "2 + 2?"):  # (leading spaces would merge with the "\n")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True, return_dict=True)
        assert ids["input_ids"][: len(prefix)] == prefix, text


def test_complete_prompts_keep_closed_new_turns_only(target):
    _, tokenizer = target
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    hello, sea = (tokenizer(t, add_special_tokens=False)["input_ids"] for t in ("Hello there", " the sea "))
    rows = [hello + [eos, 5, 6], hello + [eos], sea + [eos], [eos, 7], sea + hello]  # repeat, empty, cut off
    stats, seen = PromptStats(), {"old"}
    assert complete_prompts(rows, {eos}, tokenizer, seen, stats) == ["Hello there", "the sea"]
    assert (stats.rows, stats.kept, stats.repeated, stats.empty, stats.cut_off) == (5, 2, 1, 1, 1)
    assert stats.tokens == len(hello) + 1 + len(hello) + 1 + len(sea) + 1 + 1 + len(sea + hello)
    assert seen == {"old", "Hello there", "the sea"}


def _spec(model):
    import specgraph

    return specgraph.compile(model, None, backend="eager", max_batch=4, max_cache_len=128)


def test_a_greedy_round_is_hf_greedy_decoding_of_the_pre_query_cut_at_the_turn_end(target):
    import copy

    model, tokenizer = target
    model = copy.deepcopy(model)
    prefix = torch.tensor([pre_query(tokenizer)])
    greedy = model.generate(prefix, attention_mask=torch.ones_like(prefix), max_new_tokens=8, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, prefix.shape[1]:].tolist()  # the oracle
    k = next(i for i in range(2, 8) if greedy[i] not in greedy[:i])  # a token first written at step k ends the turn
    model.generation_config.eos_token_id = greedy[k]
    kept, stats = self_prompts(_spec(model), tokenizer, prompts=5, temperature=0.0, max_prompt_tokens=8,
                               batch_size=3)
    want = tokenizer.decode(greedy[:k], skip_special_tokens=True).strip()
    assert kept == ([want] if want else []) and stats.rows == 3 and stats.cut_off == 0
    assert stats.repeated == (2 if want else 0)  # three identical rows: one prompt


def test_seeded_rounds_repeat_themselves_and_a_row_that_never_ends_its_turn_is_dropped(target, tmp_path):
    import copy

    from specgraph.train.data import load_sharegpt, write_sharegpt

    model, tokenizer = target
    model = copy.deepcopy(model)
    prefix = torch.tensor([pre_query(tokenizer)])
    with torch.no_grad():  # a tenth of the vocabulary ends the turn: most rows close it within 6 tokens
        logits = model(prefix).logits[0, -1]
    model.generation_config.eos_token_id = logits.argsort(descending=True)[: logits.numel() // 10].tolist()
    spec = _spec(model)
    runs = [self_prompts(spec, tokenizer, prompts=6, max_prompt_tokens=6, batch_size=4, seed=seed)
            for seed in (3, 3, 4)]
    (a, stats), (b, _), (c, _) = runs
    assert a == b and a != c and len(a) == 6 and len(set(a)) == 6  # seeded; another seed, other prompts
    assert stats.rows % 4 == 0 and stats.kept == stats.rows - stats.cut_off - stats.empty - stats.repeated
    never = copy.deepcopy(model)
    never.generation_config.eos_token_id = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    none, idle = self_prompts(_spec(never), tokenizer, prompts=6, max_prompt_tokens=2, batch_size=4, idle_rounds=2)
    assert none == [] and idle.rows == 8 and idle.cut_off == 8  # two rounds that closed no turn: it stops
    path = tmp_path / "prompts.json.gz"
    write_sharegpt([[{"role": "user", "content": p}, {"role": "assistant", "content": ""}] for p in a], path,
                   prompts_only=True)
    assert [c[0]["content"] for c in load_sharegpt(path)] == a  # what distill --data reads
