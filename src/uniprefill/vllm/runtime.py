"""One engine step of UniPrefill: which rows drop, select at drop layers, compact.

The runtime never imports vLLM. The model state plans each step from the
``InputBatch`` (:meth:`UniPrefillRuntime.plan`), the model's staged forward calls
:meth:`on_attention_input` and :meth:`on_gather_point` at each drop layer, and a
:class:`StageRebuilder` (made by the model state) turns the new lengths into vLLM
attention metadata for the later layers.

Per drop layer, on the device: the selection operator (one host sync, for the kept
count) and a gather of hidden states, residual and positions. On the host: the
lengths of every row in the next stage, from numbers the step already holds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from uniprefill.config import UniPrefillConfig
from uniprefill.vllm.records import DropStats, RequestTable

logger = logging.getLogger("vllm.uniprefill")


class StageRebuilder(Protocol):
    """Installs attention metadata for one stage of a dropping step (see model_state)."""

    def __call__(
        self, step: StepContext, stage: int, qlen: np.ndarray, ctx: np.ndarray
    ) -> None: ...


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


@dataclass
class StepContext:
    """What one step knows, and what its dropping forward changes stage by stage."""

    req_ids: list[str]
    slots: np.ndarray  # [R] request slots (vLLM's req_index) of the batch rows
    qlen0: np.ndarray  # [R] scheduled tokens per row
    ctx0: np.ndarray  # [R] tokens computed before this step
    droppable: np.ndarray  # bool [R]
    dropped: np.ndarray  # [R, S+1] prompt tokens dropped before each stage, earlier steps
    # Layer name -> slot mapping to put into the forward context before the forward
    # (decode rows of compacted requests write K/V at their compacted offsets).
    slot_overrides: dict[str, torch.Tensor] = field(default_factory=dict)
    rebuild: StageRebuilder | None = None
    # The dropping forward's walk over the stages.
    qlen: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    positions: torch.Tensor | None = None
    gather_total: torch.Tensor | None = None  # kept rows, as indices into the step's input
    pending: Any = None  # Selection from the current drop layer's attention
    num_tokens_padded: int = 0  # rows of the model input (vLLM may pad past num_tokens)
    kept_at: np.ndarray | None = None  # [R, S+1] tokens of each row alive in each stage

    def __post_init__(self) -> None:
        self.qlen = self.qlen0.copy()

    @property
    def dropping(self) -> bool:
        """Whether a row may drop tokens this step (the forward then runs staged)."""
        return bool(self.droppable.any())

    @property
    def compacted(self) -> bool:
        return self.gather_total is not None


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
    ) -> None:
        self.config = config
        self.drop_layers = tuple(drop_layers)
        self.stage_of_drop = {layer: s for s, layer in enumerate(self.drop_layers)}
        self.num_stages = len(self.drop_layers) + 1
        self.table = RequestTable(max_num_reqs, self.num_stages, device)
        self.stats = DropStats(self.drop_layers)
        self.device = device
        self.score_allreduce = score_allreduce
        if select_fn is None:
            from uniprefill.ops import select_tokens

            select_fn = select_tokens
        self._select = select_fn
        self.step: StepContext | None = None

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
        # A row drops only if its whole prompt is in this step (the operator then sees
        # every key) and nothing of it was computed before: a chunk continuation or a
        # recompute after preemption (prompt + generated tokens) runs dense.
        droppable = (
            (ctx0 == 0)
            & (qlen0 == self.table.prompt_len[slots])
            & (qlen0 > cfg.sink + cfg.last_q)
            & (qlen0 >= cfg.min_prompt_len)
            & ~self.table.runs_dense[slots]
        )
        if not may_drop or (cfg.top_p >= 1.0 and cfg.keep_ratio is None):
            droppable[:] = False  # p = 1 keeps every block: the dense path, exactly
        self.step = StepContext(
            req_ids=list(req_ids),
            slots=slots,
            qlen0=qlen0,
            ctx0=ctx0,
            droppable=droppable,
            dropped=self.table.dropped[slots],
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
        rows = step.droppable & (step.qlen > cfg.sink + cfg.last_q)
        if not rows.any():
            return
        qsl = _query_start(step.qlen)
        n = int(qsl[-1])
        dev = query.device
        step.pending = self._select(
            query[:n].view(n, num_heads, head_size),
            key[:n].view(n, num_kv_heads, head_size),
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
        if sel is not None and sel.num_kept < int(step.qlen.sum()):
            hidden_states, residual = self._compact(step, sel, stage, hidden_states, residual)
        elif sel is not None:
            self._count(step, stage, step.qlen)
        if (step.compacted or step.dropped[:, stage].any()) and step.rebuild is not None:
            # Rows compacted this step start from an empty KV; the others keep their
            # context minus what earlier steps dropped before this stage.
            step.rebuild(step, stage, step.qlen, step.ctx0 - step.dropped[:, stage])
        return hidden_states, residual

    def finish_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Record this step's drops and put the final hidden states back at their rows.

        Dropped rows get zeros; vLLM only reads the rows of each request's last
        scheduled token, and those are always kept (the last ``last_q`` tokens).
        """
        step = self.step
        if step is None or step.kept_at is None:  # kept_at is set by the first compaction
            return hidden_states
        self._record(step)
        out = hidden_states.new_zeros((step.num_tokens_padded, *hidden_states.shape[1:]))
        out.index_copy_(0, step.gather_total, hidden_states)
        return out

    # ---- internals ------------------------------------------------------------------------
    def _record(self, step: StepContext) -> None:
        rows = np.flatnonzero(step.droppable)
        assert step.kept_at is not None
        dropped = step.qlen0[rows, None] - step.kept_at[rows]
        self.table.record(step.slots[rows], dropped)
        for r, d in zip(rows, dropped, strict=True):
            if d[-1] > 0:
                self.stats.dropped_prefills += 1
                prompt = int(step.qlen0[r])
                shares = ", ".join(f"{k / prompt:.3f}" for k in step.kept_at[r, 1:])
                logger.info(
                    "uniprefill: request %s prefill dropped: prompt_tokens=%d kept_share=[%s]",
                    step.req_ids[r],
                    prompt,
                    shares,
                )

    def _count(self, step: StepContext, stage: int, new_qlen: np.ndarray) -> None:
        rows = step.droppable
        self.stats.add(stage - 1, int(step.qlen[rows].sum()), int(new_qlen[rows].sum()))

    def _compact(
        self,
        step: StepContext,
        sel: Any,
        stage: int,
        hidden: torch.Tensor,
        residual: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cu = sel.new_cu_seqlens_cpu
        cu = sel.new_cu_seqlens.cpu() if cu is None else cu  # None only if nothing synced
        new_qlen = np.diff(cu.numpy()).astype(np.int64)
        self._count(step, stage, new_qlen)
        idx = sel.gather_idx
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
            cu = torch.from_numpy(_query_start(lens).astype(np.int32)).to(self.device)
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


def _query_start(qlen: np.ndarray) -> np.ndarray:
    """Query start locations ``[R+1]`` (int64) of rows with ``qlen`` tokens."""
    qsl = np.zeros(len(qlen) + 1, dtype=np.int64)
    np.cumsum(qlen, out=qsl[1:])
    return qsl
