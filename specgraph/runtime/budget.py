"""How much to speculate, from a table of step costs and the acceptance the draft is getting
(``compile(..., policy="cost")``).

A mode's tokens per second is τ / (seconds per target step). The two factors vary on different
axes, so they are estimated apart:

- The step cost depends on the hardware, the model, the draft, the dtype, the batch size and the
  tree, not on the text. ``CostTable`` measures it once per (device, model, draft, dtype, backend,
  batch, tree) and keeps it on disk, so a new process starts knowing it (no trial calls).
- τ depends on the text. Plain decoding's is 1. A speculating mode's is an exponential average over
  the latest calls that ran it; a chain that has not run yet is predicted from the tree's per-depth
  acceptance (an estimate either way: a DynamicTree may drop the chain's deeper nodes; replaced by the
  chain's own figure once it runs). A smaller budget of a DynamicTree (the same steps and topk,
  fewer nodes: ``budgets``) needs no run of its own to be known: it keeps the first N' - 1 of the
  same ranked candidates, so from each step of a larger one the host knows what it would have
  accepted (``budget_taus``: exact for greedy verification, whose accepted path in the smaller tree is
  the prefix of the larger tree's that it kept; an estimate when sampling). A larger budget is
  predicted from the draft's own confidence, which every DynamicTree step reports for every budget
  (``Tree.confidence``: EAGLE-2's expected accepted nodes over the best N' - 1 candidates), calibrated
  by what the running budget accepted (``confidence_taus``), so the policy can move up the ladder
  without trial runs.

``CostPolicy.choose`` runs the mode with the most expected tokens per second. A mode whose cost at
this batch is unknown runs first (its first call compiles, the next one is timed). A speculating mode
whose τ is only predicted (a chain from the tree's per-depth acceptance, a larger budget from the
draft's confidence) and whose predicted rate comes within ``trial_within`` of the leader's runs once
to be observed: a prediction can err both ways (a DynamicTree may drop the deeper nodes of the chain
it predicts), and one call of a near-leader costs little against settling on the wrong mode. While another
mode leads, the speculating modes are re-run now and then to refresh their τ (after
``explore_every`` calls, doubling while the leader holds, up to ``max_explore_every``; further apart
where the mode next in turn is slow: a refresh costs 1 - its rate / the leader's of a call, and they
are spaced to cost at most ``explore_share`` of the time): plain decoding by itself says nothing
about how predictable the text has become. Every mode is lossless:
the choice changes speed only.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import tempfile
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from ..trees import CONFIDENCE_BUDGETS

log = logging.getLogger(__name__)


def cost_key(model, draft, backend: str, tree) -> str:
    """What a step's cost depends on besides batch and mode: the device, the model's architecture and
    shapes (its config), its dtype, the draft's kind and tensor shapes, the backend, and the compiled
    tree (the modes' names, "tree", "chain", "tree16", stand for trees derived from it)."""
    import torch

    param = next(model.parameters())
    device = torch.cuda.get_device_name(param.device) if param.device.type == "cuda" else param.device.type
    config = json.dumps(model.config.to_dict(), sort_keys=True, default=str)
    shapes = json.dumps([(k, list(v.shape)) for k, v in draft.state_dict().items()]) \
        if isinstance(draft, torch.nn.Module) else repr(vars(draft))
    model_digest = hashlib.sha256(config.encode()).hexdigest()[:16]
    draft_digest = hashlib.sha256(shapes.encode()).hexdigest()[:16]
    return f"{device}|{type(model).__name__}:{model_digest}|{param.dtype}|{draft.kind}:{draft_digest}|{backend}|{tree}"


class CostTable:
    """Seconds per target step, per (key, batch, mode), in one JSON file (atomic writes; an unreadable
    file is set aside with a warning and measured again, never trusted)."""

    def __init__(self, path: str | os.PathLike, key: str):
        self.path, self.key = Path(path), key
        self.costs: dict[tuple[int, str], float] = {}
        try:
            saved = json.loads(self.path.read_text()).get(key, {}) if self.path.is_file() else {}
            for name, seconds in saved.items():
                batch, _, mode = name.partition("/")
                self.costs[int(batch), mode] = float(seconds)
        except (OSError, ValueError, AttributeError) as err:
            log.warning("step-cost table %s unreadable (%s): measuring again", self.path, err)
            self.costs = {}

    def get(self, batch: int, mode: str) -> float | None:
        return self.costs.get((batch, mode))

    def put(self, batch: int, mode: str, seconds: float, persist: bool = True) -> None:
        self.costs[batch, mode] = seconds
        if persist:
            self._write()

    def _write(self) -> None:
        try:
            data = json.loads(self.path.read_text()) if self.path.is_file() else {}
            if not isinstance(data, dict):
                data = {}
        except (OSError, ValueError):
            data = {}
        data[self.key] = {f"{b}/{m}": s for (b, m), s in sorted(self.costs.items())}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".costs-")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1)
            os.replace(tmp, self.path)
        except OSError as err:  # a read-only cache: the table still serves this process
            log.warning("step-cost table %s not written (%s)", self.path, err)


