"""Errors specgraph raises on purpose."""
from __future__ import annotations


class CompileError(Exception):
    """What cannot be supported, refused at compile time with every blocker listed.

    ``blockers`` holds one line per problem, each naming where it is (layer,
    graph node) and, where there is one, the fix.
    """

    def __init__(self, what: str, blockers: list[str]):
        self.blockers = list(blockers)
        lines = "\n".join(f"  - {b}" for b in self.blockers)
        super().__init__(f"{what}: {len(self.blockers)} blocker(s)\n{lines}")


class CheckpointError(ValueError):
    """A checkpoint (a draft's weights or config, a target's files) that cannot be loaded as what it was passed
    for: damaged, of another layout or model, or wrongly typed. The message names the file or directory and, where
    it can, the key. (A ValueError, as loaders raised before it existed; the CLI prints it without a traceback.)"""


class SettingError(ValueError):
    """A setting refused before any work is done, the message naming it and the fix (the CLI prints
    it without a traceback)."""
