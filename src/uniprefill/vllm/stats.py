"""Read UniPrefill's counters from a running ``vllm.LLM``, or from every data-parallel
engine of a ``vllm.v1.engine.async_llm.AsyncLLM``."""

from __future__ import annotations

from typing import Any


def collect(llm: Any) -> dict[str, Any] | None:
    """Drop statistics of the engine's output worker (the first; with pipeline
    parallelism the last stage's first, which counts every drop layer), or ``None``
    when UniPrefill is off.

    Keys: ``drop_layers``, ``seen_tokens`` and ``kept_tokens`` (per drop layer,
    summed over every dropped prefill so far), ``dropped_prefills``, ``restarted``
    (requests recomputed after a preemption), ``chunked_prefills`` and ``stash_full``
    (prompts in chunks that dropped, and that ran dense for lack of stash room),
    ``records`` (requests whose per-layer KV lengths are held right now), ``stashed``
    (prompts waiting for their last chunk), ``compiled_drop_steps`` (whether dropping
    steps run compiled), ``segment_graphs_compiled`` (graphs compiled for them in
    the worker process: one per segment once started), ``prepared_steps``,
    ``host_prepare_s`` and ``host_vllm_prepare_s`` (engine steps, the host seconds
    UniPrefill added to their attention-metadata preparation: planning, later stages'
    metadata; and the host seconds of vLLM's own preparation, for scale),
    ``kv_blocks_freed`` (KV blocks of dropped tokens given back, ``free_kv_blocks``).
    """
    ranks = collect_ranks(llm)
    if not ranks:
        return None
    return ranks[output_rank(len(ranks), llm.llm_engine.vllm_config)]


def output_rank(num_workers: int, vllm_config: Any) -> int:
    """Index of the worker whose output reaches the engine (vLLM's own choice): the first
    tensor-parallel rank of the last pipeline stage. Its UniPrefill records and counters
    cover every drop layer; an earlier stage's, only the drop layers up to its own."""
    return num_workers - vllm_config.parallel_config.tensor_parallel_size


def collect_ranks(llm: Any) -> list[dict[str, Any]]:
    """Every worker's drop statistics (as :func:`collect`), ``[]`` when UniPrefill is
    off, in rank order (pipeline stage, then tensor-parallel rank). Tensor-parallel ranks
    make the same choices, so their records must agree; a pipeline stage records the
    drop layers up to its own last (``output_rank``)."""
    from uniprefill.vllm.worker import STATS_METHOD

    if not _uniprefill_on(getattr(llm.llm_engine, "vllm_config", None)):
        return []  # UniPrefill is off: its worker RPC is not there
    return list(llm.collective_rpc(STATS_METHOD))


async def collect_engines_async(async_llm: Any) -> list[dict[str, Any]]:
    """The drop statistics (as :func:`collect`) of each data-parallel engine of an
    ``AsyncLLM``, in DP-rank order; ``[]`` when UniPrefill is off. Each engine drops on
    its own requests, so their counters differ; :func:`summed` adds them up."""
    from uniprefill.vllm.worker import STATS_METHOD

    if not _uniprefill_on(async_llm.vllm_config):
        return []
    per_engine = await rpc_engines_async(async_llm, STATS_METHOD)
    return [w[output_rank(len(w), async_llm.vllm_config)] for w in per_engine]


async def rpc_engines_async(async_llm: Any, method: str, args: tuple = ()) -> list[list[Any]]:
    """``collective_rpc`` on every data-parallel engine of an ``AsyncLLM``: per engine
    (DP-rank order), each worker's result. vLLM's own ``AsyncLLM.collective_rpc`` also
    reaches every engine but returns the first engine's results only."""
    client = async_llm.engine_core
    call = ("collective_rpc", method, None, args, None)
    if hasattr(client, "call_utility_all_async"):  # vLLM 0.32+
        return list(await client.call_utility_all_async(*call))
    import asyncio

    # vLLM 0.27: the client's private per-engine call (docs/porting.md).
    return list(
        await asyncio.gather(
            *(client._call_utility_async(*call, engine=e) for e in client.core_engines)
        )
    )


def _uniprefill_on(config: Any) -> bool:
    from uniprefill.vllm.worker import EXTENSION_CLS

    return config is not None and config.parallel_config.worker_extension_cls == EXTENSION_CLS


# Measurements of one rank's own (host timings): ranks need not agree on them.
RANK_LOCAL_KEYS = ("host_prepare_s", "host_vllm_prepare_s")


def ranks_agree(per_rank: list[dict[str, Any]]) -> bool:
    """Whether every rank kept the same records (all but :data:`RANK_LOCAL_KEYS`)."""
    shared = [{k: v for k, v in r.items() if k not in RANK_LOCAL_KEYS} for r in per_rank]
    return all(r == shared[0] for r in shared)


def _counters() -> dict[str, Any]:
    """The counters of the stats (the worker's ``DropStats`` fields) and their zeros."""
    from uniprefill.vllm.records import DropStats

    zeros = DropStats(drop_layers=()).as_dict()
    del zeros["drop_layers"]
    return zeros


def since(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The counters accumulated between two :func:`collect` calls of one engine.

    Counters are the fields of the worker's ``DropStats`` (per drop layer for lists);
    the other keys (records held, compile state) are states, taken from ``after``. A
    counter missing from either side is left as ``after`` has it.
    """
    out = dict(after)
    for key, zero in _counters().items():
        if key not in before or key not in after:
            continue
        if isinstance(zero, list):
            out[key] = [b - a for a, b in zip(before[key], after[key], strict=True)]
        else:
            out[key] = after[key] - before[key]
    return out


def summed(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """Several :func:`since` results of one engine as one: counters added, states the last's."""
    out = dict(deltas[-1])
    for key, zero in _counters().items():
        if isinstance(zero, list):
            out[key] = [sum(col) for col in zip(*(d[key] for d in deltas), strict=True)]
        else:
            out[key] = sum(d[key] for d in deltas)
    return out


def kept_ratios(stats: dict[str, Any] | None) -> list[float | None]:
    """Kept share of tokens at each drop layer (``None`` where nothing was scored)."""
    if not stats:
        return []
    return [
        k / s if s else None
        for k, s in zip(stats["kept_tokens"], stats["seen_tokens"], strict=True)
    ]
