"""The decoder layer of EAGLE-style drafts, attending through ``specgraph::tree_attention``.

A draft layer is a Llama decoder layer whose attention reads and writes a
draft KV cache with the target's contract (``[B, H_kv, S_max, D]``, slots
``0 .. cache_len-1`` committed, a 64-slot window after them). Row r of a call
writes its K/V at slot ``cache_len + slots[r]`` and attends to the committed
prefix plus the window slots its ``tree_mask`` row names — so a chain of new
context, the K lanes of one EAGLE-2 step and one level of a static tree are
all the same call. RoPE, RMSNorm and the MLP are transformers' own modules,
so rope scaling and activations follow the draft's config exactly.

``slots`` may be an int ``f``: the rows sit at window slots ``f .. f + R - 1`` (a chain, an EAGLE-2
step's lanes). Then a no-grad call writes K/V and attends in one ``specgraph::tree_attention_write``
launch, with RoPE in the kernel for up to ``fold_rotary.max_rows`` rows: inductor's RoPE and two
scatters a call were launches of their own in the draft's step. Values as the separate ops' up to
the rounding of RoPE (one rounding in the kernel, HF's three).

``fuse_projections(draft, on)`` (``compile`` calls it; fast path ``fuse_projections``, on by default):
q/k/v and gate/up laid out back to back (``passes.pack_projections``, the Parameters keep their values)
and read as one product each in no-grad calls (proposing, committing: all of generate); a call with
grad enabled keeps the separate products (the joined weights are detached views).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, apply_rotary_pos_emb

from .. import kernels  # noqa: F401  (registers specgraph::tree_attention)
from ..passes.fold_rotary import max_rows
from ..passes.fuse_projections import joined_view, pack_projections


def slot_tensor(slots, batch: int, rows: int, device) -> torch.Tensor:
    """``slots`` as a [B, R] tensor of window slots: an int ``f`` stands for ``f .. f + R - 1`` in every row."""
    if isinstance(slots, torch.Tensor):
        return slots
    return (slots + torch.arange(rows, device=device)).expand(batch, rows)


class DraftAttention(nn.Module):
    def __init__(self, config, in_features: int, kv_layer: int = 0):
        super().__init__()
        self.kv_layer = kv_layer  # this layer's K at kv[2l], V at kv[2l + 1] of the stacked draft cache
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(in_features, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(in_features, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(in_features, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.fused_qkv = None  # (weight, bias) views over q/k/v's packed storage (fuse_projections)

    def forward(self, x, cos, sin, kv, cache_len, slots, tree_mask):
        """x [B, R, F]; kv [2L, B, H_kv, S, D] (or a list of them: 2l, 2l+1 taken), written in place; slots
        [B, R] or int (see the module); tree_mask [B, R]."""
        b, r, _ = x.shape
        if self.fused_qkv is not None and not torch.is_grad_enabled():
            sizes = [self.num_heads * self.head_dim] + 2 * [self.num_kv_heads * self.head_dim]
            q, k, v = F.linear(x, *self.fused_qkv).split(sizes, -1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(b, r, self.num_heads, self.head_dim).transpose(1, 2)  # [B, H, R, D]
        k = k.view(b, r, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, H_kv, R, D]
        v = v.view(b, r, self.num_kv_heads, self.head_dim).transpose(1, 2)
        scale = self.head_dim ** -0.5
        if isinstance(slots, int) and isinstance(kv, torch.Tensor) and not torch.is_grad_enabled():  # one launch
            rope = (cos, sin) if r == 1 or b * r <= max_rows(self.head_dim) else None  # where fold_rotary folds it
            if rope is None:
                q, k = apply_rotary_pos_emb(q, k, cos, sin)
            out = torch.ops.specgraph.tree_attention_write(q, kv, self.kv_layer, k.to(kv.dtype), v.to(kv.dtype),
                                                           cache_len, tree_mask, scale, 0, *(rope or (None, None)),
                                                           slots)
        else:
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            k_cache, v_cache = kv[2 * self.kv_layer], kv[2 * self.kv_layer + 1]
            index = (cache_len.view(b, 1) + slot_tensor(slots, b, r, x.device)).view(b, 1, r, 1).expand_as(k)
            k_cache.scatter_(2, index, k.to(k_cache.dtype))
            v_cache.scatter_(2, index, v.to(v_cache.dtype))
            out = torch.ops.specgraph.tree_attention(q.contiguous(), k_cache, v_cache, cache_len, tree_mask, scale,
                                                     0)  # [B, H, R, D]
        return self.o_proj(out.transpose(1, 2).reshape(b, r, self.num_heads * self.head_dim))


class DraftLayer(nn.Module):
    """``out = h + attn(a); out = out + mlp(post_norm(out))`` with the attention input
    ``a`` and the residual ``h`` prepared by the draft (EAGLE-1: both the fc
    output; EAGLE-3: ``a = [norm(emb), norm(h)]``, 2H wide)."""

    def __init__(self, config, attention_in: int, kv_layer: int = 0):
        super().__init__()
        self.self_attn = DraftAttention(config, attention_in, kv_layer)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config)
        self.fused_gate_up = None  # (weight, bias) views over gate/up's packed storage (fuse_projections)

    def forward(self, attn_in, residual, cos, sin, kv, cache_len, slots, tree_mask):
        h = residual + self.self_attn(attn_in, cos, sin, kv, cache_len, slots, tree_mask)
        normed = self.post_attention_layernorm(h)
        if self.fused_gate_up is not None and not torch.is_grad_enabled():
            gate, up = F.linear(normed, *self.fused_gate_up).chunk(2, -1)
            return h + self.mlp.down_proj(self.mlp.act_fn(gate) * up)
        return h + self.mlp(normed)


@torch.no_grad()
def fuse_projections(draft: nn.Module, on: bool = True) -> int:
    """Each DraftLayer of ``draft``: with ``on``, its q/k/v and gate/up packed back to back and read as one
    product each in no-grad calls; off: the separate products again. Values unchanged. Returns the
    layers fused (0 for a draft that is not a module: n-grams)."""
    fused = 0
    for layer in draft.modules() if isinstance(draft, nn.Module) else ():
        if not isinstance(layer, DraftLayer):
            continue
        attn, mlp = layer.self_attn, layer.mlp
        attn.fused_qkv = layer.fused_gate_up = None
        if not on:
            continue
        pack_projections(layer)
        attn.fused_qkv = joined_view([attn.q_proj, attn.k_proj, attn.v_proj])
        layer.fused_gate_up = joined_view([mlp.gate_proj, mlp.up_proj])
        fused += attn.fused_qkv is not None and layer.fused_gate_up is not None
    return fused
