"""Data-parallel ``AsyncLLM`` runs for tests/test_data_parallel.py, in a process of
their own: ``python data_parallel_runs.py SPEC_JSON OUT_JSON``.

A separate process, because an ``AsyncLLM`` loads UniPrefill's stat logger (a
``vllm.stat_logger_plugins`` entry point) into the process that creates it, and that
logger registers Prometheus counters in the process-wide registry
(tests/test_metrics.py counts on a clean one). The spec names the model, the prompts,
the data-parallel size and the selection settings with drops; the output holds each
run's greedy tokens and each engine's UniPrefill counters.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any


async def _generate(llm: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy tokens of every prompt, all submitted at once (the engines share them)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    async def one(i: int, ids: list[int]) -> list[int]:
        final = None
        async for out in llm.generate({"prompt_token_ids": ids}, params, request_id=f"r{i}"):
            final = out
        return list(final.outputs[0].token_ids)

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


def _engine(spec: dict[str, Any], uniprefill: dict[str, Any] | None) -> Any:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    kwargs = dict(
        model=spec["model"],
        enforce_eager=True,
        max_model_len=2048,
        max_num_batched_tokens=2048,
        enable_prefix_caching=False,
        seed=0,
        data_parallel_size=spec["data_parallel_size"],
        disable_log_stats=True,
        **spec["vllm_kwargs"],
    )
    if uniprefill is not None:
        kwargs["additional_config"] = {"uniprefill": uniprefill}
    return AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))


async def _plain(spec: dict[str, Any]) -> list[list[int]]:
    # Plain vLLM on the model runner UniPrefill uses (as tests/test_vllm_plugin.py).
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    llm = _engine(spec, None)
    try:
        return await _generate(llm, spec["prompts"], spec["max_tokens"])
    finally:
        llm.shutdown()
        del os.environ["VLLM_USE_V2_MODEL_RUNNER"]


async def _uniprefill(spec: dict[str, Any]) -> dict[str, Any]:
    """top_p 1.0 first, then the drop settings on every engine (configure RPC)."""
    from uniprefill.vllm.stats import collect_engines_async, rpc_engines_async, since
    from uniprefill.vllm.worker import CONFIGURE_METHOD

    llm = _engine(spec, {"top_p": 1.0, **spec["base"]})
    try:
        out: dict[str, Any] = {
            "undropped": await _generate(llm, spec["prompts"], spec["max_tokens"])
        }
        configured = await rpc_engines_async(llm, CONFIGURE_METHOD, (spec["drops"],))
        out["configured"] = [workers[0]["config"] for workers in configured]
        before = await collect_engines_async(llm)
        out["dropped"] = await _generate(llm, spec["prompts"], spec["max_tokens"])
        after = await collect_engines_async(llm)
        out["engine_stats"] = [since(b, a) for b, a in zip(before, after, strict=True)]
        out["engine_totals"] = after
        out["published"] = _published(llm)
        return out
    finally:
        llm.shutdown()


def _published(llm: Any) -> list[dict[str, Any]]:
    """What each engine's worker published for this process's /metrics (metrics.py),
    read after the engines were idle for longer than the publication interval."""
    import time

    from uniprefill.vllm.metrics import PUBLISH_INTERVAL_S, stats_path

    time.sleep(2 * PUBLISH_INTERVAL_S)
    out = []
    for rank in range(llm.vllm_config.parallel_config.data_parallel_size):
        with open(stats_path(llm.vllm_config.instance_id, rank)) as f:
            out.append(json.load(f))
    return out


async def _main(spec: dict[str, Any]) -> dict[str, Any]:
    return {"plain": await _plain(spec), **await _uniprefill(spec)}


if __name__ == "__main__":
    from uniprefill.cpu_triton import enable

    enable()  # before vLLM's import, as tests/conftest.py
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    result = asyncio.run(_main(spec))
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)
