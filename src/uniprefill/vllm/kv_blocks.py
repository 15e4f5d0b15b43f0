"""Freeing the KV blocks of dropped tokens (``free_kv_blocks``; design in docs/kv-blocks.md).

After a drop layer, a stage's layers hold K/V only for the kept tokens, packed into
the request's first blocks; the rest of the blocks vLLM allocated for the prompt is
never written there. With one KV-cache group per stage (each layer reports a
``StageAttentionSpec``, whose stage is part of its identity: ``kv_specs.py``), each stage has a
block table of its own, and the scheduler can return those blocks to the pool once
the prompt's last chunk has run:

* the worker records, per request and stage, the tokens the stage kept
  (:func:`post`); the scheduler takes the records at its next step and frees, in each
  stage's group, the blocks :func:`freed_blocks` names (replaced by vLLM's null block,
  as the sliding-window manager does, so block counts stay valid);
* decode appends after the kept tokens. Their logical blocks ``>= first`` live
  ``count`` blocks further on in the request's block row (:func:`remap_block_table`):
  the prompt's last block, then the blocks allocated for decode. One rule on both
  sides, and the remap is right whether or not the scheduler has freed yet.

The records cross from the worker to the scheduler in memory: the worker must run in
the engine core's process (vLLM's ``uni`` executor: one GPU, or
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` on CPU); ``engine.py`` refuses other setups.
This module imports no vLLM (the runtime uses it).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from uniprefill.vllm.records import RequestTable
    from uniprefill.vllm.step import StepPlan


def freed_blocks(total_tokens: int, kept_tokens: int, block_size: int) -> tuple[int, int]:
    """Blocks ``[first, first + count)`` of a stage a finished prefill no longer needs.

    ``total_tokens`` were prefilled (allocated in every group), ``kept_tokens`` of them
    are in the stage. The prompt's last block stays: decode tokens go there first, so
    the stage never needs a block before vLLM allocates the request's next one.
    """
    first = -(-kept_tokens // block_size)
    count = max(0, -(-total_tokens // block_size) - 1 - first)
    return first, count


def remap_block_table(
    table: torch.Tensor, first: torch.Tensor, count: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """``out[r, j] = table[r, j + count[r] if j >= first[r] else j]``: the freed range skipped.

    ``table`` [R, M]; ``first`` and ``count`` [R] in the table's block units. Device ops
    only (no host sync): safe before a CUDA graph replay that reads ``out``.
    """
    m = table.shape[1]
    j = torch.arange(m, device=table.device)
    shift = torch.where(j[None, :] >= first[:, None], count[:, None], 0)
    src = (j[None, :] + shift).clamp_(max=m - 1)
    return out.copy_(torch.gather(table, 1, src.to(torch.int64)))


@dataclass(frozen=True)
class KeptRecord:
    """One request's prefill as the stages kept it."""

    req_id: str
    total_tokens: int  # prefilled tokens (allocated in every group)
    kept: tuple[int, ...]  # tokens in the KV of stages 1..S


class _Channel:
    """Worker -> scheduler records of one process, and what freeing them gave back."""

    def __init__(self) -> None:
        self.pending: deque[KeptRecord] = deque()
        self.freed_blocks = 0

    def reset(self) -> None:
        self.pending.clear()
        self.freed_blocks = 0


CHANNEL = _Channel()


def post(record: KeptRecord) -> None:
    CHANNEL.pending.append(record)


def record_freed(
    table: RequestTable, plan: StepPlan, rows: np.ndarray, dropped: np.ndarray, block_size: int
) -> None:
    """After a prefill that dropped: the ranges each stage no longer needs, for both sides
    (the request table's freed ranges for the worker's remap, a record for the scheduler).

    ``rows`` are the step's droppable rows, ``dropped`` their prompt tokens dropped
    before each stage.
    """
    total = plan.ctx0[rows] + plan.qlen0[rows]
    kept = total[:, None] - dropped
    at = np.zeros_like(dropped)
    length = np.zeros_like(dropped)
    for i, r in enumerate(rows):
        for s in range(1, dropped.shape[1]):
            first, count = freed_blocks(int(total[i]), int(kept[i, s]), block_size)
            at[i, s], length[i, s] = first * block_size, count * block_size
        if length[i].any():
            post(KeptRecord(plan.req_ids[r], int(total[i]), tuple(int(k) for k in kept[i, 1:])))
    table.record_freed(plan.slots[rows], at, length)


def take() -> list[KeptRecord]:
    out = []
    while CHANNEL.pending:
        out.append(CHANNEL.pending.popleft())
    return out
