"""One engine step of UniPrefill: select at drop layers, compact, rebuild metadata.

The runtime never imports vLLM: :mod:`uniprefill.vllm.compat` hands it
plain tensors and closures (``GroupBuild.rebuild``) and installs its hooks.

Per step, on the host, from numbers vLLM already has on the host:

* ``qlen0`` / ``ctx0``: scheduled and already-computed tokens per request;
* which rows may drop: the whole prompt is in this step (no earlier chunk, so
  the operator sees every key), it is longer than ``sink + last_q`` and than
  ``min_prompt_len``, and it wants no prompt logprobs;
* the per-stage dropped counts of requests compacted in earlier steps.

Per drop layer, on the device: the selection operator (one host sync, for
the kept count), a gather of hidden states, residual and positions, and new
attention metadata for every later layer: query start locations, sequence
lengths, slot mapping (each row writes its K/V at its own compacted
offset), max lengths.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from uniprefill.config import UniPrefillConfig
from uniprefill.vllm.records import DropStats, KeptLengthTable


@dataclass
class StageLens:
    """Lengths of one stage, on host and device, as attention builders want them."""

    query_start_loc_cpu: torch.Tensor  # int32 [R+1]
    query_start_loc: torch.Tensor
    seq_lens_cpu: torch.Tensor  # int32 [R]
    seq_lens: torch.Tensor
    num_computed_cpu: torch.Tensor  # int32 [R]
    num_tokens: int  # real tokens of this stage
    num_tokens_padded: int  # rows of the hidden-state tensor (real + padding)
    max_query_len: int
    max_seq_len: int
    positions: torch.Tensor  # [num_tokens_padded]


@dataclass
class GroupBuild:
    """How to rebuild one attention group's metadata for a stage (made by compat)."""

    layer_names: list[str]
    layer_indices: list[int]
    rebuild: Callable[[StageLens, torch.Tensor], Any]
    block_table: torch.Tensor | None  # None: not a paged-KV group (e.g. linear attention)
    kernel_block_size: int


def compaction_reserve_bytes(
    max_tokens: int,
    max_reqs: int,
    hidden_size: int,
    act_bytes: int,
    num_q_heads: int,
    last_q: int,
) -> int:
    """Device memory a step may need on top of vLLM's dense forward (an upper bound).

    At a gather point the compacted hidden states and residual are new tensors that
    live beside the originals until the layer moves on; the selection adds fp32
    per-key-tile softmax partials (key tiles are >= 64 tokens, queries padded by
    less than 128) and a few per-token index buffers. vLLM sizes the KV cache from a
    dense profile run, so this much must be held during that run or the first long
    compacted batch can run out of memory.
    """
    copies = 2 * max_tokens * hidden_size * act_bytes
    tiles = max_tokens // 64 + max_reqs
    partials = 2 * tiles * num_q_heads * (last_q + 128) * 4
    indices = max_tokens * (1 + 4 + 8 + 8)  # keep mask, prefix count, gather, composed gather
    return copies + partials + indices


