"""Read UniPrefill's counters from a running ``vllm.LLM``."""

from __future__ import annotations

from typing import Any


def collect(llm: Any) -> dict[str, Any] | None:
    """Drop statistics of the first worker, or ``None`` when UniPrefill is off.

    Keys: ``drop_layers``, ``seen_tokens`` and ``kept_tokens`` (per drop layer,
    summed over every dropped prefill so far), ``dropped_prefills``, ``restarted``
    (requests recomputed after a preemption), ``chunked_prefills`` and ``stash_full``
    (prompts in chunks that dropped, and that ran dense for lack of stash room),
    ``records`` (requests whose per-layer KV lengths are held right now), ``stashed``
    (prompts waiting for their last chunk), ``compiled_drop_steps`` (whether dropping
    steps run compiled) and ``segment_graphs_compiled`` (graphs compiled for them in
    the worker process: one per segment once started).
    """
    ranks = collect_ranks(llm)
    return ranks[0] if ranks else None


def collect_ranks(llm: Any) -> list[dict[str, Any]]:
    """Every worker's drop statistics (as :func:`collect`), ``[]`` when UniPrefill is
    off. Tensor-parallel ranks make the same choices, so their records must agree."""
    from uniprefill.vllm.worker import EXTENSION_CLS, STATS_METHOD

    config = getattr(llm.llm_engine, "vllm_config", None)
    if config is None or config.parallel_config.worker_extension_cls != EXTENSION_CLS:
        return []  # UniPrefill is off: its worker RPC is not there
    return list(llm.collective_rpc(STATS_METHOD))


def kept_ratios(stats: dict[str, Any] | None) -> list[float | None]:
    """Kept share of tokens at each drop layer (``None`` where nothing was scored)."""
    if not stats:
        return []
    return [
        k / s if s else None
        for k, s in zip(stats["kept_tokens"], stats["seen_tokens"], strict=True)
    ]
