"""``specgraph::tree_attention_write``: the step's K/V written into the cache at slots
``cache_len + first + i`` and attended in the same launch as ``tree_attention`` (its kernel with
``new_kv``), optionally with RoPE applied to q and the new keys in the kernel (``rope``).

Contract: ``tree_attention``'s (tree_attention.py), plus
  kv:         [2L, B, H_kv, S_max, D]  the stacked cache, written in place (layer l's K at 2l, V at 2l+1)
  layer:      int
  key, value: [B, H_kv, R, D]          the step's rows, in the cache's dtype
  cos, sin:   [B, R, D] or None        with them, q and key arrive unrotated (rotate_half convention)
  first:      int                      window slot of row 0 (0: a verify step; a draft's later lanes
                                       follow the lanes earlier calls wrote, read from the cache)
Window slots >= first + R are not read: the mask names only this call's rows and earlier window slots.
"""
from __future__ import annotations

import torch

from .bitmask import low_bits
from .kv_write import kv_write_reference
from .tree_attention import (WINDOW_SLOTS, _check, reference_only, rows_major, slots_in_use, tree_attention_reference,
                             tree_attention_triton)

def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's ``apply_rotary_pos_emb`` for one tensor, op for op in x's dtype: x [B, H, R, D]; cos, sin [B, R, D]."""
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # rotate_half
    return (x * cos.unsqueeze(1) + turned * sin.unsqueeze(1)).to(x.dtype)


def tree_attention_write_reference(q, kv, layer: int, key, value, cache_len, tree_mask, scale: float,
                                   window: int, cos=None, sin=None, first: int = 0, trim: bool = False) -> torch.Tensor:
    """Plain torch: write row i's K/V at slot ``cache_len + first + i`` of layer ``layer`` (in place), then
    ``tree_attention`` over the layer's caches with only window slots ``0 .. first + R - 1`` nameable. With
    ``cos``/``sin``, q and key are rotated first (``rotary_reference``). ``trim`` (the CPU op body):
    attend over ``slots_in_use`` only."""
    if cos is not None:
        q, key = rotary_reference(q, cos, sin), rotary_reference(key, cos, sin)
    b, _, r, _ = key.shape
    slots = cache_len.to(torch.int64).view(b, 1) + first + torch.arange(r, device=key.device)  # [B, R]
    kv_write_reference(kv, layer, slots.view(b, 1, r, 1).expand_as(key), key, value)
    own = tree_mask if first + r == WINDOW_SLOTS else low_bits(tree_mask, first + r)
    caches = kv[2 * layer], kv[2 * layer + 1]
    return tree_attention_reference(q, *(slots_in_use(*caches, cache_len) if trim else caches), cache_len, own, scale,
                                    window)


def _check_write(q, kv, layer, key, value, cache_len, tree_mask, scale, window, cos=None, sin=None,
                 first: int = 0) -> None:
    if kv.dim() != 5 or kv.shape[0] % 2 or not 0 <= layer < kv.shape[0] // 2:
        raise ValueError(f"tree_attention_write: kv must be [2L, B, H_kv, S_max, D] and layer in 0 .. L-1; got "
                         f"{tuple(kv.shape)}, layer {layer}")
    _check(q, kv[2 * layer], kv[2 * layer + 1], cache_len, tree_mask, scale, window)
    want = (q.shape[0], kv.shape[2], q.shape[2], kv.shape[4])
    problems = [f"{name} must be [B, H_kv, R, D] = {list(want)} in the cache's dtype {kv.dtype}; got "
                f"{tuple(t.shape)} {t.dtype}" for name, t in (("key", key), ("value", value))
                if tuple(t.shape) != want or t.dtype != kv.dtype]
    if not 0 <= first <= WINDOW_SLOTS - q.shape[2]:
        problems.append(f"first={first}: rows first .. first + R - 1 (R={q.shape[2]}) must lie in the "
                        f"{WINDOW_SLOTS}-slot window")
    if (cos is None) != (sin is None):
        problems.append("cos and sin go together: pass both (q and key unrotated) or neither (rotated)")
    elif cos is not None:
        rope = (q.shape[0], q.shape[2], q.shape[3])
        problems += [f"{name} must be [B, R, D] = {list(rope)}, floating point, D even; got {tuple(t.shape)} "
                     f"{t.dtype}" for name, t in (("cos", cos), ("sin", sin))
                     if tuple(t.shape) != rope or not t.is_floating_point() or rope[2] % 2]
    if problems:
        raise ValueError("tree_attention_write: " + "; ".join(problems))


# flexible_layout, as for kv_write: the kernel takes any strides, so inductor need not restride kv.
@torch.library.custom_op("specgraph::tree_attention_write", mutates_args=("kv",), tags=(torch.Tag.flexible_layout,))
def tree_attention_write(q: torch.Tensor, kv: torch.Tensor, layer: int, key: torch.Tensor, value: torch.Tensor,
                         cache_len: torch.Tensor, tree_mask: torch.Tensor, scale: float, window: int,
                         cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
                         first: int = 0) -> torch.Tensor:
    """``kv_write`` of the step's rows at slots ``cache_len + first + i``, then ``tree_attention`` over layer
    ``layer``'s caches (``kv[2l]``, ``kv[2l+1]``), in one launch on CUDA. q [B, H, R, D]; key, value
    [B, H_kv, R, D]; kv [2L, B, H_kv, S_max, D] written in place; out [B, H, R, D] (``rows_major``).
    Window slots >= first + R are not read (the mask names only this call's rows and the window slots
    earlier calls wrote, e.g. a draft's earlier lanes). With ``cos``,
    ``sin`` [B, R, D], q and key arrive unrotated and the op applies RoPE (``rotary_reference``) first.
    CPU: the reference over the slots in use."""
    _check_write(q, kv, layer, key, value, cache_len, tree_mask, scale, window, cos, sin, first)
    return tree_attention_write_reference(q, kv, layer, key, value, cache_len, tree_mask, scale, window, cos, sin,
                                          first, trim=True)


@tree_attention_write.register_kernel("cuda")
def _tree_attention_write_cuda(q, kv, layer, key, value, cache_len, tree_mask, scale, window, cos=None, sin=None,
                               first=0):
    _check_write(q, kv, layer, key, value, cache_len, tree_mask, scale, window, cos, sin, first)
    if reference_only(q):
        return tree_attention_write_reference(q, kv, layer, key, value, cache_len, tree_mask, scale, window, cos,
                                              sin, first)
    return tree_attention_triton(q, kv[2 * layer], kv[2 * layer + 1], cache_len, tree_mask, scale, window,
                                 new_kv=(key, value), rope=None if cos is None else (cos, sin), first_new=first)


@tree_attention_write.register_fake
def _tree_attention_write_fake(q, kv, layer, key, value, cache_len, tree_mask, scale, window, cos=None, sin=None,
                               first=0):
    _check_write(q, kv, layer, key, value, cache_len, tree_mask, scale, window, cos, sin, first)
    return rows_major(*q.shape, dtype=q.dtype, device=q.device)
