"""specgraph.attach: the user's own model.generate and pipeline("text-generation") speculate and
return what they returned before (SmolLM2, fp32, the shipped EAGLE-3 head); what the speculative
path cannot honour falls back to the original with a warning; detach restores the method."""
import pytest
import torch
import transformers

import specgraph
from specgraph.models import load_default_draft

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def smollm2():
    from specgraph.models import load_gguf

    return load_gguf()


def test_generate_and_pipeline_speculate_unchanged(smollm2):
    model, tokenizer = smollm2
    tokenizer.padding_side = "left"
    texts = ["The capital of France is", "Write one line about the sea:", "1, 2, 3,"]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    single = tokenizer(texts[:1], return_tensors="pt")
    pipe = transformers.pipeline("text-generation", model=model, tokenizer=tokenizer)
    want = {"one": model.generate(**single, max_new_tokens=12, do_sample=False),
            "three": model.generate(**batch, max_new_tokens=12, do_sample=False),
            "pipe": pipe(texts[1], max_new_tokens=12, do_sample=False)[0]["generated_text"],
            "penalty": model.generate(**single, max_new_tokens=8, do_sample=False, repetition_penalty=1.3)}
    spec = specgraph.attach(model, load_default_draft(), tree=specgraph.DynamicTree(3, 4, 8), max_batch=4,
                            max_length=256)
    try:
        assert model.generate is not type(model).generate
        assert torch.equal(model.generate(**single, max_new_tokens=12, do_sample=False), want["one"])
        assert torch.equal(model.generate(**batch, max_new_tokens=12, do_sample=False), want["three"])
        assert pipe(texts[1], max_new_tokens=12, do_sample=False)[0]["generated_text"] == want["pipe"]
        steps = spec.capture.decode_steps  # the speculative path did run (its decode steps were built)
        assert steps
        with pytest.warns(UserWarning, match="repetition_penalty=1.3"):
            got = model.generate(**single, max_new_tokens=8, do_sample=False, repetition_penalty=1.3)
        assert torch.equal(got, want["penalty"])
        with pytest.raises(RuntimeError, match="already attached"):
            specgraph.attach(model, load_default_draft())
    finally:
        specgraph.detach(model)
    assert model.generate.__func__ is type(model).generate
    with pytest.raises(RuntimeError, match="not attached"):
        specgraph.detach(model)
