"""Per-request state that outlives one engine step: dropped prompt tokens per stage.

A *stage* is the run of decoder layers between two drop layers: stage 0 is every
layer up to and including the first drop layer, stage s holds the layers after
the s-th drop layer. A layer of stage s stores K/V of the prompt tokens that
survived s selections, so during decode its sequence length is the request's
length minus the prompt tokens dropped before stage s.

:class:`RequestTable` holds, for every live request, its prompt length and those
dropped counts, indexed by vLLM's request slot (the ``req_index`` of the V2 model
runner). The counts live twice: a host array (read when a step is planned) and a
device tensor (gathered into per-stage lengths and slots without a host sync). A
row is written when a request is added, after its prefill drops, and cleared when
vLLM removes the request (finished, aborted or preempted).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch

logger = logging.getLogger("vllm.uniprefill")


def summary_interval_s() -> float:
    """Seconds between INFO summaries: vLLM's own stats interval (default 10 s)."""
    try:
        return float(os.environ.get("VLLM_LOG_STATS_INTERVAL", "10"))
    except ValueError:
        return 10.0


@dataclass
class DropStats:
    """Tokens seen and kept at each drop layer, summed over droppable prefills."""

    drop_layers: tuple[int, ...]
    seen: list[int] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)
    dropped_prefills: int = 0
    # Requests vLLM recomputed from scratch after a preemption (their prefill, prompt
    # plus generated tokens, drops the prompt's tokens again, keeping the generated ones).
    restarted: int = 0
    # Prompts prefilled over several steps that were scored in their last chunk, and
    # chunked prompts that ran dense because the stash had no room for them.
    chunked_prefills: int = 0
    stash_full: int = 0
    # Steps UniPrefill planned (every real step), the host seconds it added to vLLM's
    # attention-metadata preparation in them (planning, later stages' metadata), and
    # the host seconds of vLLM's own preparation (the same work for every layer).
    prepared_steps: int = 0
    host_prepare_s: float = 0.0
    host_vllm_prepare_s: float = 0.0
    # log_summary's last time and counters (not counters themselves).
    summary_at: float | None = field(default=None, init=False, repr=False, compare=False)
    summary_base: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    # Where publish() writes the counters for the server's Prometheus logger (metrics.py);
    # None: not published (other ranks than the first, unit tests).
    publish_path: str | None = field(default=None, init=False, repr=False, compare=False)
    published_at: float = field(default=float("-inf"), init=False, repr=False, compare=False)
    published: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.seen = [0] * len(self.drop_layers)
        self.kept = [0] * len(self.drop_layers)

    def add(self, stage: int, seen: int, kept: int) -> None:
        self.seen[stage] += seen
        self.kept[stage] += kept

    def log_summary(self, now: float | None = None) -> str | None:
        """Log, at INFO and at most once per :func:`summary_interval_s`, what changed
        since the last summary, as vLLM logs its throughput; call once per step.

        The per-request "prefill dropped" line is DEBUG: at real request rates one INFO
        line per request floods the log. A quiet interval logs nothing. Returns the line
        logged, if any.
        """
        now = time.monotonic() if now is None else now
        self.publish(now)
        if self.summary_at is None:
            self.summary_at, self.summary_base = now, self.as_dict()
        elapsed = now - self.summary_at
        if elapsed < summary_interval_s():
            return None
        cur, last = self.as_dict(), self.summary_base
        self.summary_at, self.summary_base = now, cur
        d = {k: cur[k] - last[k] for k in cur if isinstance(cur[k], (int, float))}
        if not (d["dropped_prefills"] or d["chunked_prefills"] or d["stash_full"]):
            return None
        seen = [c - p for c, p in zip(cur["seen_tokens"], last["seen_tokens"], strict=True)]
        kept = [c - p for c, p in zip(cur["kept_tokens"], last["kept_tokens"], strict=True)]
        # Of the tokens entering the first drop layer, the share alive after each one.
        shares = ", ".join(f"{k / seen[0]:.3f}" if seen[0] else "-" for k in kept)
        steps = d["prepared_steps"]
        host_ms = 1000 * d["host_prepare_s"] / steps if steps else 0.0
        line = (
            f"uniprefill: last {elapsed:.1f} s: dropped_prefills={d['dropped_prefills']} "
            f"kept_share=[{shares}] chunked_prefills={d['chunked_prefills']} "
            f"stash_full={d['stash_full']} restarted={d['restarted']} steps={steps} "
            f"host_ms_per_step={host_ms:.2f}"
        )
        logger.info("%s", line)
        return line

    def publish(self, now: float | None = None) -> bool:
        """Write the counters to :attr:`publish_path` when a prefill dropped, chunked, ran
        dense or restarted since the last write, else at most once per
        ``metrics.PUBLISH_INTERVAL_S`` while other counters moved. Returns whether it wrote.
        """
        if self.publish_path is None:
            return False
        from uniprefill.vllm import metrics

        now = time.monotonic() if now is None else now
        cur, last = self.as_dict(), self.published
        if cur == last:
            return False
        if not last and now - self.published_at < metrics.PUBLISH_INTERVAL_S:
            return False  # no reader's file yet: look again at most once a second
        event = any(cur[k] != last.get(k) for k in metrics.EVENT_KEYS)
        if not event and now - self.published_at < metrics.PUBLISH_INTERVAL_S:
            return False
        try:
            if not metrics.write_atomic(self.publish_path, cur, only_over=True):
                self.published_at = now
                return False
        except OSError as exc:
            logger.warning("uniprefill: cannot publish counters (%s); /metrics lacks them", exc)
            self.publish_path = None
            return False
        self.published_at, self.published = now, cur
        return True

    def as_dict(self) -> dict[str, object]:
        return {
            "drop_layers": list(self.drop_layers),
            "seen_tokens": list(self.seen),
            "kept_tokens": list(self.kept),
            "dropped_prefills": self.dropped_prefills,
            "restarted": self.restarted,
            "chunked_prefills": self.chunked_prefills,
            "stash_full": self.stash_full,
            "prepared_steps": self.prepared_steps,
            "host_prepare_s": self.host_prepare_s,
            "host_vllm_prepare_s": self.host_vllm_prepare_s,
        }


