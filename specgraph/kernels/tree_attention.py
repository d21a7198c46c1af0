"""``specgraph::tree_attention``: attention over a committed prefix plus a
tree window under a 64-bit ancestor mask.

Contract (settled):
  q:        [B, H, R, D]      R query rows (N tree nodes, or K draft lanes)
  k_cache:  [B, H_kv, S_max, D], v_cache likewise (H % H_kv == 0: GQA)
  cache_len:[B] int           committed slots 0 .. cache_len-1; the tree window
                              is slots cache_len .. cache_len+63
  tree_mask:[B, R] int64      bit j: window slot cache_len+j is an
                              ancestor-or-self of query i (depth = popcount-1)
  scale: float; window: int   0 = full attention; else keys at positions
                              > q_pos - window, q_pos = cache_len + depth(i)
  out:      [B, H, R, D] in q's dtype, laid out as [B, R, H, D] (``rows_major``: the
            model's transpose(1, 2) back to rows is then free)
Query i attends to every committed key (inside the sliding window, if any)
and to exactly the window slots its mask row names.

The kernel reads the prefix once per KV head for all G*R query rows of the
group (GQA rows stacked into the M dimension of one tile), split over the
prefix (flash-decoding) when B*H_kv programs cannot fill the GPU; the 64-slot
window under the mask is then one more program of its own, so no program does
two dependent rounds of loads (unsplit, the one program does both). No
mask tensor larger than [B, R] exists. Unused window slots never reach a
dot product (V is loaded as 0 there: 0 * garbage would be NaN). Split, the
tile's last program to finish merges the partials (arrival counters), so a
call is one launch.

``specgraph::tree_attention_write`` (tree_attention_write.py) is the same
launch writing the step's K/V into the cache first: window slot first + j is
row j of this step, read from the new K/V, and one program per (row, KV head)
stores them (``new_kv``; slots before ``first`` are read from the cache); with
``rope`` the kernel also rotates q and the new keys.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .. import config
from .arrivals import arrival_counters
from .bitmask import bit_at, bit_or, mask_to_matrix, popcount64
from .pdl import pdl_kwargs, pdl_launch

WINDOW_SLOTS = 64
LOG2E = 1.4426950408889634


def rows_major(b: int, h: int, r: int, d: int, **kwargs) -> torch.Tensor:
    """An empty [B, H, R, D] tensor laid out as [B, R, H, D]: the ops' output layout, so the
    model's ``transpose(1, 2).reshape(B, R, H * D)`` before o_proj is a view, not a copy."""
    return torch.empty((b, r, h, d), **kwargs).transpose(1, 2)


