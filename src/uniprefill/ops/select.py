"""Public entry point: :func:`select_tokens` (validation and dispatch)."""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import torch

from uniprefill.config import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_LAST_Q,
    DEFAULT_SINK,
    DEFAULT_TOP_P,
    SelectionParams,
)
from uniprefill.ops.reference import (
    Selection,
    block_scores_reference,
    droppable_rows,
    keep_all,
    select_from_block_scores,
)

IMPLS = ("auto", "reference", "triton")
# Set UNIPREFILL_DEBUG_CHECKS=1 to also check cu_seqlens values on the fast path
# (costs host syncs).
_DEBUG = os.environ.get("UNIPREFILL_DEBUG_CHECKS", "0") == "1"


def _check_tensors(
    q: torch.Tensor,
    k: torch.Tensor,
    cu_seqlens: torch.Tensor,
    allow_drop: torch.Tensor | None,
    row_top_p: torch.Tensor | None,
) -> None:
    """Shape/dtype/device checks that read no tensor values (no sync)."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"q must be a 3-D tensor [T, Hq, D], got {getattr(q, 'shape', q)!r}")
    if not isinstance(k, torch.Tensor) or k.dim() != 3:
        raise ValueError(f"k must be a 3-D tensor [T, Hkv, D], got {getattr(k, 'shape', k)!r}")
    if not q.is_floating_point():
        raise ValueError(f"q must be a floating-point tensor, got {q.dtype}")
    if k.dtype != q.dtype:
        raise ValueError(f"k dtype {k.dtype} must match q dtype {q.dtype}")
    if k.device != q.device:
        raise ValueError(f"k device {k.device} must match q device {q.device}")
    if k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"k shape {tuple(k.shape)} does not match q shape {tuple(q.shape)}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(
            f"q heads ({q.shape[1]}) must be a multiple of k heads ({k.shape[1]}) (GQA)"
        )
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1:
        raise ValueError("cu_seqlens must be a 1-D tensor [B+1]")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.device != q.device:
        raise ValueError(f"cu_seqlens device {cu_seqlens.device} must match q device {q.device}")
    if cu_seqlens.numel() < 1:
        raise ValueError("cu_seqlens must have at least one entry (B+1 >= 1)")
    nreq = cu_seqlens.numel() - 1
    _check_per_row("allow_drop", allow_drop, torch.bool, nreq, q.device)
    # row_top_p's values are the caller's (the request settings check them on
    # admission): reading them here would sync.
    _check_per_row("row_top_p", row_top_p, torch.float64, nreq, q.device)


def _check_per_row(
    name: str, value: torch.Tensor | None, dtype: torch.dtype, nreq: int, device: torch.device
) -> None:
    """An optional per-request tensor: ``None`` or ``dtype [nreq]`` on ``device``."""
    if value is not None and (
        not isinstance(value, torch.Tensor)
        or value.dtype != dtype
        or tuple(value.shape) != (nreq,)
        or value.device != device
    ):
        kind = str(dtype).removeprefix("torch.")
        raise ValueError(f"{name} must be None or a {kind} tensor [{nreq}] on {device}")


def _check_cu_values(cu_seqlens: torch.Tensor, num_tokens: int) -> None:
    """Value checks on cu_seqlens (host syncs; reference path or debug flag only)."""
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != num_tokens or any(cu[i] > cu[i + 1] for i in range(len(cu) - 1)):
        raise ValueError(
            f"cu_seqlens must start at 0, be non-decreasing and end at T={num_tokens}, got {cu}"
        )


def triton_usable(device: torch.device) -> bool:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return True
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def select_tokens(
    q: torch.Tensor,
    k: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    top_p: float = DEFAULT_TOP_P,
    block_size: int = DEFAULT_BLOCK_SIZE,
    last_q: int = DEFAULT_LAST_Q,
    sink: int = DEFAULT_SINK,
    allow_drop: torch.Tensor | None = None,
    keep_ratio: float | None = None,
    row_top_p: torch.Tensor | None = None,
    scale: float | None = None,
    score_allreduce: Callable[[torch.Tensor], None] | None = None,
    impl: str = "auto",
) -> Selection:
    """Choose which tokens of a packed batch survive a UniPrefill drop layer.

    Args:
        q, k: post-RoPE queries ``[T, Hq, D]`` and keys ``[T, Hkv, D]`` of the
            drop layer, same dtype and device, ``Hq % Hkv == 0``.
        cu_seqlens: int32/int64 ``[B+1]`` on the same device; request ``b`` is
            rows ``cu_seqlens[b]:cu_seqlens[b+1]`` (starts at 0, ends at T).
        top_p: keep the highest-scoring blocks of a request until the mass
            *before* a block exceeds ``top_p``; ``1.0`` keeps everything exactly
            (no scoring is done).
        block_size: tokens per block (power of two), aligned to the request start.
        last_q: number of final queries used for scoring; always kept.
        sink: number of first tokens always kept.
        allow_drop: optional bool ``[B]``; rows with ``False`` keep every token.
            The caller must pass ``False`` for decode rows, for prompts it must
            not drop, and for every prefill chunk that continues an earlier
            chunk (context length > 0): the operator only sees the chunk's own
            keys, not the earlier context, so it cannot score such a chunk, and
            keeping it whole is the correct behaviour.
            Rows of length <= ``sink + last_q`` always keep everything
            (decode rows of length 1 included).
        keep_ratio: benchmark mode: instead of top-p keep the
            ``ceil(keep_ratio * num_blocks)`` best blocks of each droppable row.
        row_top_p: optional float64 ``[B]``, each request's own top_p in (0, 1]
            (per-request settings), used instead of ``top_p``; a row at 1.0 keeps
            every token, exactly. Not with ``keep_ratio``.
        scale: softmax scale, default ``1 / sqrt(D)``.
        score_allreduce: tensor parallelism: called once with the fp32 flat
            block scores, must sum them in place over the TP group (see
            :mod:`uniprefill.ops.tp`).
        impl: ``"auto"`` (Triton on CUDA when available, else reference),
            ``"reference"`` or ``"triton"``.

    Returns:
        :class:`Selection`.

    Host syncs: exactly one, reading the kept-token count
    (``new_cu_seqlens[-1]``), because the size of ``gather_idx`` depends on it.
    Everything else (tile-to-request mapping, segmented top-p sort, masks,
    lengths, gather indices) stays on the device.  With ``top_p == 1`` there is
    none.  (The ``"reference"`` implementation loops over requests on the host
    and is not sync-free; it is the specification.)

    Raises:
        ValueError: naming the offending parameter (cheap checks only: the
            values inside ``cu_seqlens`` are checked on the reference path, or
            with ``UNIPREFILL_DEBUG_CHECKS=1``).
    """
    params = SelectionParams(top_p, block_size, last_q, sink, keep_ratio)  # validates
    _check_tensors(q, k, cu_seqlens, allow_drop, row_top_p)
    if scale is not None and (
        isinstance(scale, bool)
        or not isinstance(scale, (int, float))
        or not math.isfinite(scale)
        or scale <= 0
    ):
        raise ValueError(f"scale must be None or a finite number > 0, got {scale!r}")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if score_allreduce is not None and not callable(score_allreduce):
        raise ValueError("score_allreduce must be None or a callable")
    if row_top_p is not None:
        if keep_ratio is not None:
            raise ValueError(
                "row_top_p and keep_ratio cannot be combined (keep_ratio keeps a share)"
            )
        # A row at 1.0 keeps everything exactly: not scored at all (device-side, no sync).
        below_one = row_top_p < 1.0
        allow_drop = below_one if allow_drop is None else allow_drop & below_one

    if impl == "auto":
        # The interpreter (TRITON_INTERPRET=1, e.g. on CPU test machines) runs Triton
        # correctly but slowly: "auto" takes it only on a GPU.
        on_gpu = q.device.type == "cuda"
        impl = "triton" if on_gpu and triton_usable(q.device) else "reference"
    if impl == "triton" and not triton_usable(q.device):
        raise ValueError("impl='triton' needs a CUDA device and an importable triton")
    num_tokens = q.shape[0]
    if impl == "reference" or _DEBUG:
        _check_cu_values(cu_seqlens, num_tokens)
    if params.keeps_all and row_top_p is None:
        return keep_all(cu_seqlens, num_tokens)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])

    num_req = cu_seqlens.numel() - 1
    if num_tokens == 0 or num_req == 0:
        return keep_all(cu_seqlens, num_tokens)
    if impl == "triton":
        from uniprefill.ops.triton_select import select_tokens_triton

        return select_tokens_triton(
            q,
            k,
            cu_seqlens,
            top_p=top_p if row_top_p is None else row_top_p,
            block_size=block_size,
            last_q=last_q,
            sink=sink,
            allow_drop=allow_drop,
            keep_ratio=keep_ratio,
            scale=scale,
            score_allreduce=score_allreduce,
        )
    scored = droppable_rows(cu_seqlens, last_q, sink, allow_drop)
    scores, _ = block_scores_reference(
        q, k, cu_seqlens, block_size=block_size, last_q=last_q, scale=scale, scored=scored
    )
    if score_allreduce is not None:
        score_allreduce(scores)
    return select_from_block_scores(
        scores,
        cu_seqlens,
        num_tokens=num_tokens,
        top_p=top_p if row_top_p is None else row_top_p,
        block_size=block_size,
        last_q=last_q,
        sink=sink,
        allow_drop=allow_drop,
        keep_ratio=keep_ratio,
    )
