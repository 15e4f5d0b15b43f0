"""Per-request, per-stage KV lengths that outlive one engine step.

A *stage* is the run of decoder layers between two drop layers: stage 0 is
every layer up to and including the first drop layer's attention, stage s
holds the layers after the s-th drop layer. A layer in stage s stores K/V of
the tokens that survived s selections, so during decode its sequence length
is the request's length minus the prompt tokens dropped before stage s.

The table keeps, for every request whose prefill dropped tokens, that dropped
count per stage. It lives on the host (it is read once per step to build the
per-stage lengths, never once per layer) and an entry is removed when vLLM
forgets the request: finished, aborted, or restarted from scratch after a
preemption.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass
class DropStats:
    """Tokens seen and kept at each drop layer, summed over droppable prefills."""

    drop_layers: tuple[int, ...]
    seen: list[int] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)
    dropped_prefills: int = 0
    # Compacted requests computed again from scratch (resumed after a preemption).
    restarted: int = 0

    def __post_init__(self) -> None:
        self.seen = [0] * len(self.drop_layers)
        self.kept = [0] * len(self.drop_layers)

    def add(self, stage: int, seen: int, kept: int) -> None:
        self.seen[stage] += seen
        self.kept[stage] += kept

    def as_dict(self) -> dict[str, object]:
        return {
            "drop_layers": list(self.drop_layers),
            "seen_tokens": list(self.seen),
            "kept_tokens": list(self.kept),
            "dropped_prefills": self.dropped_prefills,
            "restarted": self.restarted,
        }


class KeptLengthTable:
    """``req_id -> dropped[stage]`` for every request whose KV was compacted."""

    def __init__(self, num_stages: int) -> None:
        # num_stages counts stage 0, whose dropped count is always 0.
        self.num_stages = num_stages
        self._dropped: dict[str, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self._dropped)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._dropped

    def record(self, req_id: str, dropped: Sequence[int]) -> None:
        arr = np.asarray(dropped, dtype=np.int64)
        if arr.shape != (self.num_stages,) or arr[0] != 0 or np.any(np.diff(arr) < 0):
            raise ValueError(f"bad dropped counts {arr.tolist()} for request {req_id!r}")
        if arr[-1] == 0:
            self._dropped.pop(req_id, None)  # nothing dropped: dense KV, no record
        else:
            self._dropped[req_id] = arr

    def forget(self, req_id: str) -> None:
        self._dropped.pop(req_id, None)

    def keep_only(self, alive: Iterable[str]) -> None:
        """Drop the entries of requests vLLM no longer tracks."""
        alive_set = set(alive)
        for req_id in [r for r in self._dropped if r not in alive_set]:
            del self._dropped[req_id]

    def matrix(self, req_ids: Sequence[str]) -> np.ndarray:
        """Dropped counts ``[len(req_ids), num_stages]``; zeros for requests without one."""
        out = np.zeros((len(req_ids), self.num_stages), dtype=np.int64)
        if self._dropped:
            for row, req_id in enumerate(req_ids):
                arr = self._dropped.get(req_id)
                if arr is not None:
                    out[row] = arr
        return out

    def req_ids(self) -> list[str]:
        return list(self._dropped)