# ----------------------------------------------------------------------------- Triton kernels
@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    if UPCAST:  # the CPU interpreter's bf16 tl.dot is wrong (triton 3.7): do it in fp32 there
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    if a.dtype == tl.float32:  # fp32 inputs get fp32 products, not TF32
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _half_turn(dims, HEAD_DIM: tl.constexpr):
    """rotate_half's source index: dimension d reads d + D/2 (mod D)."""
    return (dims + HEAD_DIM // 2) % HEAD_DIM


@triton.jit
def _half_sign(dims, HEAD_DIM: tl.constexpr):
    """rotate_half's sign: -1 on the first half (it takes -x2), +1 on the second (x1)."""
    return tl.where(dims < HEAD_DIM // 2, -1.0, 1.0)


@triton.jit
def _rotate(x, x_turned, cos, sin, sign):
    """RoPE: x * cos + rotate_half(x) * sin in float32, rounded once to x's dtype (as inductor fuses it)."""
    return (x.to(tl.float32) * cos.to(tl.float32) + sign * x_turned.to(tl.float32) * sin.to(tl.float32)).to(x.dtype)


@triton.jit
def _online_softmax_step(acc, m_i, l_i, s, v, UPCAST: tl.constexpr):
    """Fold one tile of base-2 logits s [M, N] and values v [N, D] into the running state."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST)
    return acc, m_new, l_i


@triton.jit
def _tree_attention_kernel(
    Q, K, V, CacheLen, Mask, Out, PartO, PartLse, NewK, NewV, Arrived, Cos, Sin,
    stride_qb, stride_qh, stride_qr, stride_qd,
    stride_ob, stride_oh, stride_or,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_mb, stride_mr,
    stride_nkb, stride_nkh, stride_nkn, stride_nkd,
    stride_nvb, stride_nvh, stride_nvn, stride_nvd,
    stride_cb, stride_cr, stride_cd,
    H_KV, R, N_NEW, FIRST_NEW, S_MAX, qk_scale, window,
    G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, PREFIX_SPLITS: tl.constexpr, HAS_WINDOW: tl.constexpr, WINDOW_SLOTS: tl.constexpr,
    WRITE_NEW: tl.constexpr, OLD_WINDOW: tl.constexpr, ROPE: tl.constexpr, MERGE_HERE: tl.constexpr,
    SPLITS_POW2: tl.constexpr,
    UPCAST: tl.constexpr, PDL: tl.constexpr = False,
):
    if PDL:  # launched before the kernel ahead ends (kernels/pdl.py): q, the cache and the mask are its outputs
        tl.extra.cuda.gdc_wait()
    pid_m = tl.program_id(0)  # tile of the G*R (group head, query row) pairs: fastest, so tiles share K/V in L2
    pid_bh = tl.program_id(1)  # b * H_KV + kv head
    pid_s = tl.program_id(2)  # split of the prefix; with splits, the last program takes only the window
    b = pid_bh // H_KV
    kvh = pid_bh % H_KV
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < G * R
    g = rows // R
    r = rows % R
    h = kvh * G + g
    dims = tl.arange(0, HEAD_DIM)

    q_row = Q + b.to(tl.int64) * stride_qb + h[:, None].to(tl.int64) * stride_qh + r[:, None] * stride_qr
    q = tl.load(q_row + dims[None, :] * stride_qd, mask=row_ok[:, None], other=0.0)  # [M, D]
    if ROPE:  # q arrives unrotated: rotate row r by its position's cos/sin (rotate_half convention)
        cos_row = b.to(tl.int64) * stride_cb + r[:, None] * stride_cr + dims[None, :] * stride_cd
        q_turned = tl.load(q_row + _half_turn(dims, HEAD_DIM)[None, :] * stride_qd, mask=row_ok[:, None], other=0.0)
        q = _rotate(q, q_turned, tl.load(Cos + cos_row, mask=row_ok[:, None], other=0.0),
                    tl.load(Sin + cos_row, mask=row_ok[:, None], other=0.0), _half_sign(dims, HEAD_DIM)[None, :])
    k_base = K + b.to(tl.int64) * stride_kb + kvh.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + kvh.to(tl.int64) * stride_vh
    cache_len = tl.load(CacheLen + b).to(tl.int32)
    tree_mask = tl.load(Mask + b * stride_mb + r * stride_mr, mask=row_ok, other=0)  # [M] int64

    lo = 0
    if HAS_WINDOW:
        q_pos = cache_len + popcount64(tree_mask) - 1
        lo = tl.maximum(cache_len - window + 1, 0)  # the root (depth 0) sees the least
    chunk = tl.cdiv(tl.cdiv(cache_len - lo, PREFIX_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + pid_s * chunk  # >= cache_len for the window-only program: no prefix block
    end = tl.minimum(start + chunk, cache_len)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for block in range(start, end, BLOCK_N):  # the committed prefix
        keys = block + tl.arange(0, BLOCK_N)
        key_ok = keys < end
        k = tl.load(k_base + keys[None, :] * stride_ks + dims[:, None] * stride_kd, mask=key_ok[None, :], other=0.0)
        v = tl.load(v_base + keys[:, None] * stride_vs + dims[None, :] * stride_vd, mask=key_ok[:, None], other=0.0)
        s = _dot(q, k, UPCAST) * qk_scale
        ok = key_ok[None, :]
        if HAS_WINDOW:
            ok = ok & (keys[None, :] > q_pos[:, None] - window)
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, tl.where(ok, s, float("-inf")), v, UPCAST)

    if pid_s == NUM_SPLITS - 1:  # the tree window, under the ancestor mask
        offs = tl.arange(0, WINDOW_SLOTS)
        slots = cache_len + offs
        used = (((tl.reduce(tree_mask, 0, bit_or) >> offs) & 1) != 0) & (slots < S_MAX)
        if WRITE_NEW:  # window slot FIRST_NEW + j holds new row j: read it from NewK/NewV, one program writes it
            new_row = offs - FIRST_NEW
            fresh = (new_row >= 0) & (new_row < N_NEW) & (slots < S_MAX)
            nk_base = NewK + b.to(tl.int64) * stride_nkb + kvh.to(tl.int64) * stride_nkh
            nv_base = NewV + b.to(tl.int64) * stride_nvb + kvh.to(tl.int64) * stride_nvh
            k = tl.load(nk_base + new_row[None, :] * stride_nkn + dims[:, None] * stride_nkd, mask=fresh[None, :],
                        other=0.0)
            v = tl.load(nv_base + new_row[:, None] * stride_nvn + dims[None, :] * stride_nvd, mask=fresh[:, None],
                        other=0.0)
            if ROPE:  # row j's key, rotated by row j's cos/sin, is what the cache stores: [D, 64] tiles
                cos_col = b.to(tl.int64) * stride_cb + new_row[None, :] * stride_cr + dims[:, None] * stride_cd
                turned = _half_turn(dims, HEAD_DIM)[:, None] * stride_nkd
                k_turned = tl.load(nk_base + new_row[None, :] * stride_nkn + turned, mask=fresh[None, :], other=0.0)
                k = _rotate(k, k_turned, tl.load(Cos + cos_col, mask=fresh[None, :], other=0.0),
                            tl.load(Sin + cos_col, mask=fresh[None, :], other=0.0), _half_sign(dims, HEAD_DIM)[:, None])
            if pid_m == 0:  # the other programs read only slots < cache_len + FIRST_NEW: no race with these writes
                tl.store(k_base + slots[None, :] * stride_ks + dims[:, None] * stride_kd, k, mask=fresh[None, :])
                tl.store(v_base + slots[:, None] * stride_vs + dims[None, :] * stride_vd, v, mask=fresh[:, None])
            if OLD_WINDOW:  # window slots before FIRST_NEW: written by earlier launches, read from the cache
                old = used & (new_row < 0)
                k = tl.where(fresh[None, :], k, tl.load(k_base + slots[None, :] * stride_ks + dims[:, None] * stride_kd,
                                                        mask=old[None, :], other=0.0))
                v = tl.where(fresh[:, None], v, tl.load(v_base + slots[:, None] * stride_vs + dims[None, :] * stride_vd,
                                                        mask=old[:, None], other=0.0))
                used = used & (fresh | old)
            else:
                used = used & fresh
        else:
            k = tl.load(k_base + slots[None, :] * stride_ks + dims[:, None] * stride_kd, mask=used[None, :], other=0.0)
            v = tl.load(v_base + slots[:, None] * stride_vs + dims[None, :] * stride_vd, mask=used[:, None], other=0.0)
        ancestor = ((tree_mask[:, None] >> offs[None, :]) & 1) != 0
        s = tl.where(ancestor & used[None, :], _dot(q, k, UPCAST) * qk_scale, float("-inf"))
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, s, v, UPCAST)

    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    out_row = Out + b.to(tl.int64) * stride_ob + h[:, None].to(tl.int64) * stride_oh + r[:, None] * stride_or
    row_id = (b.to(tl.int64) * (H_KV * G) + h) * R + r  # rows of [B, H, R] are contiguous in PartO/PartLse
    if NUM_SPLITS == 1:
        tl.store(out_row + dims[None, :], out.to(Out.dtype.element_ty), mask=row_ok[:, None])
    else:
        part = row_id * NUM_SPLITS + pid_s
        tl.store(PartO + part[:, None] * HEAD_DIM + dims[None, :], out, mask=row_ok[:, None])
        tl.store(PartLse + part, tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe)), mask=row_ok)
        if MERGE_HERE:  # the tile's last program to finish merges its splits: no second launch
            tile = pid_bh * tl.num_programs(0) + pid_m
            tl.debug_barrier()  # every thread's partial stored before the release below (CUTLASS's semaphore)
            arrived = tl.atomic_add(Arrived + tile, 1, sem="acq_rel", scope="gpu")
            tl.debug_barrier()
            if arrived == NUM_SPLITS - 1:
                tl.store(Arrived + tile, 0)  # all NUM_SPLITS arrived: reset for the next launch
                merged = _merge_partials(PartO, PartLse, row_id, row_ok, BLOCK_M, NUM_SPLITS, SPLITS_POW2, HEAD_DIM)
                tl.store(out_row + dims[None, :], merged.to(Out.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _merge_partials(PartO, PartLse, row_id, row_ok, BLOCK_M: tl.constexpr, NUM_SPLITS: tl.constexpr,
                    SPLITS_POW2: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The LSE-weighted sum of rows ``row_id`` [M]'s NUM_SPLITS partial outputs: [M, D] float32.
    ``.cg`` loads: the partials were stored by other programs of this launch (read past L1)."""
    dims = tl.arange(0, HEAD_DIM)
    splits = tl.arange(0, SPLITS_POW2)
    lse_all = tl.load(PartLse + row_id[:, None] * NUM_SPLITS + splits[None, :], cache_modifier=".cg",
                      mask=row_ok[:, None] & (splits < NUM_SPLITS)[None, :], other=float("-inf"))
    top = tl.max(lse_all, 1)
    top = tl.where(top == float("-inf"), 0.0, top)  # a row no split saw a key for
    total = tl.sum(tl.exp2(lse_all - top[:, None]), 1)
    merged = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for split in range(NUM_SPLITS):
        weight = tl.exp2(tl.load(PartLse + row_id * NUM_SPLITS + split, mask=row_ok, other=float("-inf"),
                                 cache_modifier=".cg") - top)
        o = tl.load(PartO + (row_id * NUM_SPLITS + split)[:, None] * HEAD_DIM + dims[None, :],
                    mask=row_ok[:, None], other=0.0, cache_modifier=".cg")
        merged += o * weight[:, None]
    return merged / tl.where(total == 0.0, 1.0, total)[:, None]


@triton.jit
def _merge_splits_kernel(PartO, PartLse, Out, ROWS, H, R, stride_ob, stride_oh, stride_or, NUM_SPLITS: tl.constexpr,
                         SPLITS_POW2: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    """The merge as a launch of its own (no arrival counters): BLOCK_ROWS (b, h, r) rows per program."""
    row_id = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = row_id < ROWS
    merged = _merge_partials(PartO, PartLse, row_id, row_ok, BLOCK_ROWS, NUM_SPLITS, SPLITS_POW2, HEAD_DIM)
    dims = tl.arange(0, HEAD_DIM)
    b, h, r = row_id // (H * R), row_id // R % H, row_id % R
    out_row = Out + b * stride_ob + h * stride_oh + r * stride_or
    tl.store(out_row[:, None] + dims[None, :], merged.to(Out.dtype.element_ty), mask=row_ok[:, None])


SMALL_TILE_ROWS = 32  # rows a KV head up to which a grid short of the SMs takes 16-row tiles (measured: D 128)
SMALL_TILE_ROWS_D64 = 96  # the same at head dim <= 64 (SmolLM2)
@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def launch_config(q: torch.Tensor, h_kv: int, s_max: int, num_splits: int | None = None, **override) -> dict:
    """Tile sizes, split count and warps for one call (static shapes only: no host sync).

    ``override`` replaces any key (tests and the benchmark's sweep use it).
    """
    b, h, r, d = q.shape
    rows = (h // h_kv) * r
    wide = d * q.element_size() > 256  # D=256 in 16-bit, or D>=128 in fp32: halve the tiles (shared memory)
    # Measured on the H200 (benchmarks/kernels.py): when the grid cannot fill the GPU (it is split
    # over the prefix: batch-1 decode, short verify steps), 16-row tiles with 8 warps beat 32- and
    # 64-row ones by 20-35% up to 32 rows (--decode); at B = 32, 64-row tiles (--sweep).
    # A longer verify step whose 64-row tiles still cannot fill it (batch 1, 64 nodes: 256 rows a KV
    # head) split best in 64-row tiles, 4 warps, each prefix split at least 6 key blocks, merged by a
    # launch of their own (1k context: 5 splits, 25.5 -> 17.3 us; the in-kernel merge is one program
    # reading the tile's every partial). Measured at 1k context and batch 1 only.
    # At head dim <= 64, 16-row tiles merging in the kernel also beat 64-row tiles and a merge launch at 48 and
    # 96 rows (SmolLM2's 16- and 32-node steps; docs/benchmarks.md)
    sms = _num_sms(q.device.index or 0) if q.is_cuda else 4
    small_rows = SMALL_TILE_ROWS_D64 if d <= 64 else SMALL_TILE_ROWS
    small_grid = rows <= small_rows and b * h_kv * triton.cdiv(rows, 16) < sms
    split_grid = not small_grid and b * h_kv * triton.cdiv(rows, 64) < sms
    block_m = 16 if small_grid else 64 if split_grid else min(64 if wide else 128, max(64, triton.next_power_of_2(rows)))
    config = dict(block_m=block_m, block_n=32 if wide else 64, num_stages=3)
    config.update(override)
    if "num_warps" not in config:
        config["num_warps"] = 8 if config["block_m"] * d >= 128 * 128 or config["block_m"] == 16 else 4
    m_tiles = triton.cdiv(rows, config["block_m"])
    if num_splits is None:
        programs = b * h_kv * m_tiles  # split the prefix only when the grid cannot fill the SMs
        blocks_per_split = 4 if config["block_m"] <= 32 else 6
        prefix_splits = min(triton.cdiv(2 * sms, programs), triton.cdiv(s_max, blocks_per_split * config["block_n"]), 63)
        num_splits = 1 if programs >= sms or prefix_splits <= 1 else prefix_splits + 1  # + the window's program
    config.setdefault("merge_here", config["block_m"] <= 32)  # small tiles merge in the kernel
    config.update(m_tiles=m_tiles, num_splits=num_splits)
    return config


def tree_attention_triton(q, k_cache, v_cache, cache_len, tree_mask, scale: float, window: int,
                          num_splits: int | None = None, new_kv: tuple | None = None, rope: tuple | None = None,
                          merge_here: bool | None = None, first_new: int = 0, **override) -> torch.Tensor:
    """Launch the Triton kernel (CUDA, or the interpreter with TRITON_INTERPRET=1).

    ``new_kv = (key, value)``, each ``[B, H_kv, N, D]``: the step's rows, written into the caches at
    slots ``cache_len + first_new + i`` by the same launch; the window reads them from here, not from the
    cache, and window slots before ``first_new`` from the cache (``tree_attention_write``). ``rope = (cos,
    sin)``, each ``[B, R, D]`` (with ``new_kv`` only): q and the
    new keys arrive unrotated and are rotated in the kernel, ``x * cos + rotate_half(x) * sin``.
    Split over the prefix, the last program of each tile to finish merges the splits (``merge_here``;
    False: a second launch, ``_merge_splits_kernel``, does; None: ``launch_config``'s choice).
    """
    b, h, r, d = q.shape
    h_kv, s_max = k_cache.shape[1], k_cache.shape[2]
    config = launch_config(q, h_kv, s_max, num_splits, **override)
    m_tiles, splits = config["m_tiles"], config["num_splits"]
    merge_here = config["merge_here"] if merge_here is None else merge_here
    out = rows_major(b, h, r, d, dtype=q.dtype, device=q.device)
    if splits > 1:
        part_o = torch.empty((b * h * r * splits, d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((b * h * r * splits,), dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # unused
    new_k, new_v = new_kv if new_kv is not None else (k_cache, v_cache)  # unused without WRITE_NEW
    if rope is not None and new_kv is None:
        raise ValueError("rope rotates the step's new keys: pass new_kv too")
    cos, sin = rope if rope is not None else (q, q)  # unused without ROPE
    if cos.stride() != sin.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    # counters per (b, kv head, m tile); None (too many tiles, or first asked for inside a capture): a merge launch
    arrived = arrival_counters("tree_attention", q.device, m_tiles * b * h_kv) if splits > 1 and merge_here else None
    _tree_attention_kernel[(m_tiles, b * h_kv, splits)](
        q, k_cache, v_cache, cache_len, tree_mask, out, part_o, part_lse, new_k, new_v,
        arrived if arrived is not None else cache_len, cos, sin,
        *q.stride(), *out.stride()[:3], *k_cache.stride(), *v_cache.stride(), *tree_mask.stride(), *new_k.stride(),
        *new_v.stride(),
        *cos.stride()[-3:],
        h_kv, r, new_k.shape[2], first_new, s_max, scale * LOG2E, window,
        G=h // h_kv, HEAD_DIM=d, BLOCK_M=config["block_m"], BLOCK_N=config["block_n"], NUM_SPLITS=splits,
        PREFIX_SPLITS=max(splits - 1, 1), HAS_WINDOW=window > 0, WINDOW_SLOTS=WINDOW_SLOTS,
        WRITE_NEW=new_kv is not None, OLD_WINDOW=new_kv is not None and first_new > 0, ROPE=rope is not None,
        MERGE_HERE=arrived is not None,
        SPLITS_POW2=triton.next_power_of_2(splits),
        UPCAST=not q.is_cuda and q.dtype == torch.bfloat16,
        num_warps=config["num_warps"], num_stages=config["num_stages"], **pdl_kwargs(pdl_launch(q.device)),
    )
    if splits > 1 and arrived is None:
        rows, block_rows = b * h * r, 16
        _merge_splits_kernel[(triton.cdiv(rows, block_rows),)](
            part_o, part_lse, out, rows, h, r, *out.stride()[:3], NUM_SPLITS=splits,
            SPLITS_POW2=triton.next_power_of_2(splits), HEAD_DIM=d, BLOCK_ROWS=block_rows)
    return out


# ----------------------------------------------------------------------------- the op
def _check(q, k_cache, v_cache, cache_len, tree_mask, scale, window) -> None:
    problems = []
    if q.dim() != 4 or k_cache.dim() != 4:
        raise ValueError(f"tree_attention: q must be [B, H, R, D] and k_cache [B, H_kv, S_max, D]; got "
                         f"{tuple(q.shape)} and {tuple(k_cache.shape)}")
    b, h, r, d = q.shape
    if k_cache.shape != v_cache.shape:
        problems.append(f"v_cache {tuple(v_cache.shape)} must match k_cache {tuple(k_cache.shape)}")
    if k_cache.shape[0] != b or k_cache.shape[3] != d:
        problems.append(f"k_cache {tuple(k_cache.shape)} must be [B={b}, H_kv, S_max, D={d}]")
    if h % k_cache.shape[1] != 0:
        problems.append(f"H={h} query heads must be a multiple of H_kv={k_cache.shape[1]}")
    if not 1 <= r <= WINDOW_SLOTS:
        problems.append(f"R={r} query rows: 1 .. {WINDOW_SLOTS} allowed")
    if q.dtype != k_cache.dtype or q.dtype != v_cache.dtype:
        problems.append(f"q, k_cache, v_cache dtypes differ: {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if cache_len.shape != (b,) or cache_len.dtype not in (torch.int32, torch.int64):
        problems.append(f"cache_len must be [B={b}] int32/int64; got {tuple(cache_len.shape)} {cache_len.dtype}")
    if tree_mask.shape != (b, r) or tree_mask.dtype != torch.int64:
        problems.append(f"tree_mask must be [B={b}, R={r}] int64; got {tuple(tree_mask.shape)} {tree_mask.dtype}")
    if window < 0:
        problems.append(f"window={window}: 0 (full attention) or a positive sliding-window width")
    if problems:
        raise ValueError("tree_attention: " + "; ".join(problems))


def allowed_keys(cache_len, tree_mask, s_max: int, window: int) -> torch.Tensor:
    """[B, R, S_max] bool: which cache slots each query may read (the op's contract as a dense mask)."""
    b = tree_mask.shape[0]
    slots = torch.arange(s_max, device=tree_mask.device).view(1, 1, s_max)
    committed_len = cache_len.to(torch.int64).view(b, 1, 1)
    committed = slots < committed_len  # [B, 1, S]
    if window > 0:
        depth = mask_to_matrix(tree_mask, WINDOW_SLOTS).sum(-1, keepdim=True) - 1  # [B, R, 1]
        committed = committed & (slots > committed_len + depth - window)
    offset = slots - committed_len  # [B, 1, S]: window slot index
    in_window = (offset >= 0) & (offset < WINDOW_SLOTS)
    # slots outside the window test bit 0, masked out below; a Where, not an int64 Clip (TensorRT)
    named = bit_at(tree_mask.unsqueeze(-1), torch.where(in_window, offset, 0))
    return committed | (in_window & named)


def tree_attention_reference(q, k_cache, v_cache, cache_len, tree_mask, scale: float, window: int) -> torch.Tensor:
    """Plain torch, float32 math: the CPU path, the decomposition, the kernel's oracle.

    Builds the [B, R, S_max] mask explicitly (fine for a reference; the kernel never does).
    """
    b, h, r, d = q.shape
    h_kv, s_max = k_cache.shape[1], k_cache.shape[2]
    allowed = allowed_keys(cache_len, tree_mask, s_max, window)  # [B, R, S]
    used = allowed.any(1)  # [B, S]: slots any query reads (others may hold garbage)
    g = h // h_kv  # query head i reads KV head i // g: the g heads of a group share one matmul
    qg = q.float().reshape(b, h_kv, g * r, d)
    v = torch.where(used.view(b, 1, s_max, 1), v_cache.float(), 0.0)  # [B, H_kv, S, D]
    scores = (qg @ k_cache.float().transpose(-1, -2)).view(b, h_kv, g, r, s_max) * scale
    scores = scores.masked_fill(~allowed.view(b, 1, 1, r, s_max), float("-inf"))
    probs = torch.softmax(scores, -1).nan_to_num(0.0)  # a row with no key at all -> zeros
    out = (probs.view(b, h_kv, g * r, s_max) @ v).view(b, h, r, d).to(q.dtype)
    # rows_major's strides, functionally (export); clone, not contiguous(): that keeps R = 1's strides
    return out.transpose(1, 2).clone(memory_format=torch.contiguous_format).transpose(1, 2)


def slots_in_use(k_cache: torch.Tensor, v_cache: torch.Tensor, cache_len: torch.Tensor):
    """CPU op bodies: the caches cut after the last slot any row may read (its committed slots and the
    window after them), so the reference's cost follows the context, not max_cache_len; the slots cut
    are masked anyway. Real tensors only (an op body, never the decomposition), and only on the CPU,
    where reading cache_len is no device sync."""
    if k_cache.device.type != "cpu":
        return k_cache, v_cache
    used = min(k_cache.shape[2], int(cache_len.max()) + WINDOW_SLOTS)
    return k_cache[:, :, :used], v_cache[:, :, :used]


@torch.library.custom_op("specgraph::tree_attention_mask", mutates_args=())
def tree_attention_mask(cache_len: torch.Tensor, tree_mask: torch.Tensor, s_max: int, window: int) -> torch.Tensor:
    """The tree_attention contract as a dense boolean SDPA mask ``[B, 1, R, S_max]``.

    Capture feeds it to the user's model so the exported graph is a correct
    (dense, slow) tree-verify graph; its node marks an SDPA whose mask
    ``replace_attention`` can prove is exactly the tree contract. After the
    rewrite it is dead code.
    """
    return allowed_keys(cache_len, tree_mask, s_max, window).unsqueeze(1)


@tree_attention_mask.register_fake
def _tree_attention_mask_fake(cache_len, tree_mask, s_max, window):
    return tree_mask.new_empty((tree_mask.shape[0], 1, tree_mask.shape[1], s_max), dtype=torch.bool)


def reference_only(q: torch.Tensor) -> bool:
    """The CUDA impls take the reference: ``config.reference_kernels``, or a head_dim the kernel has no tile for."""
    return config.reference_kernels or q.shape[-1] not in (16, 32, 64, 128, 256)


@torch.library.custom_op("specgraph::tree_attention", mutates_args=())
def tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_len: torch.Tensor,
                   tree_mask: torch.Tensor, scale: float, window: int) -> torch.Tensor:
    """Tree-masked attention (contract in the module docstring). CPU: the reference over the slots in use."""
    _check(q, k_cache, v_cache, cache_len, tree_mask, scale, window)
    return tree_attention_reference(q, *slots_in_use(k_cache, v_cache, cache_len), cache_len, tree_mask, scale, window)


@tree_attention.register_kernel("cuda")
def _tree_attention_cuda(q, k_cache, v_cache, cache_len, tree_mask, scale, window):
    _check(q, k_cache, v_cache, cache_len, tree_mask, scale, window)
    if reference_only(q):
        return tree_attention_reference(q, k_cache, v_cache, cache_len, tree_mask, scale, window)
    return tree_attention_triton(q, k_cache, v_cache, cache_len, tree_mask, scale, window)


@tree_attention.register_fake
def _tree_attention_fake(q, k_cache, v_cache, cache_len, tree_mask, scale, window):
    _check(q, k_cache, v_cache, cache_len, tree_mask, scale, window)
    return rows_major(*q.shape, dtype=q.dtype, device=q.device)  # the real output's layout
