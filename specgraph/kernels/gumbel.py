"""Seeded sampling: counter-based noise keyed by (seed, row, position, token), and the tree verdict
that makes speculative sampling emit exactly the tokens plain sampling emits with the same seed.

Contract
  stream_keys(seed, batch) -> [B, 2] int64   row r's stream: the 32-bit halves of mix(seed, r)
  seeded_exponentials(keys [B, 2], positions [B, P], vocab V) -> [B, P, V] float32
      E = -log u, u in (0, 1) a function of (keys[b], positions[b, p], v) ONLY: the same on every
      call, device and backend (the hash is integer arithmetic kept below 2**49 in int64, so nothing
      overflows; u takes the hash's top 24 bits: (h + 1/2) / 2**24, exact in float32).
  seeded_draws(probs [B, N, V], keys, positions [B, N]) -> [B, N]
      argmax_v probs[b, n, v] / E(keys[b], positions[b, n], v): the exponential race, i.e.
      Gumbel-max argmax_v log p_v + g_v with g = -log(-log u); token v wins with probability p_v.
  verify_seeded(tokens, parents, mask, target_probs, max_depth, keys, base) -> Acceptance
      node n (depth d) predicts the token at absolute position base + d + 1; its draw is
      seeded_draws at that position, so every node at one depth shares one noise vector (it is
      keyed by position, never by node). A child is accepted iff it drafted its parent's draw
      (the first such sibling); the bonus is the draw at the deepest accepted node.

Why it is plain sampling, token for token: walking from the root, the node on the accepted path at
depth d has the emitted prefix as its root path, so its draw is argmax_v p(v | prefix) / E(seed, row,
base + d + 1, v): exactly the token plain decoding (one node a step) draws at that position with the
same seed. Whatever the tree or draft, only how many of those tokens one step commits changes. Across
seeds the noise at distinct positions is independent, so the output is the target's distribution
(the 24-bit u biases a token's probability by at most ~1e-7 relative).

Coupled drafts (``coupled_scores``): since the noise is a function of the position, a draft can read it
before the target does. A draft that ranks its candidates for position t by log q(v) / T + g_t(v) (q: its
own distribution, at the sampling temperature) instead of log q(v) proposes, as its best candidate, its
own Gumbel-max sample with the target's noise, which is the target's draw wherever q and p agree on it: a
child is accepted with probability P(argmax log p + g = argmax log q + g) >= (1 - TV) / (1 + TV) (TV the
total variation between p and q; Daliri et al., 2024) instead of p(argmax q). Nothing on the target's side
changes, so the output is still plain sampling's, token for token.

Cost per step: B * (D + 1) * V hashes (about 20 int64 ops each: two 32-bit mixes, each of two
split multiplies) for the D + 1 positions of a depth-D tree, then one gather, divide and argmax over
[B, N, V] -- what ``sample_categorical`` spends on its float64 exponentials today. Fused by inductor
no [B, *, V] intermediate is stored; eagerly the int64 temporaries are ~10 passes over B * (D+1) * V *
8 bytes (B = 1, D = 7, V = 262k: ~17 MB each).
"""
from __future__ import annotations

import numbers

import torch

from .bitmask import mask_to_matrix
from .verify import Acceptance, _check_tree, verify_draws

M32 = 0xFFFFFFFF
_MUL_A, _MUL_B = 0x7FEB352D, 0x846CA68B  # lowbias32 (C. Wellons, hash-prospector)
_SALT_ROW, _SALT_POSITION, _SALT_TOKEN = 0x9E3779B9, 0x85EBCA6B, 0xC2B2AE35


def check_seed(seed) -> int:
    """``seed`` as an int in [0, 2**64); anything else is refused by name."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= int(seed) < 2**64:
        raise ValueError(f"seed={seed!r}: an int in [0, 2**64) (e.g. seed=1234), or None for unseeded sampling")
    return int(seed)


# ----------------------------------------------------------------------------- implementation (torch int ops)
def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32): the constant split in 16-bit halves, every product < 2**48."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & M32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 tensors holding 32-bit values: a bijection of [0, 2**32) with good avalanche."""
    x = x ^ (x >> 16)
    x = _mul32(x, _MUL_A)
    x = x ^ (x >> 15)
    x = _mul32(x, _MUL_B)
    return x ^ (x >> 16)


def stream_keys(seed: int, batch: int, device=None) -> torch.Tensor:
    """[B, 2] int64: row r's stream key, from (seed, r) (host-side; a few small ops)."""
    seed = check_seed(seed)
    lo = torch.full((batch,), seed & M32, dtype=torch.int64, device=device)
    hi = torch.full((batch,), seed >> 32, dtype=torch.int64, device=device)
    rows = torch.arange(batch, dtype=torch.int64, device=device)
    k = mix32(lo ^ mix32(hi))
    k = mix32(k ^ mix32((rows + _SALT_ROW) & M32))
    return torch.stack([k, mix32(k ^ _SALT_ROW)], 1)


