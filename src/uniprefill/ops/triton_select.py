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
  group, write per (kv head, token) partials; a torch sum over kv heads and the
  shared block reduction finish.

Every reduction has a fixed order (no atomics), so repeated runs and
tensor-parallel ranks give bit-identical scores.  The K tile of a kv head is
loaded once and reused for all its q heads (GQA).  Memory: O(tiles * Hq *
last_q) stats and O(Hkv * T) token partials, i.e. ``1/BLOCK_N`` and
``Hkv/(Hq*last_q)`` of the dense score matrix.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from uniprefill.ops.reference import block_offsets, num_block_slots, token_to_block_scores

# Finite "minus infinity": keeps exp2(NEG - NEG) well defined for rows with no key.
NEG = tl.constexpr(-1.0e30)
LOG2E = 1.4426950408889634


@triton.jit
def _qk_tile(
    q_ptr, k_tile, start, n, m, j, g, h, c,
    stride_qt, stride_qh, stride_qd,
    qk_scale,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, HEAD_D: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Scaled (log2-domain) causal logits of BLOCK_M scoring queries vs one key tile."""
    offs_m = c + tl.arange(0, BLOCK_M)  # index among the request's last m queries
    offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)  # key position in the request
    offs_d = tl.arange(0, BLOCK_D)
    qmask = offs_m < m
    qpos = n - m + offs_m
    rows = (start + qpos).to(tl.int64)
    q_ptrs = (
        q_ptr + rows[:, None] * stride_qt + (g * GROUP + h) * stride_qh
        + offs_d[None, :] * stride_qd
    )
    qv = tl.load(q_ptrs, mask=qmask[:, None] & (offs_d[None, :] < HEAD_D), other=0.0)
    s = tl.dot(qv, tl.trans(k_tile), input_precision=DOT_PREC) * qk_scale
    valid = qmask[:, None] & (offs_n[None, :] < n) & (offs_n[None, :] <= qpos[:, None])
    return tl.where(valid, s, NEG), valid, offs_m


@triton.jit
def _load_k_tile(
    k_ptr, start, n, j, g, stride_kt, stride_kh, stride_kd,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_D: tl.constexpr,
):
    offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    rows = (start + offs_n).to(tl.int64)
    ptrs = k_ptr + rows[:, None] * stride_kt + g * stride_kh + offs_d[None, :] * stride_kd
    mask = (offs_n[:, None] < n) & (offs_d[None, :] < HEAD_D)
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _stats_kernel(
    q_ptr, k_ptr, cu_ptr, tile_req_ptr, tile_idx_ptr, mpart_ptr, lpart_ptr,
    num_req, hq, qk_scale,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
    LAST_Q: tl.constexpr, LQ_PAD: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_D: tl.constexpr, DOT_PREC: tl.constexpr,
):
    tile = tl.program_id(0)
    g = tl.program_id(1)
    b = tl.load(tile_req_ptr + tile)
    if b >= num_req:
        return
    j = tl.load(tile_idx_ptr + tile)
    start = tl.load(cu_ptr + b).to(tl.int64)
    n = (tl.load(cu_ptr + b + 1) - start).to(tl.int32)
    m = tl.minimum(n, LAST_Q)
    k_tile = _load_k_tile(k_ptr, start, n, j, g, stride_kt, stride_kh, stride_kd,
                          BLOCK_N, BLOCK_D, HEAD_D)
    for h in tl.static_range(GROUP):
        base = (tile.to(tl.int64) * hq + g * GROUP + h) * LQ_PAD
        for c in tl.static_range(0, LQ_PAD, BLOCK_M):
            s, valid, offs_m = _qk_tile(
                q_ptr, k_tile, start, n, m, j, g, h, c, stride_qt, stride_qh, stride_qd,
                qk_scale, GROUP, BLOCK_M, BLOCK_N, BLOCK_D, HEAD_D, DOT_PREC,
            )
            mx = tl.max(s, 1)
            p = tl.where(valid, tl.exp2(s - mx[:, None]), 0.0)
            tl.store(mpart_ptr + base + offs_m, mx)
            tl.store(lpart_ptr + base + offs_m, tl.sum(p, 1))


@triton.jit
def _combine_kernel(
    mpart_ptr, lpart_ptr, tile_cu_ptr, mstat_ptr, istat_ptr, hq,
    LQ_PAD: tl.constexpr, TILES: tl.constexpr,
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


@triton.jit
def _score_kernel(
    q_ptr, k_ptr, cu_ptr, tile_req_ptr, tile_idx_ptr, mstat_ptr, istat_ptr, out_ptr, boff_ptr,
    num_req, hq, out_stride, qk_scale,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
    LAST_Q: tl.constexpr, LQ_PAD: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_D: tl.constexpr, DOT_PREC: tl.constexpr, SEG: tl.constexpr,
):
    """Per (tile, kv head): probability mass per key, summed into SEG-token segments.

    SEG == block_size (when it divides BLOCK_N): writes block partials straight
    into the flat block layout at ``boff[b]``; SEG == 1: writes token partials.
    """
    tile = tl.program_id(0)
    g = tl.program_id(1)
    b = tl.load(tile_req_ptr + tile)
    if b >= num_req:
        return
    j = tl.load(tile_idx_ptr + tile)
    start = tl.load(cu_ptr + b).to(tl.int64)
    n = (tl.load(cu_ptr + b + 1) - start).to(tl.int32)
    m = tl.minimum(n, LAST_Q)
    k_tile = _load_k_tile(k_ptr, start, n, j, g, stride_kt, stride_kh, stride_kd,
                          BLOCK_N, BLOCK_D, HEAD_D)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for h in tl.static_range(GROUP):
        base = (b.to(tl.int64) * hq + g * GROUP + h) * LQ_PAD
        for c in tl.static_range(0, LQ_PAD, BLOCK_M):
            s, valid, offs_m = _qk_tile(
                q_ptr, k_tile, start, n, m, j, g, h, c, stride_qt, stride_qh, stride_qd,
                qk_scale, GROUP, BLOCK_M, BLOCK_N, BLOCK_D, HEAD_D, DOT_PREC,
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


# Benchmark hook: {"BLOCK_M": .., "BLOCK_N": .., "num_warps": ..} overrides the defaults.
CONFIG_OVERRIDE: dict[str, int] = {}


def _config(head_dim: int, last_q: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D, num_warps); tl.dot needs every dim >= 16."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_m = min(64, max(16, triton.next_power_of_2(last_q)))
    block_n = 64 if block_d > 128 else 128
    block_m = CONFIG_OVERRIDE.get("BLOCK_M", block_m)
    block_n = CONFIG_OVERRIDE.get("BLOCK_N", block_n)
    return block_m, block_n, block_d, CONFIG_OVERRIDE.get("num_warps", 4)


def _tile_map(
    cu: torch.Tensor, scored: torch.Tensor, block_n: int, max_tiles: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Device-side tile -> (request, tile-in-request); unscored requests get no tiles."""
    lens = cu[1:] - cu[:-1]
    ntiles = torch.where(scored, (lens + block_n - 1) // block_n, torch.zeros_like(lens))
    tile_cu = torch.zeros(lens.numel() + 1, dtype=torch.int64, device=cu.device)
    torch.cumsum(ntiles, 0, out=tile_cu[1:])
    ids = torch.arange(max_tiles, device=cu.device)
    tile_req = torch.searchsorted(tile_cu[1:].contiguous(), ids, right=True)
    tile_idx = ids - tile_cu[tile_req.clamp_max(lens.numel() - 1)]
    return tile_cu.int(), tile_req.int(), tile_idx.int()


def _launch(
    q: torch.Tensor,
    k: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    last_q: int,
    scale: float,
    scored: torch.Tensor,
    seg: int,
) -> torch.Tensor:
    """Run the three kernels; fp32 [Hkv, slots] partials (tokens if seg == 1, else blocks)."""
    num_tokens, hq, head_dim = q.shape
    hkv = k.shape[1]
    num_req = cu_seqlens.numel() - 1
    slots = num_tokens if seg == 1 else num_block_slots(num_tokens, num_req, seg)
    out = torch.zeros(hkv, slots, dtype=torch.float32, device=q.device)
    if num_tokens == 0 or num_req == 0 or last_q == 0:
        return out
    block_m, block_n, block_d, warps = _config(head_dim, last_q)
    lq_pad = triton.cdiv(last_q, block_m) * block_m
    max_tiles = triton.cdiv(num_tokens, block_n) + num_req
    cu = cu_seqlens.long()
    tile_cu, tile_req, tile_idx = _tile_map(cu, scored, block_n, max_tiles)
    boff = block_offsets(cu, seg) if seg > 1 else tile_cu  # tile_cu: unused placeholder
    cu32 = cu_seqlens.int()
    mpart = torch.empty(max_tiles, hq, lq_pad, dtype=torch.float32, device=q.device)
    lpart = torch.empty_like(mpart)
    mstat = torch.empty(num_req, hq, lq_pad, dtype=torch.float32, device=q.device)
    istat = torch.empty_like(mstat)
    common = dict(
        LAST_Q=last_q, LQ_PAD=lq_pad, GROUP=hq // hkv, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=block_d, HEAD_D=head_dim,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32", num_warps=warps,
    )
    strides = (*q.stride(), *k.stride())
    qk_scale = scale * LOG2E
    grid = (max_tiles, hkv)
    _stats_kernel[grid](
        q, k, cu32, tile_req, tile_idx, mpart, lpart, num_req, hq, qk_scale, *strides, **common
    )
    _combine_kernel[(num_req, hq)](
        mpart, lpart, tile_cu, mstat, istat, hq, LQ_PAD=lq_pad, TILES=16, num_warps=4
    )
    _score_kernel[grid](
        q, k, cu32, tile_req, tile_idx, mstat, istat, out, boff, num_req, hq, slots,
        qk_scale, *strides, SEG=seg, **common,
    )
    return out


def token_scores_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    last_q: int,
    scale: float,
    scored: torch.Tensor,
) -> torch.Tensor:
    """fp32 [T] token scores (same definition as the reference); no host syncs."""
    parts = _launch(q, k, cu_seqlens, last_q=last_q, scale=scale, scored=scored, seg=1)
    return parts.sum(0)


def block_scores_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    block_size: int,
    last_q: int,
    scale: float,
    scored: torch.Tensor,
) -> torch.Tensor:
    """Flat fp32 block scores (layout of :mod:`uniprefill.ops.reference`); no host syncs.

    Blocks are reduced inside the score kernel when ``block_size`` divides the
    key tile, else from token scores with the shared torch reduction.
    """
    _, block_n, _, _ = _config(q.shape[-1], last_q)
    if 1 < block_size <= block_n:
        parts = _launch(q, k, cu_seqlens, last_q=last_q, scale=scale, scored=scored,
                        seg=block_size)
        return parts.sum(0)
    tok = token_scores_triton(q, k, cu_seqlens, last_q=last_q, scale=scale, scored=scored)
    return token_to_block_scores(tok, cu_seqlens, block_size)
