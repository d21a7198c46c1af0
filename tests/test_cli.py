"""The specgraph command: --help on every subcommand, the benchmark scripts behind `bench`, and `specgraph export` end to end on a tiny
HF model directory (the ONNX file it writes runs in onnxruntime)."""
import re
import subprocess
import sys

import numpy as np
import onnxruntime as ort
import pytest

from specgraph.cli import build_parser, main
from test_capture import tiny_model

COMMANDS = ["info", "tree", "demo", "inspect", "train", "export", "bench"]


def test_every_command_has_help(capsys):
    parser = build_parser()
    listed = set(parser._subparsers._group_actions[0].choices)
    assert listed == set(COMMANDS)
    for command in COMMANDS:
        with pytest.raises(SystemExit) as exit_:
            main([command, "--help"])
        assert exit_.value.code == 0
        assert f"usage: specgraph {command}" in capsys.readouterr().out


@pytest.mark.parametrize("script", ["e2e", "generate", "kernels"])
def test_bench_runs_the_benchmark_scripts_with_their_own_flags(script):
    done = subprocess.run([sys.executable, "-m", "specgraph", "bench", script, "--help"], capture_output=True,
                          text=True)
    assert done.returncode == 0 and f"usage: specgraph bench {script}" in done.stdout  # named as it was run
    assert "(default: " in done.stdout  # (every option's: the parser is cli_args.Parser)
    if script == "e2e":
        bad = subprocess.run([sys.executable, "-m", "specgraph", "bench", script, "--no-such-flag"],
                             capture_output=True, text=True)
        assert bad.returncode == 2 and "--no-such-flag" in bad.stderr


