"""specgraph.attach: the user's own model.generate speculates and returns what it returned before
(SmolLM2, fp32, the shipped EAGLE-3 head); what the speculative path cannot honour falls back to
the original with a warning; detach restores the method. (examples/attach.py, run by
test_models.py, checks a left-padded batch of 3 and pipeline("text-generation") the same way;
examples/pipeline.py a streamed pipeline.)"""
import pytest
import torch

import specgraph
from specgraph.models import load_default_draft

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def smollm2():
    from specgraph.models import load_gguf

    return load_gguf()


def test_generate_speculates_unchanged_and_falls_back_by_name(smollm2):
    model, tokenizer = smollm2
    single = tokenizer(["The capital of France is"], return_tensors="pt")
    want = {"one": model.generate(**single, max_new_tokens=12, do_sample=False),
            "penalty": model.generate(**single, max_new_tokens=8, do_sample=False, repetition_penalty=1.3),
            "ngram": model.generate(**single, max_new_tokens=8, do_sample=False, no_repeat_ngram_size=2)}
    spec = specgraph.attach(model, load_default_draft(), tree=specgraph.DynamicTree(3, 4, 8), max_batch=4,
                            max_cache_len=256)
    try:
        assert model.generate is not type(model).generate
        assert torch.equal(model.generate(**single, max_new_tokens=12, do_sample=False), want["one"])
        assert spec.capture.decode_steps  # the speculative path did run (its decode step was built)
        steps = len(spec.capture.decode_steps)
        got = model.generate(**single, max_new_tokens=8, do_sample=False, repetition_penalty=1.3)  # speculates
        assert torch.equal(got, want["penalty"]) and len(spec.capture.decode_steps) == steps + 1
        with pytest.warns(UserWarning, match="no_repeat_ngram_size=2"):
            got = model.generate(**single, max_new_tokens=8, do_sample=False, no_repeat_ngram_size=2)
        assert torch.equal(got, want["ngram"])
        with pytest.raises(RuntimeError, match="already attached"):
            specgraph.attach(model, load_default_draft())
    finally:
        specgraph.detach(model)
    assert model.generate.__func__ is type(model).generate
    with pytest.raises(RuntimeError, match="not attached"):
        specgraph.detach(model)


def test_a_call_asking_for_hidden_states_leaves_attach_working():
    """transformers installs output-capturing forward hooks on the first call that asks for hidden states or
    attentions (a fallback here): inert outside such a call, they do not count as a changed model, and later
    calls speculate again, token-exact. A right-padded batch falls back to HF (with a warning) too."""
    import warnings

    import specgraph
    from specgraph import Chain
    from specgraph.drafts import NGram
    from test_capture import tiny_model

    model = tiny_model("llama")
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    specgraph.attach(model, NGram(), tree=Chain(3), max_cache_len=64)
    assert torch.equal(model.generate(ids, max_new_tokens=6), want)
    with pytest.warns(UserWarning, match="falling back"):
        model.generate(ids, max_new_tokens=2, return_dict_in_generate=True, output_hidden_states=True)
    model(ids, output_attentions=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # speculated: no fallback warning
        assert torch.equal(model.generate(ids, max_new_tokens=6), want)
    right = torch.tensor([[5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 0, 0]])
    mask = torch.tensor([[1] * 6, [1, 1, 1, 1, 0, 0]])
    with pytest.warns(UserWarning, match="padding on the right"):
        out = model.generate(right, attention_mask=mask, max_new_tokens=3, pad_token_id=0)
    specgraph.detach(model)
    assert torch.equal(out, model.generate(right, attention_mask=mask, max_new_tokens=3, pad_token_id=0, do_sample=False))
