"""One engine step of UniPrefill: which rows drop, select at drop layers, compact.

The runtime never imports vLLM. The model state plans each step from the
``InputBatch`` (:meth:`UniPrefillRuntime.plan`, which returns the step's
:class:`~uniprefill.vllm.step.StepPlan`); the model's staged forward starts a
:class:`~uniprefill.vllm.step.StageWalk` (:meth:`begin_walk`), calls
:meth:`on_attention_input` and :meth:`on_gather_point` at each drop layer, and then
asks the model state for the next stage's vLLM attention metadata itself.

Per drop layer, on the device: the selection operator (one host sync, for the kept
count) and a gather of hidden states, residual and positions. On the host: the
lengths of every row in the next stage, from numbers the step already holds.

A prompt longer than one step (chunked prefill) is dropped exactly as if it had
come in one step: its earlier chunks run stage 0 and leave their state in a
:class:`~uniprefill.vllm.stash.StashStore`, keeping two placeholder tokens in later
stages; its last chunk scores the whole prompt at the first drop layer and carries
the kept tokens of every chunk through the later layers.

With vLLM's prefix caching, a request's cached prefix is dense at every layer (only
such blocks are ever published, see :mod:`uniprefill.vllm.scheduler`): its prefill
starts after it and only its new tokens are scored. The first
``dense_prefix_tokens`` of a prompt are never dropped, so a prompt that drops can
still publish them.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from uniprefill.config import UniPrefillConfig, unscored_len
from uniprefill.vllm import kv_blocks
from uniprefill.vllm.records import DropStats, RequestTable
from uniprefill.vllm.stash import (
    StashStore,
    extended_scoring,
    keep_chunk_keys,
    stash_chunks,
    with_stashes,
)
from uniprefill.vllm.step import StageWalk, StepPlan, query_start, resume_walk, walk_carry

logger = logging.getLogger("vllm.uniprefill")


class UniPrefillRuntime:
    """The drop schedule, the request table and the counters of one model."""

    def __init__(
        self,
        config: UniPrefillConfig,
        drop_layers: Sequence[int],
        device: torch.device,
        max_num_reqs: int,
        score_allreduce: Callable[[torch.Tensor], None] | None = None,
        select_fn: Callable[..., Any] | None = None,
        stash_tokens: int = 0,
    ) -> None:
        self.config = config
        self.drop_layers = tuple(drop_layers)
        self.stage_of_drop = {layer: s for s, layer in enumerate(self.drop_layers)}
        self.num_stages = len(self.drop_layers) + 1
        self.table = RequestTable(max_num_reqs, self.num_stages, device)
        self.stash = StashStore(stash_tokens)
        self.stats = DropStats(self.drop_layers)
        self.device = device
        self.score_allreduce = score_allreduce
        if select_fn is None:
            from uniprefill.ops import select_tokens

            select_fn = select_tokens
        self._select = select_fn
        self.step: StepPlan | None = None  # the step planned last
        self.walk: StageWalk | None = None  # its dropping forward, while it runs
        # free_kv_blocks: the freeing's owner, made by the model state where it finds
        # the stage groups (None: blocks are not freed).
        self.kv_freeing: kv_blocks.KVBlockFreeing | None = None

    # ---- requests (model state) ----------------------------------------------------------
    def add_request(
        self,
        slot: int,
        req_id: str,
        prompt_len: int,
        runs_dense: bool,
        start: int = 0,
        generated: int = 0,
    ) -> None:
        self.stash.release(slot)
        if self.kv_freeing is not None:
            old = self.table.slot_of.get(req_id)
            if old is not None:
                self.kv_freeing.forget(old, req_id)
            self.kv_freeing.forget(slot, self.table.req_ids[slot])
        self.table.add(slot, req_id, prompt_len, runs_dense, start, generated)

    def remove_request(self, req_id: str) -> None:
        slot = self.table.slot_of.get(req_id)
        if slot is not None:
            self.stash.release(slot)  # finished, aborted or preempted mid-prompt
            if self.kv_freeing is not None:
                self.kv_freeing.forget(slot, req_id)
        self.table.remove(req_id)

    # ---- planning (model state, before the forward) -----------------------------------
    def plan(
        self,
        req_ids: Sequence[str],
        slots: np.ndarray,
        qlen0: np.ndarray,
        ctx0: np.ndarray,
        may_drop: bool,
    ) -> StepPlan:
        """Which rows drop this step; ``may_drop=False`` keeps every row whole."""
        cfg = self.config
        selection = cfg.selection
        slots = np.asarray(slots, dtype=np.int64)
        qlen0 = np.asarray(qlen0, dtype=np.int64)
        ctx0 = np.asarray(ctx0, dtype=np.int64)
        prompt = self.table.prompt_len[slots]
        start = self.table.start[slots]
        generated = self.table.generated[slots]
        prefill_end = prompt + generated  # a recompute also prefills the generated tokens
        end = ctx0 + qlen0
        # A request's own min_prompt_len (extra_args) replaces the engine's.
        min_len = self.table.min_prompt_len[slots]
        min_len = np.where(min_len >= 0, min_len, cfg.min_prompt_len)
        eligible = selection.scorable(prompt) & (prompt >= min_len) & ~self.table.runs_dense[slots]
        # A request's own top_p (extra_args) replaces the engine's; at 1.0 it runs dense.
        # None when no row has its own: the selection then takes the engine's scalar.
        top_p = None
        if selection.keep_ratio is None:
            own = self.table.top_p[slots]
            if not np.isnan(own).all():
                top_p = np.where(np.isnan(own), selection.top_p, own)
                eligible &= top_p < 1.0
            elif selection.keeps_all:
                eligible[:] = False
        # Chunks after the first of a prompt whose first chunk opened a stash.
        in_stash = np.zeros(len(slots), dtype=bool)
        if self.stash:  # most steps (every decode step) have no open stash
            in_stash[:] = [int(s) in self.stash for s in slots]
        continued = in_stash & (ctx0 > start)
        if continued.any() and not may_drop:
            raise RuntimeError(
                "uniprefill: a chunk of a prompt being prefilled in chunks landed in a "
                "step that replays a FULL CUDA graph; run with cudagraph_mode "
                "FULL_AND_PIECEWISE or PIECEWISE, or max_stash_tokens=0"
            )
        first = eligible & (ctx0 == start) & may_drop
        droppable = first & (end == prefill_end)
        stashing = continued & (end < prefill_end)
        last_chunk = continued & (end == prefill_end)
        stash_len = np.zeros(len(slots), dtype=np.int64)
        for r in np.flatnonzero(last_chunk):
            stash_len[r] = self.stash.get(int(slots[r])).num_tokens
            self.stash.retire(int(slots[r]))  # its room goes to prompts starting now
        droppable |= last_chunk
        for r in np.flatnonzero(first & (end < prefill_end)):
            if self.stash.open(int(slots[r]), int(prefill_end[r] - start[r])):
                stashing[r] = True
            else:
                self.stats.stash_full += 1
        self.step = StepPlan(
            req_ids=list(req_ids),
            slots=slots,
            qlen0=qlen0,
            ctx0=ctx0,
            droppable=droppable,
            dropped=self.table.dropped[slots],
            stashing=stashing,
            stash_len=stash_len,
            start=start,
            protect=np.maximum(0, cfg.dense_prefix_tokens - start),
            tail=generated,
            top_p=top_p,
        )
        return self.step

    def plan_dummy(self, num_reqs: int) -> StepPlan:
        """A dummy or capture batch: no request of ours, nothing drops."""
        zeros = np.zeros(num_reqs, dtype=np.int64)
        self.step = StepPlan(
            req_ids=[],
            slots=zeros,
            qlen0=zeros,
            ctx0=zeros,
            droppable=np.zeros(num_reqs, dtype=bool),
            dropped=np.zeros((num_reqs, self.num_stages), dtype=np.int64),
        )
        return self.step

    # ---- the staged forward (model hooks) -----------------------------------------------
    def begin_walk(self, positions: torch.Tensor) -> StageWalk:
        """Start the dropping forward of the planned step over its stages."""
        assert self.step is not None
        # A copy made in vLLM's inference mode, like the gathered positions of later
        # segments (and the warm-up's): a compiled segment's guards check the tensor kind.
        self.walk = StageWalk(self.step, positions.clone(), positions.shape[0])
        return self.walk

    def resume_walk(self, positions: torch.Tensor, carry: torch.Tensor, stage: int) -> StageWalk:
        """Pipeline parallelism: go on with the walk the previous rank sent (``carry``,
        see :func:`~uniprefill.vllm.step.walk_carry`) from stage ``stage``, this rank's
        first (the drop layers before its first layer)."""
        assert self.step is not None
        self.walk = resume_walk(self.step, positions, carry, stage, self.num_stages)
        for drop, seen, kept in self.walk.counts:  # the earlier ranks' drop layers
            self.stats.add(drop, seen, kept)
        return self.walk

    def finish_stage(
        self, hidden_states: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pipeline parallelism, a rank before the last: record this step's drops as far as
        this rank knows them (every stage up to its last drop layer is exact; the last
        rank's records and counters are exact for all), and give the kept tokens padded to
        the step's rows, with the walk's state for the next rank."""
        walk, self.walk = self.walk, None
        assert walk is not None
        carry = walk_carry(walk, self.num_stages)
        if walk.kept_at is None:
            return hidden_states, residual, carry
        self._record(walk)
        rows, kept = walk.num_tokens_padded, hidden_states.shape[0]
        hidden = hidden_states.new_zeros((rows, *hidden_states.shape[1:]))
        hidden[:kept] = hidden_states
        res = residual.new_zeros((rows, *residual.shape[1:]))
        res[:kept] = residual
        return hidden, res, carry

    def on_attention_input(
        self,
        layer_idx: int,
        query: torch.Tensor,
        key: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        scale: float,
    ) -> None:
        """Score the current tokens at a drop layer (its attention still sees all of them)."""
        walk = self.walk
        if walk is None or layer_idx not in self.stage_of_drop:
            return
        plan = walk.plan
        qsl = query_start(walk.qlen)
        n = int(qsl[-1])
        q = query[:n].view(n, num_heads, head_size)
        k = key[:n].view(n, num_kv_heads, head_size)
        lens = walk.qlen
        if self.stage_of_drop[layer_idx] == 0:
            if plan.stashing.any():
                prompt_len = self.table.prompt_len[plan.slots]
                keep_chunk_keys(walk, q, k, qsl, prompt_len, self.config.last_q)
            if plan.stash_len.any():
                q, k, lens = extended_scoring(self.stash, walk, q, k, qsl)
                qsl = query_start(lens)
        rows, qsl = self._selection_rows(walk, lens, qsl)
        if not rows.any():
            return
        dev = query.device
        row_top_p = None
        if plan.top_p is not None:  # requests with their own top_p in this step
            owner = walk.sub_owner
            own = plan.top_p if owner is None else plan.top_p[owner]
            row_top_p = torch.from_numpy(own).to(dev, non_blocking=True)
        walk.pending = self._select(
            q,
            k,
            torch.from_numpy(qsl.astype(np.int32)).to(dev, non_blocking=True),
            **self.config.selection_at(self.stage_of_drop[layer_idx]).kwargs(),
            allow_drop=torch.from_numpy(rows).to(dev, non_blocking=True),
            row_top_p=row_top_p,
            scale=scale,
            score_allreduce=self.score_allreduce,
        )

    def on_gather_point(
        self, layer_idx: int, hidden_states: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """After a drop layer's attention: compact, and move the walk to the next stage
        (whose metadata the model then asks for, see :meth:`StageWalk.needs_metadata`)."""
        walk = self.walk
        if walk is None or layer_idx not in self.stage_of_drop:
            return hidden_states, residual
        sel, walk.pending = walk.pending, None
        stage = self.stage_of_drop[layer_idx] + 1
        if stage == 1 and (walk.plan.stashing.any() or walk.extended is not None):
            hidden_states, residual = self._gather_chunks(walk, sel, hidden_states, residual)
        elif sel is not None and sel.num_kept < int(walk.qlen.sum()):
            new_qlen = self._kept_lengths(walk, sel)
            self._count(walk, stage, walk.qlen, new_qlen)
            hidden_states, residual = self._compact(
                walk, sel.gather_idx, new_qlen, stage, hidden_states, residual
            )
        elif sel is not None:
            self._count(walk, stage, walk.qlen, walk.qlen)
        walk.stage = stage
        return hidden_states, residual

    def finish_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Record this step's drops and put the final hidden states back at their rows.

        Dropped rows get zeros; vLLM only reads the rows of each request's last
        scheduled token, and those are always kept (the last ``last_q`` tokens, or
        an earlier chunk's placeholders). Stashed tokens have no row of the step's
        input: they land in a spare row that is cut off.
        """
        out = self.at_step_rows(hidden_states)
        walk, self.walk = self.walk, None
        if walk is not None and walk.kept_at is not None:
            self._record(walk)
        return out

    def at_step_rows(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Hidden states of the walk's current token set at the step's rows, zeros at
        dropped rows (as is before the first compaction)."""
        walk = self.walk
        if walk is None or walk.gather_total is None:
            return hidden_states
        rows = walk.num_tokens_padded
        out = hidden_states.new_zeros((rows + 1, *hidden_states.shape[1:]))
        out.index_copy_(0, walk.gather_total.clamp(max=rows), hidden_states)
        return out[:rows]

    # ---- internals ------------------------------------------------------------------------
    def _selection_rows(
        self, walk: StageWalk, lens: np.ndarray, qsl: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Rows the selection scores and their starts.

        A row with a protected head (``dense_prefix_tokens``) or tail (the generated
        tokens of a recompute after a preemption) becomes up to three selection rows:
        the head and the tail kept whole, the middle scored on its own. So the
        selection does not depend on whether the head came from vLLM's prefix cache,
        and a recompute scores its prompt with the prompt's own last queries, as its
        first prefill did.
        """
        plan = walk.plan
        head = np.where(plan.droppable, np.minimum(plan.protect, lens), 0)
        tail = np.where(plan.droppable, np.minimum(plan.tail, lens - head), 0)
        rows = plan.droppable & self.config.selection.scorable(lens - head - tail)
        split = rows & ((head > 0) | (tail > 0))
        walk.sub_owner = None
        if not split.any():
            return rows, qsl
        head, tail = np.where(split, head, 0), np.where(split, tail, 0)
        parts = np.stack([head, lens - head - tail, tail], axis=1)
        scored = np.stack([np.zeros_like(rows), rows, np.zeros_like(rows)], axis=1)
        present = parts > 0
        present[:, 1] = True  # every row keeps its middle part (a whole unsplit row)
        walk.sub_owner = np.repeat(np.arange(len(lens)), present.sum(axis=1))
        return scored[present], query_start(parts[present])

    def _gather_chunks(
        self, walk: StageWalk, sel: Any, hidden: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first gather point of a step with chunked prompts (``stash.py``).

        Earlier chunks go into the stash and keep only placeholders; last chunks take
        their kept tokens from the stash and from this step alike.
        """
        lens = walk.plan.prefill_len  # at the first gather point: step tokens + stashes
        if sel is not None:
            new_qlen, idx = self._kept_lengths(walk, sel), sel.gather_idx
        else:
            new_qlen, idx = lens.copy(), None
        self._count(walk, 1, lens, new_qlen)
        if walk.plan.stashing.any():
            idx, new_qlen = stash_chunks(self.stash, walk, hidden, residual, new_qlen, idx)
        assert idx is not None
        if walk.extended is not None:
            self.stats.chunked_prefills += len(walk.extended.slots)
            idx, hidden, residual = with_stashes(self.stash, walk, idx, hidden, residual)
        return self._compact(walk, idx, new_qlen, 1, hidden, residual)

    def _record(self, walk: StageWalk) -> None:
        plan, kept_at = walk.plan, walk.kept_at
        rows = np.flatnonzero(plan.droppable)
        assert kept_at is not None
        prefill = plan.prefill_len[rows]
        dropped = prefill[:, None] - kept_at[rows]
        dropped[:, 0] = 0
        self.table.record(plan.slots[rows], dropped)
        if self.kv_freeing is not None:
            self.kv_freeing.record(plan, rows, dropped)
        for r, d, prompt in zip(rows, dropped, prefill, strict=True):
            if d[-1] > 0:
                self.stats.dropped_prefills += 1
                shares = ", ".join(f"{k / prompt:.3f}" for k in kept_at[r, 1:])
                # DEBUG: one line per request floods the log at real request rates;
                # DropStats.log_summary gives the INFO summary.
                logger.debug(
                    "uniprefill: request %s prefill dropped: prompt_tokens=%d kept_share=[%s]",
                    plan.req_ids[r],
                    prompt,
                    shares,
                )

    def _count(
        self, walk: StageWalk, stage: int, seen_qlen: np.ndarray, new_qlen: np.ndarray
    ) -> None:
        rows = walk.plan.droppable
        seen, kept = int(seen_qlen[rows].sum()), int(new_qlen[rows].sum())
        self.stats.add(stage - 1, seen, kept)
        walk.counts.append((stage - 1, seen, kept))

    @staticmethod
    def _kept_lengths(walk: StageWalk, sel: Any) -> np.ndarray:
        cu = sel.new_cu_seqlens_cpu
        cu = sel.new_cu_seqlens.cpu() if cu is None else cu  # None only if nothing synced
        kept = np.diff(cu.numpy()).astype(np.int64)
        if walk.sub_owner is None:
            return kept
        return np.bincount(walk.sub_owner, weights=kept, minlength=len(walk.qlen)).astype(np.int64)

    def _compact(
        self,
        walk: StageWalk,
        idx: torch.Tensor,
        new_qlen: np.ndarray,
        stage: int,
        hidden: torch.Tensor,
        residual: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Padding rows (if any) are never in idx: after the first compaction the
        # hidden states hold real tokens only.
        walk.gather_total = idx if walk.gather_total is None else walk.gather_total[idx]
        walk.positions = walk.positions[idx]
        if walk.kept_at is None:
            walk.kept_at = np.repeat(walk.plan.qlen0[:, None], self.num_stages, axis=1)
        walk.kept_at[:, stage:] = new_qlen[:, None]
        walk.qlen = new_qlen
        return hidden[idx], residual[idx]

    def warm_up(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        dtype: torch.dtype,
        scale: float,
        max_num_reqs: int,
    ) -> list[int]:
        """Run the selection once per compiled variant, on synthetic rows, at start-up.

        The Triton kernels compile at their first call, and one of them once per
        batch-size class (its binary-search depth is a compile-time constant for 1-15,
        16-255 and 256+ requests). Without this the first prefills that meet each
        variant stall for seconds. Each call holds one droppable prompt and ``R - 1``
        decode rows. Returns the request counts used.
        """
        selection = self.config.selection
        prompt = unscored_len(selection.sink, selection.last_q) + 4 * selection.block_size
        counts = [r for r in (1, 16, 256) if r == 1 or r <= max_num_reqs]
        # The top-p variant (at 0.99 when the engine runs p = 1), then the ratio one.
        modes = [dataclasses.replace(selection, top_p=min(selection.top_p, 0.99), keep_ratio=None)]
        if selection.keep_ratio is not None:
            modes.append(selection)
        gen = torch.Generator(device="cpu").manual_seed(0)
        for num_reqs in counts:
            lens = np.array([prompt] + [1] * (num_reqs - 1), dtype=np.int64)
            n = int(lens.sum())
            q = torch.randn(n, num_heads, head_size, generator=gen).to(self.device, dtype)
            k = torch.randn(n, num_kv_heads, head_size, generator=gen).to(self.device, dtype)
            cu = torch.from_numpy(query_start(lens).astype(np.int32)).to(self.device)
            allow = torch.zeros(num_reqs, dtype=torch.bool, device=self.device)
            allow[0] = True
            for mode in modes:
                self._select(
                    q, k, cu, **mode.kwargs(), allow_drop=allow, scale=scale, score_allreduce=None
                )
        return counts