def seeded_uniform_bits(keys: torch.Tensor, positions: torch.Tensor, vocab: int,
                        tokens: torch.Tensor | None = None) -> torch.Tensor:
    """[B, P, V] int64 in [0, 2**24): the hash of (keys[b], positions[b, p], v) for v in 0 .. V-1, or for
    v = tokens[i] (``tokens`` [V] int64: a draft vocabulary's ids in the target's)."""
    k0, k1 = keys[:, 0].view(-1, 1, 1), keys[:, 1].view(-1, 1, 1)
    pos = mix32(k0 ^ mix32((positions.to(torch.int64).unsqueeze(-1) + _SALT_POSITION) & M32))  # [B, P, 1]
    ids = torch.arange(vocab, dtype=torch.int64, device=keys.device) if tokens is None else tokens.to(torch.int64)
    tok = mix32(ids ^ _SALT_TOKEN)  # [V]
    return mix32(mix32(pos ^ tok) ^ k1) >> 8


def seeded_exponentials(keys: torch.Tensor, positions: torch.Tensor, vocab: int,
                        tokens: torch.Tensor | None = None) -> torch.Tensor:
    """[B, P, V] float32 Exp(1) variates E = -log u, keyed as the module docstring says."""
    u = (seeded_uniform_bits(keys, positions, vocab, tokens).to(torch.float32) + 0.5) * (2.0 ** -24)
    return -torch.log(u)


def coupled_scores(logits: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, temperature,
                   tokens: torch.Tensor | None = None) -> torch.Tensor:
    """A draft's candidate scores coupled with the target's seeded draws (module docstring, "Coupled drafts").

    logits [B, ..., V'] of the draft's vocabulary (``tokens`` [V']: their ids in the target's; None: the
    same ids); positions [B]: the absolute position the candidates are drafted for; temperature: the
    sampling temperature (a float or a 0-d tensor). Returns log_softmax(logits / T - log E) over V', E the
    noise the target's draw at that position uses: the draft's own Gumbel-max sample (its top-k: a sample
    without replacement) with the target's noise, so its best candidate is the target's draw wherever the
    two distributions agree."""
    b, v = logits.shape[0], logits.shape[-1]
    noise = seeded_exponentials(keys, positions.view(b, 1), v, tokens)  # [B, 1, V']
    noise = noise.view(b, *([1] * (logits.dim() - 2)), v)
    return torch.log_softmax(logits.float() / temperature - torch.log(noise), -1)


def seeded_draws(probs: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[B, N]: argmax_v probs / E at each node's ``positions`` (the emitted token's position)."""
    return (probs.float() / seeded_exponentials(keys, positions, probs.shape[-1])).argmax(-1)


def verify_seeded(tokens, parents, mask, target_probs, max_depth: int, keys: torch.Tensor,
                  base: torch.Tensor) -> Acceptance:
    """Seeded tree verification (module docstring). base: [B] the root's absolute position (the
    step's cache_len); keys: [B, 2] (``stream_keys``). Noise is made for the D + 1 positions
    only and gathered per node by depth."""
    _check_tree(tokens, parents, mask, max_depth)
    b, n = tokens.shape
    if target_probs.shape[:2] != (b, n):
        raise ValueError(f"target_probs must be [B, N, V] = [{b}, {n}, V]; got {tuple(target_probs.shape)}")
    depth = mask_to_matrix(mask, n).sum(-1) - 1  # [B, N]
    positions = base.to(torch.int64).view(b, 1) + 1 + torch.arange(max_depth + 1, device=tokens.device)
    noise = seeded_exponentials(keys, positions, target_probs.shape[-1])  # [B, D+1, V]
    noise = noise.gather(1, depth.unsqueeze(-1).expand(b, n, noise.shape[-1]))  # [B, N, V]
    draws = (target_probs.float() / noise).argmax(-1)
    return verify_draws(tokens, parents, mask, draws, max_depth)


# ----------------------------------------------------------------------------- reference (Python ints)
def _mix32_ref(x: int) -> int:
    x ^= x >> 16
    x = (x * _MUL_A) & M32
    x ^= x >> 15
    x = (x * _MUL_B) & M32
    return x ^ (x >> 16)


def uniform_bits_ref(seed: int, row: int, position: int, token: int) -> int:
    """One value of ``seeded_uniform_bits`` with Python's unbounded ints: the tests' oracle."""
    k = _mix32_ref((seed & M32) ^ _mix32_ref(seed >> 32))
    k = _mix32_ref(k ^ _mix32_ref((row + _SALT_ROW) & M32))
    k1 = _mix32_ref(k ^ _SALT_ROW)
    pos = _mix32_ref(k ^ _mix32_ref((position + _SALT_POSITION) & M32))
    return _mix32_ref(_mix32_ref(pos ^ _mix32_ref(token ^ _SALT_TOKEN)) ^ k1) >> 8
