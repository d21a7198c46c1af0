"""The shared training loop: each epoch visits every example once, in an order fixed by (seed,
epoch) and grouped by length; the best checkpoint by a held-out metric is kept and patience
ends the run; a resumed run continues from its data position."""
import json
import math
import re

import pytest
import torch
from torch import nn

from specgraph.errors import SettingError
from specgraph.train.loop import TrainConfig, epoch_batches, train


def test_an_epoch_visits_every_example_once_in_length_groups():
    lengths = [int(x) for x in torch.randint(1, 500, (1000,), generator=torch.Generator().manual_seed(0))]
    batches = epoch_batches(lengths, 8, seed=3, epoch=0)
    assert sorted(i for b in batches for i in b) == list(range(1000))
    assert batches == epoch_batches(lengths, 8, seed=3, epoch=0) != epoch_batches(lengths, 8, seed=3, epoch=1)
    spread = sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in batches) / len(batches)
    shuffled = torch.randperm(1000, generator=torch.Generator().manual_seed(1)).tolist()
    random_spread = sum(max(lengths[i] for i in shuffled[k:k + 8]) - min(lengths[i] for i in shuffled[k:k + 8])
                        for k in range(0, 1000, 8)) / 125
    assert spread < 0.2 * random_spread  # batches of similar lengths: little padding


