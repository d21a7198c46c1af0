"""EAGLE-3 training-time test on a tiny target. Oracle for the unrolled forward: step j at row t
equals the inference draft (tree_attention over its cache) run on the pairs 0..t and then j
tokens of its own chain — the training math is the math the trained head is used with."""
import json

import pytest
import torch

import specgraph
from specgraph.drafts import Eagle3
from specgraph.train import TrainConfig, train
from specgraph.train.eagle3 import chain_walk, eagle3_loss, new_eagle3_for, select_vocab, tap_states, ttt_forward
from test_capture import tiny_model
from test_medusa_train import self_distilled

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "drafts"))
from test_eagle import oracle_logprobs  # noqa: E402


def frozen_target():
    model = tiny_model("llama")
    for p in model.parameters():
        p.requires_grad_(False)
    return model


@torch.no_grad()
def test_unrolled_steps_equal_the_inference_draft_on_each_chain():
    model = frozen_target()
    examples = self_distilled(model, 4, length=24)
    torch.manual_seed(3)
    draft = new_eagle3_for(model, examples, draft_vocab_size=40, aux_layer_ids=(0, 1, 1))
    for proj in (draft.midlayer.self_attn.q_proj, draft.midlayer.self_attn.k_proj):
        proj.weight.mul_(6.0)  # sharp attention, so positions and masks matter
    ids = torch.stack([e["input_ids"] for e in examples[:2]])
    out = model(input_ids=ids, output_hidden_states=True)
    features = tap_states(out.hidden_states, draft.aux_layer_ids, draft.aux_convention)
    logits = ttt_forward(draft, ids, features, steps=4)
    for b in range(2):
        for t in (0, 5, 13):
            for j in range(4):
                prompt = ids[b, : t + 2].tolist()  # pairs (f_s, x_{s+1}) for s = 0..t
                chain = ids[b, t + 2: t + 2 + j].tolist()  # then j tokens of the draft's own chain
                want = oracle_logprobs(draft, features[b], prompt, chain)
                got = torch.log_softmax(logits[j][b, t].float(), -1)
                torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_eagle3_training_learns_and_the_head_speculates(tmp_path):
    model = frozen_target()
    examples = self_distilled(model, 24)
    vocab = select_vocab(examples, 60, 101)
    counts = torch.bincount(torch.cat([e["input_ids"][e["loss_mask"]] for e in examples]), minlength=101)
    assert counts[vocab].min() >= counts[torch.tensor([t for t in range(101) if t not in set(vocab.tolist())])].max()
    torch.manual_seed(1)
    draft = new_eagle3_for(model, examples, draft_vocab_size=60, aux_layer_ids=(0, 1, 1))
    assert torch.equal(draft.to_target(torch.arange(60)), vocab)
    config = TrainConfig(steps=40, batch_size=8, lr=1e-2, warmup_steps=5, save_every=40, eval_every=1000)
    history = train(draft, eagle3_loss(model, draft, steps=3), examples, config, tmp_path)
    # soft cross-entropy keeps the teacher's entropy (~8 nats on this flat tiny target): watch the fall
    # and the draft's agreement with the target's argmax
    first, last = history[0]["loss"], sum(h["loss"] for h in history[-5:]) / 5
    assert last < first - 1.0, (first, last)
    acc_first, acc_last = history[0]["acc_step0"], sum(h["acc_step0"] for h in history[-5:]) / 5
    assert acc_last > max(0.4, 5 * acc_first), (acc_first, acc_last)
    loaded = Eagle3.from_pretrained(tmp_path)
    assert "embed_tokens.weight" not in loaded.state_dict() or loaded.embed_from_target
    assert torch.equal(loaded.d2t, draft.d2t) and torch.equal(loaded.t2d, draft.t2d)
    spec = specgraph.compile(model, loaded, tree=specgraph.DynamicTree(steps=3, topk=2, nodes=6), max_cache_len=128)
    prompt = examples[0]["input_ids"][:6].tolist()
    out = spec.generate(torch.tensor([prompt]), max_new_tokens=30, eos_token_id=None, return_dict_in_generate=True)
    assert out["sequences"][0, 6:].tolist() == examples[0]["input_ids"][6:36].tolist()
    assert max(max(s) for s in out["accept_lens"]) > 1  # the trained head does get accepted


