"""output_scores / output_logits with return_dict_in_generate under speculation: per generated
position a [B, V] fp32 tensor, as model.generate returns them. Oracles: the tiny model's own
``model.generate(output_scores=True, output_logits=True)`` (greedy: allclose, penalty or not) and,
for sampling, transformers' processors run on the target's logits over the emitted sequence."""
import pytest
import torch
from transformers import (LogitsProcessorList, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                          TopKLogitsWarper, TopPLogitsWarper)

import specgraph
from specgraph import Chain, DynamicTree
from specgraph.drafts import Eagle3, NGram
from test_capture import tiny_model
from test_generate import left_pad, prompts

KEEP = dict(return_dict_in_generate=True, output_scores=True, output_logits=True)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def _hf(model, ids, mask=None, **kw):
    mask = torch.ones_like(ids) if mask is None else mask
    return model.generate(ids, attention_mask=mask, pad_token_id=0, eos_token_id=None, **KEEP, **kw)


@pytest.mark.parametrize("penalty", [None, 1.4])
@pytest.mark.parametrize("kind", ["ngram-chain3", "eagle3-dynamic"])
def test_greedy_scores_and_logits_are_model_generates(model, kind, penalty):
    draft, tree = (NGram(), Chain(3)) if kind == "ngram-chain3" else \
        (Eagle3.for_target(model, aux_layer_ids=(0, 1, 1)), DynamicTree(3, 3, 8))
    spec = specgraph.compile(model, draft, tree=tree, max_batch=3, max_cache_len=128)
    longest = 1
    for row in prompts(3, [7, 16]):
        ids = torch.tensor([row])
        out = spec.generate(ids, max_new_tokens=15, eos_token_id=None, repetition_penalty=penalty, **KEEP)
        want = _hf(model, ids, max_new_tokens=15, do_sample=False, repetition_penalty=penalty)
        assert torch.equal(out.sequences, want.sequences)
        assert len(out.scores) == len(want.scores) == len(out.logits) == 15
        for ours, theirs in ((out.scores, want.scores), (out.logits, want.logits)):
            for t, (a, b) in enumerate(zip(ours, theirs)):
                assert a.shape == b.shape == (1, model.config.vocab_size) and a.dtype == torch.float32
                assert torch.allclose(a, b, rtol=1e-4, atol=1e-4), t
        assert (penalty is None) == all(torch.equal(s, lg) for s, lg in zip(out.scores, out.logits))
        longest = max(longest, *(max(step) for step in out.accept_lens))
    assert longest > 1 or "eagle3" in kind  # several positions came from one step (an untrained EAGLE-3 may miss)


def test_batched_rows_hold_their_own_tokens_scores_and_zeros_after_they_finish(model):
    spec = specgraph.compile(model, NGram(), tree=Chain(3), max_batch=3, max_cache_len=128)
    rows = prompts(4, [5, 12, 8])
    ids, mask = left_pad(rows)
    free = _hf(model, ids, mask, max_new_tokens=14, do_sample=False)
    eos = int(free.sequences[0, ids.shape[1] + 4])  # row 0 stops by its 5th token; the others run on
    out = spec.generate(ids, attention_mask=mask, max_new_tokens=14, eos_token_id=eos, pad_token_id=0, **KEEP)
    want = model.generate(ids, attention_mask=mask, pad_token_id=0, eos_token_id=eos, max_new_tokens=14,
                          do_sample=False, **KEEP)
    assert torch.equal(out.sequences, want.sequences) and len(out.scores) == len(want.scores)
    generated = out.sequences[:, ids.shape[1]:].tolist()
    lengths = [row.index(eos) + 1 if eos in row else len(row) for row in generated]
    assert lengths[0] <= 5 < len(out.scores)  # row 0's later positions are past its end
    for b, (row, length) in enumerate(zip(generated, lengths)):
        for t in range(len(out.scores)):
            if t < length:  # model.generate computes a finished row on, over its padding: not compared
                assert torch.allclose(out.scores[t][b], want.scores[t][b], rtol=1e-4, atol=1e-4), (b, t)
                assert torch.allclose(out.logits[t][b], want.logits[t][b], rtol=1e-4, atol=1e-4), (b, t)
                assert int(out.scores[t][b].argmax()) == row[t]
            else:
                assert not out.scores[t][b].any() and not out.logits[t][b].any()


def test_sampled_scores_are_the_emitted_tokens_processed_distributions(model):
    spec = specgraph.compile(model, Eagle3.for_target(model, aux_layer_ids=(0, 1, 1)), tree=DynamicTree(3, 3, 8),
                             max_batch=2, max_cache_len=128)
    rows = prompts(6, [6, 10])
    ids, mask = left_pad(rows)
    settings = dict(temperature=0.8, top_k=20, top_p=0.9, repetition_penalty=1.3)
    torch.manual_seed(0)
    out = spec.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=None, do_sample=True,
                        **settings, **KEEP)
    processors = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.3), TemperatureLogitsWarper(0.8),
                                      TopKLogitsWarper(20), TopPLogitsWarper(0.9)])
    for b, row in enumerate(rows):  # the target over the row's emitted sequence, unpadded
        sequence = torch.cat([torch.tensor(row), out.sequences[b, ids.shape[1]:]])
        with torch.no_grad():
            logits = model(sequence.unsqueeze(0)).logits[0].float()
        for t in range(12):
            prefix = sequence[: len(row) + t].unsqueeze(0)
            raw = logits[len(row) + t - 1]
            want = processors(prefix, raw.unsqueeze(0).clone())[0]
            assert torch.allclose(out.logits[t][b], raw, rtol=1e-4, atol=1e-4), (b, t)
            finite = torch.isfinite(want)
            assert torch.equal(torch.isfinite(out.scores[t][b]), finite), (b, t)  # the same tokens filtered
            assert torch.allclose(out.scores[t][b][finite], want[finite], rtol=1e-4, atol=1e-4), (b, t)
            assert finite[sequence[len(row) + t]]  # the emitted token was one the distribution allows


def test_scores_are_gathered_only_when_returned(model):
    spec = specgraph.compile(model, NGram(), tree=Chain(2), max_cache_len=64)
    ids = torch.tensor([prompts(8, [6])[0]])
    plain = spec.generate(ids, max_new_tokens=5, eos_token_id=None, output_scores=True)  # no dict: as model.generate
    assert torch.is_tensor(plain) and len(spec.capture.decode_steps) == 1
    out = spec.generate(ids, max_new_tokens=5, eos_token_id=None, return_dict_in_generate=True)
    assert out.scores is None and out.logits is None and len(spec.capture.decode_steps) == 1
    out = spec.generate(ids, max_new_tokens=5, eos_token_id=None, return_dict_in_generate=True, output_logits=True)
    assert out.scores is None and len(out.logits) == 5 and len(spec.capture.decode_steps) == 2
    assert torch.equal(out.sequences, plain)


def test_attach_speculates_with_scores_instead_of_falling_back(model, recwarn):
    specgraph.attach(model, NGram(), tree=Chain(2), max_cache_len=128)
    try:
        ids = torch.tensor([prompts(9, [7])[0]])
        out = model.generate(ids, max_new_tokens=6, eos_token_id=None, repetition_penalty=1.2, **KEEP)
        assert out.accept_lens and len(out.scores) == 6
        assert not [w for w in recwarn if "falling back" in str(w.message)]
    finally:
        specgraph.detach(model)