def test_bench_acceptance_refuses_a_bad_tree_by_name():
    done = subprocess.run([sys.executable, "-m", "specgraph", "bench", "acceptance", "--tree", "chainx"],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "argument --tree: tree 'chainx'" in done.stderr


def test_export_command_writes_onnx_that_runs(tmp_path):
    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "tiny")
    out = tmp_path / "step.onnx"
    done = subprocess.run([sys.executable, "-m", "specgraph", "export", str(out), "--target", str(tmp_path / "tiny"),
                           "--nodes", "4", "--batch", "2", "--max-cache-len", "64"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    shapes = {i.name: i.shape for i in session.get_inputs()}
    assert shapes["input_ids"] == [2, 4] and shapes["kv"][1:] == [2, model.config.num_key_value_heads, 64,
                                                                   model.config.head_dim]
    feed = {"input_ids": np.full((2, 4), 5), "positions": np.arange(1, 5)[None].repeat(2, 0),
            "cache_len": np.ones(2, dtype=np.int64), "tree_mask": np.array([[1, 3, 7, 15]] * 2),
            "parents": np.array([[-1, 0, 1, 2]] * 2), "kv": np.zeros(shapes["kv"], dtype=np.float32)}
    logits, accept_len, emitted, kv_out = session.run(None, feed)
    assert logits.shape == (2, 4, model.config.vocab_size) and np.isfinite(logits).all()
    assert ((1 <= accept_len) & (accept_len <= 4)).all()
    bad = subprocess.run([sys.executable, "-m", "specgraph", "export", str(out), "--nodes", "65"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "--nodes: 65: a whole number in 1 .. 64" in bad.stderr


@pytest.mark.model
def test_train_on_distilled_shards_keeps_the_best_head_by_held_out_tau(tmp_path):
    """`specgraph train eagle3 --shards`: held-out conversations out of training, eval_tau every step,
    best/ loadable; --draft-vocab 0 drafts through the target's LM head."""
    import json

    import torch

    from specgraph.drafts import Eagle3
    from specgraph.train.distill import write_shards

    g = torch.Generator().manual_seed(0)
    examples = [{"input_ids": torch.randint(0, 49152, (24,), generator=g).numpy(),
                 "loss_mask": (torch.arange(24) >= 8).numpy(), "conversation": c} for c in range(5)]
    write_shards(examples, tmp_path / "data" / "greedy", vocab_size=49152)
    def run(out, *extra):
        assert main(["train", "eagle3", "--shards", str(tmp_path / "data"), "--held-out", "1", "--draft-vocab", "0",
                     "--out", str(out), "--steps", "2", "--batch-size", "2", "--eval-every", "1", "--ttt-steps", "2",
                     "--select", "eval_tau", "--cpu", *extra]) == 0
        return json.loads((out / "history.json").read_text())

    history = run(tmp_path / "head")
    assert [h["step"] for h in history] == [1, 2] and all("eval_tau" in h for h in history)
    assert Eagle3.from_pretrained(tmp_path / "head" / "best").lm_head_from_target
    # the same command trains the same head (its initial weights are seeded); another --seed another one
    assert [h["loss"] for h in run(tmp_path / "again")] == [h["loss"] for h in history]
    assert run(tmp_path / "seed1", "--seed", "1")[0]["loss"] != history[0]["loss"]
    run(tmp_path / "annealed", "--max-minutes", "10", "--anneal-to-deadline")  # the schedule ends at the deadline
    assert torch.load(tmp_path / "annealed" / "trainer.pt", weights_only=False)["config"]["anneal_to_deadline"]
    # --extra-shards: another distill folder trains too (it holds nothing out): one batch of 2 more an epoch
    more = [{"input_ids": torch.randint(0, 49152, (24,), generator=g).numpy(), "loss_mask": (torch.arange(24) >= 8)
             .numpy(), "conversation": c} for c in range(2)]
    write_shards(more, tmp_path / "more" / "t1", vocab_size=49152)
    extra = run(tmp_path / "extra", "--extra-shards", str(tmp_path / "more"), "--steps", "3")
    assert [h["epoch"] for h in extra] == [0, 0, 0] and [h["epoch"] for h in run(tmp_path / "plain3", "--steps", "3")
                                                          ] == [0, 0, 1]  # 6 examples: 3 batches; 4: 2
    import specgraph.cli as cli  # the same command again: nothing to train, so no model is even loaded

    def refuse(*args, **kwargs):
        raise AssertionError("the target was loaded for a run that is done")

    cli_load, cli.load_target = cli.load_target, refuse
    try:
        assert run(tmp_path / "head") == history
    finally:
        cli.load_target = cli_load


@pytest.mark.model
def test_train_with_mask_repeats_picks_the_draft_vocabulary_from_every_answer_token(tmp_path, monkeypatch):
    """--mask-repeats drops the loss on a loop's repeats, not their place in the draft vocabulary: the
    looping tokens (100-104, six times each) are chosen over tokens seen once (10-13), which a vocabulary
    counted after masking would take (every count 1; ties go to the lowest ids). The held-out example
    keeps its repeats (its τ is what generating it gives), cut by --held-out-first-answer."""
    import torch

    import specgraph.train
    from specgraph.drafts import Eagle3
    from specgraph.train.distill import write_shards

    seen = {}

    def recording_train(draft, loss_fn, examples, config, out, eval_examples=None, **kwargs):
        seen.update(train=examples, held=eval_examples)
        return real_train(draft, loss_fn, examples, config, out, eval_examples=eval_examples, **kwargs)

    real_train = specgraph.train.train
    monkeypatch.setattr(specgraph.train, "train", recording_train)

    loop, once = [100, 101, 102, 103, 104], [10, 11, 12, 13]
    row = [1] * 8 + loop * 6 + once
    examples = [{"input_ids": torch.tensor(row).numpy(), "loss_mask": (torch.arange(len(row)) >= 8).numpy(),
                 "conversation": c} for c in range(3)]
    write_shards(examples, tmp_path / "data" / "greedy", vocab_size=49152)
    out = tmp_path / "head"
    assert main(["train", "eagle3", "--shards", str(tmp_path / "data"), "--held-out", "1", "--draft-vocab", "4",
                 "--mask-repeats", "5", "--held-out-first-answer", "20", "--out", str(out), "--steps", "1", "--batch-size", "2", "--ttt-steps", "2",
                 "--cpu"]) == 0
    head = Eagle3.from_pretrained(out)
    used = (torch.arange(4) + head.d2t).tolist()
    assert set(used) <= set(loop)
    answer = len(row) - 8
    assert [int(e["loss_mask"].sum()) for e in seen["held"]] == [20]  # four copies of the loop: masked, 5
    assert [len(e["input_ids"]) for e in seen["held"]] == [8 + 20]
    assert [int(e["loss_mask"].sum()) for e in seen["train"]] == [answer - 5 * 5] * 2  # five repeats of the loop


def test_user_mistakes_are_one_line_errors_before_any_work(tmp_path, capsys):
    """inspect on a model directory without tokenizer files works (it reads no text); an empty directory,
    --max-cache-len not above --nodes, and an --out that cannot be written (train, bench) are one-line errors
    naming what is wrong, before the model loads or anything runs."""
    model_dir = tmp_path / "tiny"
    tiny_model("llama").save_pretrained(model_dir)  # no tokenizer files
    assert main(["inspect", str(model_dir), "--nodes", "4", "--max-cache-len", "64"]) == 0
    assert "supported" in capsys.readouterr().out
    with pytest.warns(FutureWarning, match="--max-length is the old spelling of --max-cache-len"):
        assert main(["inspect", str(model_dir), "--nodes", "4", "--max-length", "64"]) == 0  # still works
    assert "max_cache_len 64" in capsys.readouterr().out
    (tmp_path / "empty").mkdir()
    assert main(["inspect", str(tmp_path / "empty")]) == 2
    assert "cannot load the target" in capsys.readouterr().err
    assert main(["inspect", str(model_dir), "--nodes", "8", "--max-cache-len", "8"]) == 2
    assert "--max-cache-len 8 must be larger than --nodes 8" in capsys.readouterr().err
    (tmp_path / "a-file").write_text("")
    for command in (["train", "eagle3", "--target", "/no/such/model"], ["bench", "acceptance", "--target", "/no/such"]):
        assert main(command + ["--out", str(tmp_path / "a-file" / "sub")]) == 2
        assert re.search("--out .* cannot be written", capsys.readouterr().err)
    assert main(["bench", "acceptance", "--tree", "chain0", "--out", str(tmp_path / "bench")]) == 2
    assert "verifies the root alone" in capsys.readouterr().err


def test_help_shows_every_options_default(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--steps STEPS (default: 2000)" in text and "--lr LR (default: 0.001)" in text


def test_an_unreachable_hub_id_is_one_line_at_once(monkeypatch, capsys):
    import socket

    def no_network(*args, **kwargs):
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    assert main(["inspect", "some-org/no-such-model"]) == 2
    assert re.search("'some-org/no-such-model' is not a local path, and the hub .* cannot be reached",
                     capsys.readouterr().err)


class Loaded(Exception):
    """Raised by a stand-in for load_target: the command got as far as loading the target."""


@pytest.fixture
def no_target(monkeypatch):
    """``specgraph``'s load_target replaced: a command that reaches it raises Loaded."""
    import specgraph.cli as cli

    def load(*args, **kwargs):
        raise Loaded()

    monkeypatch.setattr(cli, "load_target", load)


def test_a_checkpoint_that_cannot_be_loaded_is_one_line_before_the_target(tmp_path, capsys, monkeypatch, no_target):
    """A draft path that does not exist, a damaged weights file, a directory of another head kind, a file that is
    not GGUF: one line on stderr, exit status 2, the draft read before the target. A ValueError that is not a
    CheckpointError (a bug) keeps its traceback."""
    import specgraph.cli as cli
    from specgraph.cli_io import load_target
    from specgraph.drafts import Eagle3

    Eagle3.for_target(tiny_model("llama"), aux_layer_ids=(0, 1, 1)).save_pretrained(tmp_path / "eagle3")
    (tmp_path / "damaged").mkdir()
    (tmp_path / "damaged" / "config.json").write_text((tmp_path / "eagle3" / "config.json").read_text())
    (tmp_path / "damaged" / "model.safetensors").write_bytes(b"\xff" * 4096)
    for draft, says in ((f"eagle3={tmp_path}/nowhere", "EAGLE-3 checkpoint '.*nowhere' does not exist"),
                        (f"eagle3={tmp_path}/damaged", "damaged/model.safetensors: cannot read EAGLE-3 weights"),
                        (f"medusa={tmp_path}/eagle3", "eagle3: no Medusa heads found")):
        assert main(["bench", "acceptance", "--draft", draft, "--out", str(tmp_path / "bench")]) == 2
        err = capsys.readouterr().err
        assert re.search(says, err) and len(err.strip().splitlines()) == 1, err
    (tmp_path / "rand.gguf").write_bytes(b"\x00" * 64)
    monkeypatch.setattr(cli, "load_target", load_target)  # the real one
    assert main(["inspect", str(tmp_path / "rand.gguf")]) == 2
    assert "rand.gguf' does not start with b'GGUF'" in capsys.readouterr().err

    def bug(*args, **kwargs):
        raise ValueError("an internal error")

    monkeypatch.setattr(cli, "load_target", bug)
    with pytest.raises(ValueError, match="an internal error"):
        main(["inspect", str(tmp_path / "rand.gguf")])


def test_a_target_directory_without_its_weights_is_refused(tmp_path, capsys):
    """A directory whose weights do not fill its config (a draft head's, another model's) used to load as a random
    model; a plain save_pretrained round trip loads, tied embeddings too (transformers ties, not reports, them)."""
    import transformers

    from specgraph.cli_io import load_target
    from specgraph.drafts import Eagle3
    from specgraph.errors import CheckpointError

    tiny_model("llama").save_pretrained(tmp_path / "plain")
    tied = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                    num_key_value_heads=1, vocab_size=101, tie_word_embeddings=True)
    transformers.LlamaForCausalLM(tied).save_pretrained(tmp_path / "tied")
    for name in ("plain", "tied"):
        model, _ = load_target(str(tmp_path / name), tokenizer=False)
        assert type(model).__name__ == "LlamaForCausalLM"
    Eagle3.for_target(tiny_model("llama"), aux_layer_ids=(0, 1, 1)).save_pretrained(tmp_path / "head")
    with pytest.raises(CheckpointError, match=r"head' does not hold the weights its config.json describes: \d+ "
                                              r"weights missing \(model.embed_tokens.weight"):
        load_target(str(tmp_path / "head"), tokenizer=False)
    (tmp_path / "wider").mkdir()
    (tmp_path / "wider" / "config.json").write_text((tmp_path / "tied" / "config.json").read_text())
    (tmp_path / "wider" / "model.safetensors").write_bytes((tmp_path / "plain" / "model.safetensors").read_bytes())
    with pytest.raises(CheckpointError, match=r"wider' does not hold the weights its config.json describes: weights "
                                              r"of other shapes"):
        load_target(str(tmp_path / "wider"), tokenizer=False)
    capsys.readouterr()
    assert main(["export", str(tmp_path / "h.onnx"), "--target", str(tmp_path / "head"), "--nodes", "2",
                 "--max-cache-len", "16"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("specgraph export: the target"), err
    assert not (tmp_path / "h.onnx").exists()


def test_export_checks_its_arguments_before_loading_the_target(tmp_path, capsys, monkeypatch, no_target):
    """spec.export's own checks (check_export) and --max-cache-len above --nodes, before the target loads; a missing
    extra leaves no folders behind."""
    import sys

    (tmp_path / "a-file").write_text("")
    for argv, says in (([str(tmp_path)], "is a directory: name the .onnx file"),
                       ([str(tmp_path / "a-file" / "step.onnx")], "cannot be written"),
                       ([str(tmp_path / "x.onnx"), "--nodes", "8", "--max-cache-len", "8"],
                        "--max-cache-len 8 must be larger than --nodes 8")):
        assert main(["export", *argv]) == 2
        assert says in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "onnxscript", None)
    assert main(["export", str(tmp_path / "new" / "step.onnx")]) == 2
    assert "pip install 'specgraph[export]'" in capsys.readouterr().err and not (tmp_path / "new").exists()
    monkeypatch.delitem(sys.modules, "onnxscript")
    with pytest.raises(Loaded):  # all checks pass: the next step is the target
        main(["export", str(tmp_path / "new" / "step.onnx")])


def test_train_checks_its_inputs_and_flags_before_loading_the_target(tmp_path, capsys, no_target):
    """--data (missing, not ShareGPT), --shards, --init-from, --cache, --patience without --select,
    --anneal-to-deadline without --max-minutes, and flags the run would ignore (the other head's, --shards'
    without --shards): one line each, before the target loads."""
    good = tmp_path / "good.json"
    good.write_text('[{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}]')
    (tmp_path / "bad.csv").write_text("prompt,answer\n")
    (tmp_path / "a-file").write_text("")
    out = ["--out", str(tmp_path / "run"), "--cache", str(tmp_path / "cache")]
    for argv, says in (
            (["eagle3", "--data", str(tmp_path / "none.json")], "--data '.*none.json' does not exist"),
            (["eagle3", "--data", str(tmp_path / "bad.csv")], "--data .*bad.csv: a ShareGPT file is a JSON array"),
            (["eagle3", "--shards", str(tmp_path / "no-shards")], "--shards .*no-shards: no \\*/shard-\\*"),
            (["eagle3", "--data", str(good), "--init-from", str(tmp_path / "no-head")],
             "EAGLE-3 checkpoint '.*no-head' does not exist"),
            (["eagle3", "--data", str(good), "--cache", str(tmp_path / "a-file" / "c")],
             "--cache .* cannot be written"),
            (["eagle3", "--data", str(good), "--patience", "2"], "--patience needs --select"),
            (["eagle3", "--data", str(good), "--anneal-to-deadline"], "--anneal-to-deadline needs --max-minutes"),
            (["medusa", "--data", str(good), "--ttt-steps", "3", "--draft-vocab", "5"],
             "--draft-vocab, --ttt-steps: for EAGLE-3 heads; `specgraph train medusa` would ignore them"),
            (["medusa", "--data", str(good), "--init-from", str(tmp_path)], "--init-from: for EAGLE-3 heads"),
            (["eagle3", "--data", str(good), "--heads", "2"], "--heads: for Medusa heads"),
            (["eagle3", "--data", str(good), "--variants", "greedy", "--held-out", "3"],
             "--variants, --held-out: only with --shards")):
        assert main(["train", *out, *argv]) == 2, argv  # (argv last: its --cache wins)
        err = capsys.readouterr().err
        assert re.search(says, err) and len(err.strip().splitlines()) == 1, (argv, err)
    with pytest.raises(Loaded):  # a head's own flags (their defaults too) pass
        main(["train", "medusa", "--data", str(good), "--heads", "2", "--shared-lm-head", "--ttt-steps", "7", *out])
