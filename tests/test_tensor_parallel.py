"""Tensor parallelism (specgraph/parallel.py): the target sharded over 2 ranks (torchrun, gloo on the CPU).

Each rank's speculative greedy output must equal HF's ``model.generate`` of the whole model in one
process, token for token, on every rank, and its seeded sampling the whole model's seeded plain sampling; the graph holds the all-reduces; each rank's KV cache holds
its own KV heads; what cannot be sharded is refused at compile, every blocker listed.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import specgraph
from specgraph import Chain, CompileError
from specgraph.drafts import NGram
from test_seeded_sampling import chi_square_p

HERE = Path(__file__).parent
TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")


def torchrun(tmp_path, *runs, backend="eager", timeout=240) -> list[dict]:
    """Run tests/tp_worker.py on 2 ranks; each rank's report."""
    if TORCHRUN is None or not torch.distributed.is_available():
        pytest.skip("torchrun / torch.distributed not available")
    env = {**os.environ, "TP_OUT": str(tmp_path), "TP_BACKEND": backend, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")]))}
    cmd = [TORCHRUN, "--nproc-per-node", "2", "--master-port", "0", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", "localhost:0", str(HERE / "tp_worker.py"), *runs]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def test_sharded_greedy_equals_hf_generate_on_every_rank(tmp_path):
    """NGram (chain, real acceptance) on Llama, Qwen3 (per-head q/k norms), Mistral and Gemma-3 (sliding
    windows) and an EAGLE-3 head (tree, the sharded target's taps) on Qwen2 (q/k/v biases; sharded by
    ``parallel.shard`` before compile), and Llama loaded by transformers with ``tp_plan="auto"`` (adopted);
    4 heads / 2 KV heads over 2 ranks; plus the refusals, in one launch."""
    reports = torchrun(tmp_path, "llama:ngram", "qwen2:eagle3", "qwen3:ngram", "mistral:ngram", "gemma3:ngram",
                       "hf_tp_plan:ngram")
    for rank, report in enumerate(reports):
        assert report["every_rank_same"]  # the same tokens and the same accept lengths on both ranks
        for run in report["runs"]:
            assert run["got"] == run["expected"], (rank, run["arch"], run["kind"])
            assert run["kv_heads_local"] == 1 and run["q_rows"] == 2 * 16  # 2 of 4 heads, 1 of 2 KV heads
            # prefill and decode buckets: an all-reduce after attention and after the MLP of both layers
            assert run["all_reduces"] == run["graph_all_reduces"] == [4, 4]
            assert run["dtensors_left"] == run["tp_wrappers_left"] == 0  # transformers' tp_plan shards adopted
        assert report["runs"][0]["tau"] > 1.5  # the NGram chain was accepted: verify and compaction ran
        refusals = report["refusals"]
        assert any("num_attention_heads=3 is not divisible by the world size 2" in b for b in refusals["odd_heads"])
        assert any("num_key_value_heads=1 is not divisible" in b for b in refusals["odd_heads"])
        phi3 = "\n".join(refusals["phi3"])
        assert "model_type='phi3'" in phi3 and "policy='measured'" in phi3
        assert "decoder layers 0..1: self_attn.qkv_proj.weight" in phi3
        assert len(refusals["ranks_differ"]) == 1 and "differ across ranks" in refusals["ranks_differ"][0]
        assert len(refusals["measured"]) == 1 and "policy='measured' with tp" in refusals["measured"][0]
        assert len(refusals["no_tp"]) == 1 and "the model was sharded over 2 ranks" in refusals["no_tp"][0]
        assert len(refusals["typical"]) == 1 and "verify='typical' with tp" in refusals["typical"][0]
        assert "export of a tensor-parallel target" in refusals["export"]


def pooled_chi_square_p(counts: torch.Tensor, probs: torch.Tensor, least: float = 5.0) -> float:
    """``chi_square_p`` with the tokens expected fewer than ``least`` times pooled into one."""
    rare = probs.double() * counts.sum() < least
    return chi_square_p(torch.cat([counts[~rare], counts[rare].sum().view(1)]),
                        torch.cat([probs[~rare], probs[rare].sum().view(1)]))


def test_sharded_sampling_is_seeded_plain_sampling_and_exact_in_distribution(tmp_path):
    """do_sample=True on 2 ranks, NGram chain on Llama and an EAGLE-3 tree on Qwen2: with a seed (T = 0.1), every
    rank emits what seeded plain sampling of the whole, unsharded model emits (tokens and the ranks' accept
    lengths alike); without one, 512 first tokens fit the whole model's distribution (chi-square; the negative control,
    the same draws against the distribution one temperature step colder, fails); differing seeds are refused
    on every rank."""
    reports = torchrun(tmp_path, "llama:ngram:sampled", "qwen2:eagle3:sampled")
    for rank, report in enumerate(reports):
        assert report["every_rank_same"]
        for run in report["runs"]:
            assert run["got"] == run["expected"], (rank, run["arch"], run["kind"])
            counts = torch.bincount(torch.tensor(run["firsts"]), minlength=len(run["probs"]))
            probs = torch.tensor(run["probs"], dtype=torch.float64)
            assert counts.sum() == 512 and (counts > 0).sum() >= 5  # a spread, not one token
            assert pooled_chi_square_p(counts, probs) > 1e-3
            colder = probs ** 1.5 / (probs ** 1.5).sum()  # negative control (T = 2/3): the test tells them apart
            assert pooled_chi_square_p(counts, colder) < 1e-3
            assert "the ranks of a tensor-parallel target passed different seeds" in run["mismatch"]
        ngram = report["runs"][0]  # the repeating prompt's chain is accepted: verify and compaction ran sampled
        assert max(max(step) for step in ngram["accept_lens"][0]) > 1


def test_sharded_whole_step_under_torch_compile(tmp_path):
    """backend="inductor" (dynamo + AOTAutograd through aot_eager, as conftest's aot_eager_compile): the
    functional collectives trace into the one compiled step graph; output still HF's."""
    for report in torchrun(tmp_path, "llama:ngram", backend="inductor"):
        (run,) = report["runs"]
        assert report["every_rank_same"] and run["got"] == run["expected"]


def test_tp_without_torch_distributed_is_refused():
    from test_capture import tiny_model

    model = tiny_model("llama")
    with pytest.raises(CompileError, match="torchrun --nproc-per-node N"):
        specgraph.compile(model, NGram(), tree=Chain(3), tp=True)
    with pytest.raises(CompileError, match="tp='yes'"):
        specgraph.compile(model, NGram(), tree=Chain(3), tp="yes")
    assert model.model.layers[0].self_attn.q_proj.weight.shape[0] == 64  # refused: nothing sharded
