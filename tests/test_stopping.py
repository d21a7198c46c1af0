"""Stopping criteria and stop strings asked as model.generate asks them (``runtime/stopping.py``): once a
generated position on the whole left-padded batch, rows that ran ahead under speculation cut back, finished
rows padded only under an eos id. Oracle: the tiny model's own ``model.generate``."""
import pytest
import torch

import specgraph
from specgraph.drafts import NGram
from test_generate import left_pad, prompts
from test_generate_args import model, spec  # noqa: F401  (the tiny model and its SpecModel, as fixtures)


def test_stopping_criteria_see_each_row_with_its_left_padding(model, spec):
    """MaxLengthCriteria counts the padded batch's width, as in model.generate: every row stops at the
    same total length, the short prompt's row too."""
    from transformers import MaxLengthCriteria, StoppingCriteriaList

    rows = prompts(17, [4, 10])
    ids, mask = left_pad(rows)
    stop = StoppingCriteriaList([MaxLengthCriteria(max_length=ids.shape[1] + 5)])
    out = spec.generate(ids, attention_mask=mask, max_new_tokens=20, eos_token_id=None, stopping_criteria=stop)
    hf = model.generate(ids, attention_mask=mask, max_new_tokens=20, eos_token_id=None, do_sample=False,
                        pad_token_id=0, stopping_criteria=stop)
    assert torch.equal(out, hf) and out.shape[1] == ids.shape[1] + 5


def test_stopping_criteria_are_asked_on_the_whole_batch_once_a_position(model, spec):
    """A criterion that answers per row (row i stops after limits[i] new tokens) and one that keeps state
    (it counts its calls and stops every row at the 7th) give model.generate's output and see the same
    calls, though the rows run ahead of each other under speculation: with an eos id a stopped row is
    padded, without one it goes on generating until all have stopped, as in model.generate. The negative
    control: asked a row at a time (as before), the per-row criterion would stop row 1 at 2 tokens too."""
    from transformers import StoppingCriteria

    class PerRow(StoppingCriteria):
        def __init__(self, width, limits):
            self.width, self.limits = width, torch.tensor(limits)

        def __call__(self, input_ids, scores, **kwargs):
            return (input_ids.shape[1] - self.width) >= self.limits

    class Counting(StoppingCriteria):
        def __init__(self):
            self.shapes = []

        def __call__(self, input_ids, scores, **kwargs):
            self.shapes.append(tuple(input_ids.shape))
            return torch.full((input_ids.shape[0],), len(self.shapes) >= 7)

    rows = [prompts(3, [5])[0] * 3, prompts(23, [8])[0]]  # row 0 repeats itself: its n-gram drafts pay
    ids, mask = left_pad(rows)
    t = ids.shape[1]
    free = model.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=None, do_sample=False,
                          pad_token_id=0)
    unused = next(i for i in range(1, 100) if i not in free[:, t:])  # an eos id never reached: rows get padded
    for eos in (None, unused):
        outputs = []
        for run in (spec.generate, lambda *a, **k: model.generate(*a, do_sample=False, pad_token_id=0, **k)):
            per_row, counting = PerRow(t, [2, 9]), Counting()
            first = run(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=eos, stopping_criteria=[per_row])
            second = run(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=eos, stopping_criteria=[counting])
            outputs.append((first, second, counting.shapes))
        (first, second, shapes), (hf_first, hf_second, hf_shapes) = outputs
        assert torch.equal(first, hf_first) and first.shape[1] == t + 9, eos
        assert torch.equal(first[1, t:], free[1, t: t + 9])  # row 1 ran its 9 tokens
        assert first[0, t + 2:].eq(0).all() == (eos is not None), eos  # row 0 stopped at 2: padded with an eos
        assert torch.equal(second, hf_second) and shapes == hf_shapes == [(2, t + k) for k in range(1, 8)], eos
    out = spec.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=None, return_dict_in_generate=True)
    assert max(n for step in out.accept_lens for n in step) > 1  # speculation ran rows ahead of each other
    assert all(PerRow(t, [2, 9])(torch.tensor([list(r) + [7] * 2]), None).any() for r in ids)


@pytest.mark.model
def test_stop_strings_stop_where_model_generate_stops():
    from capture_harness import tiny_target_for
    from specgraph.models import load_gguf

    _, tokenizer = load_gguf()
    model = tiny_target_for(tokenizer)
    spec = specgraph.compile(model, NGram(), tree=specgraph.Chain(3), max_cache_len=128)
    ids = tokenizer("The list: one, two, three", return_tensors="pt").input_ids
    free = spec.generate(ids, max_new_tokens=24, eos_token_id=None)[0, ids.shape[1]:].tolist()
    stop = tokenizer.decode(free[8:10])  # a string the answer reaches in its 10th token
    assert stop.strip()
    kw = dict(max_new_tokens=24, eos_token_id=None, pad_token_id=0, stop_strings=[stop], tokenizer=tokenizer)
    want = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, **kw)
    got = spec.generate(ids, **kw)
    assert torch.equal(got, want) and got.shape[1] - ids.shape[1] <= 10
    with pytest.raises(ValueError, match="stop_strings needs the tokenizer"):
        spec.generate(ids, max_new_tokens=4, stop_strings=["x"])
