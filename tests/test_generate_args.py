"""generate's arguments read as model.generate reads them — eos as a tensor, a numpy integer or a list,
padding inferred from the pad id, finished rows padded with eos[0], HF's default length, an argument
given as None overriding the generation config — and refused
where model.generate refuses them (a NaN temperature, a length that leaves nothing to generate,
ids that are not token ids); the "auto" backend. Oracle: the
tiny model's own ``model.generate``."""

import numpy as np
import pytest
import torch

import specgraph
from specgraph.drafts import NGram
from test_capture import tiny_model
from test_generate import generated_rows, hf_greedy, left_pad, prompts


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def spec(model):
    return specgraph.compile(model, NGram(), tree=specgraph.Chain(3), max_batch=2, max_cache_len=128)


def test_auto_backend_is_eager_off_cuda(model):
    assert specgraph.compile(model, None).config.backend == "eager"
    assert specgraph.compile(model, NGram(), backend="auto").config.backend == "eager"
    with pytest.raises(specgraph.CompileError, match="auto, eager, inductor"):
        specgraph.compile(model, NGram(), backend="tensorrt-ish")


def test_eos_as_a_tensor_a_numpy_integer_or_a_list_stops_where_model_generate_does(model, spec):
    row = prompts(3, [9])[0]
    free = hf_greedy(model, row, max_new_tokens=20, eos_token_id=None)
    eos = free[6]  # a token the answer reaches: generation must stop there
    want = hf_greedy(model, row, max_new_tokens=20, eos_token_id=eos)
    assert len(want) == free.index(eos) + 1 < 20
    for given in (torch.tensor([eos]), torch.tensor(eos), np.int64(eos), [eos], (eos,), np.array([eos, 101])):
        out = spec.generate(torch.tensor([row]), max_new_tokens=20, eos_token_id=given, pad_token_id=0)
        assert out[0, len(row):].tolist() == want, type(given)
    for bad in (torch.tensor([1.5]), "2", torch.tensor([[1, 2]])):
        with pytest.raises(TypeError, match="eos_token_id"):
            spec.generate(torch.tensor([row]), max_new_tokens=4, eos_token_id=bad)


def test_finished_rows_are_padded_with_the_first_eos(model, spec):
    rows = prompts(3, [9, 5])
    free = hf_greedy(model, rows[0], max_new_tokens=12, eos_token_id=None)
    eos = [free[2], 100 if free[2] != 100 else 99]  # row 0 finishes early; its padding must be eos[0]
    ids, mask = left_pad(rows)
    out = spec.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=eos)
    hf = model.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=eos, do_sample=False)
    assert torch.equal(out, hf)
    assert out[0, ids.shape[1] + 3:].eq(eos[0]).all()


def test_left_padding_without_a_mask_is_inferred_from_the_pad_id(model, spec):
    rows = prompts(5, [4, 11])
    pad = 1  # not a token of these prompts (they use 3..100), and not eos
    width = max(map(len, rows))
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    out = spec.generate(ids, max_new_tokens=10, pad_token_id=pad, eos_token_id=None)
    for row, got in zip(rows, generated_rows(out, width)):
        assert got == hf_greedy(model, row, max_new_tokens=10, eos_token_id=None)


def test_hfs_default_length_applies_when_none_is_given(model, spec):
    """No length anywhere: model.generate's default (20 new tokens, the whole within max_position_embeddings),
    for a prompt shorter and longer than 20 tokens."""
    before = model.generation_config.max_length, model.config.max_position_embeddings
    model.generation_config.max_length = None
    try:
        for row in (prompts(7, [6])[0], prompts(8, [30])[0]):
            ids = torch.tensor([row])
            ours = spec.generate(ids, eos_token_id=None)
            theirs = model.generate(ids, attention_mask=torch.ones_like(ids), eos_token_id=None, do_sample=False)
            assert ours.shape[1] == len(row) + 20 and torch.equal(ours, theirs)
        model.config.max_position_embeddings = 40  # the whole within the model's positions: 10 new tokens
        ids = torch.tensor([prompts(8, [30])[0]])
        ours = spec.generate(ids, eos_token_id=None)
        theirs = model.generate(ids, attention_mask=torch.ones_like(ids), eos_token_id=None, do_sample=False)
        assert ours.shape[1] == 40 and torch.equal(ours, theirs)
    finally:
        model.generation_config.max_length, model.config.max_position_embeddings = before


