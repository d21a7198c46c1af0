"""What replace_attention cannot prove, it refuses: every blocker listed with its layer and node."""
import pytest
import torch
import torch.nn.functional as F
import transformers

import specgraph.kernels  # noqa: F401
from specgraph.capture import TargetInfo, export_tree_step, graph_context
from specgraph.errors import CompileError
from specgraph.passes import replace_attention

B, N, S, H, D = 1, 4, 32, 2, 8


class Layer(torch.nn.Module):
    def __init__(self, variant: str):
        super().__init__()
        self.variant = variant
        self.q, self.k, self.v = (torch.nn.Linear(H * D, H * D) for _ in range(3))
        self.bias = torch.nn.Parameter(torch.randn(H, 1, 1))

    def forward(self, x, kv, layer, slots, cache_len, tree_mask, other):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, H, D).transpose(1, 2)
        k_new = self.k(x).view(b, n, H, D).transpose(1, 2)
        index = slots.view(b, 1, n, 1).expand_as(k_new)
        k = kv[2 * layer].scatter_(2, index, k_new)
        v = kv[2 * layer + 1].scatter_(2, index, self.v(x).view(b, n, H, D).transpose(1, 2))
        mask = torch.ops.specgraph.tree_attention_mask(cache_len, tree_mask, S, 0)
        if self.variant == "alibi":  # a learned per-head bias added to the tree mask
            mask = torch.where(mask, self.bias, float("-inf"))
        if self.variant == "causal":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if self.variant == "cross":  # keys from another sequence
            other_k = self.k(other).view(b, -1, H, D).transpose(1, 2)
            return F.scaled_dot_product_attention(q, other_k, other_k, attn_mask=mask[..., : other.shape[1]])
        if self.variant == "eager":  # attention by hand: invisible to the pass
            scores = (q @ k.transpose(-1, -2)).masked_fill(~mask, float("-inf"))
            return scores.softmax(-1) @ v
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class Toy(torch.nn.Module):
    def __init__(self, variants):
        super().__init__()
        self.layers = torch.nn.ModuleList(Layer(v) for v in variants)
        self.register_buffer("kv", torch.zeros(2 * len(variants), B, H, S, D))

    def forward(self, input_ids, positions, cache_len, tree_mask):
        x = torch.nn.functional.one_hot(input_ids, H * D).float()
        slots = cache_len.unsqueeze(1) + torch.arange(input_ids.shape[1])
        for i, layer in enumerate(self.layers):
            x = x + layer(x, self.kv, i, slots, cache_len, tree_mask, x[:, :2]).transpose(1, 2).reshape(x.shape)
        return x


def run(variants):
    args = (torch.zeros(B, N, dtype=torch.long), torch.arange(N).unsqueeze(0), torch.zeros(B, dtype=torch.long),
            torch.tensor([[1, 3, 7, 15]]))
    program = torch.export.export(Toy(variants), args, strict=False)
    info = TargetInfo(len(variants), H, H, D, H * D, (0,) * len(variants), torch.float32)
    return replace_attention(program.graph_module, graph_context(program, info))


def test_the_toy_is_accepted_when_plain():
    result = run(["plain", "plain"])
    assert result.counters["sdpa_replaced"] == 2


@pytest.mark.parametrize("variant, message", [
    ("alibi", "not the tree mask alone"),
    ("causal", "is_causal=True"),
    ("cross", "do not come from the KV cache"),
    ("eager", "no SDPA over the KV cache found"),
])
def test_refusal_names_the_blocker_and_layer(variant, message):
    with pytest.raises(CompileError) as err:
        run(["plain", variant])
    text = str(err.value)
    assert message in text
    assert "layers.1" in text or "layers [1]" in text, text
    assert "layers.0" not in text  # the plain layer is not blamed


def test_every_blocker_is_listed():
    with pytest.raises(CompileError) as err:
        run(["alibi", "causal", "cross"])
    assert len(err.value.blockers) >= 3
    for message in ("not the tree mask alone", "is_causal=True", "do not come from the KV cache"):
        assert message in str(err.value)


def test_config_refusals_are_listed_at_capture():
    config = transformers.Gemma2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                       num_key_value_heads=1, head_dim=16, vocab_size=64, attn_logit_softcapping=50.0,
                                       pad_token_id=0)
    model = transformers.Gemma2ForCausalLM(config)
    with pytest.raises(CompileError, match="attn_logit_softcapping"):
        TargetInfo.from_model(model)