@torch.no_grad()
def test_tau_rows_is_the_mean_accepted_length_over_answer_rows():
    """Oracle: for each row t whose step-0 token is an answer token, count the leading steps j whose
    draft argmax (from the unrolled forward) equals the target's argmax at x_{t+2+j}."""
    model = frozen_target()
    examples = self_distilled(model, 4, length=24)
    torch.manual_seed(5)
    draft = new_eagle3_for(model, examples, draft_vocab_size=0, aux_layer_ids=(0, 1, 1))
    batch = {"input_ids": torch.stack([e["input_ids"] for e in examples]),
             "loss_mask": torch.stack([e["loss_mask"] for e in examples])}
    _, metrics = eagle3_loss(model, draft, steps=3)(batch)
    ids, mask = batch["input_ids"], batch["loss_mask"]
    out = model(input_ids=ids, output_hidden_states=True)
    logits = ttt_forward(draft, ids, tap_states(out.hidden_states, draft.aux_layer_ids, draft.aux_convention), 3)
    target = out.logits.argmax(-1)  # target[t] predicts x_{t+1}
    runs = []
    for b in range(ids.shape[0]):
        for t in range(ids.shape[1] - 2):
            if not mask[b, t + 2]:
                continue
            run = 0
            for j in range(3):
                if t + 2 + j >= ids.shape[1] or not mask[b, t + 2 + j]:
                    break
                if logits[j][b, t].argmax() != target[b, t + 1 + j]:
                    break
                run += 1
            runs.append(run)
    assert float(metrics["tau_rows"]) == pytest.approx(1 + sum(runs) / len(runs), abs=1e-6)
    assert 0 < sum(runs)  # the check can see hits: a random head agrees on some of this tiny vocabulary


def test_tau_is_what_a_chain_commits_per_step_generating_the_same_answers(tmp_path):
    """Oracle: generation. On the target's own greedy continuations, the held-out ``tau`` of a trained head
    equals the tokens per step that ``spec.generate`` with ``Chain(steps)`` commits writing the same
    answers; ``tau_rows`` (every answer row weighed alike: the old held-out τ) is the negative control."""
    model = frozen_target()
    examples = self_distilled(model, 24)
    torch.manual_seed(1)
    draft = new_eagle3_for(model, examples, draft_vocab_size=0, aux_layer_ids=(0, 1, 1))
    config = TrainConfig(steps=40, batch_size=8, lr=1e-2, warmup_steps=5, save_every=40, eval_every=1000)
    loss_fn = eagle3_loss(model, draft, steps=3)
    train(draft, loss_fn, examples, config, tmp_path)
    draft.eval()
    held = examples[:6]
    with torch.no_grad():
        _, metrics = loss_fn({k: torch.stack([e[k] for e in held]) for k in ("input_ids", "loss_mask")})
    spec = specgraph.compile(model, Eagle3.from_pretrained(tmp_path), tree=specgraph.Chain(3), max_cache_len=128)
    committed = []
    for e in held:
        prompt = int((~e["loss_mask"]).sum())
        out = spec.generate(e["input_ids"][None, :prompt], max_new_tokens=len(e["input_ids"]) - prompt,
                            eos_token_id=None, return_dict_in_generate=True)
        assert out["sequences"][0].tolist() == e["input_ids"].tolist()
        lens = [step[0] for step in out["accept_lens"]]
        # the first answer token is the prefill's; the last step's tokens past the length: dropped
        lens[-1] -= sum(lens) - (len(e["input_ids"]) - prompt - 1)
        assert lens[-1] >= 1
        committed += lens
    tokens, steps = sum(committed), len(committed)
    assert 1.3 < tokens / steps  # the head is accepted: steps commit several tokens
    assert float(metrics["tau"]) == pytest.approx(tokens / steps, abs=1e-6)
    assert float(metrics["tau_rows"]) != pytest.approx(tokens / steps, abs=1e-3)  # rows weighed alike: not it


@pytest.mark.parametrize("runs, answer, committed", [
    ([0] * 6, [0, 0, 1, 1, 1, 1], [1, 1, 1]),  # x_2 the prefill's, then one token a step from it (row 1)
    ([1, 3, 9, 9, 9, 9, 9, 9], [0, 0, 1, 1, 1, 1, 1, 1], [4, 1]),  # row 1: 3 accepted + bonus; row 5: capped
    ([0, 3, 9, 9, 9, 9, 9, 9], [0, 0, 1, 1, 1, 1, 0, 0], [3]),  # row 1: capped at the answer's end (x_5)
    ([2, 2, 2, 2, 2, 2, 2, 2], [0, 0, 1, 1, 0, 0, 0, 1], [1]),  # two answers (turns), each's first the prefill's
    ([5, 0, 0], [1, 1, 1], [1]),  # an answer from position 0: x_0 and x_1 are given
])
def test_chain_walk_steps_through_each_answer(runs, answer, committed):
    assert chain_walk(runs, [bool(a) for a in answer]) == committed