def test_an_argument_given_as_none_overrides_the_generation_config(model, spec):
    """As model.generate (its kwargs update the config, None included): max_new_tokens=None is the default
    length, repetition_penalty=None no penalty, do_sample=None greedy, top_k=None no top-k filter."""
    ids = torch.tensor([prompts(9, [8])[0]])
    mask = torch.ones_like(ids)
    gen = model.generation_config
    before = dict(gen.to_dict())
    try:
        gen.max_new_tokens, gen.repetition_penalty, gen.do_sample, gen.top_k = 5, 1.5, True, 3
        kw = dict(eos_token_id=None, pad_token_id=0)
        none = dict(max_new_tokens=None, repetition_penalty=None, do_sample=None)
        ours, theirs = spec.generate(ids, **none, **kw), model.generate(ids, attention_mask=mask, **none, **kw)
        assert ours.shape[1] == ids.shape[1] + 20 and torch.equal(ours, theirs)  # greedy, no penalty, 20 tokens
        assert not torch.equal(spec.generate(ids, max_new_tokens=20, do_sample=False, **kw)[:, :ours.shape[1]],
                               ours)  # negative control: the config's penalty applies where not overridden
        out = spec.generate(ids, do_sample=True, top_k=None, max_new_tokens=2, return_dict_in_generate=True,
                            output_scores=True, **kw)
        assert all(int(torch.isfinite(s).sum()) == model.config.vocab_size for s in out.scores)  # no top-k filter
        out = spec.generate(ids, do_sample=True, max_new_tokens=2, return_dict_in_generate=True, output_scores=True, **kw)
        assert all(int(torch.isfinite(s).sum()) == 3 for s in out.scores)  # the config's top_k=3
    finally:
        gen.update(**before)
        gen.max_new_tokens, gen.repetition_penalty, gen.do_sample, gen.top_k = (before.get(k) for k in (
            "max_new_tokens", "repetition_penalty", "do_sample", "top_k"))


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_new_tokens=0), "max_new_tokens=0"),
    (dict(max_new_tokens=-3), "max_new_tokens=-3"),
    (dict(max_length=4), "max_length=4 leaves no room"),
    (dict(max_length=0), "max_length=0 leaves no room"),
    (dict(max_length=10.5), "max_length=10.5: a whole number"),
    (dict(max_new_tokens=4, do_sample=True, temperature=float("nan")), "temperature=nan"),
    (dict(max_new_tokens=4, do_sample=True, temperature=0.0), "temperature=0.0"),
    (dict(max_new_tokens=4, do_sample=True, top_k=-5), "top_k=-5"),
    (dict(max_new_tokens=4, do_sample=True, top_p=1.5), "top_p=1.5"),
    (dict(max_new_tokens=4, do_sample=True, min_p=-0.1), "min_p=-0.1"),
])
def test_settings_model_generate_refuses_are_refused(spec, kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        spec.generate(torch.tensor([prompts(1, [6])[0]]), **kwargs)


def test_input_ids_that_are_not_token_ids_are_refused(spec):
    with pytest.raises(TypeError, match="input_ids: a \\[B, T\\] tensor of integer token ids"):
        spec.generate([[5, 6, 7]], max_new_tokens=2)
    with pytest.raises(TypeError, match="torch.float32"):
        spec.generate(torch.tensor([[5.0, 6.0]]), max_new_tokens=2)
    for bad in ([[5, 600, 7]], [[5, -1, 7]]):
        with pytest.raises(ValueError, match="outside the vocabulary 0 .. 100"):
            spec.generate(torch.tensor(bad), max_new_tokens=2)


def test_a_users_generation_config_takes_what_it_leaves_unset_from_the_models(model):
    """model.generate fills a passed GenerationConfig's unset fields (eos, pad, return_dict_in_generate, ...)
    from model.generation_config; a field the user set wins."""
    from transformers import GenerationConfig

    row = prompts(21, [7])[0]
    eos = hf_greedy(model, row, max_new_tokens=16, eos_token_id=None)[4]  # reached: generation must stop there
    ids = torch.tensor([row])
    before = (model.generation_config.eos_token_id, model.generation_config.pad_token_id)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = eos, 0
    spec = specgraph.compile(model, NGram(), tree=specgraph.Chain(3), max_cache_len=128)
    try:
        for given in (GenerationConfig(max_new_tokens=16), GenerationConfig(max_new_tokens=16, eos_token_id=2)):
            want = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=given)
            assert torch.equal(spec.generate(ids, generation_config=given), want), given.eos_token_id
        assert spec.generate(ids, generation_config=GenerationConfig(max_new_tokens=16)).shape[1] < len(row) + 16
        as_dict = GenerationConfig(max_new_tokens=4, return_dict_in_generate=True, output_scores=True)
        out = spec.generate(ids, generation_config=as_dict)
        assert torch.is_tensor(out.sequences) and len(out.scores) == out.sequences.shape[1] - len(row)
    finally:
        model.generation_config.eos_token_id, model.generation_config.pad_token_id = before


