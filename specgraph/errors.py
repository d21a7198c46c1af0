"""Errors specgraph raises on purpose, and the checked reading of its whole-number settings."""
from __future__ import annotations

import os


class CompileError(Exception):
    """What cannot be supported, refused at compile time with every blocker listed.

    ``blockers`` holds one line per problem, each naming where it is (layer,
    graph node) and, where there is one, the fix.
    """

    def __init__(self, what: str, blockers: list[str]):
        self.blockers = list(blockers)
        lines = "\n".join(f"  - {b}" for b in self.blockers)
        super().__init__(f"{what}: {len(self.blockers)} blocker(s)\n{lines}")


def env_whole_number(name: str, default: int, meaning: str, low: int = 0, high: int | None = None) -> int:
    """The environment variable ``name`` as a whole number in low..high (``default`` when unset or empty);
    anything else is refused naming the variable, what it means and the range."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    if not value.isdigit() or int(value) < low or (high is not None and int(value) > high):
        bound = f"{low}..{high}" if high is not None else f">= {low}"
        raise ValueError(f"{name}={value!r}: give {meaning}, a whole number {bound} (default {default})")
    return int(value)