def compute_slot_mapping(
    block_table: torch.Tensor,
    kernel_block_size: int,
    num_computed: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_tokens: int,
    num_tokens_padded: int,
) -> torch.Tensor:
    """Slot of every token: row r's j-th token goes to index ``num_computed[r] + j``.

    Padding rows get -1 (vLLM's pad slot), so the KV write skips them.
    """
    device = block_table.device
    slots = torch.full((num_tokens_padded,), -1, dtype=torch.int64, device=device)
    if num_tokens == 0:
        return slots
    tok = torch.arange(num_tokens, device=device, dtype=torch.int64)
    qsl = query_start_loc.to(device=device, dtype=torch.int64)
    row = torch.searchsorted(qsl[1:], tok, right=True)
    index = num_computed.to(device=device, dtype=torch.int64)[row] + (tok - qsl[row])
    block = block_table[row, index // kernel_block_size].to(torch.int64)
    slots[:num_tokens] = block * kernel_block_size + index % kernel_block_size
    return slots


@dataclass
class StepState:
    """What one step knows and changes as it walks the stages."""

    req_ids: list[str]
    qlen0: np.ndarray
    ctx0: np.ndarray
    droppable: np.ndarray  # bool [R]
    dropped: np.ndarray  # [R, S+1] from earlier steps
    groups: list[GroupBuild]
    qlen: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    positions: torch.Tensor | None = None
    gather_total: torch.Tensor | None = None  # kept rows, as indices into the step's input
    pending: Any = None  # Selection from the current drop layer's attention
    num_tokens_padded: int = 0  # rows of the model input (vLLM may pad past num_tokens)
    kept_at: np.ndarray | None = None  # [R, S+1] tokens of each row alive in each stage

    def __post_init__(self) -> None:
        self.qlen = self.qlen0.copy()

    @property
    def active(self) -> bool:
        return bool(self.droppable.any() or self.dropped.any())

    @property
    def compacted(self) -> bool:
        return self.gather_total is not None


class UniPrefillRuntime:
    """Holds the drop schedule and the length table of one model runner."""

    def __init__(
        self,
        config: UniPrefillConfig,
        drop_layers: Sequence[int],
        device: torch.device,
        score_allreduce: Callable[[torch.Tensor], None] | None = None,
        select_fn: Callable[..., Any] | None = None,
    ) -> None:
        self.config = config
        self.drop_layers = tuple(drop_layers)
        self.stage_of_drop = {layer: s for s, layer in enumerate(self.drop_layers)}
        self.table = KeptLengthTable(num_stages=len(self.drop_layers) + 1)
        self.stats = DropStats(self.drop_layers)
        self.device = device
        self.score_allreduce = score_allreduce
        if select_fn is None:
            from uniprefill.ops import select_tokens

            select_fn = select_tokens
        self._select = select_fn
        self.step: StepState | None = None

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

    # ---- step lifecycle -------------------------------------------------------------
    def begin_step(
        self,
        req_ids: Sequence[str],
        qlen0: np.ndarray,
        ctx0: np.ndarray,
        num_prompt: np.ndarray,
        wants_prompt_logprobs: np.ndarray,
        groups: list[GroupBuild],
    ) -> StepState:
        cfg = self.config
        qlen0 = np.asarray(qlen0, dtype=np.int64)
        ctx0 = np.asarray(ctx0, dtype=np.int64)
        # A request computed from scratch this step has no compacted KV anymore
        # (vLLM recomputes a preempted request from its first token).
        for r in np.flatnonzero(ctx0 == 0):
            if req_ids[r] in self.table:
                self.table.forget(req_ids[r])
                self.stats.restarted += 1
        droppable = (
            (ctx0 == 0)
            & (qlen0 == np.asarray(num_prompt, dtype=np.int64))
            & (qlen0 > cfg.sink + cfg.last_q)
            & (qlen0 >= cfg.min_prompt_len)
            & ~np.asarray(wants_prompt_logprobs, dtype=bool)
        )
        if cfg.top_p >= 1.0 and cfg.keep_ratio is None:
            droppable[:] = False  # p = 1 keeps every block: the dense path, exactly
        self.step = StepState(
            req_ids=list(req_ids),
            qlen0=qlen0,
            ctx0=ctx0,
            droppable=droppable,
            dropped=self.table.matrix(req_ids),
            groups=groups,
        )
        return self.step

    def end_step(self) -> None:
        self.step = None

    # ---- hooks (called by compat) -----------------------------------------------------
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
        rows = step.droppable & (step.qlen > self.config.sink + self.config.last_q)
        if not rows.any():
            return
        cfg = self.config
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
        self,
        layer_idx: int,
        hidden_states: torch.Tensor,
        residual: torch.Tensor,
        attn_metadata: dict[str, Any],
        slot_mapping: dict[str, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """After a drop layer's attention: compact, then switch later layers' metadata."""
        step = self.step
        if step is None or layer_idx not in self.stage_of_drop:
            return hidden_states, residual
        sel, step.pending = step.pending, None
        stage = self.stage_of_drop[layer_idx] + 1
        if sel is not None and sel.num_kept < int(step.qlen.sum()):
            hidden_states, residual = self._compact(step, sel, stage, hidden_states, residual)
        elif sel is not None:
            self._count(step, stage, step.qlen)
        if step.compacted or step.dropped[:, stage].any():
            self._install_stage_metadata(step, stage, attn_metadata, slot_mapping)
        return hidden_states, residual

    def finish_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Put the final hidden states back at the step's original token rows.

        Dropped rows get zeros; vLLM only reads the rows of each request's last
        scheduled token, and those are always kept (the last ``last_q`` tokens).
        """
        step = self.step
        if step is None or step.gather_total is None:
            return hidden_states
        out = hidden_states.new_zeros((step.num_tokens_padded, *hidden_states.shape[1:]))
        out.index_copy_(0, step.gather_total, hidden_states)
        return out

    def record_step(self) -> None:
        """Store this step's compactions so later decode steps use them."""
        step = self.step
        if step is None or step.kept_at is None:  # kept_at is set by the first compaction
            return
        for r in np.flatnonzero(step.droppable):
            # Prompt tokens of row r removed before each stage in this step.
            dropped = step.qlen0[r] - step.kept_at[r]
            self.table.record(step.req_ids[r], dropped)
            if dropped[-1] > 0:
                self.stats.dropped_prefills += 1

    # ---- internals ------------------------------------------------------------------------
    def _count(self, step: StepState, stage: int, new_qlen: np.ndarray) -> None:
        rows = step.droppable
        self.stats.add(stage - 1, int(step.qlen[rows].sum()), int(new_qlen[rows].sum()))

    def _compact(
        self, step: StepState, sel: Any, stage: int, hidden: torch.Tensor, residual: torch.Tensor
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
            step.kept_at = np.repeat(step.qlen0[:, None], self.table.num_stages, axis=1)
        step.kept_at[:, stage:] = new_qlen[:, None]
        step.qlen = new_qlen
        return hidden[idx], residual[idx]

    def _stage_lens(self, step: StepState, stage: int) -> StageLens:
        # Rows compacted this step start from an empty KV; others keep their context
        # minus what earlier steps dropped before this stage.
        ctx = step.ctx0 - step.dropped[:, stage]
        qsl = _query_start(step.qlen)
        seq = ctx + step.qlen
        num_tokens = int(qsl[-1])
        padded = num_tokens if step.compacted else step.num_tokens_padded
        dev = self.device
        qsl_cpu = torch.from_numpy(qsl.astype(np.int32))
        seq_cpu = torch.from_numpy(seq.astype(np.int32))
        return StageLens(
            query_start_loc_cpu=qsl_cpu,
            query_start_loc=qsl_cpu.to(dev, non_blocking=True),
            seq_lens_cpu=seq_cpu,
            seq_lens=seq_cpu.to(dev, non_blocking=True),
            num_computed_cpu=torch.from_numpy(ctx.astype(np.int32)),
            num_tokens=num_tokens,
            num_tokens_padded=padded,
            max_query_len=int(step.qlen.max()) if len(step.qlen) else 0,
            max_seq_len=int(seq.max()) if len(seq) else 0,
            positions=step.positions,
        )

    def _install_stage_metadata(
        self,
        step: StepState,
        stage: int,
        attn_metadata: dict[str, Any],
        slot_mapping: dict[str, torch.Tensor],
    ) -> None:
        lens = self._stage_lens(step, stage)
        ctx_dev = lens.num_computed_cpu.to(self.device, non_blocking=True)
        first_layer = self.drop_layers[stage - 1] + 1
        for group in step.groups:
            names = [
                n
                for n, i in zip(group.layer_names, group.layer_indices, strict=True)
                if i >= first_layer
            ]
            if not names:
                continue
            if group.block_table is not None:
                slots = compute_slot_mapping(
                    group.block_table,
                    group.kernel_block_size,
                    ctx_dev,
                    lens.query_start_loc,
                    lens.num_tokens,
                    lens.num_tokens_padded,
                )
            else:
                slots = torch.full(
                    (lens.num_tokens_padded,), -1, dtype=torch.int64, device=self.device
                )
            meta = group.rebuild(lens, slots)
            for name in names:
                attn_metadata[name] = meta
                if name in slot_mapping:
                    slot_mapping[name] = slots


def _query_start(qlen: np.ndarray) -> np.ndarray:
    """Query start locations ``[R+1]`` (int64) of rows with ``qlen`` tokens."""
    qsl = np.zeros(len(qlen) + 1, dtype=np.int64)
    np.cumsum(qlen, out=qsl[1:])
    return qsl
