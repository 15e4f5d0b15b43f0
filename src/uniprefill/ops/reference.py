"""Reference (specification) implementation of UniPrefill token selection.

Two stages:

1. scoring: :func:`block_scores_reference` computes, per request, the causal
   softmax attention of the last ``last_q`` queries over all keys of the
   request, sums it over those queries and all q heads (token scores), and sums
   the token scores into blocks of ``block_size`` tokens aligned to the request
   start;
2. selection: :func:`select_from_block_scores` turns fp32 block scores into a
   token keep mask with per-request top-p (or keep-ratio), sinks and the last
   queries always kept.  It runs on the device without host syncs except the
   single read of the kept-token count.

What the Triton path (:mod:`uniprefill.ops.triton_select`) shares with this module
and what it mirrors: it shares :class:`Selection`, the block-score layout below
(:func:`num_block_slots`, and :func:`token_to_block_scores` for blocks wider than
its key tile) and the rule of which rows are long enough to score
(:func:`uniprefill.config.scorable`, whose threshold its layout kernel compares
with).  It does not run :func:`select_from_block_scores`: its kernels re-implement
the block rule (ranking by pairwise comparison instead of a segmented sort) and the
token mask.  ``tests/test_ops_triton.py`` holds the mirror to this code: both get
the same block scores and must give the same mask, lengths and gather indices, ties
and short rows included.

Block-score layout (shared by all implementations): request ``b`` owns the
``cdiv(len_b, block_size)`` entries starting at ``block_offsets[b]`` of a flat
fp32 tensor of ``num_block_slots(T, B, block_size) = T // block_size + B``
entries; the unused tail is zero.  The size depends only on shapes, never on
``cu_seqlens`` values, so it is known on the host without a sync and is equal
on every tensor-parallel rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from uniprefill.config import scorable


@dataclass
class Selection:
    """Result of token selection over a packed (varlen) batch.

    ``keep`` is over all packed tokens; ``gather_idx`` lists the kept token
    indices in increasing order; ``num_kept`` is ``len(gather_idx)`` on the host.
    ``block_scores`` holds the raw (un-normalised, all-reduced) fp32 block
    scores in the flat layout described in the module docstring, or ``None``
    when no scoring was needed (``top_p == 1``).
    """

    keep: torch.Tensor
    new_lens: torch.Tensor
    new_cu_seqlens: torch.Tensor
    gather_idx: torch.Tensor
    num_kept: int
    block_scores: torch.Tensor | None
    # new_cu_seqlens copied to the host by the one sync (None where no sync was needed):
    # callers that need per-request kept lengths on the host read them here for free.
    new_cu_seqlens_cpu: torch.Tensor | None = None


# ---------------------------------------------------------------------------
# layout helpers (device-side, no host syncs)
# ---------------------------------------------------------------------------


def num_block_slots(num_tokens: int, num_requests: int, block_size: int) -> int:
    """Host-side upper bound of sum_b cdiv(len_b, block_size): T // G + B."""
    return num_tokens // block_size + num_requests


def block_offsets(cu_seqlens: torch.Tensor, block_size: int) -> torch.Tensor:
    """int64 [B+1]: start of each request's blocks in the flat block layout."""
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    nblk = (lens + block_size - 1) // block_size
    out = torch.zeros(lens.numel() + 1, dtype=torch.int64, device=cu_seqlens.device)
    torch.cumsum(nblk, 0, out=out[1:])
    return out


def droppable_rows(
    cu_seqlens: torch.Tensor, last_q: int, sink: int, allow_drop: torch.Tensor | None
) -> torch.Tensor:
    """bool [B]: requests whose tokens may be dropped at all."""
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    ok = scorable(lens, sink, last_q)
    if allow_drop is not None:
        ok = ok & allow_drop
    return ok


def _segment_of(cu: torch.Tensor, n: int) -> torch.Tensor:
    """int64 [n]: segment b with cu[b] <= i < cu[b+1] for i in range(n); B if past the end."""
    idx = torch.arange(n, device=cu.device, dtype=cu.dtype)
    return torch.searchsorted(cu[1:].contiguous(), idx, right=True)


def _prefix(x: torch.Tensor) -> torch.Tensor:
    """[0, cumsum(x)]: segment sums as differences, deterministic unlike atomics."""
    out = torch.zeros(x.numel() + 1, dtype=x.dtype, device=x.device)
    torch.cumsum(x, 0, out=out[1:])
    return out


