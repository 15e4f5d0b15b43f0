"""Prometheus counters of UniPrefill on a server's ``/metrics`` (entry point of the
``vllm.stat_logger_plugins`` group).

The counters (``records.DropStats``) live in the worker; vLLM's stat loggers run in the
API server (front end) and see only the scheduler's statistics, and vLLM has no seam
that carries a worker's own counters to the front end (0.26 - 0.34). So the first
tensor-parallel worker of each engine's last pipeline stage (the one that counts every
drop layer) publishes ``DropStats.as_dict()``
(cumulative) to a small JSON file (:func:`stats_path`, written by rename, so a reader
never sees half a file), and :class:`UniPrefillStatLogger` reads it when it changed and
moves its Prometheus counters by the difference. Both sides name the file by vLLM's own
engine identity, ``VllmConfig.instance_id`` (set in the front end, copied to every
process of the engine) and the data-parallel rank (the front end's engine index).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import tempfile
from typing import TYPE_CHECKING, Any

from vllm.v1.metrics.loggers import StatLoggerBase

from uniprefill.config import ENTRY

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger("vllm.uniprefill")

# Seconds between publications while only per-step counters (steps, host time) change;
# a step whose prefills dropped, chunked, ran dense or restarted publishes at once.
PUBLISH_INTERVAL_S = 1.0
# DropStats counters that mark such a step.
EVENT_KEYS = ("dropped_prefills", "chunked_prefills", "stash_full", "restarted")

# (DropStats.as_dict key, Prometheus name without "_total", help). Counters whose key
# holds a list get a drop_layer label.
COUNTERS = (
    ("dropped_prefills", "vllm:uniprefill_dropped_prefills", "Prefills that dropped tokens."),
    (
        "seen_tokens",
        "vllm:uniprefill_prompt_tokens",
        "Prompt tokens of dropping prefills that entered each drop layer.",
    ),
    (
        "kept_tokens",
        "vllm:uniprefill_kept_tokens",
        "Prompt tokens of dropping prefills kept at each drop layer.",
    ),
    (
        "chunked_prefills",
        "vllm:uniprefill_chunked_prefills",
        "Prompts prefilled in chunks that dropped tokens in their last chunk.",
    ),
    (
        "stash_full",
        "vllm:uniprefill_stash_full",
        "Chunked prompts that ran dense because the stash had no room.",
    ),
    (
        "restarted",
        "vllm:uniprefill_restarted_requests",
        "Requests recomputed after a preemption (their prefill dropped again).",
    ),
    ("prepared_steps", "vllm:uniprefill_steps", "Engine steps UniPrefill planned."),
    (
        "host_prepare_s",
        "vllm:uniprefill_host_prepare_seconds",
        "Host seconds UniPrefill added to vLLM's attention-metadata preparation.",
    ),
    (
        "host_vllm_prepare_s",
        "vllm:uniprefill_host_vllm_prepare_seconds",
        "Host seconds of vLLM's own attention-metadata preparation, for scale.",
    ),
)


def stats_dir() -> str:
    """Shared memory where there is some (no disk write per step), else the temp dir."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def stats_path(instance_id: str, dp_rank: int) -> str:
    return os.path.join(stats_dir(), f"uniprefill-{instance_id}-dp{dp_rank}.json")


def worker_stats_path(vllm_config: VllmConfig) -> str:
    """The file of this worker's engine. A dense model's DP engines each run as DP=1 with
    ``data_parallel_rank`` 0; ``data_parallel_index`` keeps the engine's rank (0.27.1 and
    0.32.0). With Ray data parallelism vLLM suffixes each engine's ``instance_id`` with
    ``_dp<rank>`` (the front end keeps the plain one)."""
    pc = vllm_config.parallel_config
    rank = getattr(pc, "data_parallel_index", None)
    rank = pc.data_parallel_rank if rank is None else rank
    return stats_path(vllm_config.instance_id.removesuffix(f"_dp{rank}"), rank)


def publish_from_worker(stats: Any, vllm_config: VllmConfig) -> None:
    """Make this worker's ``DropStats`` publish, on the engine's output rank only (the
    first tensor-parallel rank of the last pipeline stage: tensor-parallel ranks keep the
    same records, and the last stage counts every drop layer) and once the front end's
    logger created the file. Called once the model is built (``worker.log_start``)."""
    from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank

    if get_tensor_model_parallel_rank() != 0 or not get_pp_group().is_last_rank:
        return
    stats.publish_path = worker_stats_path(vllm_config)


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.remove(path)


