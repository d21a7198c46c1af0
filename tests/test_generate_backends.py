"""The static decode step under the compiled backends: backend="cudagraphs" (recorded as it runs, nothing
compiled) and backend="inductor" (the whole step one graph, token-exact, reused across prompt lengths and
calls); each step under its own code object; compiles of one model share its capture."""
import pytest
import torch

import specgraph
from specgraph import Chain
from specgraph.drafts import Medusa, NGram
from specgraph.runtime.graphed import GraphedCall
from test_capture import tiny_model
from test_generate import generated_rows, hf_greedy, left_pad, prompts


@pytest.mark.parametrize("kind", ["ngram", "eagle3-lookup", "medusa-static"])
def test_cudagraphs_backend_is_token_exact_and_compiles_nothing(kind):
    """backend="cudagraphs": the inductor path's static step (prefill bucket, first propose, the EAGLE
    draft's pass over the prompt, the whole decode step over static buffers) without torch.compile; on the
    CPU it runs op by op, on CUDA it is recorded as CUDA graphs (tests/test_generate_gpu.py)."""
    from specgraph.drafts import Eagle3
    from specgraph.runtime.graphed import StaticStep

    model = tiny_model("llama")
    torch.manual_seed(0)
    static = specgraph.StaticTree([(0,), (1,), (0, 0), (0, 1), (0, 0, 0)])
    draft, tree = {"ngram": (NGram(), Chain(3)),
                   "eagle3-lookup": (Eagle3.for_target(model, aux_layer_ids=(0, 1, 1)),
                                     specgraph.WithLookup(specgraph.DynamicTree(steps=3, topk=2, nodes=6), 3)),
                   "medusa-static": (Medusa(model.config.hidden_size, model.config.vocab_size, 3), static)}[kind]
    spec = specgraph.compile(model, draft, tree=tree, max_batch=2, max_cache_len=128, backend="cudagraphs")
    torch._dynamo.utils.counters.clear()
    for lengths in ([6, 45], [70, 33]):  # 45, 70: the draft's prompt pass runs several chunks
        rows = prompts(11, lengths)
        ids, mask = left_pad(rows)
        out = spec.generate(ids, attention_mask=mask, max_new_tokens=20, eos_token_id=None)
        for row, got in zip(rows, generated_rows(out, ids.shape[1])):
            assert got == hf_greedy(model, row, max_new_tokens=20, eos_token_id=None)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0  # nothing compiled
    (bucket,) = spec.capture.decode_steps.values()
    assert isinstance(bucket.run, StaticStep) and isinstance(bucket.propose, GraphedCall)
    assert bucket.run.copies_after_step == 0  # the step carried its own results (DecodeStep.carried)
    assert all(isinstance(p, GraphedCall) for p in spec.capture.prefills.values())


# slow: a third draft through inductor's CPU codegen (a minute on CI's 2 cores)
@pytest.mark.parametrize("kind,whole_step", [("ngram", True), ("eagle3", True),
                                             pytest.param("medusa", True, marks=pytest.mark.slow), ("eagle3", False)])
