"""What one engine step knows, and what its dropping forward changes stage by stage.

The model state makes a :class:`StepContext` when it plans a step
(:meth:`~uniprefill.vllm.runtime.UniPrefillRuntime.plan`); the runtime's hooks at the
drop layers update it (kept rows, lengths, positions) as the forward walks the stages.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch


class StageRebuilder(Protocol):
    """Installs attention metadata for one stage of a dropping step (see model_state)."""

    def __call__(
        self, step: StepContext, stage: int, qlen: np.ndarray, ctx: np.ndarray
    ) -> None: ...


@dataclass
class StepContext:
    """What one step knows, and what its dropping forward changes stage by stage."""

    req_ids: list[str]
    slots: np.ndarray  # [R] request slots (vLLM's req_index) of the batch rows
    qlen0: np.ndarray  # [R] scheduled tokens per row
    ctx0: np.ndarray  # [R] tokens computed before this step
    droppable: np.ndarray  # bool [R] rows scored at the drop layers
    dropped: np.ndarray  # [R, S+1] prompt tokens dropped before each stage, earlier steps
    # Chunked prompts: rows whose chunk goes into the stash (not the last chunk), and
    # per row the stashed tokens the last chunk scores with its own (0 elsewhere).
    stashing: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    stash_len: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # Prefix caching: per row the prompt tokens vLLM had cached (dense at every layer,
    # before the row's first token), and the tokens at the head of the row's selection
    # set that are never dropped (dense_prefix_tokens not yet cached).
    start: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    protect: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # Per row the tokens at the end of its selection set that are never dropped: what a
    # request recomputed after a preemption had generated (0 for a first prefill).
    tail: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
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

    def __post_init__(self) -> None:
        self.qlen = self.qlen0.copy()
        n = len(self.qlen0)
        if len(self.stashing) == 0:
            self.stashing = np.zeros(n, dtype=bool)
            self.stash_len = np.zeros(n, dtype=np.int64)
        if len(self.start) == 0:
            self.start = np.zeros(n, dtype=np.int64)
            self.protect = np.zeros(n, dtype=np.int64)
        if len(self.tail) == 0:
            self.tail = np.zeros(n, dtype=np.int64)

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

    @property
    def compacted(self) -> bool:
        return self.gather_total is not None


@dataclass
class ExtendedRows:
    """The first drop layer's token set when last chunks bring their stashed tokens.

    Rows are laid out as the selection saw them (each last chunk's stash ahead of its
    own tokens); ``to_source`` maps those tokens into ``[step rows ; stashes]``.
    """

    to_source: torch.Tensor  # [sum(prefill_len)] int64
    slots: list[int]  # request slots whose stashes follow the step's rows, in order


def query_start(qlen: np.ndarray) -> np.ndarray:
    """Query start locations ``[R+1]`` (int64) of rows with ``qlen`` tokens."""
    qsl = np.zeros(len(qlen) + 1, dtype=np.int64)
    np.cumsum(qlen, out=qsl[1:])
    return qsl