def test_hf_argument_forms_stopping_criteria_lists_int32_prompts_numpy_lengths(model, spec):
    """Forms model.generate takes: a plain list of criteria, an int32 prompt (int64 out), a numpy length,
    ``logits_processor=None`` or ``[]`` (its defaults); a non-empty one or a criteria that is not one is refused."""
    from transformers import MaxLengthCriteria

    row = prompts(23, [6])[0]
    ids = torch.tensor([row])
    stop = [MaxLengthCriteria(max_length=len(row) + 3)]
    want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, eos_token_id=None,
                          do_sample=False, stopping_criteria=stop)
    assert torch.equal(spec.generate(ids, max_new_tokens=12, eos_token_id=None, stopping_criteria=stop), want)
    out = spec.generate(ids.int(), max_new_tokens=np.int64(5), eos_token_id=None, logits_processor=None)
    assert out.dtype == torch.int64 and out[0, len(row):].tolist() == hf_greedy(model, row, max_new_tokens=5,
                                                                               eos_token_id=None)
    assert torch.equal(spec.generate(ids, max_new_tokens=5, eos_token_id=None, logits_processor=[]), out)
    for length in (5.0, np.float64(5.0)):  # model.generate takes an integer-valued float length too
        assert torch.equal(spec.generate(ids, max_new_tokens=length, eos_token_id=None), out)
    with pytest.raises(ValueError, match="max_new_tokens=4.5"):
        spec.generate(ids, max_new_tokens=4.5)
    numpy_settings = dict(do_sample=True, seed=3, top_k=np.int64(8), top_p=np.float32(0.9), min_p=np.float32(0.05),
                          repetition_penalty=np.float32(1.2))  # model.generate takes numpy numbers here
    python_settings = {k: v if k == "seed" else v.item() for k, v in numpy_settings.items() if k != "do_sample"}
    assert torch.equal(spec.generate(ids, max_new_tokens=6, **numpy_settings),
                       spec.generate(ids, max_new_tokens=6, do_sample=True, **python_settings))
    with pytest.raises(TypeError, match="stopping_criteria=3"):
        spec.generate(ids, max_new_tokens=4, stopping_criteria=3)
    with pytest.raises(TypeError, match="logits_processor"):
        spec.generate(ids, max_new_tokens=4, logits_processor=[lambda i, s: s])
    with pytest.raises(TypeError, match="attention_mask: a \\[B, T\\] tensor"):
        spec.generate(ids, attention_mask=[[1] * len(row)], max_new_tokens=4)