def test_full_vocabulary_head_drafts_through_the_targets_lm_head(tmp_path):
    """--draft-vocab 0: no vocabulary matrix of its own (trained, saved or loaded); the checkpoint says so
    as SGLang reads it (no draft_vocab_size, no lm_head.weight) and speculates token-exactly."""
    model = frozen_target()
    examples = self_distilled(model, 16)
    torch.manual_seed(1)
    draft = new_eagle3_for(model, examples, draft_vocab_size=0, aux_layer_ids=(0, 1, 1))
    assert draft.lm_head_from_target and not any(n.startswith("lm_head") for n, _ in draft.named_parameters())
    head = model.get_output_embeddings().weight.clone()
    config = TrainConfig(steps=30, batch_size=8, lr=1e-2, warmup_steps=3, save_every=30, eval_every=1000)
    history = train(draft, eagle3_loss(model, draft, steps=2), examples, config, tmp_path)
    assert sum(h["loss"] for h in history[-5:]) / 5 < history[0]["loss"]
    assert torch.equal(model.get_output_embeddings().weight, head)  # the target's head stays as it was
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["draft_vocab_size"] is None
    from safetensors import safe_open

    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert not any(k.startswith(("lm_head", "embed")) for k in f.keys())
    loaded = Eagle3.from_pretrained(tmp_path)
    assert loaded.lm_head_from_target and loaded.d2t is None
    spec = specgraph.compile(model, loaded, tree=specgraph.DynamicTree(steps=3, topk=2, nodes=6), max_cache_len=128)
    prompt = examples[0]["input_ids"][:6].tolist()
    out = spec.generate(torch.tensor([prompt]), max_new_tokens=30, eos_token_id=None)
    assert out[0, 6:].tolist() == examples[0]["input_ids"][6:36].tolist()
    with pytest.raises(ValueError, match="full vocabulary"):
        Eagle3(loaded.config.__class__(**{**loaded.config.to_dict(), "draft_vocab_size": 50}), (0, 1, 1),
               lm_head_from_target=True)


@torch.no_grad()
def test_a_warm_start_keeps_what_the_source_head_learnt_and_grows_its_vocabulary():
    """init_from: a head with a larger draft vocabulary drafts exactly as the source on the source's
    tokens (same hidden states; LM-head rows carried by target id), and other taps are refused."""
    model = frozen_target()
    examples = self_distilled(model, 16)
    torch.manual_seed(2)
    source = new_eagle3_for(model, examples, draft_vocab_size=20, aux_layer_ids=(0, 1, 1))
    for p in source.parameters():
        if p.requires_grad:
            p.add_(torch.randn_like(p) * 0.1)  # stands in for training: away from any initialisation
    torch.manual_seed(3)
    grown = new_eagle3_for(model, examples, draft_vocab_size=40, init_from=source)
    assert grown.aux_layer_ids == source.aux_layer_ids
    ids = examples[0]["input_ids"][None, :12]
    features = tap_states(model(input_ids=ids, output_hidden_states=True).hidden_states, source.aux_layer_ids,
                          source.aux_convention)
    old, new = ttt_forward(source, ids, features, 2), ttt_forward(grown, ids, features, 2)
    old_ids = torch.arange(20) + source.d2t
    new_ids = torch.arange(40) + grown.d2t
    assert set(old_ids.tolist()) < set(new_ids.tolist())
    where = torch.tensor([new_ids.tolist().index(t) for t in old_ids.tolist()])
    for a, b in zip(old, new):
        torch.testing.assert_close(b[..., where], a)
    fresh = torch.tensor([i for i in range(40) if i not in where.tolist()])
    assert not torch.allclose(new[0][..., fresh], torch.zeros(()))  # new tokens keep their own rows
    other = new_eagle3_for(model, examples, draft_vocab_size=20, aux_layer_ids=(0, 0, 1))
    with pytest.raises(ValueError, match="same features"):
        from specgraph.train.eagle3 import warm_start

        warm_start(other, source)


def test_mapped_rows_recover_a_linear_map_of_the_target_rows():
    """Where the head's rows are a linear map of the target's (float64 oracle: T @ A), the map fitted on the
    shared rows gives the new rows to rounding, whatever the rows' scale; a huge ridge does not (control)."""
    from specgraph.train.eagle3 import mapped_rows

    g = torch.Generator().manual_seed(0)
    target = torch.randn(300, 16, generator=g, dtype=torch.float64)
    a = torch.randn(16, 16, generator=g, dtype=torch.float64)
    for scale in (1e-3, 1.0, 50.0):
        t = target * scale
        got = mapped_rows(t[:200], t[:200] @ a, t[200:], ridge=1e-12)
        torch.testing.assert_close(got, t[200:] @ a, rtol=1e-6, atol=1e-9 * scale)
    shrunk = mapped_rows(target[:200], target[:200] @ a, target[200:], ridge=1e3)
    assert (shrunk - target[200:] @ a).norm() > 0.5 * (target[200:] @ a).norm()