def write_atomic(path: str, data: dict[str, Any], only_over: bool = False) -> bool:
    """Replace ``path`` by ``data`` (JSON); with ``only_over``, only where it exists (the
    front end's logger creates it: an engine without a reader, offline, writes nothing)."""
    if only_over and not os.path.exists(path):
        return False
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)
    return True


# The counters this process registered, by name: with data parallelism the front end
# builds one logger per engine, and the engines' loggers must share one set of counters
# (their `engine` label tells them apart); Prometheus refuses a second with a name.
_COUNTERS: dict[str, Any] = {}


def _shared_counter(name: str, doc: str, labelnames: list[str]) -> Any:
    """The registered counter ``name``: a new one, or the one another engine's logger of
    this process made. vLLM's own logger unregisters every ``vllm:`` collector when an
    engine starts, so a cached counter counts only while it is still registered."""
    from prometheus_client import Counter

    try:
        counter = Counter(name, doc, labelnames=labelnames)
    except ValueError:  # registered already: ours from another engine's logger, or not
        if name not in _COUNTERS:
            raise
        return _COUNTERS[name]
    _COUNTERS[name] = counter
    return counter


class UniPrefillStatLogger(StatLoggerBase):
    """Per-engine stat logger: UniPrefill's counters as ``vllm:uniprefill_*`` Prometheus
    counters, labels ``model_name``, ``engine`` (and ``drop_layer`` per drop layer).

    Inert when the engine runs without UniPrefill. The counters are created on first use,
    not here: vLLM's own Prometheus logger is built after plugin loggers and unregisters
    every ``vllm:`` collector it finds.
    """

    def __init__(self, vllm_config: VllmConfig, engine_index: int = 0) -> None:
        self.enabled = ENTRY in (vllm_config.additional_config or {})
        self.path = stats_path(vllm_config.instance_id, engine_index)
        self.labels = {
            "model_name": vllm_config.model_config.served_model_name,
            "engine": str(engine_index),
        }
        self.counters: dict[str, Any] | None = None
        self.last: dict[str, Any] = {}
        self.mtime_ns: tuple[int, int] | None = None
        if self.enabled:
            # The worker publishes only over this file; the server removes it at exit (a
            # killed server leaves it, a few hundred bytes).
            try:
                write_atomic(self.path, {})
                atexit.register(_remove, self.path)
            except OSError as exc:
                logger.warning("uniprefill: no /metrics counters (%s)", exc)

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):  # type: ignore[no-untyped-def]
        # Called after every engine step's outputs: a stat() only, the read when it changed.
        self.update()

    def log(self) -> None:
        self.update()

    def log_engine_initialized(self) -> None:
        pass

    def update(self) -> None:
        if not self.enabled:
            return
        try:
            st = os.stat(self.path)
            # Each write is a new inode (rename): a coarse clock's equal mtime still differs.
            mtime = (st.st_ino, st.st_mtime_ns)
            if mtime == self.mtime_ns:
                return
            with open(self.path) as f:
                cur = json.load(f)
        except (OSError, ValueError):
            return  # not published yet (or the engine is gone)
        self.mtime_ns = mtime
        if "drop_layers" in cur:  # else only the marker this logger wrote
            self._add(cur)

    def _add(self, cur: dict[str, Any]) -> None:
        if self.counters is None:
            self.counters = {}
            for key, name, doc in COUNTERS:
                names = ["model_name", "engine"]
                if isinstance(cur.get(key), list):
                    names.append("drop_layer")
                self.counters[key] = _shared_counter(name, doc, names)
        layers = [str(layer) for layer in cur.get("drop_layers", [])]
        for key, counter in self.counters.items():
            value, last = cur.get(key), self.last.get(key)
            if isinstance(value, list):
                for i, (layer, v) in enumerate(zip(layers, value, strict=True)):
                    prev = last[i] if isinstance(last, list) and i < len(last) else 0
                    self._inc(counter.labels(**self.labels, drop_layer=layer), v, prev)
            elif isinstance(value, (int, float)):
                prev = last if isinstance(last, (int, float)) else 0
                self._inc(counter.labels(**self.labels), value, prev)
        self.last = cur

    @staticmethod
    def _inc(child: Any, value: float, prev: float) -> None:
        # A smaller value than last time: a new worker started from zero.
        delta = value - prev if value >= prev else value
        if delta > 0:
            child.inc(delta)