def test_multi_head_latent_attention_is_refused_at_compile():
    import specgraph

    config = transformers.DeepseekV3Config(hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                           vocab_size=64, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
                                           qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
                                           first_k_dense_replace=1, pad_token_id=0)
    model = transformers.DeepseekV3ForCausalLM(config)
    with pytest.raises(CompileError, match="kv_lora_rank=16: multi-head latent attention"):
        specgraph.compile(model, specgraph.drafts.NGram(), tree=specgraph.Chain(2))


def test_window_narrower_than_the_tree_is_refused():
    config = transformers.MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                        num_key_value_heads=1, vocab_size=64, sliding_window=4)
    model = transformers.MistralForCausalLM(config)
    with pytest.raises(CompileError) as err:
        export_tree_step(model, batch=1, nodes=8, max_length=32)
    assert "layer 0: window 4" in str(err.value) and "layer 1: window 4" in str(err.value)
    with pytest.raises(CompileError) as err:  # and compile() says so before anything runs
        specgraph.compile(model, specgraph.drafts.NGram(), tree=specgraph.Chain(7), max_cache_len=32)
    assert "layer 0: sliding window 4 <= tree of 8 nodes" in str(err.value) and "layer 1: sliding" in str(err.value)
    specgraph.compile(model, specgraph.drafts.NGram(), tree=specgraph.Chain(2), max_cache_len=32)  # 3 nodes fit


def test_generation_settings_that_would_change_the_output_are_named():
    """generation_config / kwargs: "off" values pass, anything else is named (SpecModel.generate
    refuses it; attach falls back to HF for it)."""
    from transformers import GenerationConfig

    from specgraph.generate_args import unsupported_arguments

    off = GenerationConfig(repetition_penalty=1.0, num_beams=1, output_scores=False, no_repeat_ngram_size=0,
                           suppress_tokens=[], max_new_tokens=9, top_k=5, do_sample=True)
    assert unsupported_arguments({"max_new_tokens": 3, "eos_token_id": 2, "logits_processor": []}, off) == []  # HF's defaults
    on = GenerationConfig(no_repeat_ngram_size=3, forced_bos_token_id=0, suppress_tokens=[7])
    assert unsupported_arguments({"num_beams": 2, "logits_processor": ["p"], "prefix_allowed_tokens_fn": None}, on) == [
        "logits_processor=['p']", "forced_bos_token_id=0", "no_repeat_ngram_size=3", "num_beams=2", "suppress_tokens=[7]"]
    # a tensor is named by its shape (attach warns once per reason, not once per call with a data dump)
    assert unsupported_arguments({"inputs_embeds": torch.zeros(2, 3)}, off) == ["inputs_embeds=<tensor (2, 3) float32>"]
    # supported now: a repetition penalty, scores and logits in the output
    assert unsupported_arguments({"repetition_penalty": 1.2, "output_scores": True, "output_logits": True}, off) == []


def _tiny(cls_name: str, config_name: str, **fields):
    torch.manual_seed(0)
    model = getattr(transformers, cls_name)(getattr(transformers, config_name)(vocab_size=101, hidden_size=32,
                                                                             **fields)).eval()
    return model


@pytest.mark.parametrize("cls_name, config_name, fields, message", [
    ("BertLMHeadModel", "BertConfig", dict(num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                            is_decoder=True), "the LM head is 'cls.predictions.decoder'"),
    ("BertForMaskedLM", "BertConfig", dict(num_hidden_layers=2, num_attention_heads=2, intermediate_size=64),
     "not a generative causal LM"),
    ("BloomForCausalLM", "BloomConfig", dict(n_layer=2, n_head=2), "model_type='bloom' biases attention"),
    ("LlamaForCausalLM", "LlamaConfig", dict(num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                              rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
     "rope_type='dynamic' recomputes the rotary frequencies"),
    ("Phi3ForCausalLM", "Phi3Config", dict(num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, pad_token_id=0,
                                            max_position_embeddings=256, original_max_position_embeddings=64,
                                            rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 8,
                                                          "long_factor": [2.0] * 8}),
     "rope_type='longrope' recomputes"),
])
def test_models_the_step_cannot_express_are_refused_at_compile(cls_name, config_name, fields, message):
    """They used to pass compile and fail inside the first generate (rotary frequencies recomputed from the
    sequence length: inside the captured graph, a guard on data)."""
    import specgraph

    with pytest.raises(CompileError, match=message):
        specgraph.compile(_tiny(cls_name, config_name, **fields), specgraph.drafts.NGram(), tree=specgraph.Chain(2),
                          max_cache_len=64)