@torch.no_grad()
def test_a_grown_vocabularys_new_rows_start_from_the_target_rows_mapped():
    """init_from growing the vocabulary: where the source's LM-head rows are a linear map of the target's,
    the new tokens' rows come out close to that map of their target rows, where warm_start without the
    target's rows leaves them at their random initialisation (control); the carried rows stay the source's."""
    from specgraph.train.eagle3 import warm_start

    model = frozen_target()
    examples = self_distilled(model, 16)
    torch.manual_seed(2)
    source = new_eagle3_for(model, examples, draft_vocab_size=70, aux_layer_ids=(0, 1, 1))
    target_rows = model.get_output_embeddings().weight.double()
    planted = torch.randn(target_rows.shape[1], target_rows.shape[1], dtype=torch.float64)
    source_ids = torch.arange(70) + source.d2t
    source.lm_head.weight.copy_((target_rows[source_ids] @ planted).float())
    grown = new_eagle3_for(model, examples, draft_vocab_size=100, init_from=source)
    control = new_eagle3_for(model, examples, draft_vocab_size=100, aux_layer_ids=(0, 1, 1))
    warm_start(control, source)
    grown_ids = torch.arange(100) + grown.d2t
    fresh = torch.tensor([t not in source_ids.tolist() for t in grown_ids.tolist()])
    assert fresh.sum() == 30
    expected = target_rows[grown_ids] @ planted
    torch.testing.assert_close(grown.lm_head.weight[~fresh].double(), expected[~fresh], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(control.lm_head.weight[~fresh], grown.lm_head.weight[~fresh])
    cosine = torch.nn.functional.cosine_similarity
    assert cosine(grown.lm_head.weight[fresh].double(), expected[fresh], dim=1).mean() > 0.9
    assert cosine(control.lm_head.weight[fresh].double(), expected[fresh], dim=1).abs().mean() < 0.3


@torch.no_grad()
def test_padding_to_the_width_multiple_changes_no_loss_or_metric():
    """collate pads T up to PAD_MULTIPLE (fewer shapes for per-shape kernel plans): the padded rows carry
    no loss and, the model being causal, change no kept row — same loss and τ as the exact width."""
    from specgraph.train.loop import PAD_MULTIPLE, collate

    model = frozen_target()
    examples = self_distilled(model, 4)
    draft = new_eagle3_for(model, examples, draft_vocab_size=0, aux_layer_ids=(0, 1, 1)).eval()  # eval: tau too
    loss_fn = eagle3_loss(model, draft, steps=3)
    padded = collate(examples)
    width = max(len(e["input_ids"]) for e in examples)
    assert padded["input_ids"].shape[1] % PAD_MULTIPLE == 0 and padded["input_ids"].shape[1] > width
    exact = {k: v[:, :width] for k, v in padded.items()}
    (a, ma), (b, mb) = loss_fn(padded), loss_fn(exact)
    torch.testing.assert_close(a, b)
    assert "tau" in ma and set(ma) == set(mb) and all(float(ma[k]) == pytest.approx(float(mb[k]), abs=1e-6) for k in ma)


def test_the_unrolled_attention_keeps_off_cudnns_sdpa(monkeypatch):
    """Every TTT step's attention runs with the cuDNN SDPA backend disabled (its backward returns NaN
    grad_q for some masked shapes: pytorch/pytorch#196678), so CUDA picks the memory-efficient kernel.
    Control: the target's own attention (outside ttt_forward) runs with it enabled, torch's default."""
    import specgraph.train.eagle3 as trainer

    model = frozen_target()
    examples = self_distilled(model, 2, length=16)
    draft = new_eagle3_for(model, examples, draft_vocab_size=40, aux_layer_ids=(0, 1, 1))
    seen, sdpa = [], trainer.F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(trainer.F, "scaled_dot_product_attention", spy)
    ids = torch.stack([e["input_ids"] for e in examples])
    with torch.no_grad():
        features = tap_states(model(input_ids=ids, output_hidden_states=True).hidden_states,
                              draft.aux_layer_ids, draft.aux_convention)
    layers = len(seen)  # the target's own attention: torch's default, cuDNN allowed (the control)
    ttt_forward(draft, ids, features, steps=3)
    assert layers == model.config.num_hidden_layers and seen == [True] * layers + [False] * 3
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored after each step