class RequestTable:
    """``slot -> (req_id, prompt_len, start, generated, dropped[stage])`` for vLLM's requests."""

    def __init__(self, max_num_reqs: int, num_stages: int, device: torch.device) -> None:
        # num_stages counts stage 0, whose dropped count is always 0.
        self.num_stages = num_stages
        self.req_ids: list[str | None] = [None] * max_num_reqs
        self.slot_of: dict[str, int] = {}
        self.prompt_len = np.zeros(max_num_reqs, dtype=np.int64)
        self.runs_dense = np.zeros(max_num_reqs, dtype=bool)
        # The request's own min_prompt_len (SamplingParams.extra_args); -1: the engine's.
        self.min_prompt_len = np.full(max_num_reqs, -1, dtype=np.int64)
        # The request's own top_p (extra_args); NaN: the engine's.
        self.top_p = np.full(max_num_reqs, np.nan, dtype=np.float64)
        # Prompt tokens vLLM's prefix cache held when the request arrived: dense at every
        # layer, never scored; the prefill starts after them.
        self.start = np.zeros(max_num_reqs, dtype=np.int64)
        # Tokens the request had generated before a preemption: its recompute prefills
        # them after the prompt, kept at every layer (0 for a request's first prefill).
        self.generated = np.zeros(max_num_reqs, dtype=np.int64)
        self.dropped = np.zeros((max_num_reqs, num_stages), dtype=np.int64)
        self.dropped_gpu = torch.zeros((max_num_reqs, num_stages), dtype=torch.int32, device=device)

    def __len__(self) -> int:
        """Requests whose KV is compacted right now."""
        return int(np.count_nonzero(self.dropped[:, -1]))

    def add(
        self,
        slot: int,
        req_id: str,
        prompt_len: int,
        runs_dense: bool,
        start: int = 0,
        generated: int = 0,
    ) -> None:
        self.remove(req_id)
        self.req_ids[slot] = req_id
        self.slot_of[req_id] = slot
        self.prompt_len[slot] = prompt_len
        self.runs_dense[slot] = runs_dense
        self.min_prompt_len[slot] = -1
        self.top_p[slot] = np.nan
        self.start[slot] = start
        self.generated[slot] = generated
        self._clear(slot)

    def remove(self, req_id: str) -> None:
        slot = self.slot_of.pop(req_id, None)
        if slot is not None:
            self.req_ids[slot] = None
            self._clear(slot)

    def holds(self, req_ids: list[str], slots: np.ndarray) -> bool:
        """Whether these batch rows are requests of this table (a dummy batch is not)."""
        return len(req_ids) > 0 and self.req_ids[int(slots[0])] == req_ids[0]

    def record(self, slots: np.ndarray, dropped: np.ndarray) -> None:
        """Store the dropped counts ``[len(slots), num_stages]`` of rows that just dropped."""
        if dropped.shape != (len(slots), self.num_stages) or np.any(dropped[:, 0] != 0):
            raise ValueError(f"bad dropped counts {dropped.tolist()}")
        if np.any(np.diff(dropped, axis=1) < 0):
            raise ValueError(f"dropped counts must not shrink over stages: {dropped.tolist()}")
        self.dropped[slots] = dropped
        index = torch.from_numpy(slots.astype(np.int64))
        values = torch.from_numpy(dropped.astype(np.int32))
        dev = self.dropped_gpu.device
        self.dropped_gpu[index.to(dev)] = values.to(dev, non_blocking=True)

    def _clear(self, slot: int) -> None:
        if self.dropped[slot].any():
            self.dropped[slot] = 0
            self.dropped_gpu[slot] = 0
