"""One engine step: its plan, and the walk of its dropping forward over the stages.

The model state plans each step (:meth:`~uniprefill.vllm.runtime.UniPrefillRuntime.plan`):
a :class:`StepPlan`, fixed once made, says which rows drop, which stash a chunk and
which bring stashed tokens. A step that drops runs its layers in stages; its forward
(``UniPrefillModel._dropping_forward``) starts a :class:`StageWalk`, the cursor the
runtime's hooks move at each drop layer (kept rows, their lengths and positions), and
enters each later stage with an explicit call that asks the model state for the
stage's attention metadata. :func:`compaction_reserve_bytes` bounds the device memory
such a forward needs beyond vLLM's dense one.

With pipeline parallelism a walk crosses ranks: :func:`walk_carry` packs what the next
rank's layers need (kept rows, tokens alive per row in every stage) into one int64
tensor that travels with the intermediate tensors, and :func:`resume_walk` unpacks it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


def _int_rows(n: int) -> np.ndarray:
    return np.zeros(n, dtype=np.int64)


@dataclass(frozen=True)
class StepPlan:
    """What one step is: its rows and what each does (the arrays are per row, ``[R]``)."""

    req_ids: list[str]
    slots: np.ndarray  # request slots (vLLM's req_index) of the batch rows
    qlen0: np.ndarray  # scheduled tokens per row
    ctx0: np.ndarray  # tokens computed before this step
    droppable: np.ndarray  # bool: rows scored at the drop layers
    dropped: np.ndarray  # [R, S+1] prompt tokens dropped before each stage, earlier steps
    # Chunked prompts: rows whose chunk goes into the stash (not the last chunk), and
    # per row the stashed tokens the last chunk scores with its own (0 elsewhere).
    stashing: np.ndarray | None = None
    stash_len: np.ndarray | None = None
    # Prefix caching: per row the prompt tokens vLLM had cached (dense at every layer,
    # before the row's first token), and the tokens at the head of the row's selection
    # set that are never dropped (dense_prefix_tokens not yet cached).
    start: np.ndarray | None = None
    protect: np.ndarray | None = None
    # Per row the tokens at the end of its selection set that are never dropped: what a
    # request recomputed after a preemption had generated (0 for a first prefill).
    tail: np.ndarray | None = None
    # Per row its top_p where a request of the step has its own (extra_args), else None:
    # the engine's top_p for every row.
    top_p: np.ndarray | None = None
    # Layer name -> slot mapping to put into the forward context before the forward
    # (decode rows of compacted requests write K/V at their compacted offsets); the
    # model state fills it while it prepares the step.
    slot_overrides: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.qlen0)
        defaults = {"stashing": np.zeros(n, dtype=bool), "stash_len": _int_rows(n)}
        defaults |= {"start": _int_rows(n), "protect": _int_rows(n), "tail": _int_rows(n)}
        for name, zeros in defaults.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, zeros)

    @property
    def dropping(self) -> bool:
        """Whether a row may drop tokens this step (the forward then runs staged)."""
        return bool(self.droppable.any() or self.stashing.any())

    @property
    def prefill_len(self) -> np.ndarray:
        """Tokens each row's selection chooses from (the whole prompt for a last chunk)."""
        return self.qlen0 + self.stash_len

    def later_ctx(self, stage: int) -> np.ndarray:
        """Tokens of each row in stage ``stage``'s KV before this step's tokens.

        A chunked prompt has only its cached prefix there until its last chunk writes
        every kept token; other rows hold their context minus earlier steps' drops.
        """
        chunked = self.stashing | (self.stash_len > 0)
        return np.where(chunked, self.start, self.ctx0 - self.dropped[:, stage])