class Scalar(nn.Module):
    """One weight; its eval metric is scripted by the step the loop evaluates at."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(()))

    def save_pretrained(self, path, dtype=None, max_shard_bytes=None):
        path.mkdir(parents=True, exist_ok=True)
        (path / "w.json").write_text(json.dumps(float(self.w)))


def scripted(draft, taus: dict[int, float], step: list[int], weights: dict | None = None):
    """loss_fn whose held-out tau after training step k is taus[k]; weights[k]: w entering step k."""
    def loss_fn(batch):
        if draft.training:
            step[0] += 1
            if weights is not None:
                weights[step[0]] = float(draft.w)
        return (draft.w - 1.0) ** 2 * batch["input_ids"].shape[0], {"tau": torch.tensor(taus.get(step[0], 0.0))}
    return loss_fn


def test_the_best_checkpoint_is_kept_and_patience_stops_the_run(tmp_path):
    examples = [{"input_ids": torch.ones(3, dtype=torch.int64), "loss_mask": torch.ones(3, dtype=torch.bool)}] * 5
    draft = Scalar()
    taus = {2: 1.5, 4: 2.5, 6: 2.0, 8: 2.25, 10: 3.0}  # exact in float32
    config = TrainConfig(steps=20, batch_size=2, lr=0.1, warmup_steps=1, eval_every=2, save_every=100,
                         select="eval_tau", patience=2)
    weights = {}
    history = train(draft, scripted(draft, taus, [0], weights), examples, config, tmp_path,
                    eval_examples=examples[:1])
    assert history[-1]["step"] == 8  # steps 6 and 8 did not beat step 4's 2.5
    assert [h["eval_tau"] for h in history if "eval_tau" in h] == [1.5, 2.5, 2.0, 2.25]
    assert json.loads((tmp_path / "best" / "w.json").read_text()) == weights[5] != float(draft.w)
    state = torch.load(tmp_path / "trainer.pt", weights_only=False)
    assert state["best"] == {"step": 4, "value": 2.5} and state["step"] == 8
    assert (tmp_path / "history.png").is_file() and json.loads((tmp_path / "history.json").read_text()) == history
    with pytest.raises(ValueError, match="patience needs select"):
        train(draft, scripted(draft, taus, [0]), examples, TrainConfig(patience=1), tmp_path / "x")


def test_settings_the_run_cannot_use_are_refused_before_a_step(tmp_path):
    """A select the evaluation does not give, a select with nothing held out, a learning rate that is not a
    finite positive number: refused before the first step (no checkpoint written)."""
    examples = [{"input_ids": torch.ones(3, dtype=torch.int64), "loss_mask": torch.ones(3, dtype=torch.bool)}] * 5
    draft, steps = Scalar(), [0]
    for config, held, message in [(TrainConfig(steps=2, select="eval_acc"), examples[:1], r"gives \['eval_loss', "
                                   r"'eval_tau'\]"), (TrainConfig(steps=2, select="eval_tau"), None, "needs held-out"),
                                  (TrainConfig(steps=2, lr=float("nan")), None, "lr=nan"),
                                  (TrainConfig(steps=2, lr=0.0), None, "lr=0.0")]:
        with pytest.raises(SettingError, match=message):
            train(draft, scripted(draft, {}, steps), examples, config, tmp_path, eval_examples=held)
    assert steps == [0] and not (tmp_path / "trainer.pt").exists()
    (tmp_path / "file").write_text("")
    with pytest.raises(SettingError, match="is a file"):
        train(draft, scripted(draft, {}, steps), examples, TrainConfig(steps=2), tmp_path / "file")
    with pytest.raises(SettingError, match="no training examples"):
        train(draft, scripted(draft, {}, steps), [], TrainConfig(steps=2), tmp_path / "none")
    no_loss = [{"input_ids": torch.ones(3, dtype=torch.int64), "loss_mask": torch.zeros(3, dtype=torch.bool)}] * 5
    with pytest.raises(SettingError, match="no training example keeps a token with loss"):  # prompts fill max_length
        train(draft, scripted(draft, {}, steps), no_loss, TrainConfig(steps=2), tmp_path / "no-loss")


@pytest.mark.parametrize("field, value", [("steps", 0), ("steps", -1), ("batch_size", 0), ("warmup_steps", -1),
                                          ("eval_every", 0), ("save_every", 2.5), ("grad_clip", 0.0),
                                          ("weight_decay", float("inf")), ("patience", 0), ("save_dtype", "int8"),
                                          ("max_shard_bytes", 0), ("seed", "0")])
def test_every_config_number_out_of_range_is_named(tmp_path, field, value):
    """steps <= 0 used to train nothing and return [], batch_size=0 to fail inside range(): each field is named."""
    examples = [{"input_ids": torch.ones(3, dtype=torch.int64), "loss_mask": torch.ones(3, dtype=torch.bool)}] * 5
    draft, steps = Scalar(), [0]
    config = TrainConfig(**{"steps": 2, "select": "eval_tau" if field == "patience" else None, field: value})
    with pytest.raises(SettingError, match=re.escape(f"TrainConfig.{field}={value!r}")):
        train(draft, scripted(draft, {}, steps), examples, config, tmp_path / "run", eval_examples=examples[:1])
    assert steps == [0] and not (tmp_path / "run").exists()


def test_an_out_that_cannot_be_written_is_refused_before_a_step(tmp_path):
    examples = [{"input_ids": torch.ones(3, dtype=torch.int64), "loss_mask": torch.ones(3, dtype=torch.bool)}] * 5
    draft, steps = Scalar(), [0]
    (tmp_path / "file").write_text("")
    with pytest.raises(SettingError, match=r"out '.*file/run' cannot be written"):  # its folder is a file
        train(draft, scripted(draft, {}, steps), examples, TrainConfig(steps=2), tmp_path / "file" / "run")
    assert steps == [0]


def test_a_checkpoint_resumes_only_its_own_run(tmp_path):
    """Other run-shaping settings, or another head, in the same directory are refused (they used to be
    overridden by the saved optimizer and schedule, or fail in load_state_dict); logging settings may change."""
    examples = [{"input_ids": torch.ones(3, dtype=torch.int64), "loss_mask": torch.ones(3, dtype=torch.bool)}] * 5
    config = TrainConfig(steps=4, batch_size=2, lr=0.1, warmup_steps=1, save_every=2)
    draft = Scalar()
    train(draft, scripted(draft, {}, [0]), examples, config, tmp_path, stop_at=2)
    for changed in (dict(lr=1e-6), dict(batch_size=4), dict(steps=8), dict(anneal_to_deadline=True)):
        with pytest.raises(SettingError, match=f"{next(iter(changed))}=.* -> "):
            train(draft, scripted(draft, {}, [0]), examples, TrainConfig(**{**config.__dict__, **changed}), tmp_path)
    # what TrainConfig.run names (the CLI: the target's identity, the loss's settings, the data): the same
    with pytest.raises(SettingError, match="ttt_steps=None -> 5"):
        train(draft, scripted(draft, {}, [0]), examples, TrainConfig(**{**config.__dict__, "run": {"ttt_steps": 5}}),
              tmp_path)

    class Other(Scalar):
        def __init__(self):
            super().__init__()
            self.v = nn.Parameter(torch.zeros(()))
    with pytest.raises(SettingError, match="another head"):
        train(Other(), scripted(draft, {}, [0]), examples, config, tmp_path)
    history = train(draft, scripted(draft, {}, [0]), examples, TrainConfig(**{**config.__dict__, "save_every": 4}),
                    tmp_path)
    assert history[-1]["step"] == 4


def test_evaluate_takes_a_ratio_metric_as_the_ratio_of_its_totals():
    """Batches of 3 and 1 examples: a Ratio of counts (tokens per step) is total / total over the held-out
    set; a plain number is the mean of the batches' values (the negative control: they differ)."""
    from specgraph.train.loop import Ratio, evaluate

    def loss_fn(batch):
        rows = batch["input_ids"].shape[0]
        tokens, steps = (3 * rows, rows) if rows == 3 else (1, 1)  # 3 tokens a step, then 1
        return torch.tensor(0.0), {"tau": Ratio(torch.tensor(tokens), torch.tensor(steps)),
                                   "tau_mean": torch.tensor(tokens / steps)}

    examples = [{"input_ids": torch.ones(2, dtype=torch.int64), "loss_mask": torch.ones(2, dtype=torch.bool)}] * 4
    out = evaluate(Scalar(), loss_fn, examples, batch_size=3, device=torch.device("cpu"))
    assert out["tau"] == pytest.approx(10 / 4)
    assert out["tau_mean"] == pytest.approx((3 + 1) / 2)
    assert float(Ratio(0, 0)) == 0.0  # no steps: no division error