def budget_taus(accepted_ranks: list[list[list[int]]], accept_lens: list[list[int]], tau: float,
                budgets) -> dict[int, float]:
    """τ per node budget N' of the same DynamicTree draft, from one call's steps: a step that accepted
    drafted nodes of ranks r_1 < r_2 < ... (their path order; ``Tree.rank``) commits 1 + #{r_i < N' - 1}
    in the budget's tree. Scaled to the call's own ``tau`` (tokens per step: the last step of a row may
    commit fewer than it accepted), so the running budget's figure is ``tau`` itself."""
    accepted = sum(n for step in accept_lens for n in step)
    if accepted == 0:
        return {}
    out = {}
    for nodes in budgets:
        kept = sum(1 + sum(r < nodes - 1 for r in ranks)
                   for step, lens in zip(accepted_ranks, accept_lens) for ranks, n in zip(step, lens) if n > 0)
        out[nodes] = tau * kept / accepted
    return out


def confidence_at(confidence: list[float], nodes: int) -> float:
    """A tree's confidence row (``Tree.confidence``, at CONFIDENCE_BUDGETS) at any budget ``nodes``:
    linear between the budgets it was given at (the sum over ranks is piecewise linear in between, to
    within one candidate's probability)."""
    budgets = CONFIDENCE_BUDGETS[: len(confidence)]
    if nodes <= budgets[0]:
        return confidence[0] * (nodes - 1) / (budgets[0] - 1)
    for (lo, c_lo), (hi, c_hi) in zip(zip(budgets, confidence), zip(budgets[1:], confidence[1:])):
        if nodes <= hi:
            return c_lo + (c_hi - c_lo) * (nodes - lo) / (hi - lo)
    return confidence[-1]


def mean_confidence(confidence: list[list[list[float]]], accept_lens: list[list[int]]) -> list[float] | None:
    """A call's ``Tree.confidence`` rows averaged over its live row-steps (None: a tree that reports none)."""
    rows = [conf for step, lens in zip(confidence, accept_lens) for conf, n in zip(step, lens) if n > 0 and conf]
    return [sum(col) / len(rows) for col in zip(*rows)] if rows else None


def confidence_taus(confidence: list[list[list[float]]], accept_lens: list[list[int]], tau: float, running: int,
                    budgets) -> dict[int, float]:
    """τ per node budget N' of the same DynamicTree draft predicted from the draft's own confidence
    (``Tree.confidence``) over one call's steps: the accepted drafted nodes scale as the draft's
    expected ones do, calibrated by what the running budget (``running`` nodes) accepted: τ(N') =
    1 + (τ - 1) · conf(N') / conf(running). For budgets larger than the running one (smaller ones
    are known exactly: ``budget_taus``)."""
    mean = mean_confidence(confidence, accept_lens)
    if mean is None:
        return {}
    base = confidence_at(mean, running)
    if base <= 0:
        return {}
    return {nodes: 1 + (tau - 1) * confidence_at(mean, nodes) / base for nodes in budgets}


def chain_tau(position_rate: tuple[float, ...], depth: int) -> float:
    """τ of a chain ``depth`` deep predicted from a deeper draft's per-depth acceptance:
    1 + the share of steps that accepted depth 1, 2, ..., ``depth``."""
    return 1.0 + sum(position_rate[:depth])


