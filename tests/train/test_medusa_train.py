"""Medusa-1 training on a tiny target: the loss falls, the checkpoint loads in the public
format and speculates token-exactly, and an interrupted run resumes to the same state."""
import torch

import specgraph
from specgraph.drafts import Medusa
from specgraph.train import TrainConfig, medusa_loss, new_medusa_for, train
from test_capture import tiny_model


def self_distilled(model, n: int, length: int = 40) -> list[dict]:
    """The target's own greedy continuations of random prompts; loss on the continuation."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        prompt = torch.randint(3, 101, (1, 6), generator=g)
        ids = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=length - 6,
                             min_new_tokens=length - 6, do_sample=False, pad_token_id=0)[0]
        out.append({"input_ids": ids, "loss_mask": torch.arange(len(ids)) >= 6})
    return out


def run(model, examples, out, steps, total):
    torch.manual_seed(1)
    draft = new_medusa_for(model, num_heads=3)
    config = TrainConfig(steps=total, batch_size=8, lr=3e-3, warmup_steps=5, save_every=steps, eval_every=1000)
    if steps < total:  # stop early, as if interrupted, then resume with a fresh module
        train(draft, medusa_loss(model, draft), examples, config, out, stop_at=steps)
        torch.manual_seed(1)
        draft = new_medusa_for(model, num_heads=3)
    return draft, train(draft, medusa_loss(model, draft), examples, config, out)


def test_medusa_training_learns_saves_and_resumes(tmp_path):
    model = tiny_model("llama")
    for p in model.parameters():
        p.requires_grad_(False)
    examples = self_distilled(model, 24)
    draft, history = run(model, examples, tmp_path / "straight", steps=40, total=40)
    first, last = history[0]["loss"], sum(h["loss"] for h in history[-5:]) / 5
    assert last < 0.7 * first, (first, last)
    assert history[-1]["top1_head0"] > history[0]["top1_head0"]
    loaded = Medusa.from_pretrained(tmp_path / "straight")
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in draft.state_dict().items())
    spec = specgraph.compile(model, loaded, tree=specgraph.Chain(3), max_batch=1, max_cache_len=128)
    prompt = examples[0]["input_ids"][:6].tolist()
    out = spec.generate(torch.tensor([prompt]), max_new_tokens=30, eos_token_id=None, return_dict_in_generate=True)
    assert out["sequences"][0, 6:].tolist() == examples[0]["input_ids"][6:36].tolist()  # the target's own greedy
    assert max(max(s) for s in out["accept_lens"]) > 1  # the trained heads do get accepted
    resumed, resumed_history = run(model, examples, tmp_path / "resumed", steps=20, total=40)
    assert [h["loss"] for h in resumed_history] == [h["loss"] for h in history]
    assert all(torch.equal(v, resumed.state_dict()[k]) for k, v in draft.state_dict().items())


def test_shared_lm_head_heads_train_alone_and_ship_without_it(tmp_path):
    """--shared-lm-head: only the ResBlocks train (the target's LM head stays as it was), the
    checkpoint is the legacy layout without vocabulary matrices, and it speculates token-exactly."""
    model = tiny_model("llama")
    for p in model.parameters():
        p.requires_grad_(False)
    head_before = model.get_output_embeddings().weight.clone()
    examples = self_distilled(model, 16)
    torch.manual_seed(1)
    draft = new_medusa_for(model, num_heads=2, own_lm_head=False)
    assert all(not n.startswith("lm_heads") for n, _ in draft.named_parameters())
    config = TrainConfig(steps=30, batch_size=8, lr=3e-3, warmup_steps=5, save_every=30, eval_every=1000)
    history = train(draft, medusa_loss(model, draft), examples, config, tmp_path / "shared")
    assert sum(h["loss"] for h in history[-5:]) / 5 < history[0]["loss"]
    assert torch.equal(model.get_output_embeddings().weight, head_before)
    loaded = Medusa.from_pretrained(tmp_path / "shared")
    assert loaded.lm_heads is None
    spec = specgraph.compile(model, loaded, tree=specgraph.Chain(2), max_batch=1, max_cache_len=128)
    prompt = examples[0]["input_ids"][:6].tolist()
    out = spec.generate(torch.tensor([prompt]), max_new_tokens=20, eos_token_id=None)
    assert out[0, 6:].tolist() == examples[0]["input_ids"][6:26].tolist()
    # a deadline already passed: the run saves where it is and returns
    fresh = new_medusa_for(model, num_heads=2, own_lm_head=False)
    late = train(fresh, medusa_loss(model, fresh), examples, config, tmp_path / "late", deadline=0.0)
    assert late == [] and (tmp_path / "late" / "trainer.pt").is_file()
