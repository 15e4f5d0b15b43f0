"""Freeing the KV blocks of dropped tokens (``free_kv_blocks``; design in docs/kv-blocks.md).

After a drop layer, a stage's layers hold K/V only for the kept tokens, packed into
the request's first blocks; the rest of the blocks vLLM allocated for the prompt is
never written there. With one KV-cache group per stage (each layer reports a
``StageAttentionSpec``, whose stage is part of its identity: ``kv_specs.py``), each
stage has a block table of its own, and the scheduler can return those blocks to the
pool once the prompt's last chunk has run. One rule on both sides,
:func:`freed_blocks`; one owner on the worker, :class:`KVBlockFreeing`:

* after a prefill drops, it stores each stage group's freed range for the request
  (once per request) and a :class:`KeptRecord` for the scheduler;
* the records ride back to the engine core on the step's ``ModelRunnerOutput``
  (attribute :data:`RECORDS_ATTR`, attached by the worker patch in ``patches.py``), so
  they cross vLLM's process boundary with vLLM's own per-step result. Under tensor
  parallelism only the driver rank's output arrives; every rank selects the same
  tokens, so its records are every rank's;
* the scheduler (``scheduler.py``) frees, in each stage's group, the blocks the rule
  names (replaced by vLLM's null block, as the sliding-window manager does, so block
  counts stay valid) and tells the workers what it freed on the next
  ``SchedulerOutput`` (attribute :data:`FREED_ATTR`), which they check against their
  own ranges and count;
* decode appends after the kept tokens: logical blocks ``>= first`` live ``count``
  blocks further on in the request's block row, the prompt's last block, then the
  blocks allocated for decode (:meth:`KVBlockFreeing.remap`, all stage groups in one
  batched gather). The remap holds from the record on, whether or not the scheduler
  has freed yet.

This module imports no vLLM (the runtime uses it).
"""

from __future__ import annotations

from collections.abc import Container, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from uniprefill.vllm.step import StepPlan

# The worker's kept records on vLLM's ModelRunnerOutput (list[KeptRecord]).
RECORDS_ATTR = "uniprefill_kept_records"
# What the scheduler freed on the next SchedulerOutput ({req_id: blocks freed}).
FREED_ATTR = "uniprefill_blocks_freed"