@pytest.mark.parametrize("fields", [dict(multi_query=True, new_decoder_architecture=False),
                                    dict(num_kv_heads=2, new_decoder_architecture=True)], ids=["multi-query", "gqa"])
def test_falcon_kv_heads_are_read_from_its_own_fields(fields):
    """Falcon's multi-query layout has one K/V head whatever its num_kv_heads says: token-exact with generate."""
    import specgraph

    model = _tiny("FalconForCausalLM", "FalconConfig", num_hidden_layers=2, num_attention_heads=4, **fields)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    spec = specgraph.compile(model, specgraph.drafts.NGram(), tree=specgraph.Chain(2), max_cache_len=64)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 5, 6]])
    want = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(spec.generate(ids, max_new_tokens=12, eos_token_id=None), want)


@pytest.mark.parametrize("model, message", [("HuggingFaceTB/SmolLM2-135M", "a hub id"), (None, "model=NoneType"),
                                            (torch.nn.Linear(3, 3), "model=Linear")])
def test_what_is_not_a_transformers_model_is_refused_by_name(model, message):
    import specgraph
    from specgraph.drafts import NGram

    with pytest.raises(CompileError, match=message):
        specgraph.compile(model, NGram())


def test_weights_compile_cannot_trace_or_a_cache_beyond_memory_are_refused_at_compile():
    """Meta tensors (not loaded), inference tensors (made under torch.inference_mode) and a KV cache larger
    than the device: refused at compile, before any capture, each naming the fix."""
    import specgraph
    from specgraph.drafts import NGram
    from test_capture import tiny_model

    config = tiny_model("llama").config
    with torch.device("meta"):
        meta = transformers.LlamaForCausalLM(config)
    with torch.inference_mode():
        inference = transformers.LlamaForCausalLM(config).eval()
    for model, message in ((meta, "meta tensors"), (inference, "torch.inference_mode")):
        with pytest.raises(CompileError, match=message):
            specgraph.compile(model, NGram(), tree=specgraph.Chain(3), max_cache_len=64)
    with pytest.raises(CompileError, match=r"max_cache_len=1000000000000 with max_batch=1: the KV cache alone needs"):
        specgraph.compile(tiny_model("llama"), NGram(), tree=specgraph.Chain(3), max_cache_len=10**12)
    specgraph.compile(tiny_model("llama"), NGram(), tree=specgraph.Chain(3), max_cache_len=4096)  # a sane one


def test_a_tree_wider_than_the_drafts_vocabulary_is_refused_at_compile():
    """A node's children are the draft's top k: k above the tokens it ranks among (an EAGLE-3 draft
    vocabulary, the target's vocabulary for the others) is refused at compile, naming the tree; as
    wide as the vocabulary still compiles and generates."""
    import specgraph
    from specgraph.drafts import Eagle3, Medusa
    from test_capture import tiny_model

    model = tiny_model("llama")
    vocab = model.config.vocab_size
    small = Eagle3.for_target(model, draft_vocab=torch.arange(16), aux_layer_ids=(0, 1, 1))
    medusa = Medusa(model.config.hidden_size, vocab, 1)
    for draft, tree, ranked in ((small, specgraph.DynamicTree(2, 20, 8), 16),
                                (small, specgraph.DynamicTree(1, 300, 8), 16),
                                (medusa, specgraph.StaticTree([[0], [vocab]]), vocab)):
        with pytest.raises(CompileError, match=rf"top {tree.topk}, more than the {ranked} tokens"):
            specgraph.compile(model, draft, tree=tree, max_cache_len=64)
    spec = specgraph.compile(model, small, tree=specgraph.DynamicTree(2, 16, 8), max_cache_len=64)
    assert spec.generate(torch.tensor([[10, 11, 12, 13]]), max_new_tokens=4).shape == (1, 8)