def test_attach_honours_return_dict_in_generate_from_the_generation_config(model):
    specgraph.attach(model, NGram(), tree=specgraph.Chain(2), max_cache_len=128)
    try:
        model.generation_config.return_dict_in_generate = True
        out = model.generate(torch.tensor([prompts(2, [6])[0]]), max_new_tokens=5, eos_token_id=None)
        assert hasattr(out, "sequences") and out.accept_lens
    finally:
        model.generation_config.return_dict_in_generate = False
        specgraph.detach(model)


def test_compile_reads_tree_spellings_and_refuses_a_draft_class(model):
    assert specgraph.compile(model, NGram(), tree="chain4").config.tree == specgraph.Chain(4)
    assert specgraph.compile(model, NGram(), tree="chain2").config.tree == specgraph.Chain(2)
    with pytest.raises(specgraph.CompileError, match="tree='chainx'.*spellings: chainK"):
        specgraph.compile(model, NGram(), tree="chainx")
    with pytest.raises(specgraph.CompileError, match="tree=5: a specgraph.Chain"):
        specgraph.compile(model, NGram(), tree=5)
    with pytest.raises(specgraph.CompileError, match=r"draft=NGram is a class: pass an instance, e.g. NGram\(\)"):
        specgraph.compile(model, NGram, tree="chain4")
    with pytest.raises(TypeError, match="NGram\\(max_ngram=2.5\\): whole numbers"):
        NGram(max_ngram=2.5)
    with pytest.raises(specgraph.CompileError, match="max_batch=True: an int >= 1"):
        specgraph.compile(model, NGram(), tree="chain4", max_batch=True)
    with pytest.raises(specgraph.CompileError, match="synthetic_accept=True: an int"):
        specgraph.compile(model, NGram(), tree="chain4", synthetic_accept=True)
    spec = specgraph.compile(model, NGram(), tree="chain4")
    with pytest.raises(TypeError, match="batch_sizes=1: a list or tuple"):
        spec.warmup(1)
    with pytest.raises(ValueError, match=r"batch_sizes=\[True\]"):
        spec.warmup((True,))
    with pytest.raises(ValueError, match="batch=True: an int"):
        spec.export("x.onnx", batch=True)
    with pytest.raises(TypeError, match="MTP.from_target takes the target's model directory"):
        specgraph.drafts.MTP.from_target(model)
    with pytest.raises(ValueError, match=r"draft_vocab: ids \[101, 102.*lie outside the target's vocabulary 0 .. 100"):
        specgraph.drafts.Eagle3.for_target(model, draft_vocab=torch.arange(200))
    with pytest.raises(ValueError, match="draft_vocab: 3 distinct target token ids in 0 .. 100 .got 3 ids, 2 distinct"):
        specgraph.drafts.Eagle3.for_target(model, draft_vocab=[4, 4, 5])


def test_head_checkpoints_name_the_file_or_the_hub_id_they_could_not_read(tmp_path, monkeypatch):
    from specgraph.drafts import Eagle3

    draft = Eagle3.for_target(model_for_heads())
    draft.save_pretrained(tmp_path / "head")
    weights = tmp_path / "head" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated
    with pytest.raises(ValueError, match="model.safetensors: cannot read EAGLE-3 weights"):
        Eagle3.from_pretrained(tmp_path / "head")
    draft.save_pretrained(tmp_path / "head")
    (tmp_path / "head" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json: not valid JSON"):
        Eagle3.from_pretrained(tmp_path / "head")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="'someorg/no-such-head': not a local path, and the hub id could not"):
        Eagle3.from_pretrained("someorg/no-such-head")
    with pytest.raises(FileNotFoundError, match="'no/such/dir' does not exist"):
        Eagle3.from_pretrained("no/such/dir")
    # a hub id resolves through huggingface_hub's snapshot (here: one prepared locally)
    draft.save_pretrained(tmp_path / "snapshot")
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo_id, **kw: str(tmp_path / "snapshot"))
    loaded = Eagle3.from_pretrained("someorg/a-head")
    assert torch.equal(loaded.fc.weight, draft.fc.weight)