def freed_blocks(total_tokens: Any, kept_tokens: Any, block_size: int) -> tuple[Any, Any]:
    """Blocks ``[first, first + count)`` of a stage a finished prefill no longer needs.

    ``total_tokens`` were prefilled (allocated in every group), ``kept_tokens`` of them
    are in the stage. The prompt's last block stays: decode tokens go there first, so
    the stage never needs a block before vLLM allocates the request's next one.
    Ints give ints; NumPy arrays give arrays (the worker's batch of rows).
    """
    first = -(-kept_tokens // block_size)
    count = np.maximum(0, -(-total_tokens // block_size) - 1 - first)
    if np.ndim(count) == 0:
        return int(first), int(count)
    return first, count


def remap_block_table(
    table: torch.Tensor, first: torch.Tensor, count: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """``out[..., r, j] = table[..., r, j + count[..., r] if j >= first[..., r] else j]``.

    ``table`` [..., R, M] (one group's table, or every stage group's stacked);
    ``first`` and ``count`` [..., R] in the table's block units. Device ops only (no
    host sync): safe before a CUDA graph replay that reads ``out``.
    """
    m = table.shape[-1]
    j = torch.arange(m, device=table.device)
    shift = torch.where(j >= first[..., None], count[..., None], 0)
    src = (j + shift).clamp_(max=m - 1)
    return out.copy_(torch.gather(table, -1, src.to(torch.int64)))


@dataclass(frozen=True)
class KeptRecord:
    """One request's prefill as the stages kept it (worker -> scheduler)."""

    req_id: str
    total_tokens: int  # prefilled tokens (allocated in every group)
    kept: tuple[int, ...]  # tokens in the KV of stages 1..S


def records_of(output: Any) -> list[KeptRecord]:
    """The kept records a ``ModelRunnerOutput`` carries (none: ``[]``)."""
    return getattr(output, RECORDS_ATTR, None) or []


class KVBlockFreeing:
    """``free_kv_blocks`` on one worker: the block size, each request's freed ranges,
    the batched block-table remap and the records for the scheduler.

    Made by the model state once it has found the stage groups (``model_state.py``)
    and held as ``UniPrefillRuntime.kv_freeing``.
    """

    def __init__(
        self,
        block_size: int,
        table_block_size: int,
        group_stage: Mapping[int, int],
        max_num_reqs: int,
        max_rows: int,
        device: torch.device,
    ) -> None:
        if not group_stage:
            raise ValueError("uniprefill: free_kv_blocks needs at least one stage group")
        if block_size % table_block_size:
            raise ValueError(
                f"uniprefill: KV block size {block_size} is not a multiple of the block "
                f"tables' block size {table_block_size}"
            )
        self.block_size = block_size  # the KV manager's, the rule's unit
        self._per_block = block_size // table_block_size  # table blocks per KV block
        self.groups = tuple(sorted(group_stage))  # KV-cache group ids of stages >= 1
        self.stages = np.array([group_stage[g] for g in self.groups], dtype=np.int64)
        self.max_num_reqs = max_num_reqs
        self.max_rows = max_rows
        # Per request slot: [first, count] per stage group, in table blocks (0: none).
        self.freed = torch.zeros(
            (max_num_reqs, 2, len(self.groups)), dtype=torch.int32, device=device
        )
        self._has_freed = np.zeros(max_num_reqs, dtype=bool)
        # The last remap's tables, stacked [groups, rows, blocks] (the slots of every
        # stage group come from them in one computation).
        self.stacked: torch.Tensor | None = None
        # Each stage group's id, and its row in the per-stage lengths (stage - 1), on the
        # device once: the decode fill indexes with them at every step.
        self.group_ids = torch.tensor(self.groups, device=device)
        self.stage_rows = torch.tensor(self.stages - 1, device=device)
        self._ranged: set[str] = set()  # requests with freed ranges here
        self.pending: list[KeptRecord] = []  # for the step's ModelRunnerOutput
        self.blocks_freed = 0  # freed by the scheduler, as its notices say
        # The remap's persistent buffers ([2, groups, rows] and [groups, rows, blocks]),
        # made at the first step: FULL CUDA graphs read the remapped tables.
        self._step_freed: torch.Tensor | None = None
        self._remapped: torch.Tensor | None = None

    # ---- per request (once at its drop, once at its removal) ----------------------------
    def record(self, plan: StepPlan, rows: np.ndarray, dropped: np.ndarray) -> None:
        """After a prefill that dropped: each stage group's freed range for the remap,
        and a record for the scheduler. ``rows`` are the step's droppable rows,
        ``dropped`` their prompt tokens dropped before each stage."""
        if len(self.pending) > self.max_num_reqs:
            raise RuntimeError(
                "uniprefill: free_kv_blocks records are not reaching the scheduler (the "
                "worker's execute_model/sample_tokens patch did not run: is the worker "
                "class vLLM's Worker?)"
            )
        total = plan.ctx0[rows] + plan.qlen0[rows]
        kept = total[:, None] - dropped  # [rows, stages]
        first, count = freed_blocks(total[:, None], kept[:, self.stages], self.block_size)
        has = (count > 0).any(axis=1)
        if not has.any():
            return
        rows, total, kept = rows[has], total[has], kept[has]
        ranges = np.stack([first[has], count[has]], axis=1) * self._per_block
        slots = plan.slots[rows]
        dev = self.freed.device
        index = torch.from_numpy(slots.astype(np.int64)).to(dev)
        self.freed[index] = torch.from_numpy(ranges.astype(np.int32)).to(dev, non_blocking=True)
        self._has_freed[slots] = True
        for i, r in enumerate(rows):
            req_id = plan.req_ids[r]
            self._ranged.add(req_id)
            self.pending.append(KeptRecord(req_id, int(total[i]), tuple(map(int, kept[i, 1:]))))

    def forget(self, slot: int, req_id: str | None) -> None:
        """The request in ``slot`` is gone (finished, aborted, preempted) or replaced."""
        if req_id is not None:
            self._ranged.discard(req_id)
        if self._has_freed[slot]:
            self._has_freed[slot] = False
            self.freed[slot] = 0

    # ---- the hand-off (worker patch) ---------------------------------------------------
    def take_records(self) -> list[KeptRecord]:
        out, self.pending = self.pending, []
        return out

    def note_freed(self, freed: Mapping[str, int], held: Container[str]) -> None:
        """The scheduler's notice of what it freed. A request this worker still holds
        (``held``) must have its ranges skipped here, or its decode would read blocks
        now given to other requests."""
        for req_id, blocks in freed.items():
            if req_id not in self._ranged and req_id in held:
                raise RuntimeError(
                    f"uniprefill: the scheduler freed KV blocks of request {req_id} that "
                    "this worker's block tables still use"
                )
            self.blocks_freed += int(blocks)

    # ---- per step -------------------------------------------------------------------------
    def remap(
        self, idx: torch.Tensor, block_tables: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, ...]:
        """The step's block tables, each stage group's with its rows' freed ranges
        skipped; ``idx`` maps the step's rows to request slots. A fixed number of device
        ops per step, whatever the number of stage groups."""
        tables = self.stage_tables(block_tables)
        _, rows, width = tables.shape
        out = self.remap_buffer(tables, rows, width)
        assert self._step_freed is not None
        n = idx.shape[0]
        step = self._step_freed[:, :, :rows]
        step[:, :, :n] = self.freed[idx].permute(1, 2, 0)
        step[:, :, n:] = 0  # the batch's padding rows: nothing skipped
        remap_block_table(tables, step[0], step[1], out)
        return self.remapped_tables(block_tables, out)

    def stage_tables(self, block_tables: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The stage groups' block tables stacked [groups, rows, blocks], as given."""
        tables = [block_tables[g] for g in self.groups]
        if any(t.shape != tables[0].shape for t in tables):
            raise RuntimeError(
                "uniprefill: the stage groups' block tables differ in shape "
                f"{[tuple(t.shape) for t in tables]}"
            )
        return torch.stack(tables)

    def remap_buffer(self, like: torch.Tensor, rows: int, width: int) -> torch.Tensor:
        """The persistent buffer [groups, rows, width] the remapped tables go to: FULL CUDA
        graphs captured with it read it at every replay (the torch remap above and the
        step's Triton fill, ``ops/triton_stage_fill.py``, both write it)."""
        if self._remapped is None or self._remapped.shape[2] != width or rows > self.max_rows:
            self.max_rows = max(rows, self.max_rows)
            shape = (len(self.groups), self.max_rows)
            self._step_freed = self.freed.new_zeros((2, *shape))
            self._remapped = like.new_zeros((*shape, width))
        return self._remapped[:, :rows]

    def remapped_tables(
        self, block_tables: tuple[torch.Tensor, ...], out: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """``block_tables`` with each stage group's replaced by its table in ``out``."""
        self.stacked = out  # every stage group's remapped table, in self.groups' order
        result = list(block_tables)
        for i, g in enumerate(self.groups):
            result[g] = out[i]
        return tuple(result)