def test_inductor_backend_is_token_exact(kind, whole_step, settings, request):
    """backend="inductor": the decode step (verify, compact, commit, and for EAGLE-3 the next EAGLE-2
    tree) compiles as one graph (fullgraph=True: a graph break or host sync would raise); same tokens.
    config.whole_step=False (the fallback) compiles the target bucket alone. The n-gram case runs dynamo
    and AOTAutograd without inductor's CPU codegen (aot_eager_compile: its verify, compact and commit are
    the other cases' under inductor; the n-gram step under inductor is test_graphed's, on the GPU)."""
    from specgraph.drafts import Eagle3

    if kind == "ngram":
        request.getfixturevalue("aot_eager_compile")
    settings(whole_step=whole_step)

    def compiled():  # a new tiny Llama and draft, the same each time (seeded)
        model = tiny_model("llama")
        torch.manual_seed(0)
        if kind == "ngram":
            draft, tree = NGram(), Chain(3)
        elif kind == "medusa":
            draft, tree = Medusa(model.config.hidden_size, model.config.vocab_size, num_heads=3), Chain(3)
        else:
            draft = Eagle3.for_target(model, aux_layer_ids=(0, 1, 1))
            tree = specgraph.DynamicTree(steps=3, topk=2, nodes=6)
        return model, specgraph.compile(model, draft, tree=tree, max_batch=2, max_cache_len=128, backend="inductor")

    model, spec = compiled()
    rows = prompts(9, [6, 45])  # 45: the draft's prefill runs two chunks (one of them padded)
    ids, mask = left_pad(rows)
    torch._dynamo.utils.counters.clear()
    out = spec.generate(ids, attention_mask=mask, max_new_tokens=20, eos_token_id=None)
    for row, got in zip(rows, generated_rows(out, ids.shape[1])):
        assert got == hf_greedy(model, row, max_new_tokens=20, eos_token_id=None)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs >= 2  # the prefill bucket and the decode step
    again = spec.generate(ids.flip(0), attention_mask=mask.flip(0), max_new_tokens=20, eos_token_id=None)
    assert torch.equal(again, out.flip(0))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # the bucket's step is reused
    longer = prompts(10, [70, 33])  # new lengths (the draft's prompt pass runs three chunks): no recompile
    ids, mask = left_pad(longer)
    out = spec.generate(ids, attention_mask=mask, max_new_tokens=20, eos_token_id=None)
    for row, got in zip(longer, generated_rows(out, ids.shape[1])):
        assert got == hf_greedy(model, row, max_new_tokens=20, eos_token_id=None)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    (prefill,) = spec.capture.prefills.values()  # the prefill bucket over static buffers (a CUDA graph on CUDA)
    assert isinstance(prefill, GraphedCall) and not prefill.cuda_graph and prefill.inputs is not None
    if whole_step:  # so are the first propose and (EAGLE) the draft's pass over the prompt
        (bucket,) = spec.capture.decode_steps.values()
        assert isinstance(bucket.propose, GraphedCall) and bucket.propose.inputs is not None
        assert kind != "eagle3" or isinstance(bucket.session._prefill_chain, GraphedCall)
        # the compiled step wrote its results over its inputs itself (DecodeStep.carried): nothing copied after
        # it, which on CUDA were a memcpy launch each in the recorded graph
        assert bucket.run.copies_after_step == 0
    if kind == "ngram" and whole_step:  # sampling: a new temperature reuses the compiled step
        hot = spec.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=None, do_sample=True,
                            temperature=5.0)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        cold = spec.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=None, do_sample=True,
                             temperature=1e-4)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
        # the step read the new value: near-zero temperature samples the greedy tokens
        assert torch.equal(cold, spec.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=None))
        assert not torch.equal(hot, cold)
    if kind == "eagle3" and whole_step:  # the draft's pass over the prompt is compiled too
        (bucket,) = spec.capture.decode_steps.values()
        assert hasattr(bucket.session, "_prefill_chain")
    if kind == "medusa" and torch._inductor.config.fx_graph_cache:  # compiled artifacts are cached: compiling
        # the same model and buckets afresh (dynamo reset, a new model, a new Capture) loads inductor's graphs
        # from its FX graph cache on disk instead of generating code again (across processes as well:
        # docs/design.md); unless the user turned that cache off
        torch._dynamo.reset()
        cache = torch._dynamo.utils.counters["inductor"]
        cache.clear()
        _, spec = compiled()
        assert torch.equal(spec.generate(ids, attention_mask=mask, max_new_tokens=20, eos_token_id=None), out)
        assert cache["fxgraph_cache_hit"] >= 2 and cache["fxgraph_cache_miss"] == 0, dict(cache)

def test_every_step_compiles_under_its_own_code_object():
    """torch.compile counts recompiles per code object (limit 8); decode steps built in one process
    (buckets, models, trees) must not share one, or the ninth fails under fullgraph=True."""
    from specgraph.runtime.generate import own_code

    class Step:
        def __init__(self, scale):
            self.fn = type(f"Graph{scale}", (torch.nn.Module,), {"forward": lambda _, x: x * scale})()
            # a class of its own per instance, guarded by type, as each step's captured GraphModule is

        def __call__(self, x):
            return self.fn(x)

    x = torch.ones(2)
    shared = [torch.compile(Step(i).__call__, fullgraph=True, dynamic=False, backend="eager") for i in range(10)]
    with pytest.raises(Exception, match="(?i)recompile limit|fullgraph"):
        for f in shared:
            f(x)
    torch._dynamo.reset()
    own = [torch.compile(own_code(Step(i).__call__), fullgraph=True, dynamic=False, backend="eager") for i in range(10)]
    assert [f(x)[0].item() for f in own] == [float(i) for i in range(10)]


def test_compiles_of_one_model_share_its_capture():
    """A second compile of the same model (same max_length) reuses the captured buckets; a changed
    model (dtype) or another max_length gets a new capture; a deep copy starts with none."""
    import copy

    model = tiny_model("llama")
    first = specgraph.compile(model, NGram(), tree=Chain(3), max_cache_len=64)
    plain = specgraph.compile(model, None, max_cache_len=64)
    assert plain.capture is first.capture
    ids = torch.tensor([prompts(3, [9])[0]])
    assert plain.generate(ids, max_new_tokens=6, eos_token_id=None)[0, 9:].tolist() == \
        hf_greedy(model, ids[0].tolist(), max_new_tokens=6, eos_token_id=None)
    assert specgraph.compile(model, None, max_cache_len=96).capture is not first.capture
    assert copy.deepcopy(model).__dict__["_specgraph_captures"] == {}
    model.to(torch.float64)
    assert specgraph.compile(model, None, max_cache_len=96).capture.kv_device == torch.device("cpu")
    captured = specgraph.compile(model, None, max_cache_len=96).capture
    assert next(iter(captured.model.parameters())).dtype == torch.float64
