"""Capture + replace_attention on tiny random configs of six architectures:
every node's logits equal the HF eager model on that node's root path alone;
after several verify/compact steps the cache equals HF's own."""

import importlib

import pytest
import torch
import transformers

from specgraph.capture import TargetInfo
from capture_harness import Driver, check_cache_against_hf, check_tree_against_hf

FOLD_ROTARY = importlib.import_module("specgraph.passes.fold_rotary")  # the module (the package exports the pass)
TOL = dict(atol=1e-4, rtol=1e-4)  # fp32; different summation order than HF's SDPA
COMMON = dict(hidden_size=64, intermediate_size=96, vocab_size=101, max_position_embeddings=512, pad_token_id=0,
              bos_token_id=1, eos_token_id=2, attn_implementation="sdpa")
CONFIGS = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                      head_dim=16)),
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(num_hidden_layers=2, num_attention_heads=4,
                                                            num_key_value_heads=2, sliding_window=24)),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", dict(num_hidden_layers=3, num_attention_heads=2,
                                                             num_key_value_heads=1, head_dim=256, sliding_window=16,
                                                             layer_types=["sliding_attention", "sliding_attention",
                                                                          "full_attention"],
                                                             query_pre_attn_scalar=256)),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)),
}


def tiny_model(name: str, seed: int = 0):
    model_cls, config_cls, extra = CONFIGS[name]
    config = getattr(transformers, config_cls)(**COMMON, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # random init is too flat to make argmax ties unlikely: sharpen the head
        model.lm_head.weight.mul_(8.0)
    return model


@pytest.fixture(scope="module", params=list(CONFIGS))
def driver(request):
    model = tiny_model(request.param)
    d = Driver(model, batch=3, max_length=160, seed=1)
    rng = d.rng
    d.prefill([[rng.randrange(3, 101) for _ in range(length)] for length in (5, 37, 20)])
    return d


def test_target_info_reads_the_windows(driver):
    info = TargetInfo.from_model(driver.model)
    config = driver.model.config
    if getattr(config, "layer_types", None) and "sliding_attention" in config.layer_types:
        assert info.layer_windows == tuple(config.sliding_window if t == "sliding_attention" else 0
                                          for t in config.layer_types)
    assert len(info.layer_windows) == config.num_hidden_layers


def test_every_node_matches_hf_on_its_root_path(driver):
    check_tree_against_hf(driver, nodes=8, tol=TOL)


def test_pass_counters(driver):
    step = driver.capture.step(driver.batch, 8)
    names = [name for name, _ in step.pass_results]
    assert names == ["all_reduce_partial_sums", "replace_attention", "tap_hidden_states", "prune_logits",
                     "outer_products", "fuse_projections", "inplace_cache_writes", "fold_cache_writes", "fold_rotary",
                     "fold_norms", "fold_norms_rows"]
    result = step.pass_results[1][1]
    # nothing asked of them: no tensor parallelism, no taps, no pruning
    assert [r.modified for _, r in (step.pass_results[0], *step.pass_results[2:4])] == [False, False, False]
    info = step.info
    assert result.counters["sdpa_replaced"] == info.num_layers
    assert result.counters["cache_writes_kept"] == 2 * info.num_layers
    assert result.counters["sliding_window_layers"] == sum(w > 0 for w in info.layer_windows)
    graph = step.graph.graph
    assert not graph.find_nodes(op="call_function", target=torch.ops.aten.scaled_dot_product_attention.default)
    assert dict(step.pass_results)["inplace_cache_writes"].counters["kv_writes"] == info.num_layers
    fusion = dict(step.pass_results)["fuse_projections"].counters  # q/k/v and gate/up, each one product; Phi-3 ships them fused
    groups = 0 if "phi3" in type(driver.model).__name__.lower() else 2 * info.num_layers
    assert (fusion["groups_fused"], fusion["linears_fused"], fusion["linears_unfused"]) == (
        groups, 5 * groups // 2, 0)
    linears = graph.find_nodes(op="call_function", target=torch.ops.aten.linear.default)
    assert len(linears) == 4 * info.num_layers + 1  # qkv, o, gate_up, down per layer; the LM head
    # every layer's write folded into its attention: one launch reads the step's K/V and writes them to the cache
    assert dict(step.pass_results)["fold_cache_writes"].counters == {"writes_folded": info.num_layers,
                                                                      "writes_unfolded": 0}
    kv = graph.find_nodes(op="placeholder")[step._kv_index]  # the state comes first, in the step's order
    for target in (torch.ops.specgraph.kv_write.default, torch.ops.specgraph.tree_attention.default,
                   torch.ops.aten.scatter_.src):
        assert not graph.find_nodes(op="call_function", target=target), target
    assert not [n for n in kv.users if n.target == torch.ops.aten.select.int]  # nothing else reads a layer's cache
    folded = graph.find_nodes(op="call_function", target=torch.ops.specgraph.tree_attention_write.default)
    assert sorted(n.args[2] for n in folded) == list(range(info.num_layers))
    for node in folded:  # the step's own K/V (un-expanded: the kernel does GQA), in the cache's dtype
        key, value = (node.args[i].meta["val"] for i in (3, 4))
        assert node.args[1] is kv and key.shape == value.shape == (driver.batch, info.num_kv_heads, 8, info.head_dim)
    if driver.batch * 8 <= FOLD_ROTARY.max_rows(info.head_dim):  # 3 sequences x 8 rows: within the limit
        _assert_rope_folded(step, driver.model)
    else:  # Gemma-3's 256-dim heads fold up to 8 rows in all: apart, counted
        assert dict(step.pass_results)["fold_rotary"].counters == {"rotary_folded": 0,
                                                                   "rotary_unfolded": info.num_layers}
    _assert_rope_folded(driver.capture.step(1, 8), driver.model)  # one sequence x 8 rows
    rows_fold = dict(step.pass_results)["fold_norms_rows"].counters  # 24 rows: above fused_linear's 16
    assert rows_fold["norms_folded"] == rows_fold["silu_mul_folded"] == 0


def _assert_rope_folded(step, model):
    """Every layer's RoPE (whole head_dim, rotate_half) moved into its attention: no rotate_half left,
    one cos/sin pair per rotary table."""
    layers = step.info.num_layers
    assert dict(step.pass_results)["fold_rotary"].counters == {"rotary_folded": layers, "rotary_unfolded": 0}
    graph = step.graph.graph
    folded = graph.find_nodes(op="call_function", target=torch.ops.specgraph.tree_attention_write.default)
    assert len(folded) == layers and all(len(n.args) == 11 for n in folded)
    assert not graph.find_nodes(op="call_function", target=torch.ops.aten.neg.default)
    tables = {(n.args[9], n.args[10]) for n in folded}
    assert len(tables) == (2 if "gemma3" in type(model).__name__.lower() else 1)  # Gemma-3: local + global


def test_single_row_step_rotates_in_attention_and_matches_hf(driver):
    """R = 1 (plain decoding): fold_rotary moves every layer's RoPE into tree_attention_write; each
    row's logits still equal HF eager's."""
    _assert_rope_folded(driver.capture.step(driver.batch, 1), driver.model)
    check_tree_against_hf(driver, nodes=1, tol=TOL)


def test_multi_row_fold_is_exact_when_allowed(driver, monkeypatch):
    """The fold is correct at any R (MAX_ROWS is a measured speed limit, not a correctness one): a 12-node
    tree for 3 sequences folds (both row limits raised to 64, whatever the head width) and every node
    still matches HF on its root path; with the limits lowered the RoPE stays apart, counted."""
    for name in ("MAX_ROWS", "MAX_ROWS_WIDE_HEADS"):
        monkeypatch.setattr(FOLD_ROTARY, name, 64)
    _assert_rope_folded(driver.capture.step(driver.batch, 12), driver.model)
    check_tree_against_hf(driver, nodes=12, tol=TOL)
    for name in ("MAX_ROWS", "MAX_ROWS_WIDE_HEADS"):
        monkeypatch.setattr(FOLD_ROTARY, name, 8)
    above = driver.capture.step(1, 9)  # above the limit: apart, counted
    assert dict(above.pass_results)["fold_rotary"].counters == {"rotary_folded": 0,
                                                                "rotary_unfolded": above.info.num_layers}


def test_wide_heads_fold_fewer_rows(driver, monkeypatch):
    """The row limit follows the head width: heads wider than NARROW_HEAD_DIM fold steps of up to
    MAX_ROWS_WIDE_HEADS (8) rows (measured slower at 64 rows on the 8B shape), narrower ones up to MAX_ROWS."""
    assert FOLD_ROTARY.max_rows(64) == FOLD_ROTARY.MAX_ROWS == 64
    assert FOLD_ROTARY.max_rows(128) == FOLD_ROTARY.MAX_ROWS_WIDE_HEADS == 8
    monkeypatch.setattr(FOLD_ROTARY, "NARROW_HEAD_DIM", driver.capture.step(1, 1).info.head_dim - 1)
    wide = driver.capture.step(1, 13)  # 13 > 8 rows of (now) wide heads: apart, counted
    assert dict(wide.pass_results)["fold_rotary"].counters == {"rotary_folded": 0,
                                                               "rotary_unfolded": wide.info.num_layers}
    _assert_rope_folded(driver.capture.step(1, 7), driver.model)  # within the wide heads' 8


def test_partial_rotary_stays_apart_and_exact():
    """Phi-3 with half its head_dim rotated: fold_rotary cannot prove the rotate_half form, leaves every
    layer's RoPE in the graph (counted), and the graph still matches HF on every root path."""
    model_cls, config_cls, extra = CONFIGS["phi3"]
    config = getattr(transformers, config_cls)(**COMMON, **extra, partial_rotary_factor=0.5)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    d = Driver(model, batch=2, max_length=96, seed=2)
    d.prefill([[d.rng.randrange(3, 101) for _ in range(length)] for length in (9, 30)])
    step = d.capture.step(2, 1)
    assert dict(step.pass_results)["fold_rotary"].counters == {"rotary_folded": 0, "rotary_unfolded": 2}
    check_tree_against_hf(d, nodes=1, tol=TOL)
    check_tree_against_hf(d, nodes=8, tol=TOL)


def test_steps_with_compaction_keep_hf_cache(driver):
    for _ in range(3):
        tokens, parents, mask, depth = driver.random_tree(nodes=8)
        logits = driver.tree_logits(tokens, mask, depth)
        driver.verify_and_commit(tokens, parents, mask, logits)
    windows = TargetInfo.from_model(driver.model).layer_windows
    for row in range(driver.batch):
        length = int(driver.cache_len[row])
        for layer, (k, _) in enumerate(driver.hf_cache(row)):
            kept = k.shape[1]  # sliding layers: HF keeps only the last tokens
            assert kept == length or (windows[layer] and kept < length)
    check_cache_against_hf(driver, TOL)


def test_tapped_hidden_states_match_hf(driver):
    """layer_input of i == HF hidden_states[i]; layer_output of i == hidden_states[i+1]; final == the
    normed state HF feeds its LM head (its last hidden_states entry)."""
    from specgraph.passes import HiddenTaps

    layers = driver.model.config.num_hidden_layers
    ids = list(range(layers))
    tokens, parents, mask, depth = driver.random_tree(nodes=8, good_path=False)
    positions = driver.cache_len.unsqueeze(1) + depth
    for convention, shift in (("layer_input", 0), ("layer_output", 1)):
        step = driver.capture.step(driver.batch, 8, taps=HiddenTaps(tuple(ids), convention, final=True))
        logits, taps = step(tokens, positions, driver.cache_len, mask)
        assert len(taps) == layers + 1
        for row in range(driver.batch):
            for i in range(8):
                path_ids = driver.tokens[row] + [tokens[row, j].item() for j in _path(parents[row].tolist(), i)[1:]]
                with torch.no_grad():
                    hf = driver.model(torch.tensor([path_ids]), output_hidden_states=True).hidden_states
                for layer in ids:
                    if layer + shift < len(hf) - 1:  # HF's last entry is after the final norm
                        torch.testing.assert_close(taps[layer][row, i], hf[layer + shift][0, -1], **TOL)
                torch.testing.assert_close(taps[-1][row, i], hf[-1][0, -1], **TOL)


def test_prune_logits_keeps_only_the_asked_rows(driver):
    tokens, parents, mask, depth = driver.random_tree(nodes=8, good_path=False)
    positions = driver.cache_len.unsqueeze(1) + depth
    full = driver.capture.step(driver.batch, 8)(tokens, positions, driver.cache_len, mask)
    pruned_step = driver.capture.step(driver.batch, 8, logits_rows=(7, 8))
    pruned = pruned_step(tokens, positions, driver.cache_len, mask)
    assert pruned.shape == (driver.batch, 1, full.shape[-1])
    torch.testing.assert_close(pruned, full[:, 7:8], **TOL)
    assert dict(pruned_step.pass_results)["prune_logits"].counters == {"rows": 1, "rows_pruned": 7}


def _path(parents, i):
    from capture_harness import root_path

    return root_path(parents, i)


def test_skipping_speed_up_passes_keeps_logits_and_cache(settings):
    """config.skip_passes (A/B measurements): without the folds the step computes the same logits and
    writes the same cache; a pass the graph needs cannot be skipped."""
    from specgraph.capture import Capture

    model = tiny_model("llama")
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 101, (2, 1), generator=gen)  # one row per sequence: both folds apply
    cache_len = torch.tensor([0, 5])
    positions = cache_len.unsqueeze(1)
    chain = torch.ones(2, 1, dtype=torch.int64)
    full = Capture(model, 64).step(2, 1)
    assert [name for name, _ in full.pass_results][-2:] == ["fold_norms", "fold_norms_rows"]
    _assert_rope_folded(full, model)
    settings(skip_passes="fold_rotary, fold_cache_writes, fold_norms, fold_norms_rows")
    bare = Capture(model, 64).step(2, 1)
    assert [name for name, _ in bare.pass_results][-1] == "inplace_cache_writes"
    graph = bare.graph.graph
    assert graph.find_nodes(op="call_function", target=torch.ops.aten.neg.default)  # RoPE left in the graph
    for step in (full, bare):
        step.kv.copy_(torch.randn(step.kv.shape, generator=torch.Generator().manual_seed(4)))
    with torch.no_grad():
        torch.testing.assert_close(full(ids, positions, cache_len, chain), bare(ids, positions, cache_len, chain),
                                   atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(full.kv, bare.kv, atol=1e-6, rtol=1e-6)
    settings(skip_passes="replace_attention")
    with pytest.raises(ValueError, match="only speed-up passes may be skipped"):
        Capture(model, 64).step(2, 1)


@pytest.mark.parametrize("debug", [False, True])
def test_export_skips_stack_traces_unless_debugging(debug, settings):
    """Exports trace without torch.fx's per-node stack traces (a fifth of the time, read by nothing);
    config.debug keeps them. The global flag is restored either way."""
    import torch.fx.config as fx_config

    from specgraph.capture import export_tree_step

    if not hasattr(fx_config, "do_not_emit_stack_traces"):
        pytest.skip("this torch (2.11) has no torch.fx.config.do_not_emit_stack_traces: exports keep their traces")
    settings(debug=debug)
    before = fx_config.do_not_emit_stack_traces
    program, _ = export_tree_step(tiny_model("llama"), batch=1, nodes=2, max_length=32)
    traced = [n for n in program.graph.nodes if n.op == "call_function" and n.meta.get("stack_trace")]
    assert bool(traced) == debug
    assert fx_config.do_not_emit_stack_traces == before