@dataclass
class StageWalk:
    """Where a dropping forward is: the stage it runs and the tokens alive in it."""

    plan: StepPlan
    positions: torch.Tensor  # of the alive tokens (a copy of the model input's at first)
    num_tokens_padded: int  # rows of the model input (vLLM may pad past num_tokens)
    stage: int = 0
    qlen: np.ndarray = field(init=False)  # [R] alive tokens per row in this stage
    gather_total: torch.Tensor | None = None  # kept rows, as indices into the step's input
    pending: Any = None  # Selection from the current drop layer's attention
    kept_at: np.ndarray | None = None  # [R, S+1] tokens of each row alive in each stage
    # Set at the first drop layer when a last chunk reads its stash.
    extended: ExtendedRows | None = None
    # Row -> (keys, (offset in the chunk, queries) of the prompt's last last_q tokens in
    # it) of a stashing row, taken at the drop layer's attention until its gather point
    # completes the chunk.
    chunk_keys: dict[int, tuple[torch.Tensor, tuple[int, torch.Tensor] | None]] = field(
        default_factory=dict
    )
    # The current drop layer's selection rows -> step rows, when rows with a protected
    # head or tail were split (None: one selection row per step row).
    sub_owner: np.ndarray | None = None
    # (drop layer index, tokens seen, tokens kept) of the step's droppable rows at each
    # drop layer that scored: a pipeline rank counts the earlier ranks' too.
    counts: list[tuple[int, int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.qlen = self.plan.qlen0.copy()

    @property
    def compacted(self) -> bool:
        return self.gather_total is not None

    def needs_metadata(self) -> bool:
        """Whether this stage's attention metadata differs from vLLM's (after a drop layer:
        tokens were dropped this step, or rows hold fewer tokens from earlier steps)."""
        return self.compacted or bool(self.plan.dropped[:, self.stage].any())


@dataclass
class ExtendedRows:
    """The first drop layer's token set when last chunks bring their stashed tokens.

    Rows are laid out as the selection saw them (each last chunk's stash ahead of its
    own tokens); ``to_source`` maps those tokens into ``[step rows ; stashes]``.
    """

    to_source: torch.Tensor  # [sum(prefill_len)] int64
    slots: list[int]  # request slots whose stashes follow the step's rows, in order


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


def query_start(qlen: np.ndarray) -> np.ndarray:
    """Query start locations ``[R+1]`` (int64) of rows with ``qlen`` tokens."""
    qsl = np.zeros(len(qlen) + 1, dtype=np.int64)
    np.cumsum(qlen, out=qsl[1:])
    return qsl


# Pipeline parallelism: a walk's state as one int64 tensor [n, CARRY_COLS + S + 1 + 3]
# that travels with vLLM's intermediate tensors (n: the step's padded token count, as
# the receiving rank slices them; -1 where unused). Column 0: the kept rows, as indices
# into the step's input; [0, 1]: their count (-1: nothing compacted yet); rows [0, R)
# of the next S + 1 columns: ``kept_at``; rows of the last 3: the walk's ``counts``.
CARRY_COLS = 2
_COUNT_COLS = 3


def carry_width(num_stages: int) -> int:
    """Columns of the carried tensor of a model with ``num_stages`` stages."""
    return CARRY_COLS + num_stages + _COUNT_COLS


def walk_carry(walk: StageWalk, num_stages: int) -> torch.Tensor:
    """The walk's state for the next pipeline rank (one row per input token)."""
    n = walk.num_tokens_padded
    dev = walk.positions.device
    width = carry_width(num_stages)
    carry = torch.full((n, width), -1, dtype=torch.int64, device=dev)
    rows = len(walk.plan.qlen0)
    if len(walk.counts) > n:  # never: a row that drops has more tokens than there are layers
        raise RuntimeError("uniprefill: more drop layers than tokens in a dropping step")
    head = np.full((max(rows, len(walk.counts), 1), width - 1), -1, dtype=np.int64)
    if walk.gather_total is not None:
        assert walk.kept_at is not None
        kept = walk.gather_total.shape[0]
        carry[:kept, 0] = walk.gather_total
        head[0, 0] = kept
        head[:rows, 1 : 1 + num_stages] = walk.kept_at
    if walk.counts:
        head[: len(walk.counts), 1 + num_stages :] = np.asarray(walk.counts, dtype=np.int64)
    carry[: len(head), 1:] = torch.from_numpy(head).to(dev, non_blocking=True)
    return carry


def resume_walk(
    plan: StepPlan, positions: torch.Tensor, carry: torch.Tensor, stage: int, num_stages: int
) -> StageWalk:
    """The walk a previous pipeline rank left at stage ``stage`` (``positions``: this
    rank's input positions, the same as the first rank's; one host sync)."""
    walk = StageWalk(plan, positions.clone(), positions.shape[0], stage=stage)
    rows = len(plan.qlen0)
    head = carry[: max(rows, num_stages - 1, 1), 1:].cpu().numpy()
    counts = head[:, 1 + num_stages :]
    walk.counts = [(int(d), int(a), int(b)) for d, a, b in counts[counts[:, 0] >= 0]]
    kept = int(head[0, 0])
    if kept < 0:
        return walk
    walk.gather_total = carry[:kept, 0].clone()
    walk.positions = walk.positions[walk.gather_total]
    walk.kept_at = head[:rows, 1 : 1 + num_stages].copy()
    walk.qlen = walk.kept_at[:, stage].copy()
    return walk