def model_for_heads():
    return tiny_model("llama")


@pytest.mark.parametrize("argv, message", [
    (["demo", "--max-new-tokens", "-1"], "--max-new-tokens: -1: a whole number >= 1"),
    (["train", "medusa", "--out", "x", "--heads", "0"], "--heads: 0: a whole number >= 1"),
    (["train", "eagle3", "--out", "x", "--steps", "-1"], "--steps: -1: a whole number >= 1"),
    (["export", "x.onnx", "--batch", "0"], "--batch: 0: a whole number >= 1"),
    (["bench", "acceptance", "--questions", "many"], "--questions: 'many': a whole number >= 1"),
    (["bench", "acceptance", "--draft", "foo"], "--draft: 'foo': one of ngram, eagle=DIR"),
    (["bench", "acceptance", "--draft", "eagle3"], "eagle3 needs its weights: eagle3=DIR"),
    (["bench", "acceptance", "--temperature", "nan"], "--temperature: nan: a finite number >= 0"),
    (["bench", "acceptance", "--temperature", "-1"], "--temperature: -1: a finite number >= 0"),
    (["inspect", "--taps", "a,b"], "--taps: 'a,b': layer ids >= 0"),
    (["inspect", "--logits-rows", "5"], "--logits-rows: '5': START:STOP"),
    (["inspect", "--logits-rows", "5:2"], "--logits-rows: '5:2': START:STOP"),
    (["inspect", "--nodes", "100"], "--nodes: 100: a whole number in 1 .. 64"),
    (["export", "x.onnx", "--nodes", "65"], "--nodes: 65: a whole number in 1 .. 64"),
    (["train", "eagle3", "--out", "x", "--lr", "nan"], "--lr: nan: a finite number > 0"),
    (["train", "eagle3", "--out", "x", "--max-minutes", "-3"], "--max-minutes: -3: a finite number > 0"),
    (["train", "eagle3", "--out", "x", "--max-shard-mb", "0"], "--max-shard-mb: 0: a finite number > 0"),
])
def test_the_cli_refuses_nonsense_numbers(argv, message, capsys):
    from specgraph.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_the_cli_prints_a_refusal_without_a_traceback(monkeypatch, capsys):
    import specgraph.cli as cli
    from specgraph.cli_args import MAX_NODES

    assert MAX_NODES == specgraph.MAX_NODES  # the parser's copy, kept without importing torch

    def refused(args):
        raise specgraph.CompileError("cannot compile X", ["max_cache_len=4: an int larger than the tree (8 nodes)"])
    monkeypatch.setattr(cli, "_info", refused)
    assert cli.main(["info"]) == 2
    assert "specgraph info: cannot compile X: 1 blocker(s)\n  - max_cache_len=4" in capsys.readouterr().err
    assert cli.main(["inspect", "--nodes", "8", "--logits-rows", "0:9"]) == 2  # before loading any model
    assert "--logits-rows 0:9 lies past the 8 nodes" in capsys.readouterr().err


def test_acceptance_statistics_of_the_last_call_match_its_accept_lens(model, spec):
    rows = prompts(13, [9, 14])
    ids, mask = left_pad(rows)
    out = spec.generate(ids, attention_mask=mask, max_new_tokens=20, eos_token_id=None, return_dict_in_generate=True)
    stats = out.acceptance
    assert stats is spec.last_stats
    lens = [n for step in out.accept_lens for n in step if n > 0]
    # 2 rows x 20 tokens, each row's first from the prefill (no step's)
    assert stats.steps == len(lens) and stats.tokens == 38 and stats.tau == pytest.approx(38 / len(lens))
    assert stats.accepted_hist == tuple(sum(min(n - 1, 3) == k for n in lens) for k in range(4))
    assert stats.position_rate[0] == pytest.approx(sum(n >= 2 for n in lens) / len(lens))
    assert stats.tau > 1  # the repeated prompt (row 1) makes the n-gram draft pay


