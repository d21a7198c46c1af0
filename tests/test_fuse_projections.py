"""pack_projections + the fuse_projections pass: q/k/v and gate/up read as one matrix each, with the
model's values and Parameters unchanged; groups that are not laid out together are left alone."""
import torch

from specgraph.capture import Capture
from specgraph.passes import pack_projections
from capture_harness import Driver, check_tree_against_hf
from test_capture import TOL, tiny_model


def _projections(model):
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    return [attn.q_proj, attn.k_proj, attn.v_proj], [mlp.gate_proj, mlp.up_proj]


def test_pack_keeps_parameters_and_values_and_is_idempotent(tmp_path):
    model = tiny_model("qwen2")  # q/k/v carry biases
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = list(model.parameters())
    assert pack_projections(model) == 2 * model.config.num_hidden_layers
    assert list(model.parameters()) == params  # same Parameter objects: optimizers and hooks still hold them
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    for group in _projections(model):
        for tensors in ([m.weight for m in group], [m.bias for m in group if m.bias is not None]):
            ptrs = {t.untyped_storage().data_ptr() for t in tensors}
            assert len(ptrs) <= 1
            for a, b in zip(tensors, tensors[1:]):
                assert b.storage_offset() == a.storage_offset() + a.numel()
    addresses = [p.data_ptr() for p in model.parameters()]
    assert pack_projections(model) == 0 and [p.data_ptr() for p in model.parameters()] == addresses
    model.save_pretrained(tmp_path)  # shared storage, disjoint slices: saved as separate tensors
    reloaded = type(model).from_pretrained(tmp_path)
    assert all(torch.equal(v, before[k]) for k, v in reloaded.state_dict().items())


def test_a_group_not_laid_out_together_is_left_alone():
    model = tiny_model("llama")
    driver = Driver(model, batch=2, max_length=96, seed=3)  # the Capture packs every group
    q, k, v = _projections(model)[0]
    assert k.weight.untyped_storage().data_ptr() == q.weight.untyped_storage().data_ptr()
    q.weight.data = q.weight.data.clone()  # layer 0's q now lives apart: k and v stay back to back
    rng = driver.rng
    driver.prefill([[rng.randrange(3, 101) for _ in range(n)] for n in (9, 30)])
    counters = dict(driver.capture.step(2, 8).pass_results)["fuse_projections"].counters
    layers = model.config.num_hidden_layers
    assert counters == {"groups_fused": 2 * layers, "linears_fused": 5 * layers - 1, "linears_unfused": 1}
    check_tree_against_hf(driver, nodes=8, tol=TOL)


def test_fused_step_matches_hf_compiled():
    model = tiny_model("gemma3")
    driver = Driver(model, batch=2, max_length=96, seed=4)
    assert isinstance(driver.capture, Capture)
    rng = driver.rng
    driver.prefill([[rng.randrange(3, 101) for _ in range(n)] for n in (12, 40)])
    step = driver.capture.step(2, 8)
    step.run = torch.compile(step.graph, backend="inductor", fullgraph=True, dynamic=False)
    check_tree_against_hf(driver, nodes=8, tol=TOL)


def test_a_parallel_block_fuses_its_two_groups_and_stays_exact():
    """Cohere's parallel block: q/k/v and gate/up all read one LayerNorm output from two storages; each group
    fuses within its own storage (sorting the five by offset alone interleaved them and broke the
    postcondition), greedy token-exact with model.generate."""
    import transformers

    import specgraph
    from specgraph.drafts import NGram

    config = transformers.CohereConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, vocab_size=256, logit_scale=0.5, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.CohereForCausalLM(config).eval()
    ids = torch.randint(3, 200, (1, 12), generator=torch.Generator().manual_seed(11))
    spec = specgraph.compile(model, NGram(), tree=specgraph.Chain(3), max_cache_len=128)
    out = spec.generate(ids, max_new_tokens=8, eos_token_id=None)
    want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False, eos_token_id=None)
    assert torch.equal(out, want)
    counters = dict(next(iter(spec.capture._steps.values())).pass_results)["fuse_projections"].counters
    assert counters == {"groups_fused": 4, "linears_fused": 10, "linears_unfused": 0}
