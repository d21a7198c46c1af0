"""Programmatic dependent launch (PDL, Hopper and later; ``config.pdl``, on with the L2 prefetch by default).

A kernel launched with it may start while the kernel ahead of it on the stream still runs. Contract for
every kernel launched so: it runs ``griddepcontrol.wait`` (``tl.extra.cuda.gdc_wait``) before it reads
anything a kernel before it wrote and before it writes anything; before the wait it may only read what
no kernel writes (weights). It calls ``gdc_launch_dependents`` once its own main loop is done, which lets
the next such kernel launch early. Since each waits for the one before it to end, and that one waited for
its own predecessor, the stream's order holds. tests/kernels/test_pdl.py checks the order in the PTX.
"""
from __future__ import annotations

import functools

import torch

from .. import config


@functools.lru_cache(maxsize=None)
def _hopper_or_later(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_launch(device: torch.device) -> bool:
    """Whether a kernel on ``device`` launches with PDL now (``config.pdl`` on, CUDA, compute capability 9+)."""
    return device.type == "cuda" and config.pdl != "off" and _hopper_or_later(device.index or 0)


def pdl_kwargs(pdl: bool, **constexprs) -> dict:
    """The launch's keyword arguments: ``PDL=True``, Triton's ``launch_pdl`` and ``constexprs``; none without."""
    return dict(PDL=True, launch_pdl=True, **constexprs) if pdl else {}
