"""Fused Triton scoring for UniPrefill token selection.

Computes the same fp32 token scores as
:func:`uniprefill.ops.reference.token_scores_reference` without ever holding the
``last_q x N x heads`` probability matrix:

* the work unit is a *key tile* (``BLOCK_N`` keys of one request) times one kv
  head; the tile list is an upper bound known on the host,
  ``cdiv(T, BLOCK_N) + B`` tiles, mapped to requests on the device
  (programs past the end exit), so no ``cu_seqlens`` value is read on the host;
* pass 1 (``_stats_kernel``): per tile, per q head of the kv group and per
  scoring query, the max and sum-exp of the causal logits over the tile's keys
  (partials ``[tiles, Hq, LQ]``);
* combine (``_combine_kernel``): per request, q head and query, fold the tile
  partials in tile order into the softmax max / normaliser (online softmax);
* pass 2 (``_score_kernel``): recompute ``QK^T`` per tile, normalise with the
  combined stats, sum the probabilities over queries and the q heads of the kv
  group and over the tile's blocks, write per (kv head, block) partials; a
  torch sum over kv heads gives the fp32 block scores (all-reduced here under
  tensor parallelism);
* selection (``_select_kernel``, ``_token_kernel``, ``_gather_kernel``): a mirror
  of :func:`uniprefill.ops.reference.select_from_block_scores` (not a call of
  it), with the mass ranked above each block computed by pairwise comparison
  within its request (O(blocks^2) per request, tiny next to scoring) instead of
  a segmented sort, and few launches (the host launch cost dominates at small
  sizes); ``tests/test_ops_triton.py`` checks the two agree on the same scores.
  ``_layout_kernel`` computes the per-request offsets up front, and which rows
  are scored (:func:`uniprefill.config.scorable`, against its threshold).

Every reduction has a fixed order (no atomics), so repeated runs and
tensor-parallel ranks give bit-identical scores.  The K tile of a kv head is
loaded once and reused for all its q heads (GQA).  Memory: O(tiles * Hq *
last_q) stats and O(Hkv * T) token partials, i.e. ``1/BLOCK_N`` and
``Hkv/(Hq*last_q)`` of the dense score matrix.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from uniprefill.config import unscored_len
from uniprefill.ops.reference import Selection, num_block_slots, token_to_block_scores

# Finite "minus infinity": keeps exp2(NEG - NEG) well defined for rows with no key.
NEG = tl.constexpr(-1.0e30)
LOG2E = 1.4426950408889634


@triton.jit
def _qk_tile(
    q_ptr,
    k_tile,
    start,
    n,
    m,
    j,
    g,
    h,
    c,
    stride_qt,
    stride_qh,
    stride_qd,
    qk_scale,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_D: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Scaled (log2-domain) causal logits of BLOCK_M scoring queries vs one key tile."""
    offs_m = c + tl.arange(0, BLOCK_M)  # index among the request's last m queries
    offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)  # key position in the request
    offs_d = tl.arange(0, BLOCK_D)
    qmask = offs_m < m
    qpos = n - m + offs_m
    rows = (start + qpos).to(tl.int64)
    q_ptrs = (
        q_ptr
        + rows[:, None] * stride_qt
        + (g * GROUP + h) * stride_qh
        + offs_d[None, :] * stride_qd
    )
    qv = tl.load(q_ptrs, mask=qmask[:, None] & (offs_d[None, :] < HEAD_D), other=0.0)
    s = tl.dot(qv, tl.trans(k_tile), input_precision=DOT_PREC) * qk_scale
    valid = qmask[:, None] & (offs_n[None, :] < n) & (offs_n[None, :] <= qpos[:, None])
    return tl.where(valid, s, NEG), valid, offs_m


@triton.jit
def _load_k_tile(
    k_ptr,
    start,
    n,
    j,
    g,
    stride_kt,
    stride_kh,
    stride_kd,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_D: tl.constexpr,
):
    offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    rows = (start + offs_n).to(tl.int64)
    ptrs = k_ptr + rows[:, None] * stride_kt + g * stride_kh + offs_d[None, :] * stride_kd
    mask = (offs_n[:, None] < n) & (offs_d[None, :] < HEAD_D)
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _find_request(tile_cu_ptr, tile, num_req):
    """Request owning ``tile`` (``num_req`` if past the end): binary search of tile_cu."""
    lo = tile * 0
    hi = lo + num_req
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(tile_cu_ptr + mid + 1) <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo


@triton.jit(do_not_specialize=["num_req"])
def _stats_kernel(
    q_ptr,
    k_ptr,
    cu_ptr,
    tile_cu_ptr,
    mpart_ptr,
    lpart_ptr,
    num_req,
    hq,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kt,
    stride_kh,
    stride_kd,
    LAST_Q: tl.constexpr,
    LQ_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_D: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    tile = tl.program_id(0)
    g = tl.program_id(1)
    b = _find_request(tile_cu_ptr, tile, num_req)
    if b >= num_req:
        return
    j = tile - tl.load(tile_cu_ptr + b)
    start = tl.load(cu_ptr + b).to(tl.int64)
    n = (tl.load(cu_ptr + b + 1) - start).to(tl.int32)
    m = tl.minimum(n, LAST_Q)
    k_tile = _load_k_tile(
        k_ptr, start, n, j, g, stride_kt, stride_kh, stride_kd, BLOCK_N, BLOCK_D, HEAD_D
    )
    for h in tl.static_range(GROUP):
        base = (tile.to(tl.int64) * hq + g * GROUP + h) * LQ_PAD
        for c in tl.static_range(0, LQ_PAD, BLOCK_M):
            s, valid, offs_m = _qk_tile(
                q_ptr,
                k_tile,
                start,
                n,
                m,
                j,
                g,
                h,
                c,
                stride_qt,
                stride_qh,
                stride_qd,
                qk_scale,
                GROUP,
                BLOCK_M,
                BLOCK_N,
                BLOCK_D,
                HEAD_D,
                DOT_PREC,
            )
            mx = tl.max(s, 1)
            p = tl.where(valid, tl.exp2(s - mx[:, None]), 0.0)
            tl.store(mpart_ptr + base + offs_m, mx)
            tl.store(lpart_ptr + base + offs_m, tl.sum(p, 1))


@triton.jit
def _combine_kernel(
    mpart_ptr,
    lpart_ptr,
    tile_cu_ptr,
    mstat_ptr,
    istat_ptr,
    hq,
    LQ_PAD: tl.constexpr,
    TILES: tl.constexpr,
):
    """Fold a request's tile partials, in tile order, into max and 1/sum-exp."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    t0 = tl.load(tile_cu_ptr + b)
    t1 = tl.load(tile_cu_ptr + b + 1)
    offs_q = tl.arange(0, LQ_PAD)
    mx = tl.full([LQ_PAD], NEG, tl.float32)
    den = tl.zeros([LQ_PAD], tl.float32)
    for t in range(t0, t1, TILES):
        rows = t + tl.arange(0, TILES)
        rmask = rows < t1
        off = (rows.to(tl.int64)[:, None] * hq + h) * LQ_PAD + offs_q[None, :]
        mt = tl.load(mpart_ptr + off, mask=rmask[:, None], other=NEG)
        lt = tl.load(lpart_ptr + off, mask=rmask[:, None], other=0.0)
        new = tl.maximum(mx, tl.max(mt, 0))
        den = den * tl.exp2(mx - new) + tl.sum(lt * tl.exp2(mt - new[None, :]), 0)
        mx = new
    out = (b.to(tl.int64) * hq + h) * LQ_PAD + offs_q
    tl.store(mstat_ptr + out, mx)
    tl.store(istat_ptr + out, tl.where(den > 0, 1.0 / tl.maximum(den, 1e-30), 0.0))


@triton.jit(do_not_specialize=["num_req", "out_stride"])
def _score_kernel(
    q_ptr,
    k_ptr,
    cu_ptr,
    tile_cu_ptr,
    mstat_ptr,
    istat_ptr,
    out_ptr,
    boff_ptr,
    num_req,
    hq,
    out_stride,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kt,
    stride_kh,
    stride_kd,
    LAST_Q: tl.constexpr,
    LQ_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_D: tl.constexpr,
    DOT_PREC: tl.constexpr,
    SEG: tl.constexpr,
):
    """Per (tile, kv head): probability mass per key, summed into SEG-token segments.

    SEG == block_size (when it divides BLOCK_N): writes block partials straight
    into the flat block layout at ``boff[b]``; SEG == 1: writes token partials.
    """
    tile = tl.program_id(0)
    g = tl.program_id(1)
    b = _find_request(tile_cu_ptr, tile, num_req)
    if b >= num_req:
        return
    j = tile - tl.load(tile_cu_ptr + b)
    start = tl.load(cu_ptr + b).to(tl.int64)
    n = (tl.load(cu_ptr + b + 1) - start).to(tl.int32)
    m = tl.minimum(n, LAST_Q)
    k_tile = _load_k_tile(
        k_ptr, start, n, j, g, stride_kt, stride_kh, stride_kd, BLOCK_N, BLOCK_D, HEAD_D
    )
    acc = tl.zeros([BLOCK_N], tl.float32)
    for h in tl.static_range(GROUP):
        base = (b.to(tl.int64) * hq + g * GROUP + h) * LQ_PAD
        for c in tl.static_range(0, LQ_PAD, BLOCK_M):
            s, valid, offs_m = _qk_tile(
                q_ptr,
                k_tile,
                start,
                n,
                m,
                j,
                g,
                h,
                c,
                stride_qt,
                stride_qh,
                stride_qd,
                qk_scale,
                GROUP,
                BLOCK_M,
                BLOCK_N,
                BLOCK_D,
                HEAD_D,
                DOT_PREC,
            )
            mx = tl.load(mstat_ptr + base + offs_m)
            inv = tl.load(istat_ptr + base + offs_m)
            p = tl.where(valid, tl.exp2(s - mx[:, None]) * inv[:, None], 0.0)
            acc += tl.sum(p, 0)
    # Tiles start at multiples of BLOCK_N from the request start, so SEG-segments
    # of a tile are whole blocks (the request's last one may be short).
    seg = tl.sum(tl.reshape(acc, [BLOCK_N // SEG, SEG]), 1)
    offs_s = j * (BLOCK_N // SEG) + tl.arange(0, BLOCK_N // SEG)
    if SEG == 1:
        dst = out_ptr + g.to(tl.int64) * out_stride + start + offs_s
    else:
        dst = out_ptr + g.to(tl.int64) * out_stride + tl.load(boff_ptr + b) + offs_s
    tl.store(dst, seg, mask=offs_s * SEG < n)


@triton.jit(do_not_specialize=["num_req", "stride", "min_len"])
def _layout_kernel(
    cu_ptr,
    allow_ptr,
    lay_ptr,
    num_req,
    stride,
    min_len,
    HAS_ALLOW: tl.constexpr,
    BLOCK_N: tl.constexpr,
    G: tl.constexpr,
    CH: tl.constexpr,
):
    """One program: int32 rows of ``lay`` (num_req+1 used, ``stride`` apart):
    0 cu_seqlens, 1 key-tile offsets (droppable rows only), 2 block offsets, 3 droppable."""
    zero = tl.program_id(0) * 0
    carry_t = zero
    carry_b = zero
    tl.store(lay_ptr, tl.load(cu_ptr).to(tl.int32))
    tl.store(lay_ptr + stride, zero)
    tl.store(lay_ptr + 2 * stride, zero)
    for c in range(0, num_req, CH):
        r = c + tl.arange(0, CH)
        mask = r < num_req
        s = tl.load(cu_ptr + r, mask=mask, other=0).to(tl.int32)
        e = tl.load(cu_ptr + r + 1, mask=mask, other=0).to(tl.int32)
        n = e - s
        drop = (n > min_len) & mask  # uniprefill.config.scorable, min_len = unscored_len
        if HAS_ALLOW:
            drop = drop & (tl.load(allow_ptr + r, mask=mask, other=0) != 0)
        nt = tl.where(drop, (n + BLOCK_N - 1) // BLOCK_N, 0)
        nb = tl.where(mask, (n + G - 1) // G, 0)
        tl.store(lay_ptr + r + 1, e, mask=mask)
        tl.store(lay_ptr + stride + r + 1, carry_t + tl.cumsum(nt, 0), mask=mask)
        tl.store(lay_ptr + 2 * stride + r + 1, carry_b + tl.cumsum(nb, 0), mask=mask)
        tl.store(lay_ptr + 3 * stride + r, drop.to(tl.int32), mask=mask)
        carry_t += tl.sum(nt, 0)
        carry_b += tl.sum(nb, 0)


@triton.jit
def _select_kernel(
    score_ptr,
    boff_ptr,
    drop_ptr,
    bkeep_ptr,
    top_p_ptr,
    top_p_bits,
    ratio_bits,
    USE_RATIO: tl.constexpr,
    ROW_TOP_P: tl.constexpr,
    BI: tl.constexpr,
    BJ: tl.constexpr,
):
    """Per (request, chunk of its blocks): keep flag of each block.

    Blocks ranked above block i (higher score, or equal score and lower index)
    are found by comparing against every block of the request; their fp64 mass
    (or count, for keep_ratio) decides, exactly as the sorted cumulative sum.
    """
    c = tl.program_id(0)
    b = tl.program_id(1)
    b0 = tl.load(boff_ptr + b)
    nb = tl.load(boff_ptr + b + 1) - b0
    if (c * BI >= nb) | (tl.load(drop_ptr + b) == 0):
        return  # non-droppable rows are kept whole by _token_kernel
    li = c * BI + tl.arange(0, BI)
    imask = li < nb
    si = tl.load(score_ptr + b0 + li, mask=imask, other=0.0)
    before = tl.zeros([BI], tl.float64)
    rank = tl.zeros([BI], tl.int32)
    total = tl.zeros([BJ], tl.float64)
    for j0 in range(0, nb, BJ):
        lj = j0 + tl.arange(0, BJ)
        jmask = lj < nb
        sj = tl.load(score_ptr + b0 + lj, mask=jmask, other=0.0)
        higher = (sj[None, :] > si[:, None]) | (
            (sj[None, :] == si[:, None]) & (lj[None, :] < li[:, None])
        )
        higher = higher & jmask[None, :]
        before += tl.sum(tl.where(higher, sj[None, :].to(tl.float64), 0.0), 1)
        rank += tl.sum(higher.to(tl.int32), 1)
        total += sj.to(tl.float64)
    if USE_RATIO:
        # rank < ceil(nb * ratio)  <=>  rank < nb * ratio, for an integer rank
        ratio = ratio_bits.to(tl.int64).to(tl.float64, bitcast=True)
        keep = rank.to(tl.float64) < nb.to(tl.float64) * ratio
    else:
        tot = tl.sum(total, 0)
        frac = tl.where(tot > 0, before / tot, 0.0)
        if ROW_TOP_P:  # the request's own top_p (float64 [B])
            keep = frac <= tl.load(top_p_ptr + b)
        else:
            keep = frac <= top_p_bits.to(tl.int64).to(tl.float64, bitcast=True)
    tl.store(bkeep_ptr + b0 + li, keep.to(tl.int8), mask=imask)


@triton.jit(do_not_specialize=["num_tokens", "num_req", "stride", "sink", "last_q"])
def _token_kernel(
    lay_ptr,
    bkeep_ptr,
    keep_ptr,
    num_tokens,
    num_req,
    stride,
    sink,
    last_q,
    G: tl.constexpr,
    BT: tl.constexpr,
    LOG_B: tl.constexpr,
):
    """Token keep mask: kept block, sink, last queries, or non-droppable row."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    tmask = t < num_tokens
    # request of each token: number of request ends <= t (vector binary search)
    lo = tl.zeros([BT], tl.int32)
    hi = lo + num_req
    for _ in tl.static_range(LOG_B):
        active = lo < hi
        mid = (lo + hi) // 2
        v = tl.load(lay_ptr + mid + 1, mask=active, other=0)
        right = active & (v <= t)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(active & (v > t), mid, hi)
    r = tl.minimum(lo, num_req - 1)
    s = tl.load(lay_ptr + r, mask=tmask, other=0)
    n = tl.load(lay_ptr + r + 1, mask=tmask, other=0) - s
    drop = tl.load(lay_ptr + 3 * stride + r, mask=tmask, other=0) != 0
    pos = t - s
    blk = tl.load(lay_ptr + 2 * stride + r, mask=tmask, other=0) + pos // G
    bk = tl.load(bkeep_ptr + blk, mask=tmask & drop, other=1) != 0
    keep = bk | (pos < sink) | (pos >= n - last_q) | (~drop)
    tl.store(keep_ptr + t, keep, mask=tmask)


@triton.jit(do_not_specialize=["num_tokens"])
def _gather_kernel(keep_ptr, csum_ptr, out_ptr, num_tokens, BT: tl.constexpr):
    """Kept token t goes to slot csum[t] - 1 (csum: inclusive prefix count)."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    tmask = t < num_tokens
    k = tl.load(keep_ptr + t, mask=tmask, other=0) != 0
    dst = tl.load(csum_ptr + t + 1, mask=tmask, other=1) - 1
    tl.store(out_ptr + dst, t.to(tl.int64), mask=tmask & k)


# Benchmark hook: {"BLOCK_M": .., "BLOCK_N": .., "num_warps": ..} overrides the defaults.
CONFIG_OVERRIDE: dict[str, int] = {}


def _config(head_dim: int, last_q: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D, num_warps); tl.dot needs every dim >= 16."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_m = min(128 if block_d <= 128 else 64, max(16, triton.next_power_of_2(last_q)))
    block_n = 64 if block_d > 128 else 128
    block_m = CONFIG_OVERRIDE.get("BLOCK_M", block_m)
    block_n = CONFIG_OVERRIDE.get("BLOCK_N", block_n)
    warps = 8 if block_m * block_n >= 128 * 128 else 4
    return block_m, block_n, block_d, CONFIG_OVERRIDE.get("num_warps", warps)


def _search_steps(num_req: int) -> int:
    """Binary-search steps for ``num_req`` requests, rounded up to 4, 8 or 16.

    The step count is a compile-time constant: rounding it keeps the number of
    compiled variants at three instead of one per power of two of the batch size
    (each recompile stalls an engine step). Extra steps are masked no-ops.
    """
    need = max(1, num_req.bit_length())
    return next(b for b in (4, 8, 16, 32) if need <= b)


def _f64_bits(x: float) -> int:
    """A Python float as int64 bits: Triton passes float scalars as fp32 only.

    (x must be nonzero: 0 would be passed as an int32.)"""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _layout(
    cu_seqlens: torch.Tensor,
    allow_drop: torch.Tensor | None,
    *,
    min_len: int,
    block_n: int,
    block_size: int,
) -> torch.Tensor:
    num_req = cu_seqlens.numel() - 1
    # Rows padded to 16 bytes: Triton specialises pointer arguments on 16-byte
    # alignment, so unpadded rows (lay[1], lay[2], ...) would compile a new kernel
    # variant for each class of num_req % 4 met in serving.
    stride = triton.cdiv(num_req + 1, 4) * 4
    lay = torch.empty(4, stride, dtype=torch.int32, device=cu_seqlens.device)
    has_allow = allow_drop is not None
    _layout_kernel[(1,)](
        cu_seqlens,
        allow_drop if has_allow else cu_seqlens,
        lay,
        num_req,
        stride,
        min_len,
        HAS_ALLOW=has_allow,
        BLOCK_N=block_n,
        G=block_size,
        CH=1024,
        num_warps=4,
    )
    return lay[:, : num_req + 1]


def _score(
    q: torch.Tensor,
    k: torch.Tensor,
    lay: torch.Tensor,
    *,
    last_q: int,
    scale: float,
    seg: int,
) -> torch.Tensor:
    """Run the scoring kernels: fp32 [Hkv, slots] partials (tokens if seg == 1, else blocks)."""
    num_tokens, hq, head_dim = q.shape
    hkv = k.shape[1]
    num_req = lay.shape[1] - 1
    slots = num_tokens if seg == 1 else num_block_slots(num_tokens, num_req, seg)
    out = torch.zeros(hkv, slots, dtype=torch.float32, device=q.device)
    if num_tokens == 0 or num_req == 0 or last_q == 0:
        return out
    block_m, block_n, block_d, warps = _config(head_dim, last_q)
    lq_pad = triton.cdiv(last_q, block_m) * block_m
    max_tiles = triton.cdiv(num_tokens, block_n) + num_req
    cu32, tile_cu, boff = lay[0], lay[1], lay[2]
    part = torch.empty(2, max_tiles, hq, lq_pad, dtype=torch.float32, device=q.device)
    stat = torch.empty(2, num_req, hq, lq_pad, dtype=torch.float32, device=q.device)
    common = dict(
        LAST_Q=last_q,
        LQ_PAD=lq_pad,
        GROUP=hq // hkv,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        HEAD_D=head_dim,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=warps,
    )
    strides = (*q.stride(), *k.stride())
    qk_scale = scale * LOG2E
    grid = (max_tiles, hkv)
    _stats_kernel[grid](
        q, k, cu32, tile_cu, part[0], part[1], num_req, hq, qk_scale, *strides, **common
    )
    _combine_kernel[(num_req, hq)](
        part[0], part[1], tile_cu, stat[0], stat[1], hq, LQ_PAD=lq_pad, TILES=16, num_warps=4
    )
    _score_kernel[grid](
        q,
        k,
        cu32,
        tile_cu,
        stat[0],
        stat[1],
        out,
        boff,
        num_req,
        hq,
        slots,
        qk_scale,
        *strides,
        SEG=seg,
        **common,
    )
    return out


def token_scores_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    last_q: int,
    scale: float,
    sink: int,
    allow_drop: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 [T] token scores (same definition as the reference; zero on non-droppable rows)."""
    _, block_n, _, _ = _config(q.shape[-1], last_q)
    lay = _layout(
        cu_seqlens, allow_drop, min_len=unscored_len(sink, last_q), block_n=block_n, block_size=1
    )
    return _score(q, k, lay, last_q=last_q, scale=scale, seg=1).sum(0)


def select_tokens_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    top_p: float | torch.Tensor,
    block_size: int,
    last_q: int,
    sink: int,
    allow_drop: torch.Tensor | None,
    keep_ratio: float | None,
    scale: float,
    score_allreduce: Callable[[torch.Tensor], None] | None,
) -> Selection:
    """Fused scoring + selection; one host sync (the kept-token count). Arguments validated.

    ``top_p``: one value, or a float64 ``[B]`` with each request's own."""
    num_tokens = q.shape[0]
    num_req = cu_seqlens.numel() - 1
    dev = q.device
    row_top_p = isinstance(top_p, torch.Tensor)
    _, block_n, _, _ = _config(q.shape[-1], last_q)
    lay = _layout(
        cu_seqlens,
        allow_drop,
        min_len=unscored_len(sink, last_q),
        block_n=block_n,
        block_size=block_size,
    )
    if 1 < block_size <= block_n:  # blocks reduced inside the score kernel
        scores = _score(q, k, lay, last_q=last_q, scale=scale, seg=block_size).sum(0)
    else:
        tok = _score(q, k, lay, last_q=last_q, scale=scale, seg=1).sum(0)
        scores = token_to_block_scores(tok, cu_seqlens, block_size)
    if score_allreduce is not None:
        score_allreduce(scores)
    nslots = scores.numel()
    bkeep = torch.empty(nslots, dtype=torch.int8, device=dev)
    bi = 64
    _select_kernel[(triton.cdiv(num_tokens // block_size + 1, bi), num_req)](
        scores,
        lay[2],
        lay[3],
        bkeep,
        top_p if row_top_p else scores,  # a pointer the kernel reads only with ROW_TOP_P
        0 if row_top_p else _f64_bits(top_p),
        _f64_bits(keep_ratio or 1.0),
        USE_RATIO=keep_ratio is not None,
        ROW_TOP_P=row_top_p,
        BI=bi,
        BJ=128,
        num_warps=4,
    )
    keep = torch.empty(num_tokens, dtype=torch.bool, device=dev)
    bt = 1024
    grid_t = (triton.cdiv(num_tokens, bt),)
    _token_kernel[grid_t](
        lay,
        bkeep,
        keep,
        num_tokens,
        num_req,
        lay.stride(0),
        sink,
        last_q,
        G=block_size,
        BT=bt,
        LOG_B=_search_steps(num_req),
        num_warps=4,
    )
    csum = torch.zeros(num_tokens + 1, dtype=torch.int32, device=dev)
    torch.cumsum(keep, 0, dtype=torch.int32, out=csum[1:])
    gather = torch.empty(num_tokens, dtype=torch.int64, device=dev)
    _gather_kernel[grid_t](keep, csum, gather, num_tokens, BT=bt, num_warps=4)
    new_cu = torch.index_select(csum, 0, lay[0])
    new_cu_cpu = new_cu.cpu()  # the one host sync: gather_idx's length
    num_kept = int(new_cu_cpu[-1])
    return Selection(
        keep=keep,
        new_lens=new_cu[1:] - new_cu[:-1],
        new_cu_seqlens=new_cu,
        gather_idx=gather[:num_kept],
        num_kept=num_kept,
        block_scores=scores,
        new_cu_seqlens_cpu=new_cu_cpu,
    )
