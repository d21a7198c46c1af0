"""Speculate or decode plainly, per batch size, by measured cost (``compile(..., policy="measured")``).

Speculation pays while tau * t_plain > t_tree. At a large batch the target step stops being
bound by its weights' bytes, a tree step costs more than a plain one, and speculation can lose.
``MeasuredPolicy`` keeps, per batch size, each mode's measured seconds per generated token (an
exponential average over generate calls, prefill included) and runs the cheaper mode. A mode's
first call at a batch size compiles it and is not measured. Until both modes are measured it
runs whichever is not, and afterwards it tries the other mode again every ``explore_every``
calls, so it notices when acceptance changes (another kind of prompt). Both modes are lossless:
the choice changes speed only.
"""
from __future__ import annotations

from dataclasses import dataclass, field

MODES = ("tree", "plain")


@dataclass
class MeasuredPolicy:
    explore_every: int = 32
    decay: float = 0.5  # weight of the old average when a new measurement comes in
    cost: dict = field(default_factory=dict)  # (batch, mode) -> seconds per generated token
    calls: dict = field(default_factory=dict)  # (batch, mode) -> calls run in that mode
    chosen: dict = field(default_factory=dict)  # batch -> calls decided

    def choose(self, batch: int) -> str:
        """The mode of the next generate call at ``batch`` rows."""
        n = self.chosen.get(batch, 0)
        self.chosen[batch] = n + 1
        unmeasured = [m for m in MODES if (batch, m) not in self.cost]
        if unmeasured:
            return unmeasured[0]
        best = min(MODES, key=lambda m: self.cost[batch, m])
        other = MODES[1 - MODES.index(best)]
        return other if n % self.explore_every == self.explore_every - 1 else best

    def record(self, batch: int, mode: str, seconds: float, tokens: int) -> None:
        """A finished call: ``tokens`` generated (all rows) in ``seconds``."""
        runs = self.calls.get((batch, mode), 0)
        self.calls[batch, mode] = runs + 1
        if runs == 0 or tokens <= 0:  # the first call compiled the mode's step: not a measurement
            return
        per_token = seconds / tokens
        old = self.cost.get((batch, mode))
        self.cost[batch, mode] = per_token if old is None else self.decay * old + (1 - self.decay) * per_token
