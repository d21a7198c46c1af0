"""The pass pipeline's contracts: the declared order is checked when a pipeline is built, postconditions
and invariants raise named errors (never asserts), and the invariant check runs after every pass."""
import ast
import logging
from pathlib import Path

import pytest
import torch

import specgraph
from specgraph import config
from specgraph.capture import export_tree_step, graph_context
from specgraph.passes import (PIPELINE, PassContractError, PipelineOrderError, check_order, ensure, fold_cache_writes,
                              fold_rotary, graph_pass, inplace_cache_writes, invariants, replace_attention,
                              run_pipeline)
from test_capture import tiny_model


def exported():
    """A tiny Llama's exported step (2 nodes), before any pass, and its context."""
    program, info = export_tree_step(tiny_model("llama"), batch=1, nodes=2, max_length=32)
    return program.graph_module, graph_context(program, info)


def test_a_misordered_pipeline_is_refused_before_any_pass_runs():
    with pytest.raises(PipelineOrderError, match="fold_rotary must run after fold_cache_writes"):
        check_order((replace_attention, inplace_cache_writes, fold_rotary, fold_cache_writes))
    gm, ctx = exported()
    before = str(gm.graph)
    with pytest.raises(PipelineOrderError, match="inplace_cache_writes must run after replace_attention"):
        run_pipeline(gm, ctx, passes=(inplace_cache_writes, replace_attention))
    assert str(gm.graph) == before
    assert check_order(PIPELINE) == PIPELINE
    assert check_order((replace_attention, fold_rotary)) == (replace_attention, fold_rotary)  # skipping is allowed


def test_an_undeclared_or_repeated_pass_is_refused():
    def bare(gm, ctx):
        return None

    with pytest.raises(PipelineOrderError, match="bare is not declared with @graph_pass"):
        check_order((replace_attention, bare))
    with pytest.raises(PipelineOrderError, match="listed twice"):
        check_order((replace_attention, replace_attention))


@graph_pass(after=("inplace_cache_writes",))
def drop_a_cache_write(gm, ctx):
    """A broken pass: erases layer 0's kv_write (each layer's cache must be written once)."""
    node = gm.graph.find_nodes(op="call_function", target=invariants.KV_WRITE)[0]
    gm.graph.erase_node(node)
    gm.recompile()
    return specgraph.passes.PassResult(gm, True)


def test_the_invariant_check_runs_after_every_pass_and_names_the_pass():
    passes = (replace_attention, inplace_cache_writes, drop_a_cache_write)
    with config.patch(check_graph=True):
        gm, ctx = exported()
        with pytest.raises(PassContractError, match=r"after pass drop_a_cache_write: invariant 1: layers written \[1\]"):
            run_pipeline(gm, ctx, passes=passes)
    with config.patch(check_graph=False):  # off (outside tests and debug): nothing checked
        gm, ctx = exported()
        assert [name for name, _ in run_pipeline(gm, ctx, passes=passes)][-1] == "drop_a_cache_write"
    with config.patch(check_graph=False, debug=True):  # debug turns the check on
        gm, ctx = exported()
        with pytest.raises(PassContractError, match="after pass drop_a_cache_write"):
            run_pipeline(gm, ctx, passes=passes)


def test_a_host_synchronisation_breaks_invariant_3():
    gm, ctx = exported()
    run_pipeline(gm, ctx)
    assert invariants.problems(gm, ctx) == []
    cache_len = ctx.placeholder(gm, "cache_len")
    with gm.graph.inserting_after(cache_len):
        first = gm.graph.call_function(torch.ops.aten.select.int, (cache_len, 0, 0))
    with gm.graph.inserting_after(first):
        gm.graph.call_function(torch.ops.aten._local_scalar_dense.default, (first,))
    assert any(p.startswith("invariant 3: host synchronisations") for p in invariants.problems(gm, ctx))


def test_ensure_raises_a_named_error():
    ensure(True, "some_pass", "never shown")
    with pytest.raises(PassContractError, match="^some_pass: 2 writes, 3 expected$"):
        ensure(False, "some_pass", "2 writes, 3 expected")


def test_no_contract_is_an_assert():
    """``assert`` vanishes under ``python -O``: the package states its contracts with raised errors."""
    root = Path(specgraph.__file__).parent
    asserts = [f"{path.relative_to(root)}:{node.lineno}" for path in root.rglob("*.py")
               for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Assert)]
    assert asserts == []


def test_counters_go_to_the_passes_logger(caplog):
    gm, ctx = exported()
    with caplog.at_level(logging.DEBUG, logger="specgraph.passes"):
        run_pipeline(gm, ctx)
    messages = [r.getMessage() for r in caplog.records if r.name == "specgraph.passes"]
    assert any(m.startswith("pass replace_attention: modified=True sdpa_replaced=") for m in messages), messages
    assert len([m for m in messages if m.startswith("pass ")]) == len(PIPELINE)


def test_the_pipeline_makes_the_modules_code_once_and_a_pass_alone_its_own(monkeypatch):
    """Code generation was half of a capture's pass time while every pass recompiled: the pipeline makes
    the module's code once, from the final graph; a pass called on its own still leaves its module running
    what it rewrote."""
    real = torch.fx.GraphModule.recompile
    made = []
    monkeypatch.setattr(torch.fx.GraphModule, "recompile", lambda self: made.append(self) or real(self))
    gm, ctx = exported()
    made.clear()
    run_pipeline(gm, ctx)
    assert made == [gm]
    assert "specgraph.tree_attention" in gm.code and "scaled_dot_product_attention" not in gm.code
    alone, alone_ctx = exported()
    made.clear()
    replace_attention(alone, alone_ctx)
    assert made == [alone] and "specgraph.tree_attention" in alone.code
