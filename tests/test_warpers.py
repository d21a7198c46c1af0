"""The sampling filters a step runs (kernels/verify.py ``_warp``, ``Sampling.warpers``): a top-k found by
torch.topk among the ``top_k_cap`` largest logits, and the top-p nucleus found among them, filter exactly what
a sort of the vocabulary does (ties at the k-th logit and at the nucleus' edge included); a filter that is off
is not run; the step's bucket is keyed by the filters that are on, and ``warmup(sampling=True)`` compiles the
bucket a plain ``do_sample=True`` call uses."""
import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

import specgraph
import specgraph.runtime.step as step
from specgraph.kernels.verify import TOP_K_CAP, sampling_probs, warped_logits
from specgraph.runtime.generate import Sampling
from test_generate import _small_vocab_model


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_top_k_among_the_largest_filters_what_the_sort_does(data):
    b, n, v = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3)), data.draw(st.integers(2, 300))
    cap = data.draw(st.sampled_from([1, 4, 16, 64, 256]))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    logits = torch.randint(-8, 8, (b, n, v), generator=g).float() / 2  # a coarse grid: ties everywhere, as in bf16
    top_k = torch.tensor([data.draw(st.integers(1, cap)) for _ in range(b)])  # the cap's promise: 1 <= k <= cap
    temperature = torch.tensor([data.draw(st.sampled_from([0.5, 1.0, 1.3])) for _ in range(b)])
    top_p = torch.tensor([data.draw(st.sampled_from([1.0, 0.99, 0.9, 0.5, 0.1])) for _ in range(b)])
    min_p = torch.tensor([data.draw(st.sampled_from([0.0, 0.1])) for _ in range(b)])
    sorted_ = warped_logits(logits, temperature, top_k, top_p, min_p)
    among_largest = warped_logits(logits, temperature, top_k, top_p, min_p, top_k_cap=cap)
    assert torch.equal(among_largest, sorted_)
    probs = sampling_probs(logits, temperature, top_k, top_p, min_p, top_k_cap=cap, greedy_rows=False)
    assert torch.equal(probs, sampling_probs(logits, temperature, top_k, top_p, min_p))


def test_a_cap_below_k_would_filter_differently():
    """Negative control: the equality above needs k <= cap (Sampling.warpers sorts a larger top_k)."""
    logits = torch.arange(40.0).view(1, 1, 40)
    assert not torch.equal(warped_logits(logits, 1.0, top_k=10, top_k_cap=4), warped_logits(logits, 1.0, top_k=10))
    # and k >= 1: with top-k off the nucleus may reach past the cap's largest (here the 5th token)
    assert not torch.equal(warped_logits(logits, 1.0, top_k=0, top_p=0.99, top_k_cap=4),
                           warped_logits(logits, 1.0, top_k=0, top_p=0.99))
    assert Sampling(top_k=TOP_K_CAP).warpers()[0] == "topk" and Sampling(top_k=TOP_K_CAP + 1).warpers()[0] == "sort"


def test_filters_that_are_off_are_skipped_and_change_nothing():
    logits = torch.randn(2, 3, 50, generator=torch.Generator().manual_seed(0)) * 4
    skipped = sampling_probs(logits, 0.8)
    torch.testing.assert_close(sampling_probs(logits, 0.8, top_k=0, top_p=1.0, min_p=0.0), skipped, rtol=0, atol=0)
    assert Sampling(1.0, top_k=0, top_p=1.0, min_p=0.0).warpers() == (None, False, False)
    assert Sampling(0.7, top_k=50, top_p=0.9, min_p=0.05).warpers() == ("topk", True, True)


def test_the_step_runs_the_filters_that_are_on_and_keys_its_bucket_by_them(monkeypatch):
    seen = []
    real = step.sampling_probs
    monkeypatch.setattr(step, "sampling_probs", lambda logits, **kw: seen.append(kw) or real(logits, **kw))
    spec = specgraph.compile(_small_vocab_model(), None, max_cache_len=64)
    ids = torch.tensor([[3, 4, 5, 6]])

    def call(**kw):
        seen.clear()
        spec.generate(ids, do_sample=True, max_new_tokens=3, eos_token_id=None, **kw)
        return seen[-1]

    off = call(top_k=0, top_p=1.0)
    assert off["top_k"] is None and off["top_p"] is None and off["min_p"] is None and off["greedy_rows"] is False
    buckets = len(spec.capture.decode_steps)
    topk = call(top_k=5, top_p=0.9)
    assert topk["top_k_cap"] == TOP_K_CAP and int(topk["top_k"]) == 5 and float(topk["top_p"]) == pytest.approx(0.9)
    assert len(spec.capture.decode_steps) == buckets + 1  # other filters: another bucket
    assert int(call(top_k=7, top_p=0.5)["top_k"]) == 7  # the same filters: the bucket reads the new values
    assert len(spec.capture.decode_steps) == buckets + 1
    assert call(top_k=TOP_K_CAP + 1)["top_k_cap"] is None  # a k past the cap: the sort
    assert len(spec.capture.decode_steps) == buckets + 2


def test_warmup_compiles_the_bucket_a_plain_sampled_call_uses():
    spec = specgraph.compile(_small_vocab_model(), None, max_cache_len=64)
    spec.warmup(sampling=True)
    buckets = len(spec.capture.decode_steps)
    ids = torch.tensor([[3, 4, 5, 6]])
    spec.generate(ids, do_sample=True, max_new_tokens=3, eos_token_id=None)  # the config's top_k=50, top_p=1
    assert len(spec.capture.decode_steps) == buckets
    spec.generate(ids, do_sample=True, top_k=0, max_new_tokens=3, eos_token_id=None)  # control: other filters
    assert len(spec.capture.decode_steps) == buckets + 1


# slow: inductor's CPU codegen (half a minute on CI's 2 cores); eager here, inductor on CUDA in the GPU tests
@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_a_vocabulary_past_the_cap_samples_through_topk_and_speculation_keeps_plain_samplings_tokens(
        backend, aot_eager_compile):
    """A 300-token vocabulary (> TOP_K_CAP): transformers' default top_k=50 takes the torch.topk path inside the
    step (eager, and traced as one graph: aot_eager stands in for inductor's code generation); seeded, an
    EAGLE tree and an n-gram chain emit plain sampling's tokens."""
    import transformers

    from specgraph import Chain, DynamicTree
    from specgraph.drafts import Eagle, NGram

    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, vocab_size=300, max_position_embeddings=128,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(4)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 12, 9, 10, 11, 12]])

    def tokens(draft, tree):
        spec = specgraph.compile(model, draft, tree=tree, max_batch=2, max_cache_len=96, backend=backend)
        out = spec.generate(ids, do_sample=True, seed=3, temperature=0.9, max_new_tokens=16, eos_token_id=None)
        caps = {bucket.step.warp_args()["top_k_cap"] for bucket in spec.capture.decode_steps.values()}
        assert caps == {TOP_K_CAP}, caps
        return out

    plain = tokens(None, None)
    assert torch.equal(tokens(NGram(), Chain(3)), plain)
    assert torch.equal(tokens(Eagle.for_target(model), DynamicTree(steps=2, topk=2, nodes=4)), plain)
