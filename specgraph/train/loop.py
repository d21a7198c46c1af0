"""The training loop every draft trainer shares: frozen target, AdamW with warm-up and cosine
decay, gradient clipping, bf16 autocast on CUDA, tqdm, periodic eval and checkpoints, resume.

A trainer supplies ``loss_fn(batch) -> (loss, metrics)`` over batches of
examples (``{"input_ids": [T], "loss_mask": [T]}``) and the draft module to
optimise. A checkpoint directory holds the draft in its public format
(``save_pretrained``) plus ``trainer.pt`` (optimizer, scheduler, step, RNG
states), so an interrupted run resumes to the same state.
"""
from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm


@dataclass
class TrainConfig:
    steps: int = 1000
    batch_size: int = 8
    lr: float = 1e-4
    weight_decay: float = 0.0
    warmup_steps: int = 50
    grad_clip: float = 0.5
    eval_every: int = 200
    save_every: int = 500
    seed: int = 0
    save_dtype: str | None = None  # e.g. "bfloat16": the checkpoint's weights (trainer.pt keeps full precision)
    max_shard_bytes: int | None = None  # split the checkpoint's safetensors (HF index) above this size


def collate(examples: list[dict], pad_id: int = 0) -> dict:
    """Right-pad a batch: input_ids [B, T], loss_mask [B, T] (padding carries no loss)."""
    width = max(len(e["input_ids"]) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.int64)
    mask = torch.zeros(len(examples), width, dtype=torch.bool)
    for i, e in enumerate(examples):
        ids[i, : len(e["input_ids"])] = e["input_ids"]
        mask[i, : len(e["loss_mask"])] = e["loss_mask"]
    return {"input_ids": ids, "loss_mask": mask}


def lr_lambda(config: TrainConfig) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def train(draft: torch.nn.Module, loss_fn, examples: list[dict], config: TrainConfig, out: str | Path,
          eval_examples: list[dict] | None = None, device=None, stop_at: int | None = None,
          deadline: float | None = None) -> list[dict]:
    """Optimise ``draft``'s trainable parameters; returns the logged history. Resumes from ``out``;
    ``stop_at`` (a step) or ``deadline`` (a ``time.time()``) ends this run early, checkpointed, e.g. to
    split a run into time slots."""
    out = Path(out)
    device = device or next(draft.parameters()).device
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(config))
    rng = random.Random(config.seed)
    step, history = 0, []
    state_file = out / "trainer.pt"
    if state_file.is_file():  # resume: draft weights, optimizer, schedule, data order, history
        state = torch.load(state_file, weights_only=False)
        draft.load_state_dict(state["draft"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        rng.setstate(state["rng"])
        torch.set_rng_state(state["torch_rng"])
        step, history = state["step"], state["history"]
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else _nothing()
    bar = tqdm(total=config.steps, initial=step, desc="train")
    last = min(config.steps, stop_at if stop_at is not None else config.steps)
    while step < last:
        if deadline is not None and time.time() > deadline:
            save(draft, optimizer, scheduler, rng, step, history, config, out)
            break
        batch = {k: v.to(device) for k, v in collate(rng.sample(examples, min(config.batch_size, len(examples)))).items()}
        draft.train()
        with autocast:
            loss, metrics = loss_fn(batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
        optimizer.step()
        scheduler.step()
        step += 1
        entry = {"step": step, "loss": loss.item(), "grad_norm": float(grad_norm), "lr": scheduler.get_last_lr()[0],
                 **{k: float(v) for k, v in metrics.items()}}
        if eval_examples and (step % config.eval_every == 0 or step == config.steps):
            entry["eval_loss"] = evaluate(draft, loss_fn, eval_examples, config.batch_size, device)
        history.append(entry)
        bar.update(1)
        bar.set_postfix(loss=f"{entry['loss']:.3f}")
        if step % config.save_every == 0 or step == last:
            save(draft, optimizer, scheduler, rng, step, history, config, out)
    bar.close()
    return history


@torch.no_grad()
def evaluate(draft, loss_fn, examples: list[dict], batch_size: int, device) -> float:
    draft.eval()
    losses = [float(loss_fn({k: v.to(device) for k, v in collate(examples[i:i + batch_size]).items()})[0])
              for i in range(0, len(examples), batch_size)]
    return sum(losses) / len(losses)


def save(draft, optimizer, scheduler, rng, step, history, config, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    draft.save_pretrained(out, dtype=getattr(torch, config.save_dtype) if config.save_dtype else None,
                          max_shard_bytes=config.max_shard_bytes)
    torch.save({"draft": draft.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "rng": rng.getstate(), "torch_rng": torch.get_rng_state(), "step": step, "history": history,
                "config": asdict(config)}, out / "trainer.pt")
    (out / "history.json").write_text(json.dumps(history))  # the training log, readable without torch


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