def test_incomplete_heads_empty_prompts_and_unknown_targets_get_clear_errors(model, spec, tmp_path, monkeypatch, capsys):
    from safetensors.torch import load_file, save_file

    from specgraph.cli import main
    from specgraph.drafts import Medusa

    Medusa(16, 50, num_heads=3).save_pretrained(tmp_path / "medusa")
    weights = tmp_path / "medusa" / "medusa_lm_head.safetensors"
    save_file({k: v for k, v in load_file(str(weights)).items() if not k.startswith("1.")}, str(weights))
    with pytest.raises(ValueError, match=r"Medusa heads \[1\] are missing \(found heads \[0, 2\]\)"):
        Medusa.from_pretrained(tmp_path / "medusa")
    with pytest.raises(ValueError, match="rows of T >= 1 tokens; got \\(1, 0\\)"):
        spec.generate(torch.zeros(1, 0, dtype=torch.long), max_new_tokens=2)
    import transformers

    def offline(name, **kwargs):  # what transformers raises without a network (none is reached in tests)
        raise OSError(f"We couldn't connect to the hub to load {name}.\nmore")

    import socket

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", offline)
    monkeypatch.setattr(socket, "getaddrinfo", lambda *args, **kwargs: [])  # the hub's host resolves, then fails
    assert main(["inspect", "someorg/no-such-model"]) == 2
    assert "the target 'someorg/no-such-model' is not a .gguf file or a model directory" in capsys.readouterr().err


def test_every_draft_kind_implements_the_draft_protocol_and_others_are_refused(model):
    from specgraph.drafts import MTP, Eagle, Eagle3, Medusa, Plain
    from specgraph.drafts.base import Draft, DraftSession

    assert all(issubclass(kind, Draft) for kind in (NGram, Medusa, Eagle, Eagle3, MTP, Plain))
    plain = specgraph.compile(model, None)  # plain decoding is the Plain draft on root-only trees
    assert isinstance(plain.draft, Plain) and plain.config.tree == specgraph.Chain(0)
    row = prompts(19, [7])[0]
    assert plain.generate(torch.tensor([row]), max_new_tokens=9, eos_token_id=None)[0, 7:].tolist() == \
        hf_greedy(model, row, max_new_tokens=9, eos_token_id=None)
    with pytest.raises(specgraph.CompileError, match="plain decoding verifies the root alone"):
        specgraph.compile(model, Plain(), tree="chain2")
    session = NGram().session(specgraph.Chain(2), 1, 32, torch.device("cpu"))
    assert isinstance(session, DraftSession) and session.taps is None

    class Lookalike:  # duck-typed: has the names, not the protocol
        kind = "ngram"

        def session(self, *args):
            return None

    with pytest.raises(specgraph.CompileError, match="draft=Lookalike: not a specgraph draft"):
        specgraph.compile(model, Lookalike(), tree="chain2")