@dataclass
class CostPolicy:
    """``modes``: name -> chain depth (0: plain decoding; None: the tree, whose τ is only observed).
    ``table``: the step costs, shared across processes. ``budgets``: name -> nodes of the modes that are
    one DynamicTree at several node budgets (the tree included): each one's τ is known from any run of
    a larger one (``budget_taus``)."""

    modes: dict
    table: CostTable
    budgets: dict = field(default_factory=dict)
    max_tau: dict = field(default_factory=dict)  # mode -> its deepest path + 1: no step commits more
    explore_every: int = 8
    trial_within: float = 0.9  # a never-run mode predicted at this share of the leader's rate runs once
    max_explore_every: int = 256
    explore_share: float = 0.02  # refreshes spaced so that they cost at most this share of the time (_gap)
    decay: float = 0.5  # weight of the old τ or cost when a new measurement comes in
    tau: dict = field(default_factory=dict)  # mode -> expected tokens per step
    rates: tuple = ()  # the deepest speculating mode's latest per-depth acceptance
    budget_tau: dict = field(default_factory=dict)  # nodes -> τ a budget would have had (budget_taus)
    calls: dict = field(default_factory=dict)  # (batch, mode) -> calls run in this process (as MeasuredPolicy)
    chosen: dict = field(default_factory=dict)  # batch -> calls decided (as MeasuredPolicy)
    interval: dict = field(default_factory=dict)  # batch -> calls between refreshes while another mode leads
    next_refresh: dict = field(default_factory=dict)  # batch -> the call index of the next refresh
    leader: dict = field(default_factory=dict)  # batch -> the best mode when last decided
    refreshes: dict = field(default_factory=dict)  # batch -> refreshes made (which mode is next)
    saved: dict = field(default_factory=dict)  # (batch, mode) -> the cost last written to the table's file
    observed: set = field(default_factory=set)  # (batch, mode) whose τ a call measured (its own or a larger budget's)
    history: deque = field(default_factory=lambda: deque(maxlen=4096))  # per call: mode, τ, draft confidence

    def expected_tau(self, mode: str) -> float | None:
        depth = self.modes[mode]
        if depth == 0:
            return 1.0
        if mode in self.tau:
            return self.tau[mode]
        if mode in self.budgets:
            return self.budget_tau.get(self.budgets[mode])
        return None if depth is None or not self.rates else chain_tau(self.rates, depth)

    def rate(self, batch: int, mode: str) -> float | None:
        """Expected tokens per second per row; None while τ or the cost is unknown."""
        tau, cost = self.expected_tau(mode), self.table.get(batch, mode)
        return None if tau is None or cost is None else tau / cost

    def upper_rate(self, batch: int, mode: str) -> float | None:
        """The most tokens per second ``mode`` could give (every node of its deepest path accepted)."""
        cost = self.table.get(batch, mode)
        return None if cost is None or mode not in self.max_tau else self.max_tau[mode] / cost

    def choose(self, batch: int) -> str:
        n = self.chosen.get(batch, 0)
        self.chosen[batch] = n + 1
        rates = {m: self.rate(batch, m) for m in self.modes}
        known = {m: r for m, r in rates.items() if r is not None}
        upper = {m: self.upper_rate(batch, m) or float("inf") for m in self.modes}  # inf: no bound known
        # a mode that could not beat a known rate even if it accepted every node is never run for its τ
        hopeless = {m for m in self.modes if known and upper[m] < max(known.values())}
        unknown = [m for m in self.modes if m not in known and m not in hopeless]
        speculating = [m for m in unknown if self.modes[m] != 0]
        if unknown:  # measure first: the speculating modes, the most promising at best first, then the rest
            return max(speculating, key=upper.get) if speculating else unknown[0]
        best = max(known, key=known.get)
        trial = [m for m in known if self.modes[m] != 0 and (batch, m) not in self.observed and m not in hopeless
                 and known[m] >= self.trial_within * known[best]]
        if trial:  # close enough to lead and never seen: find out
            return max(trial, key=known.get)
        refresh = [m for m in self.modes if self.modes[m] != 0 and m != best and m not in hopeless]
        if self.leader.get(batch) != best:
            self.leader[batch], self.interval[batch] = best, self.explore_every
            self.next_refresh[batch] = n + self._gap(batch, known, best, refresh)
        if n < self.next_refresh[batch]:
            return best
        # refresh the τ of a speculating mode that is not leading, in turn
        self.interval[batch] = min(2 * self.interval[batch], self.max_explore_every)
        if not refresh:
            self.next_refresh[batch] = n + self.interval[batch]
            return best
        self.refreshes[batch] = self.refreshes.get(batch, 0) + 1
        self.next_refresh[batch] = n + self._gap(batch, known, best, refresh)
        return refresh[self.refreshes[batch] % len(refresh)]

    def _gap(self, batch: int, known: dict, best: str, refresh: list) -> int:
        """Calls until the next refresh: the interval, or more where the mode next in turn is slow enough that
        refreshing it that often would spend more than ``explore_share`` of the time (a refresh costs 1 - its
        rate / the leader's of a call): near-ties are refreshed often, far losers seldom."""
        if not refresh:
            return self.interval[batch]
        mode = refresh[(self.refreshes.get(batch, 0) + 1) % len(refresh)]
        loss = 1.0 - min(known.get(mode, 0.0) / known[best], 1.0)
        return min(max(self.interval[batch], math.ceil(loss / self.explore_share)), self.max_explore_every)

    def record(self, batch: int, mode: str, seconds: float | None, steps: int, tau: float,
               position_rate: tuple[float, ...], budget_tau: dict | None = None,
               confidence: list[float] | None = None) -> None:
        """A finished call: ``steps`` target steps in ``seconds`` (None: not a timing, a call run uncompiled while
        its bucket compiles: its τ counts, its cost does not), ``tau`` tokens per step; ``budget_tau``:
        what the other budgets of a DynamicTree mode would have had (the smaller ones exactly, ``budget_taus``;
        the larger ones predicted from the draft's confidence, ``confidence_taus``); ``confidence``: its
        ``mean_confidence`` (in ``history``: the expected accepted nodes at the widest budget given)."""
        self.history.append(dict(batch=batch, mode=mode, tau=tau, confidence=confidence[-1] if confidence else None))
        runs = self.calls.get((batch, mode), 0)
        self.calls[batch, mode] = runs + 1
        if self.modes[mode] != 0 and steps > 0:
            self.observed.add((batch, mode))
            old = self.tau.get(mode)
            self.tau[mode] = tau if old is None else self.decay * old + (1 - self.decay) * tau
            if self.modes[mode] is None and self.budgets.get(mode, 0) == max(self.budgets.values(), default=0):
                self.rates = tuple(position_rate)  # the (largest) tree: its per-depth acceptance predicts the chains
            for nodes, figure in (budget_tau or {}).items():
                if nodes != self.budgets.get(mode):  # the other budgets; a mode's own τ is its own run's
                    old = self.budget_tau.get(nodes)
                    self.budget_tau[nodes] = figure if old is None else self.decay * old + (1 - self.decay) * figure
                    for other, n in self.budgets.items():  # their own figures age out: the text moved on
                        if n == nodes:
                            self.tau.pop(other, None)
                            if nodes < self.budgets.get(mode, 0):  # a smaller budget's τ is measured, not predicted
                                self.observed.add((batch, other))
        if runs == 0 or steps == 0 or seconds is None:  # the first call in a process may compile: not a measurement
            return
        per_step = seconds / steps
        old = self.table.get(batch, mode)
        if old is None:
            log.info("step cost at batch %d, %s: %.3g ms", batch, mode, 1e3 * per_step)
        new = per_step if old is None else self.decay * old + (1 - self.decay) * per_step
        saved = self.saved.get((batch, mode))
        # written when first measured and when it has moved by a tenth since: not a file write per call
        persist = saved is None or abs(new - saved) > 0.1 * saved
        self.table.put(batch, mode, new, persist=persist)
        if persist:
            self.saved[batch, mode] = new
