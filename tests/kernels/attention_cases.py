"""Random tree-attention problems and the independent oracle: SDPA run
separately for each query over exactly the keys its root path may see."""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specgraph.kernels.bitmask import ancestor_masks
from specgraph.trees import random_parents


@dataclass
class Case:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cache_len: torch.Tensor
    mask: torch.Tensor
    scale: float
    window: int

    def args(self):
        return self.q, self.k, self.v, self.cache_len, self.mask, self.scale, self.window

    def to(self, **kw):
        f = lambda x: x.to(**kw) if x.is_floating_point() else x.to(device=kw.get("device", x.device))  # noqa: E731
        return Case(f(self.q), f(self.k), f(self.v), f(self.cache_len), f(self.mask), self.scale, self.window)


def tree_masks(rng: random.Random, b: int, r: int, lanes: bool) -> torch.Tensor:
    """[B, R] ancestor masks: verify rows (R tree nodes), or draft lanes (R
    queries, each the tip of a path through a larger window of up to 64 slots)."""
    rows = []
    for _ in range(b):
        if lanes:
            slots = rng.randint(r, 64)
            masks, _ = ancestor_masks(torch.tensor([random_parents(rng, slots)]))
            pick = sorted(rng.sample(range(slots), r))
            rows.append(masks[0, pick])
        else:
            rows.append(ancestor_masks(torch.tensor([random_parents(rng, r)]))[0][0])
    return torch.stack(rows)


def make_case(seed: int, *, b=None, h_kv=None, g=None, d=None, r=None, s_max=None, window=None, lanes=None,
              dtype=torch.float32, poison=True) -> Case:
    rng = random.Random(seed)
    b = b or rng.randint(1, 3)
    h_kv = h_kv or rng.randint(1, 2)
    g = g or rng.choice([1, 2, 3])
    d = d or rng.choice([16, 32, 64])
    r = r or rng.choice([1, 2, 5, 8, 16, rng.randint(1, 64)])
    lanes = rng.random() < 0.3 if lanes is None else lanes
    s_max = s_max or rng.randint(70, 300)
    gen = torch.Generator().manual_seed(seed)
    mask = tree_masks(rng, b, r, lanes)
    depth = max(bin(int(m) & (2**64 - 1)).count("1") - 1 for m in mask.flatten())
    if window is None:
        window = rng.choice([0, 0, rng.randint(depth + 1, depth + 80)])
    cache_len = torch.tensor([rng.randint(0, s_max - 64) for _ in range(b)])
    q = torch.randn(b, h_kv * g, r, d, generator=gen, dtype=torch.float64)
    k = torch.randn(b, h_kv, s_max, d, generator=gen, dtype=torch.float64)
    v = torch.randn(b, h_kv, s_max, d, generator=gen, dtype=torch.float64)
    if poison:  # slots no query may read hold NaN: reading one would show
        bits = ((mask.unsqueeze(-1) >> torch.arange(64)) & 1).any(1)  # [B, 64] window slots in use
        for row in range(b):
            for j in range(64):
                slot = int(cache_len[row]) + j
                if slot < s_max and not bits[row, j]:
                    k[row, :, slot] = float("nan")
                    v[row, :, slot] = float("nan")
    return Case(q, k, v, cache_len, mask, d**-0.5, window).to(dtype=dtype)


def oracle(case: Case) -> torch.Tensor:
    """float64 SDPA per (row, query) over its keys alone."""
    q, k, v = case.q.double(), case.k.double(), case.v.double()
    b, h, r, d = q.shape
    g = h // k.shape[1]
    out = torch.zeros(b, h, r, d, dtype=torch.float64)
    for row in range(b):
        n0 = int(case.cache_len[row])
        for i in range(r):
            m = int(case.mask[row, i]) & (2**64 - 1)
            window_slots = [n0 + j for j in range(64) if (m >> j) & 1]
            q_pos = n0 + len(window_slots) - 1
            prefix = [s for s in range(n0) if case.window == 0 or s > q_pos - case.window]
            keys = torch.tensor(prefix + window_slots, dtype=torch.long)
            kk = k[row, :, keys].repeat_interleave(g, 0)  # [H, n, D]
            vv = v[row, :, keys].repeat_interleave(g, 0)
            out[row, :, i] = F.scaled_dot_product_attention(q[row, :, i : i + 1], kk, vv, scale=case.scale)[:, 0]
    return out