def test_compiles_old_max_length_spelling_warns_and_still_sizes_the_cache(model):
    """compile(max_cache_len=) is the cache; max_length= (its spelling before 0.1) still works with a
    FutureWarning; generate(max_length=) keeps transformers' meaning."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert specgraph.compile(model, NGram(), tree=specgraph.Chain(3), max_cache_len=96).config.max_cache_len == 96
    with pytest.warns(FutureWarning, match=r"specgraph.compile\(max_length=\) is now max_cache_len="):
        spec = specgraph.compile(model, NGram(), tree=specgraph.Chain(3), max_length=96)
    assert spec.config.max_cache_len == 96 and spec.capture.max_length == 96
    with pytest.warns(FutureWarning, match="SpecConfig.max_length is now max_cache_len"):
        assert spec.config.max_length == 96
    row = prompts(23, [8])[0]
    out = spec.generate(torch.tensor([row]), max_length=20, eos_token_id=None)  # generate's: prompt + new tokens
    assert out[0, 8:].tolist() == hf_greedy(model, row, max_new_tokens=12, eos_token_id=None)
    with pytest.raises(ValueError, match="exceeds max_cache_len=96 given to specgraph.compile"):
        spec.generate(torch.tensor([row]), max_new_tokens=90)
    with pytest.raises(TypeError, match="max_length= is the old spelling of max_cache_len=; pass max_cache_len only"):
        specgraph.compile(model, NGram(), tree=specgraph.Chain(3), max_cache_len=64, max_length=96)
    with pytest.warns(FutureWarning, match=r"specgraph.attach\(max_length=\)"):
        attached = specgraph.attach(model, NGram(), tree=specgraph.Chain(2), max_length=80)
    specgraph.detach(model)
    assert attached.config.max_cache_len == 80


def test_hf_defaults_pass_and_warmup_arguments_are_checked(spec):
    """synced_gpus=False (model.generate's default) is accepted; warmup's sampling is a bool and its batch
    sizes are not empty."""
    ids = torch.tensor([prompts(4, [6])[0]])
    assert torch.equal(spec.generate(ids, max_new_tokens=3, synced_gpus=False), spec.generate(ids, max_new_tokens=3))
    with pytest.raises(TypeError, match="synced_gpus=True"):
        spec.generate(ids, max_new_tokens=3, synced_gpus=True)
    with pytest.raises(TypeError, match="sampling='yes'"):
        spec.warmup(sampling="yes")
    with pytest.raises(ValueError, match="batch_sizes=\\[\\]"):
        spec.warmup(batch_sizes=())


def test_leading_pad_ids_are_padding_and_inner_ones_are_warned_about(model, spec):
    """No attention_mask, a pad id set: each row's leading run of pad ids is left padding (as model.generate
    infers); a pad id inside the prompt stays a token, with a warning (model.generate would mask it). A mask
    of any nonzero values attends as 1 does."""
    pad, row = 1, prompts(13, [8])[0]
    inner = row[:4] + [pad] + row[4:]
    ids = torch.tensor([[pad, pad] + inner])
    with pytest.warns(UserWarning, match="hold pad_token_id=1 inside the prompt"):
        out = spec.generate(ids, max_new_tokens=6, pad_token_id=pad, eos_token_id=None)
    assert out[0, ids.shape[1]:].tolist() == hf_greedy(model, inner, max_new_tokens=6, eos_token_id=None)
    ids = torch.tensor([row])
    twos = spec.generate(ids, attention_mask=2 * torch.ones_like(ids), max_new_tokens=6, eos_token_id=None)
    assert twos[0, len(row):].tolist() == hf_greedy(model, row, max_new_tokens=6, eos_token_id=None)
    for bad in (ids.to(torch.complex64), ids.to("meta")):
        with pytest.raises(TypeError, match="input_ids"):
            spec.generate(bad, max_new_tokens=2)


def test_paths_and_streamers_of_the_wrong_kind_are_named(spec, tmp_path):
    from specgraph.drafts import Eagle3, Medusa
    from specgraph.models import load_gguf

    for loader in (Eagle3.from_pretrained, Medusa.from_pretrained):
        for bad in (None, 123):
            with pytest.raises(TypeError, match=f"path={bad!r}"):
                loader(bad)
    with pytest.raises(TypeError, match="path=123"):
        spec.export(123)
    with pytest.raises(TypeError, match="streamer='x'"):
        spec.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, streamer="x")
    with pytest.raises(FileNotFoundError, match="is a directory"):
        load_gguf(tmp_path)
