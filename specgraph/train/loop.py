"""The training loop every draft trainer shares: frozen target, AdamW with warm-up and cosine
decay (over ``steps``, or ending at the deadline with ``anneal_to_deadline``), gradient clipping,
bf16 autocast on CUDA, tqdm, periodic held-out eval, checkpoints, resume, early stopping. A step whose
gradient is not finite is skipped (its history entry's ``skipped`` names the parameters whose gradient was).

A trainer supplies ``loss_fn(batch) -> (loss, metrics)`` over batches of
examples (``{"input_ids": [T], "loss_mask": [T]}``) and the draft module to
optimise; a metric is a number or a ``Ratio`` (held out, a ratio of totals
over the batches, not a mean of the batches' ratios). A checkpoint
directory holds the draft in its public format (``save_pretrained``) plus ``trainer.pt`` (optimizer, scheduler, step, data
position, RNG states), so an interrupted run resumes to the same state, and
``history.json`` / ``history.png`` (the curves). With ``select`` (a held-out
metric, e.g. "eval_tau"), ``best/`` holds the checkpoint that scored highest,
and ``patience`` evaluations without a new best end the run.

Data order: each epoch shuffles the examples with (seed, epoch), groups
``GROUP`` batches' worth by length (less padding) and shuffles the batches;
the position is (epoch, batch index), so no order has to be stored.
"""
from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple

import torch
from tqdm import tqdm

from ..errors import SettingError


class Ratio(NamedTuple):
    """A metric made of counts, e.g. tokens per step: evaluated over many batches as total / total."""
    numerator: float | torch.Tensor
    denominator: float | torch.Tensor

    def __float__(self) -> float:
        return float(self.numerator) / max(float(self.denominator), 1e-12)


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
    select: str | None = None  # a held-out metric to keep the best checkpoint by (higher is better)
    patience: int | None = None  # evaluations without a new best before stopping (needs select)
    save_dtype: str | None = None  # e.g. "bfloat16": the checkpoint's weights (trainer.pt keeps full precision)
    max_shard_bytes: int | None = None  # split the checkpoint's safetensors (HF index) above this size
    # with a deadline, the cosine ends at the deadline or at ``steps``, whichever comes first (a time-boxed run
    # that stops mid-schedule keeps a learning rate near its peak to the end); see ``decay_progress``
    anneal_to_deadline: bool = False
    # what else shapes the run, compared on resume like the fields above: the target's identity, the loss's
    # settings, the data (the CLI fills it)
    run: dict = field(default_factory=dict)


PAD_MULTIPLE = 64  # few distinct T: kernels that plan per shape (the target's cuDNN attention) plan once per width


def collate(examples: list[dict], pad_id: int = 0) -> dict:
    """Right-pad a batch to a multiple of PAD_MULTIPLE: input_ids [B, T], loss_mask [B, T] (padding
    carries no loss)."""
    width = -(-max(len(e["input_ids"]) for e in examples) // PAD_MULTIPLE) * PAD_MULTIPLE
    ids = torch.full((len(examples), width), pad_id, dtype=torch.int64)
    mask = torch.zeros(len(examples), width, dtype=torch.bool)
    for i, e in enumerate(examples):
        ids[i, : len(e["input_ids"])] = e["input_ids"]
        mask[i, : len(e["loss_mask"])] = e["loss_mask"]
    return {"input_ids": ids, "loss_mask": mask}


GROUP = 32  # batches whose examples are sorted by length together


def epoch_batches(lengths: list[int], batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """One epoch's batches (example indices): shuffled, length-grouped, then the batches shuffled."""
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    order = torch.randperm(len(lengths), generator=g).tolist()
    batches = []
    for start in range(0, len(order), batch_size * GROUP):
        group = sorted(order[start:start + batch_size * GROUP], key=lambda i: lengths[i])
        batches += [group[i:i + batch_size] for i in range(0, len(group), batch_size)]
    return [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]


def lr_lambda(config: TrainConfig, progress: Callable[[], float] | None = None) -> Callable[[int], float]:
    """Linear warm-up, then a cosine over ``progress()`` (default: the steps after warm-up over ``steps``)."""
    def factor(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        done = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, done if progress is None else progress())))

    return factor


