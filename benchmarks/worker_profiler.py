"""The torch profiler inside vLLM's worker, for ``bench_ttft.py --profile-length``.

Both functions run in the worker (``LLM.collective_rpc`` with a callable, which vLLM
pickles only with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``).
"""

from __future__ import annotations

from typing import Any


def profile_start(worker: Any) -> None:
    """Runs in the worker: start a torch profiler (CPU + CUDA when there is a GPU)."""
    import torch

    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    prof = torch.profiler.profile(activities=acts)
    prof.start()
    worker._bench_profiler = prof


def profile_stop(worker: Any, trace_path: str | None, top: int) -> dict[str, Any]:
    """Runs in the worker: stop the profiler; summarise where host and device time went.

    ``gpu_busy_ms`` is the union of kernel intervals, ``gpu_span_ms`` first kernel start
    to last kernel end: their difference is time the GPU sat idle inside the step (host
    launch gaps, syncs). ``gaps`` lists the longest idle stretches, each with the kernels
    on either side, to place them.
    """
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    prof = worker._bench_profiler
    prof.stop()
    worker._bench_profiler = None

    def dev_us(e: Any) -> float:
        return float(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)))

    avgs = list(prof.key_averages())
    rows = [
        {
            "name": e.key[:90],
            "count": int(e.count),
            "self_cpu_ms": e.self_cpu_time_total / 1e3,
            "self_dev_ms": dev_us(e) / 1e3,
        }
        for e in avgs
    ]
    by_dev = sorted(rows, key=lambda r: -r["self_dev_ms"])[:top]
    by_cpu = sorted(rows, key=lambda r: -r["self_cpu_ms"])[:top]
    runtime = [
        r
        for r in rows
        if r["name"].startswith(("cuda", "cudaMalloc", "cudaFree")) or "Synchronize" in r["name"]
    ]
    kernels = []
    for e in prof.events():
        if str(getattr(e, "device_type", "")).endswith("CUDA") and e.time_range.end > 0:
            kernels.append((e.time_range.start, e.time_range.end, e.name[:60]))
    kernels.sort()
    busy, gaps, cur_s, cur_e, prev = 0.0, [], None, None, None
    for s, e, name in kernels:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
                gaps.append((s - cur_e, prev, name))
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
        prev = name
    if cur_e is not None:
        busy += cur_e - cur_s
    span = (kernels[-1][1] - kernels[0][0]) if kernels else 0.0
    gaps.sort(key=lambda g: -g[0])
    if trace_path:
        prof.export_chrome_trace(trace_path)
    return {
        "num_kernels": len(kernels),
        "gpu_busy_ms": busy / 1e3,
        "gpu_span_ms": span / 1e3,
        "gaps": [{"ms": g / 1e3, "after": a, "before": b} for g, a, b in gaps[:top]],
        "top_by_device": by_dev,
        "top_by_cpu": by_cpu,
        "runtime_calls": sorted(runtime, key=lambda r: -r["self_cpu_ms"])[:top],
    }
