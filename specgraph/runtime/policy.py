"""Speculate with the tree, with a smaller one, or decode plainly, per batch size, by measured cost
(``compile(..., policy="measured")``).

Speculation pays while tau * t_plain > t_tree. At a large batch the target step stops being
bound by its weights' bytes, a tree step costs more than a plain one, and a big tree can lose
while a small one still wins (on the H200, an 8B target at batch 64 with 4 tokens accepted per
step: a DynamicTree(4, 4, 16) at 0.58x plain decoding's tokens/s, a Chain(4) at 1.85x).
``MeasuredPolicy`` keeps, per batch size, each mode's measured seconds per generated token (an
exponential average over generate calls, prefill included) and runs the cheapest mode. The modes
are the caller's (``SpecModel``: the tree, a chain as deep as the tree, plain decoding). A mode's
first call at a batch size compiles it and is not measured. Until every mode is measured it runs
the first that is not; afterwards it retries the others in turn, so it notices when acceptance
changes (another kind of prompt): first after ``explore_every`` calls, then at twice the interval
each time a retry confirms the leader (up to ``max_explore_every``), back to ``explore_every``
when the leader changes. So the calls spent in a slower mode fall to about 1 in
``max_explore_every``. Every mode is lossless: the choice changes speed only.
"""
from __future__ import annotations

from dataclasses import dataclass, field

MODES = ("tree", "plain")


@dataclass
class MeasuredPolicy:
    modes: tuple = MODES  # in the order they are first tried
    explore_every: int = 32
    max_explore_every: int = 1024
    decay: float = 0.5  # weight of the old average when a new measurement comes in
    cost: dict = field(default_factory=dict)  # (batch, mode) -> seconds per generated token
    calls: dict = field(default_factory=dict)  # (batch, mode) -> calls run in that mode
    chosen: dict = field(default_factory=dict)  # batch -> calls decided
    interval: dict = field(default_factory=dict)  # batch -> calls between retries of the other mode now
    next_retry: dict = field(default_factory=dict)  # batch -> the call index of the next retry
    leader: dict = field(default_factory=dict)  # batch -> the cheaper mode when last decided
    retrying: dict = field(default_factory=dict)  # batch -> (the leader a retry in flight tests, its call index)
    retries: dict = field(default_factory=dict)  # batch -> retries made (which challenger is next)

    def choose(self, batch: int) -> str:
        """The mode of the next generate call at ``batch`` rows."""
        n = self.chosen.get(batch, 0)
        self.chosen[batch] = n + 1
        unmeasured = [m for m in self.modes if (batch, m) not in self.cost]
        if unmeasured:
            return unmeasured[0]
        best = self._cheapest(batch)
        if self.leader.get(batch) != best:  # the first leader, or a new one by its own calls: retries start over
            self.leader[batch], self.interval[batch] = best, self.explore_every
            self.next_retry[batch] = n + self.explore_every
        if n < self.next_retry[batch]:
            return best
        self.retrying[batch] = (best, n)
        challengers = [m for m in self.modes if m != best]
        k = self.retries.get(batch, 0)
        self.retries[batch] = k + 1
        return challengers[k % len(challengers)]

    def _cheapest(self, batch: int) -> str:
        return min(self.modes, key=lambda m: self.cost[batch, m])

    def record(self, batch: int, mode: str, seconds: float, tokens: int) -> None:
        """A finished call: ``tokens`` generated (all rows) in ``seconds``."""
        runs = self.calls.get((batch, mode), 0)
        self.calls[batch, mode] = runs + 1
        if runs > 0 and tokens > 0:  # the first call compiled the mode's step: not a measurement
            per_token = seconds / tokens
            old = self.cost.get((batch, mode))
            self.cost[batch, mode] = per_token if old is None else self.decay * old + (1 - self.decay) * per_token
        if batch in self.retrying:  # a retry came back: the leader held (back off) or lost (start over)
            incumbent, at = self.retrying.pop(batch)
            best = self._cheapest(batch)
            self.interval[batch] = (min(2 * self.interval[batch], self.max_explore_every) if best == incumbent
                                    else self.explore_every)
            self.leader[batch], self.next_retry[batch] = best, at + self.interval[batch]