def decay_progress(progress: float, steps_done: int, config: TrainConfig, step_seconds: float,
                   seconds_left: float) -> float:
    """How far the cosine is after ``steps_done`` steps when it must end by a deadline ``seconds_left`` away:
    the remaining part shrinks as if every step left took this one's ``step_seconds`` (1 / (remaining steps + 1)
    of it per step, so at a steady pace progress is linear in time and reaches 1 at the deadline), and never
    lags the count (``steps`` still ends it)."""
    if steps_done <= config.warmup_steps:  # the decay starts after the warm-up's last step
        return 0.0
    by_count = (steps_done - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    by_time = 1.0 if seconds_left <= 0 else progress + (1 - progress) * step_seconds / (step_seconds + seconds_left)
    return min(1.0, max(by_count, by_time))


def train(draft: torch.nn.Module, loss_fn, examples: list[dict], config: TrainConfig, out: str | Path,
          eval_examples: list[dict] | None = None, device=None, stop_at: int | None = None,
          deadline: float | None = None) -> list[dict]:
    """Optimise ``draft``'s trainable parameters; returns the logged history. Resumes from ``out``;
    ``stop_at`` (a step) or ``deadline`` (a ``time.time()``) ends this run early, checkpointed, e.g. to
    split a run into time slots; a run the deadline ends has its last weights scored (``select``: kept if best)."""
    from ..cli_io import writable_dir

    out = Path(out)
    device = device or next(draft.parameters()).device
    check_config(config)
    if not examples:
        raise SettingError("no training examples (after the held-out ones were taken): give more data")
    if "loss_mask" in examples[0] and not any(bool(e["loss_mask"].any()) for e in examples):
        raise SettingError("no training example keeps a token with loss (an answer token) within its length: the "
                           "prompts fill it (a longer max_length / --max-length, or shorter conversations)")
    if out.exists() and not out.is_dir():
        raise SettingError(f"out={str(out)!r} is a file: the checkpoint is a directory; pass another path")
    writable_dir(out, "out")  # checkpoints go there: said before the first step, not at the first save
    if config.select is not None:
        _check_select(draft, loss_fn, eval_examples, config.select, device)
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    lengths = [len(e["input_ids"]) for e in examples]
    state = {"step": 0, "history": [], "epoch": 0, "batch": 0, "best": None, "since_best": 0, "progress": 0.0}
    anneal = config.anneal_to_deadline and deadline is not None
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(config, (lambda: state["progress"])
                                                                         if anneal else None))
    state_file = out / "trainer.pt"
    if state_file.is_file():  # resume: draft weights, optimizer, schedule, data position, history
        saved = torch.load(state_file, weights_only=False)
        _check_resumable(saved, config, draft, out)
        draft.load_state_dict(saved["draft"])
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        torch.set_rng_state(saved["torch_rng"])
        state.update({k: saved[k] for k in state if k in saved})
    history = state["history"]
    autocast = _autocast(device)
    bar = tqdm(total=config.steps, initial=state["step"], desc="train")
    last = min(config.steps, stop_at if stop_at is not None else config.steps)
    batches = epoch_batches(lengths, config.batch_size, config.seed, state["epoch"])
    unsaved = False
    tick = time.time()  # when the last step ended (annealing to the deadline paces itself by it)

    def score(entry: dict) -> None:  # the held-out metrics of the weights now, into a history entry
        with autocast:
            entry.update({f"eval_{k}": v for k, v in evaluate(draft, loss_fn, eval_examples, config.batch_size,
                                                               device).items()})
    while state["step"] < last:
        if deadline is not None and time.time() > deadline:
            unsaved = True  # a checkpoint to resume from, even with no step taken
            if eval_examples and history and "eval_loss" not in history[-1]:  # the weights it ends with, scored
                score(history[-1])
                _track_best(draft, history[-1], state, config, out)
            break
        if state["batch"] >= len(batches):
            state["epoch"], state["batch"] = state["epoch"] + 1, 0
            batches = epoch_batches(lengths, config.batch_size, config.seed, state["epoch"])
        chosen = [examples[i] for i in batches[state["batch"]]]
        state["batch"] += 1
        batch = {k: v.to(device) for k, v in collate(chosen).items()}
        draft.train()
        with autocast:
            loss, metrics = loss_fn(batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
        finite = bool(torch.isfinite(grad_norm))
        if finite:  # AdamW would carry one batch's inf/nan gradient into every weight: skip the step
            optimizer.step()
        if anneal:
            now = time.time()
            state["progress"] = decay_progress(state["progress"], state["step"] + 1, config, now - tick,
                                               deadline - now)
            tick = now
        scheduler.step()
        state["step"] += 1
        step = state["step"]
        entry = {"step": step, "epoch": state["epoch"], "loss": loss.item(), "grad_norm": float(grad_norm),
                 "lr": scheduler.get_last_lr()[0], **{k: float(v) for k, v in metrics.items()},
                 **({} if finite else {"skipped": _non_finite_grads(draft)})}
        stop = False
        if eval_examples and (step % config.eval_every == 0 or step == config.steps):
            score(entry)
            stop = _track_best(draft, entry, state, config, out)
        history.append(entry)
        bar.update(1)
        bar.set_postfix(loss=f"{entry['loss']:.3f}", **({"eval_tau": f"{entry['eval_tau']:.2f}"}
                                                        if "eval_tau" in entry else {}))
        unsaved = not (step % config.save_every == 0 or step == last or stop)
        if not unsaved:
            save(draft, optimizer, scheduler, state, config, out)
        if stop:
            break
    if unsaved:  # stopped by the deadline
        save(draft, optimizer, scheduler, state, config, out)
    bar.close()
    return history


def check_config(config: TrainConfig) -> None:
    """Every number of ``config`` in its range, refused naming the field (steps=0 used to train nothing and
    return [], batch_size=0 to fail inside range())."""
    def whole(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    def finite(value) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    for name, least in (("steps", 1), ("batch_size", 1), ("warmup_steps", 0), ("eval_every", 1), ("save_every", 1)):
        value = getattr(config, name)
        if not whole(value) or value < least:
            raise SettingError(f"TrainConfig.{name}={value!r}: a whole number >= {least}")
    for name, above in (("lr", True), ("grad_clip", True), ("weight_decay", False)):
        value = getattr(config, name)
        if not finite(value) or value < 0 or (above and value == 0):
            raise SettingError(f"TrainConfig.{name}={value!r}: a finite number {'>' if above else '>='} 0")
    if not whole(config.seed):
        raise SettingError(f"TrainConfig.seed={config.seed!r}: a whole number")
    if config.patience is not None and (not whole(config.patience) or config.patience < 1):
        raise SettingError(f"TrainConfig.patience={config.patience!r}: a whole number >= 1, or None")
    if config.patience is not None and config.select is None:
        raise SettingError("TrainConfig.patience needs select (the held-out metric to watch)")
    dtype = getattr(torch, config.save_dtype, None) if isinstance(config.save_dtype, str) else None
    if config.save_dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise SettingError(f"TrainConfig.save_dtype={config.save_dtype!r}: a floating torch dtype's name, e.g. "
                           f"'bfloat16', or None")
    if config.max_shard_bytes is not None and (not whole(config.max_shard_bytes) or config.max_shard_bytes < 1):
        raise SettingError(f"TrainConfig.max_shard_bytes={config.max_shard_bytes!r}: a whole number >= 1, or None")


RUN_FIELDS = ("steps", "batch_size", "lr", "weight_decay", "warmup_steps", "grad_clip", "seed",  # shape the run
              "anneal_to_deadline")


def _check_resumable(saved: dict, config: TrainConfig, draft, out: Path) -> None:
    """A checkpoint resumes only the run it came from: the same head and the settings that shape the run
    (a resumed run ends where an uninterrupted one would)."""
    before = saved.get("config", {})
    changed = [f"{f}={before[f]!r} -> {getattr(config, f)!r}" for f in RUN_FIELDS
               if f in before and before[f] != getattr(config, f)]
    saved_run = before.get("run", config.run)  # (a checkpoint from before ``run`` existed: not compared)
    changed += [f"{k}={saved_run.get(k)!r} -> {config.run.get(k)!r}" for k in sorted(set(saved_run) | set(config.run))
                if saved_run.get(k) != config.run.get(k)]
    if changed:
        raise SettingError(f"{out} holds a run with other settings ({', '.join(changed)}): resume with the same "
                           f"ones (split a run with stop_at / --stop-at), or start a new run in another directory")
    mine, theirs = draft.state_dict(), saved["draft"]
    if set(mine) != set(theirs) or any(mine[k].shape != theirs[k].shape for k in mine):
        raise SettingError(f"{out} holds a checkpoint of another head ({len(set(theirs) ^ set(mine))} parameter names "
                           f"differ, or their shapes): train it into another directory")


def _check_select(draft, loss_fn, eval_examples, select: str, device) -> None:
    """Refuse a ``select`` the evaluation will not give before any step is taken (the names from one
    held-out example)."""
    if not eval_examples:
        raise SettingError(f"TrainConfig.select={select!r} needs held-out examples (eval_examples) to evaluate")
    with _autocast(device):
        given = sorted(f"eval_{k}" for k in evaluate(draft, loss_fn, eval_examples[:1], 1, device))
    if select not in given:
        raise SettingError(f"TrainConfig.select={select!r}: the held-out evaluation gives {given} (--select names "
                           f"one of them)")


def _track_best(draft, entry: dict, state: dict, config: TrainConfig, out: Path) -> bool:
    """Keep ``out/best`` at the best ``config.select`` seen; returns: patience ran out."""
    if config.select is None:
        return False
    if config.select not in entry:
        raise KeyError(f"TrainConfig.select={config.select!r}: the evaluation gives {sorted(entry)}")
    value = entry[config.select]
    if state["best"] is None or value > state["best"]["value"]:
        state["best"], state["since_best"] = {"step": entry["step"], "value": value}, 0
        draft.save_pretrained(out / "best", dtype=getattr(torch, config.save_dtype) if config.save_dtype else None,
                              max_shard_bytes=config.max_shard_bytes)
        return False
    state["since_best"] += 1
    return config.patience is not None and state["since_best"] >= config.patience


@torch.no_grad()
def evaluate(draft, loss_fn, examples: list[dict], batch_size: int, device) -> dict[str, float]:
    """The loss and every metric of ``loss_fn`` over batches of ``examples`` (in order): the mean of the
    batches' values, a ``Ratio`` as its totals' ratio."""
    draft.eval()
    sums: dict[str, list[float]] = {}  # name -> [numerator, denominator]
    for i in range(0, len(examples), batch_size):
        loss, metrics = loss_fn({k: v.to(device) for k, v in collate(examples[i:i + batch_size]).items()})
        for k, v in {"loss": loss, **metrics}.items():
            num, den = (float(v.numerator), float(v.denominator)) if isinstance(v, Ratio) else (float(v), 1.0)
            total = sums.setdefault(k, [0.0, 0.0])
            total[0], total[1] = total[0] + num, total[1] + den
    return {k: float(Ratio(num, den)) for k, (num, den) in sums.items()}


def save(draft, optimizer, scheduler, state: dict, config, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    draft.save_pretrained(out, dtype=getattr(torch, config.save_dtype) if config.save_dtype else None,
                          max_shard_bytes=config.max_shard_bytes)
    torch.save({"draft": draft.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "torch_rng": torch.get_rng_state(), **state, "config": asdict(config)}, out / "trainer.pt")
    (out / "history.json").write_text(json.dumps(state["history"]))  # the training log, readable without torch
    plot_history(state["history"], out / "history.png")


def plot_history(history: list[dict], path: str | Path) -> None:
    """Training and held-out loss per step, and every held-out ``tau`` / ``acc`` metric, one PNG."""
    if not history:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    steps = [h["step"] for h in history]
    window = max(1, len(history) // 100)  # a running mean: single batches are noisy
    losses = [h["loss"] for h in history]
    smooth = [sum(losses[max(0, i - window + 1): i + 1]) / len(losses[max(0, i - window + 1): i + 1])
              for i in range(len(losses))]
    left.plot(steps, smooth, label=f"train (mean of {window})")
    evals = [h for h in history if "eval_loss" in h]
    if evals:
        left.plot([h["step"] for h in evals], [h["eval_loss"] for h in evals], "o-", label="held-out")
        for key in ("eval_tau",):
            if key in evals[0]:
                right.plot([h["step"] for h in evals], [h[key] for h in evals], "o-", color="#c44e52")
                right.set(xlabel="step", ylabel="held-out τ (greedy chain)", title="held-out acceptance")
    left.set(xlabel="step", ylabel="loss", title="loss")
    left.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _non_finite_grads(draft: torch.nn.Module) -> list[str]:
    """The parameters whose gradient holds an inf or a nan (where a skipped step's overflow reached)."""
    return [name for name, p in draft.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]


def _autocast(device):
    """bf16 autocast on CUDA (training and evaluation alike); nothing elsewhere."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
