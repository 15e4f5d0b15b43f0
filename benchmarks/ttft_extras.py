"""The extras of a ``bench_ttft.py`` sweep: plain compiled vLLM's dense baseline and
the torch profiler's look at one prefill per mode (split out of ``bench_ttft.py``).

Both take the sweep (``bench_ttft.Sweep``): its arguments, its JSON document, its
clock and its error log.
"""

from __future__ import annotations

import statistics
import subprocess
from pathlib import Path
from typing import Any

from common import batch_prompts, close_llm, log, wait_gpu_free
from ttft_points import dense_point, point_seed, run_batch
from worker_profiler import profile_start, profile_stop


def compiled_baseline(
    sweep: Any, name: str, mdir: Path, sp: Any, points: list[tuple[int, int]] | None = None
) -> None:
    """Dense TTFT of plain compiled vLLM at every point the eager sweep measured
    (or at ``points``, for ``--compiled-only``).

    Same prompts (same seeds) as the sweep. The eager engine is what UniPrefill needs
    (docs/usage.md), so its dense mode is the like-for-like reference; this one says
    what a user running vLLM's defaults gives up or gains by switching.
    """
    a = sweep.args
    done = points or sorted(
        {
            (p["length"], p["concurrency"])
            for p in sweep.doc["points"]
            if p.get("model") == name and p.get("mode") == "dense"
        },
        key=lambda lc: (lc[1], lc[0]),
    )
    if not done:
        return
    if sweep.elapsed() > a.deadline_s - a.min_model_s / 2:
        log(f"{name}: no time left for the compiled baseline")
        sweep.doc["errors"].append({"where": f"{name} compiled", "error": "skipped: time budget"})
        return
    try:
        llm = sweep.start_engine(name, mdir, compiled=True)
    except Exception as e:  # noqa: BLE001
        sweep.error(f"{name}: compiled engine start", e)
        return
    try:
        for conc in sorted({c for _, c in done}):
            run_batch(llm, sp, batch_prompts(min(a.lengths), conc, seed=999))
        for length, conc in done:
            eager = dense_point(sweep.doc, name, length, conc)
            left = a.deadline_s - sweep.elapsed()
            if eager and eager["wall_median_s"] * a.repeats * 1.2 > left:
                log(f"{name}: compiled skip L={length} c={conc}: {left:.0f} s left")
                continue
            walls, ttfts = [], []
            for rep in range(a.repeats):
                r = run_batch(
                    llm, sp, batch_prompts(length, conc, seed=point_seed(a, rep, length, conc))
                )
                walls.append(r["wall_s"])
                ttfts.append(statistics.fmean(r["ttft_s"]))
            ttft, wall = statistics.median(ttfts), statistics.median(walls)
            sweep.doc["points"].append(
                {
                    "model": name,
                    "length": length,
                    "concurrency": conc,
                    "mode": "dense_compiled",
                    "repeats": len(walls),
                    "ttft_median_s": ttft,
                    "ttft_mean_all_reps_s": ttfts,
                    "wall_median_s": wall,
                    "wall_all_s": walls,
                    "prefill_tok_s": conc * length / wall,
                    "ttft_source": r["ttft_source"],
                    # relative to the eager dense of the same prompts (same run)
                    "speedup_ttft": eager["ttft_median_s"] / ttft if eager else None,
                    "throughput_gain": eager["wall_median_s"] / wall - 1.0 if eager else None,
                    "stats": None,
                    "kept": None,
                }
            )
            ref = f" (eager dense {eager['ttft_median_s']:.3f} s)" if eager else ""
            log(f"{name} L={length} c={conc} dense_compiled ttft {ttft:.3f} s{ref}")
            sweep.save()
    except Exception as e:  # noqa: BLE001
        sweep.error(f"{name}: compiled baseline", e)
    finally:
        close_llm(llm)
        wait_gpu_free()


def profile(sweep: Any, llm: Any, sp: Any, name: str, drop_layers: list[int]) -> None:
    """One profiled prefill per mode (concurrency 1) after two unprofiled ones.

    The summary (kernel time, GPU idle gaps, top ops, CUDA runtime calls) goes into
    the JSON under ``profiles``; the first non-dense mode's chrome trace, gzipped,
    next to it when ``--profile-trace`` is given.
    """
    a = sweep.args
    length = a.profile_length
    traced = False
    for mode in a.profile_modes:
        try:
            sweep.set_mode(llm, mode, drop_layers, length)
            for rep in range(2):
                run_batch(llm, sp, batch_prompts(length, 1, seed=500 + rep))
            trace = None
            if a.profile_trace and mode != "dense" and not traced:
                trace = str(sweep.out / f"trace_{name}_{mode}.json")
                traced = True
            llm.collective_rpc(profile_start)
            r = run_batch(llm, sp, batch_prompts(length, 1, seed=502))
            summary = llm.collective_rpc(profile_stop, args=(trace, 25))[0]
        except Exception as e:  # noqa: BLE001
            sweep.error(f"{name}: profile {mode}", e)
            continue
        if trace:
            subprocess.run(["gzip", "-f", trace], check=False)
        summary.update(model=name, mode=mode, length=length, wall_s=r["wall_s"])
        sweep.doc.setdefault("profiles", []).append(summary)
        sweep.save()
        log(
            f"PROFILE {name} L={length} {mode}: wall {1e3 * r['wall_s']:.1f} ms, "
            f"{summary['num_kernels']} kernels, GPU busy {summary['gpu_busy_ms']:.1f} ms "
            f"of span {summary['gpu_span_ms']:.1f} ms"
        )
        for g in summary["gaps"][:8]:
            log(f"  gap {g['ms']:.2f} ms after {g['after']} before {g['before']}")
        for row in summary["top_by_device"][:12]:
            log(f"  dev {row['self_dev_ms']:8.2f} ms x{row['count']:<5} {row['name']}")
        for row in summary["runtime_calls"][:8]:
            log(f"  rt  {row['self_cpu_ms']:8.2f} ms x{row['count']:<5} {row['name']}")