def test_a_step_with_a_non_finite_gradient_is_skipped_not_taken(tmp_path):
    """A batch whose gradient is inf/nan leaves the weight as it was (and the history says so); the
    steps around it train as usual. Control: the finite steps do move the weight."""
    examples = [{"input_ids": torch.ones(3, dtype=torch.int64), "loss_mask": torch.ones(3, dtype=torch.bool)}] * 4
    draft, step, weights = Scalar(), [0], {}

    def loss_fn(batch):
        step[0] += 1
        weights[step[0]] = float(draft.w)
        scale = float("inf") if step[0] == 3 else 1.0  # step 3: an overflowing batch
        return (draft.w - 1.0) ** 2 * scale, {}

    config = TrainConfig(steps=5, batch_size=2, lr=0.1, warmup_steps=1, eval_every=100, save_every=100)
    history = train(draft, loss_fn, examples, config, tmp_path)
    assert [h.get("skipped", []) for h in history] == [[], [], ["w"], [], []]  # the parameter it reached
    assert all(math.isfinite(w) for w in weights.values()) and math.isfinite(float(draft.w))
    assert weights[4] == weights[3] != weights[2]  # step 3 changed nothing; step 2 did
    assert weights[5] != weights[4]


class Clock:
    """time.time for the loop: a training step takes one second (the loss function advances it)."""

    def __init__(self):
        self.now = 1000.0

    def time(self) -> float:
        return self.now


def test_annealing_to_the_deadline_ends_the_cosine_when_the_time_does(tmp_path, monkeypatch):
    """20 one-second steps fit before the deadline of a 1,000-step schedule: annealed, the learning rate falls
    with the time left and reaches 0 at the deadline; by the count (the control) it is still ~0.99 of its peak.
    Either way the weights the run ends with are scored, and kept as best if they are."""
    import specgraph.train.loop as loop

    clock = Clock()
    monkeypatch.setattr(loop, "time", clock)
    examples = [{"input_ids": torch.ones(3, dtype=torch.int64), "loss_mask": torch.ones(3, dtype=torch.bool)}] * 5
    lrs = {}
    for anneal in (True, False):
        draft, step = Scalar(), [0]

        def loss_fn(batch, draft=draft, step=step):
            if draft.training:
                step[0] += 1
                clock.now += 1.0
            return (draft.w - 1.0) ** 2, {"tau": torch.tensor(float(step[0]))}  # the latest weights score best

        config = TrainConfig(steps=1000, batch_size=2, lr=0.1, warmup_steps=2, eval_every=8, save_every=1000,
                             select="eval_tau", anneal_to_deadline=anneal)
        history = train(draft, loss_fn, examples, config, tmp_path / str(anneal), eval_examples=examples[:1],
                        deadline=clock.now + 20)
        assert history[-1]["step"] == 21  # stopped by the deadline (checked before each step), not by the count
        lrs[anneal] = [h["lr"] for h in history]
        assert history[-1]["eval_tau"] == 21  # the last weights scored at the deadline, not only at step 16
        best = torch.load(tmp_path / str(anneal) / "trainer.pt", weights_only=False)["best"]
        assert best == {"step": 21, "value": 21}
    annealed, counted = lrs[True], lrs[False]
    assert annealed[:2] == counted[:2]  # the warm-up is the same
    assert all(a >= b for a, b in zip(annealed[1:], annealed[2:]))  # falls, and only after the warm-up
    assert annealed[19] == 0.0 and annealed[9] == pytest.approx(0.1 * 0.5 * (1 + math.cos(math.pi * 8 / 18)))
    assert min(counted[2:]) > 0.099  # the control: by the count, 21 of 1,000 steps leave it near its peak


def test_decay_progress_is_linear_in_time_at_a_steady_pace_and_never_lags_the_count():
    from specgraph.train.loop import decay_progress

    config = TrainConfig(steps=100, warmup_steps=10)
    progress, trail = 0.0, []
    for done in range(1, 41):  # one second a step, the deadline 30 s after the warm-up
        progress = decay_progress(progress, done, config, 1.0, max(0.0, 40.0 - done))
        trail.append(progress)
    assert trail[:10] == [0.0] * 10  # no decay during the warm-up
    assert trail[9:] == pytest.approx([(done - 10) / 30 for done in range(10, 41)])
    assert decay_progress(0.0, 95, config, 1.0, 1e9) == pytest.approx(85 / 90)  # far deadline: the count rules
    assert decay_progress(0.2, 50, config, 5.0, 0.0) == 1.0  # the deadline passed
