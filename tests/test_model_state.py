"""model_state.py: a SpecModel refuses copies (its graphs are tied to the model's storage) and a draft serves
one live target at a time. (Its per-call fingerprint and inference-mode wrapper: tests/test_generate.py.)"""
import copy
import gc
import pickle

import pytest

import specgraph
from specgraph.drafts import Eagle3, NGram
from test_capture import tiny_model


def test_a_spec_model_refuses_copies_with_the_fix():
    spec = specgraph.compile(tiny_model("llama"), NGram(), tree=specgraph.Chain(2), max_cache_len=64)
    for copier in (copy.deepcopy, pickle.dumps, copy.copy):
        with pytest.raises(TypeError, match=r"copy.deepcopy\(model\)"):
            copier(spec)


def test_one_draft_module_serves_one_live_target():
    """Compiling a draft for a second model would point its borrowed LM head and embedding at that model:
    refused while the first SpecModel lives, with the fix; once it is gone, or for the same model, fine."""
    first, second = tiny_model("llama"), tiny_model("llama", seed=3)
    draft = Eagle3.for_target(first, aux_layer_ids=(0, 1, 1))
    spec = specgraph.compile(first, draft, tree=specgraph.Chain(2), max_cache_len=64)
    again = specgraph.compile(first, draft, tree=specgraph.Chain(3), max_cache_len=64)  # the same model: fine
    with pytest.raises(specgraph.CompileError, match="already compiled with another model"):
        specgraph.compile(second, draft, tree=specgraph.Chain(2), max_cache_len=64)
    del spec, again
    gc.collect()
    specgraph.compile(second, draft, tree=specgraph.Chain(2), max_cache_len=64)
