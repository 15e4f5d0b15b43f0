"""One engine step of UniPrefill: which rows drop, select at drop layers, compact.

The runtime never imports vLLM. The model state plans each step from the
``InputBatch`` (:meth:`UniPrefillRuntime.plan`, which returns the step's
:class:`~uniprefill.vllm.step.StepContext`), the model's staged forward calls
:meth:`on_attention_input` and :meth:`on_gather_point` at each drop layer, and a
:class:`~uniprefill.vllm.step.StageRebuilder` (made by the model state) turns the new
lengths into vLLM attention metadata for the later layers.

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

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from uniprefill.config import UniPrefillConfig
from uniprefill.vllm import kv_blocks
from uniprefill.vllm.records import DropStats, RequestTable
from uniprefill.vllm.stash import StashedChunk, StashStore
from uniprefill.vllm.step import ExtendedRows, StepContext, query_start

logger = logging.getLogger("vllm.uniprefill")

# Tokens an earlier chunk keeps in each later stage: its KV and linear-attention state
# writes there are overwritten by the last chunk. Two, not one: a one-token row would
# pass for a decode, and vLLM's Mamba metadata wants decodes ahead of prefills.
PLACEHOLDER_TOKENS = 2


def compaction_reserve_bytes(
    max_tokens: int,
    max_reqs: int,
    hidden_size: int,
    act_bytes: int,
    num_q_heads: int,
    last_q: int,
) -> int:
    """Device memory a dropping step may need on top of vLLM's dense forward (a bound).

    At a gather point the compacted hidden states and residual are new tensors that
    live beside the originals until the layer moves on; the selection adds fp32
    per-key-tile softmax partials (key tiles are >= 64 tokens, queries padded by
    less than 128) and a few per-token index buffers. vLLM sizes the KV cache from a
    dense profile run, so this much is held during that run.
    """
    copies = 2 * max_tokens * hidden_size * act_bytes
    tiles = max_tokens // 64 + max_reqs
    partials = 2 * tiles * num_q_heads * (last_q + 128) * 4
    indices = max_tokens * (1 + 4 + 8 + 8)  # keep mask, prefix count, gather, composed gather
    return copies + partials + indices


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
        self.step: StepContext | None = None
        # free_kv_blocks: the block size of the stages' KV-cache groups (set by the
        # model state once the KV cache exists; None: blocks are not freed).
        self.kv_block_size: int | None = None

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
        self.table.add(slot, req_id, prompt_len, runs_dense, start, generated)

    def remove_request(self, req_id: str) -> None:
        slot = self.table.slot_of.get(req_id)
        if slot is not None:
            self.stash.release(slot)  # finished, aborted or preempted mid-prompt
        self.table.remove(req_id)

    # ---- planning (model state, before the forward) -----------------------------------
    def plan(
        self,
        req_ids: Sequence[str],
        slots: np.ndarray,
        qlen0: np.ndarray,
        ctx0: np.ndarray,
        may_drop: bool,
    ) -> StepContext:
        """Which rows drop this step; ``may_drop=False`` keeps every row whole."""
        cfg = self.config
        slots = np.asarray(slots, dtype=np.int64)
        qlen0 = np.asarray(qlen0, dtype=np.int64)
        ctx0 = np.asarray(ctx0, dtype=np.int64)
        prompt = self.table.prompt_len[slots]
        start = self.table.start[slots]
        generated = self.table.generated[slots]
        prefill_end = prompt + generated  # a recompute also prefills the generated tokens
        end = ctx0 + qlen0
        eligible = (
            (prompt > cfg.sink + cfg.last_q)
            & (prompt >= cfg.min_prompt_len)
            & ~self.table.runs_dense[slots]
        )
        if cfg.top_p >= 1.0 and cfg.keep_ratio is None:
            eligible[:] = False  # p = 1 keeps every block: the dense path, exactly
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
        self.step = StepContext(
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
        )
        return self.step

    def plan_dummy(self, num_reqs: int) -> StepContext:
        """A dummy or capture batch: no request of ours, nothing drops."""
        zeros = np.zeros(num_reqs, dtype=np.int64)
        self.step = StepContext(
            req_ids=[],
            slots=zeros,
            qlen0=zeros,
            ctx0=zeros,
            droppable=np.zeros(num_reqs, dtype=bool),
            dropped=np.zeros((num_reqs, self.num_stages), dtype=np.int64),
        )
        return self.step

    # ---- the staged forward (model hooks) -----------------------------------------------
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
        step = self.step
        if step is None or layer_idx not in self.stage_of_drop:
            return
        cfg = self.config
        qsl = query_start(step.qlen)
        n = int(qsl[-1])
        q = query[:n].view(n, num_heads, head_size)
        k = key[:n].view(n, num_kv_heads, head_size)
        lens = step.qlen
        if self.stage_of_drop[layer_idx] == 0:
            if step.stashing.any():
                self._stash_keys(step, q, k, qsl)
            if step.stash_len.any():
                q, k, lens = self._extend_scoring(step, q, k, qsl)
                qsl = query_start(lens)
        rows, qsl = self._selection_rows(step, lens, qsl)
        if not rows.any():
            return
        dev = query.device
        step.pending = self._select(
            q,
            k,
            torch.from_numpy(qsl.astype(np.int32)).to(dev, non_blocking=True),
            top_p=cfg.top_p,
            block_size=cfg.block_size,
            last_q=cfg.last_q,
            sink=cfg.sink,
            allow_drop=torch.from_numpy(rows).to(dev, non_blocking=True),
            keep_ratio=cfg.keep_ratio,
            scale=scale,
            score_allreduce=self.score_allreduce,
        )

    def on_gather_point(
        self, layer_idx: int, hidden_states: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """After a drop layer's attention: compact, then give later layers their metadata."""
        step = self.step
        if step is None or layer_idx not in self.stage_of_drop:
            return hidden_states, residual
        sel, step.pending = step.pending, None
        stage = self.stage_of_drop[layer_idx] + 1
        if stage == 1 and (step.stashing.any() or step.extended is not None):
            hidden_states, residual = self._gather_chunks(step, sel, hidden_states, residual)
        elif sel is not None and sel.num_kept < int(step.qlen.sum()):
            new_qlen = self._kept_lengths(step, sel)
            self._count(step, stage, step.qlen, new_qlen)
            hidden_states, residual = self._compact(
                step, sel.gather_idx, new_qlen, stage, hidden_states, residual
            )
        elif sel is not None:
            self._count(step, stage, step.qlen, step.qlen)
        if (step.compacted or step.dropped[:, stage].any()) and step.rebuild is not None:
            step.rebuild(step, stage, step.qlen, step.later_ctx(stage))
        return hidden_states, residual

    def finish_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Record this step's drops and put the final hidden states back at their rows.

        Dropped rows get zeros; vLLM only reads the rows of each request's last
        scheduled token, and those are always kept (the last ``last_q`` tokens, or
        an earlier chunk's placeholders). Stashed tokens have no row of the step's
        input: they land in a spare row that is cut off.
        """
        step = self.step
        if step is None or step.kept_at is None:  # kept_at is set by the first compaction
            return hidden_states
        self._record(step)
        rows = step.num_tokens_padded
        out = hidden_states.new_zeros((rows + 1, *hidden_states.shape[1:]))
        out.index_copy_(0, step.gather_total.clamp(max=rows), hidden_states)
        return out[:rows]

    # ---- internals ------------------------------------------------------------------------
    def _selection_rows(
        self, step: StepContext, lens: np.ndarray, qsl: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Rows the selection scores and their starts.

        A row with a protected head (``dense_prefix_tokens``) or tail (the generated
        tokens of a recompute after a preemption) becomes up to three selection rows:
        the head and the tail kept whole, the middle scored on its own. So the
        selection does not depend on whether the head came from vLLM's prefix cache,
        and a recompute scores its prompt with the prompt's own last queries, as its
        first prefill did.
        """
        cfg = self.config
        head = np.where(step.droppable, np.minimum(step.protect, lens), 0)
        tail = np.where(step.droppable, np.minimum(step.tail, lens - head), 0)
        rows = step.droppable & (lens - head - tail > cfg.sink + cfg.last_q)
        split = rows & ((head > 0) | (tail > 0))
        step.sub_owner = None
        if not split.any():
            return rows, qsl
        head, tail = np.where(split, head, 0), np.where(split, tail, 0)
        parts = np.stack([head, lens - head - tail, tail], axis=1)
        scored = np.stack([np.zeros_like(rows), rows, np.zeros_like(rows)], axis=1)
        present = parts > 0
        present[:, 1] = True  # every row keeps its middle part (a whole unsplit row)
        step.sub_owner = np.repeat(np.arange(len(lens)), present.sum(axis=1))
        return scored[present], query_start(parts[present])

    def _stash_keys(
        self, step: StepContext, q: torch.Tensor, k: torch.Tensor, qsl: np.ndarray
    ) -> None:
        """Keep this chunk's drop-layer keys (and queries among the prompt's last last_q)."""
        last_q = self.config.last_q
        for r in np.flatnonzero(step.stashing):
            a, b = int(qsl[r]), int(qsl[r + 1])
            prompt = int(self.table.prompt_len[step.slots[r]])
            # The scoring queries are the prompt's last last_q tokens; a recompute's
            # chunk may also hold generated tokens after them.
            c0 = int(step.ctx0[r])
            lo = max(c0, prompt - last_q) - c0
            hi = min(c0 + b - a, prompt) - c0
            tail = (lo, q[a + lo : a + hi].clone()) if hi > lo else None
            step.chunk_keys[int(r)] = (k[a:b].clone(), tail)

    def _extend_scoring(
        self, step: StepContext, q: torch.Tensor, k: torch.Tensor, qsl: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        """q/k of every row, each last chunk's stashed tokens ahead of its own.

        Only a row's last ``last_q`` queries are scored; the other stashed query rows
        are zeros.
        """
        qs: list[torch.Tensor] = []
        ks: list[torch.Tensor] = []
        to_source: list[np.ndarray] = []
        slots: list[int] = []
        source_off = step.num_tokens_padded
        for r in range(len(step.qlen)):
            a, b = int(qsl[r]), int(qsl[r + 1])
            n_stash = int(step.stash_len[r])
            if n_stash:
                stash = self.stash.get(int(step.slots[r]))
                stash_q = q.new_zeros((n_stash, *q.shape[1:]))
                offset = 0
                for c in stash.chunks:
                    if c.tail_queries is not None:
                        at = offset + c.tail_offset
                        stash_q[at : at + c.tail_queries.shape[0]] = c.tail_queries
                    offset += c.hidden.shape[0]
                qs.append(stash_q)
                ks.append(stash.cat("keys"))
                to_source.append(np.arange(source_off, source_off + n_stash))
                source_off += n_stash
                slots.append(int(step.slots[r]))
            qs.append(q[a:b])
            ks.append(k[a:b])
            to_source.append(np.arange(a, b))
        index = torch.from_numpy(np.concatenate(to_source).astype(np.int64))
        step.extended = ExtendedRows(index.to(q.device, non_blocking=True), slots)
        return torch.cat(qs), torch.cat(ks), step.prefill_len

    def _gather_chunks(
        self, step: StepContext, sel: Any, hidden: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first gather point of a step with chunked prompts.

        Earlier chunks go into the stash and keep only placeholders; last chunks take
        their kept tokens from the stash and from this step alike.
        """
        ext = step.extended
        lens = step.prefill_len  # at the first gather point: this step's tokens + stashes
        if sel is not None:
            new_qlen, idx = self._kept_lengths(step, sel), sel.gather_idx
        else:
            new_qlen, idx = lens.copy(), None
        self._count(step, 1, lens, new_qlen)
        if step.stashing.any():
            qsl = query_start(step.qlen)
            assert step.positions is not None
            for r, (keys, tail) in step.chunk_keys.items():
                a, b = int(qsl[r]), int(qsl[r + 1])
                chunk = StashedChunk(
                    hidden=hidden[a:b].clone(),
                    residual=residual[a:b].clone(),
                    positions=step.positions[a:b].clone(),
                    keys=keys,
                    tail_queries=tail[1] if tail else None,
                    tail_offset=tail[0] if tail else 0,
                )
                self.stash.get(int(step.slots[r])).chunks.append(chunk)
            step.chunk_keys = {}
            # Of a stashing row (kept whole by the selection) keep its last tokens only.
            keep = np.where(step.stashing, np.minimum(new_qlen, PLACEHOLDER_TOKENS), new_qlen)
            end = np.cumsum(new_qlen)
            picks = np.concatenate([np.arange(e - n, e) for e, n in zip(end, keep, strict=True)])
            pick = torch.from_numpy(picks.astype(np.int64)).to(hidden.device, non_blocking=True)
            if idx is None:
                idx = pick
            else:
                idx = idx[pick]
            new_qlen = keep
        assert idx is not None
        if ext is not None:
            idx = ext.to_source[idx]
            stashes = [self.stash.get(slot) for slot in ext.slots]
            hidden = torch.cat([hidden, *(s.cat("hidden") for s in stashes)])
            residual = torch.cat([residual, *(s.cat("residual") for s in stashes)])
            assert step.positions is not None
            step.positions = torch.cat([step.positions, *(s.cat("positions") for s in stashes)])
            for slot in ext.slots:
                self.stash.release(slot)
            self.stats.chunked_prefills += len(ext.slots)
        return self._compact(step, idx, new_qlen, 1, hidden, residual)

    def _record(self, step: StepContext) -> None:
        rows = np.flatnonzero(step.droppable)
        assert step.kept_at is not None
        prefill = step.prefill_len[rows]
        dropped = prefill[:, None] - step.kept_at[rows]
        dropped[:, 0] = 0
        self.table.record(step.slots[rows], dropped)
        if self.kv_block_size:
            self._record_freed(step, rows, dropped)
        for r, d, prompt in zip(rows, dropped, prefill, strict=True):
            if d[-1] > 0:
                self.stats.dropped_prefills += 1
                shares = ", ".join(f"{k / prompt:.3f}" for k in step.kept_at[r, 1:])
                logger.info(
                    "uniprefill: request %s prefill dropped: prompt_tokens=%d kept_share=[%s]",
                    step.req_ids[r],
                    prompt,
                    shares,
                )

    def _record_freed(self, step: StepContext, rows: np.ndarray, dropped: np.ndarray) -> None:
        """free_kv_blocks: the ranges each stage no longer needs, for both sides."""
        bs = self.kv_block_size
        total = step.ctx0[rows] + step.qlen0[rows]
        kept = total[:, None] - dropped
        at = np.zeros_like(dropped)
        length = np.zeros_like(dropped)
        for i, r in enumerate(rows):
            for s in range(1, dropped.shape[1]):
                first, count = kv_blocks.freed_blocks(int(total[i]), int(kept[i, s]), bs)
                at[i, s], length[i, s] = first * bs, count * bs
            if length[i].any():
                kv_blocks.post(
                    kv_blocks.KeptRecord(
                        step.req_ids[r], int(total[i]), tuple(int(k) for k in kept[i, 1:])
                    )
                )
        self.table.record_freed(step.slots[rows], at, length)

    def _count(
        self, step: StepContext, stage: int, seen_qlen: np.ndarray, new_qlen: np.ndarray
    ) -> None:
        rows = step.droppable
        self.stats.add(stage - 1, int(seen_qlen[rows].sum()), int(new_qlen[rows].sum()))

    @staticmethod
    def _kept_lengths(step: StepContext, sel: Any) -> np.ndarray:
        cu = sel.new_cu_seqlens_cpu
        cu = sel.new_cu_seqlens.cpu() if cu is None else cu  # None only if nothing synced
        kept = np.diff(cu.numpy()).astype(np.int64)
        if step.sub_owner is None:
            return kept
        return np.bincount(step.sub_owner, weights=kept, minlength=len(step.qlen)).astype(np.int64)

    def _compact(
        self,
        step: StepContext,
        idx: torch.Tensor,
        new_qlen: np.ndarray,
        stage: int,
        hidden: torch.Tensor,
        residual: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Padding rows (if any) are never in idx: after the first compaction the
        # hidden states hold real tokens only.
        step.gather_total = idx if step.gather_total is None else step.gather_total[idx]
        if step.positions is not None:
            step.positions = step.positions[idx]
        if step.kept_at is None:
            step.kept_at = np.repeat(step.qlen0[:, None], self.num_stages, axis=1)
        step.kept_at[:, stage:] = new_qlen[:, None]
        step.qlen = new_qlen
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
        cfg = self.config
        prompt = cfg.sink + cfg.last_q + 4 * cfg.block_size
        counts = [r for r in (1, 16, 256) if r == 1 or r <= max_num_reqs]
        modes: list[dict[str, Any]] = [{"top_p": min(cfg.top_p, 0.99), "keep_ratio": None}]
        if cfg.keep_ratio is not None:
            modes.append({"top_p": cfg.top_p, "keep_ratio": cfg.keep_ratio})
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
                    q,
                    k,
                    cu,
                    block_size=cfg.block_size,
                    last_q=cfg.last_q,
                    sink=cfg.sink,
                    allow_drop=allow,
                    scale=scale,
                    score_allreduce=None,
                    **mode,
                )
        return counts