def token_to_block_scores(
    token_scores: torch.Tensor, cu_seqlens: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Sum fp32 token scores [T] into the flat per-request block layout.

    Gathers each block's (at most ``block_size``) tokens into a padded row and
    sums it, so the reduction order is fixed (no atomics): repeated runs and
    tensor-parallel ranks get bit-identical results.
    """
    num_tokens = token_scores.numel()
    num_req = cu_seqlens.numel() - 1
    nslots = num_block_slots(num_tokens, num_req, block_size)
    cu = cu_seqlens.long()
    boff = block_offsets(cu, block_size)
    req = _segment_of(boff, nslots).clamp_max(max(num_req - 1, 0))
    slot = torch.arange(nslots, device=cu.device)
    start = cu[req] + (slot - boff[req]) * block_size
    end = torch.minimum(start + block_size, cu[req + 1])
    end = torch.where(slot < boff[-1], end, start)  # tail slots own no tokens
    tok = start[:, None] + torch.arange(block_size, device=cu.device)[None, :]
    valid = tok < end[:, None]
    vals = token_scores[tok.clamp_max(max(num_tokens - 1, 0))]
    return torch.where(valid, vals, torch.zeros((), dtype=vals.dtype, device=vals.device)).sum(1)


# ---------------------------------------------------------------------------
# stage 1: scoring (reference)
# ---------------------------------------------------------------------------


def token_scores_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    last_q: int,
    scale: float,
    scored: torch.Tensor | None = None,
    head_chunk: int = 8,
) -> torch.Tensor:
    """fp32 [T]: per token, attention mass received from the last queries of its request.

    Plain PyTorch with a host loop over requests (this is the spec, not the hot
    path).  Requests with ``scored[b] == False`` get zeros.  Heads are processed
    ``head_chunk`` at a time to bound the ``last_q x N x heads`` buffer.
    """
    num_tokens, hq, _ = q.shape
    group = hq // k.shape[1]
    out = torch.zeros(num_tokens, dtype=torch.float32, device=q.device)
    bounds = cu_seqlens.tolist()
    flags = scored.tolist() if scored is not None else [True] * (len(bounds) - 1)
    for b in range(len(bounds) - 1):
        s, e = bounds[b], bounds[b + 1]
        n = e - s
        m = min(last_q, n)
        if n == 0 or m == 0 or not flags[b]:
            continue
        qpos = torch.arange(n - m, n, device=q.device)
        causal = torch.arange(n, device=q.device)[None, :] <= qpos[:, None]  # [m, n]
        acc = torch.zeros(n, dtype=torch.float32, device=q.device)
        for h0 in range(0, hq, head_chunk):
            heads = torch.arange(h0, min(h0 + head_chunk, hq), device=q.device)
            qs = q[e - m : e, heads].float()  # [m, h, D]
            ks = k[s:e, heads // group].float()  # [n, h, D]
            logits = torch.einsum("mhd,nhd->hmn", qs, ks) * scale
            logits = logits.masked_fill(~causal, float("-inf"))
            acc += torch.softmax(logits, dim=-1).sum(dim=(0, 1))
        out[s:e] = acc
    return out


def block_scores_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    block_size: int,
    last_q: int,
    scale: float,
    scored: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat fp32 block scores and int64 [B+1] block offsets (see module docstring)."""
    tok = token_scores_reference(q, k, cu_seqlens, last_q=last_q, scale=scale, scored=scored)
    return token_to_block_scores(tok, cu_seqlens, block_size), block_offsets(cu_seqlens, block_size)


# ---------------------------------------------------------------------------
# stage 2: selection (shared by all implementations)
# ---------------------------------------------------------------------------


def _keep_blocks(
    block_scores: torch.Tensor,
    boff: torch.Tensor,
    *,
    top_p: float | torch.Tensor,
    keep_ratio: float | None,
) -> torch.Tensor:
    """bool [slots]: per-request top-p (or top-ratio) blocks, via one segmented sort.

    ``top_p`` is one value for every request, or a float64 ``[B]`` (a request's own).

    Order within a request: score descending, ties by lower block index (two
    stable sorts: by score, then by request).  Cumulative masses are fp64
    prefix sums, so the result is a deterministic function of the scores.
    """
    nslots = block_scores.numel()
    num_req = boff.numel() - 1
    req = _segment_of(boff, nslots)  # tail slots -> num_req, sorted last
    by_score = torch.sort(block_scores, descending=True, stable=True).indices
    by_req = torch.sort(req[by_score], stable=True).indices
    perm = by_score[by_req]  # slot ids in segmented sorted order
    req_sorted = req[perm]
    req_c = req_sorted.clamp_max(num_req - 1)
    rank = torch.arange(nslots, device=boff.device) - boff[req_c]
    if keep_ratio is not None:
        nblk = (boff[1:] - boff[:-1]).double()
        quota = torch.ceil(nblk * keep_ratio).long()
        keep_sorted = rank < quota[req_c]
    else:
        x = block_scores.double()
        total = _prefix(x)
        total = total[boff[1:]] - total[boff[:-1]]  # [B]
        norm = x[perm] / total[req_c].clamp_min(torch.finfo(torch.float64).tiny)
        csum = _prefix(norm)
        before = csum[:-1] - csum[boff[req_c]]
        keep_sorted = before <= (top_p[req_c] if isinstance(top_p, torch.Tensor) else top_p)
    keep_sorted = keep_sorted & (req_sorted < num_req)
    keep = torch.empty_like(keep_sorted)
    keep[perm] = keep_sorted
    return keep


def _finish(
    keep: torch.Tensor, cu_seqlens: torch.Tensor, block_scores: torch.Tensor | None
) -> Selection:
    """Lengths, offsets and gather indices from a token mask; the one host sync."""
    cu = cu_seqlens.long()
    counts = _prefix(keep.long())  # [T+1]
    new_cu = counts[cu]
    new_lens = (new_cu[1:] - new_cu[:-1]).int()
    # The single host sync: gather_idx's size depends on the kept count.
    new_cu_cpu = new_cu.int().cpu()
    num_kept = int(new_cu_cpu[-1])
    # Scatter kept token ids to their output slot; dropped ones go to a spare slot.
    dest = torch.where(keep, counts[1:] - 1, torch.full_like(counts[1:], num_kept))
    buf = torch.empty(num_kept + 1, dtype=torch.int64, device=keep.device)
    buf.scatter_(0, dest, torch.arange(keep.numel(), device=keep.device))
    return Selection(
        keep=keep,
        new_lens=new_lens,
        new_cu_seqlens=new_cu.int(),
        gather_idx=buf[:num_kept],
        num_kept=num_kept,
        block_scores=block_scores,
        new_cu_seqlens_cpu=new_cu_cpu,
    )


def keep_all(cu_seqlens: torch.Tensor, num_tokens: int) -> Selection:
    """Selection that keeps every token; needs no sync (T is a shape)."""
    dev = cu_seqlens.device
    cu = cu_seqlens.int()
    return Selection(
        keep=torch.ones(num_tokens, dtype=torch.bool, device=dev),
        new_lens=(cu[1:] - cu[:-1]),
        new_cu_seqlens=cu.clone(),
        gather_idx=torch.arange(num_tokens, dtype=torch.int64, device=dev),
        num_kept=num_tokens,
        block_scores=None,
    )


def select_from_block_scores(
    block_scores: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    num_tokens: int,
    top_p: float | torch.Tensor,
    block_size: int,
    last_q: int,
    sink: int,
    allow_drop: torch.Tensor | None = None,
    keep_ratio: float | None = None,
) -> Selection:
    """Token selection from fp32 flat block scores (already summed over all heads/ranks).

    ``top_p``: one value, or a float64 ``[B]`` of each request's own (rows at 1.0 must
    come with ``allow_drop`` False: :func:`select_tokens` sees to it).

    Keep block if the normalised mass of the request's higher-ranked blocks is
    <= ``top_p`` (the top block is always kept), or, with ``keep_ratio``, if it
    is among the ``ceil(keep_ratio * num_blocks)`` best.  A token is kept if its
    block is, or it is among the first ``sink`` / last ``last_q`` tokens of its
    request, or its request is not droppable (see :func:`droppable_rows`).
    Device-side and sync-free except the final read of the kept count.
    """
    num_req = cu_seqlens.numel() - 1
    if num_req == 0 or num_tokens == 0:
        return keep_all(cu_seqlens, num_tokens)
    cu = cu_seqlens.long()
    boff = block_offsets(cu, block_size)
    blk_keep = _keep_blocks(block_scores, boff, top_p=top_p, keep_ratio=keep_ratio)
    drop_ok = droppable_rows(cu, last_q, sink, allow_drop)
    req = _segment_of(cu, num_tokens)
    pos = torch.arange(num_tokens, device=cu.device) - cu[req]
    length = cu[req + 1] - cu[req]
    keep = blk_keep[boff[req] + pos // block_size]
    keep = keep | (pos < sink) | (pos >= length - last_q) | ~drop_ok[req]
    return _finish(keep, cu_seqlens, block_scores)
