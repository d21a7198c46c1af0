"""transformers' stopping criteria over a speculative batch, asked as ``model.generate`` asks them.

``model.generate`` calls its ``StoppingCriteriaList`` once a step on the whole batch, ``[B, T + k]`` at
its k-th new token, finished rows filled with the pad id, and stops the rows whose entry is True; a
criterion may look at several rows or keep state between calls. Under speculation the rows run ahead
of each other by different accepted lengths, so ``BatchStopping`` asks the criteria for step k once
every row still running has its k-th token (rows that ran further are cut back where a criterion
stopped them): the same calls, in the same order, on the same tensors as ``model.generate``.
Without an eos id ``model.generate`` pads nothing: a stopped row goes on generating until every row has
stopped (its tokens are in the output), and so it does here.
"""
from __future__ import annotations

import torch


class BatchStopping:
    """The criteria's frontier over one batch: ``advance`` after each step's tokens are appended.

    ``prefixes``: each row's left padding + prompt (one length T for all rows, as the input batch);
    ``pad``: the id ``model.generate`` writes after a row has finished; ``streamer`` gets row 0's tokens
    as the frontier passes them (a token a criterion later cuts is never streamed).
    """

    def __init__(self, criteria, prefixes: list[list[int]], pad: int, max_new_tokens: int, streamer=None):
        self.criteria, self.prefixes, self.pad = criteria, prefixes, pad
        self.max_new_tokens, self.streamer = max_new_tokens, streamer
        self.steps = 0  # the steps asked so far
        self.finished: list[int | None] = [None] * len(prefixes)  # per row: the step it finished at

    def advance(self, generated: list[list[int]], eos_token_ids: set[int]) -> list[int]:
        """Ask every step whose tokens are all there; returns the rows that finished meanwhile (each
        row's ``generated`` is cut to its finishing step). A row the engine ended (eos or the length)
        has its last token at the step it finishes at."""
        newly: list[int] = []
        pads = bool(eos_token_ids)  # model.generate pads finished rows only when it has an eos id
        while True:
            k = self.steps + 1
            live = [r for r, f in enumerate(self.finished) if f is None]
            needed = live if pads else range(len(generated))  # without padding, every row's token k is shown
            if not live or any(len(generated[r]) < k for r in needed):
                return newly
            rows = [self.prefixes[r] + self._row(generated[r], r, k, pads) for r in range(len(self.prefixes))]
            stop = self.criteria(torch.tensor(rows), None)  # [B] bool, as model.generate's list returns
            stop = stop.reshape(-1).tolist() if isinstance(stop, torch.Tensor) else [bool(stop)] * len(rows)
            if self.streamer is not None and (self.finished[0] is None or not pads):
                self.streamer.put(torch.tensor([generated[0][k - 1]]))
            for r in live:
                if stop[r] or generated[r][k - 1] in eos_token_ids or k >= self.max_new_tokens:
                    self.finished[r] = k
                    if pads:
                        del generated[r][k:]
                        newly.append(r)
            self.steps = k
            if not pads and all(f is not None for f in self.finished):  # every row ends at the last step
                for r, tokens in enumerate(generated):
                    del tokens[k:]
                return list(range(len(generated)))

    def _row(self, tokens: list[int], row: int, k: int, pads: bool) -> list[int]:
        """Row ``row``'s new tokens as model.generate's batch shows them at step k."""
        end = self.finished[row]
        return tokens[:k] if end is None or not pads else tokens[:end] + [self.pad] * (k - end)
