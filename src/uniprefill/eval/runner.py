"""Dense vLLM vs vLLM + UniPrefill on the same RULER-style prompts.

One engine at a time (the second starts after the first is freed), greedy decoding,
prefix caching off (a repeated prompt would otherwise skip prefill entirely).
"""

from __future__ import annotations

import gc
import os
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from uniprefill.eval.ruler import TASKS, Sample, generate_suite, string_match_all, token_counter

# RULER's per-task output budgets, trimmed: answers are short and CPU decode is not free.
DEFAULT_MAX_NEW_TOKENS = {
    "niah_single": 24,
    "niah_multikey": 24,
    "niah_multivalue": 64,
    "vt": 40,
    "cwe": 64,
    "prose_fact": 24,
    "prose_2hop": 32,
}


class Progress:
    """tqdm when installed, else a one-line stderr bar; silent when disabled."""

    def __init__(self, total: int, desc: str, enabled: bool) -> None:
        self.total, self.desc, self.enabled, self.n = total, desc, enabled, 0
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, desc=desc, file=sys.stderr)
            except ImportError:
                self._draw()

    def update(self, n: int = 1) -> None:
        self.n += n
        if self._bar is not None:
            self._bar.update(n)
        elif self.enabled:
            self._draw()

    def _draw(self) -> None:
        width = 30
        done = int(width * self.n / max(self.total, 1))
        bar = "#" * done + "-" * (width - done)
        sys.stderr.write(f"\r{self.desc} [{bar}] {self.n}/{self.total}")
        if self.n >= self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def resolve_model(model: str | Path) -> tuple[Path, dict[str, Any]]:
    """A model path, or a built-in tiny arch name built offline; plus the LLM kwargs it needs."""
    from uniprefill.testing import ARCHS, cached_tiny_model, vllm_kwargs

    if str(model) in ARCHS:
        return cached_tiny_model(str(model)), vllm_kwargs(str(model))  # type: ignore[arg-type]
    path = Path(model)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{model}: not a model directory nor one of {ARCHS}")
    return path, {}


def read_stats(llm: Any) -> dict[str, Any] | None:
    """UniPrefill's cumulative drop counters, or ``None`` if the plugin (or its stats) is absent."""
    try:
        from uniprefill.vllm import stats

        return stats.collect(llm)
    except (ImportError, AttributeError):
        return None


def stats_delta(after: dict[str, Any] | None, before: dict[str, Any] | None) -> dict | None:
    """Counters accumulated between two :func:`read_stats` calls (``after`` itself
    without a ``before``: counted from the engine's start)."""
    from uniprefill.vllm.stats import since

    if after is None or before is None:
        return after
    return since(before, after)


def kept_summary(stats: dict[str, Any] | None) -> dict[str, Any]:
    """Per-drop-layer kept ratio (kept/seen at that layer), their mean, and the share of
    prompt tokens that survive the last drop layer."""
    if not stats or not stats.get("seen_tokens") or not any(stats["seen_tokens"]):
        return {"kept_ratio": None, "kept_ratio_per_layer": None, "final_kept_share": None}
    kept, seen = stats["kept_tokens"], stats["seen_tokens"]
    per_layer = [k / s if s else None for k, s in zip(kept, seen, strict=True)]
    valid = [r for r in per_layer if r is not None]
    return {
        "kept_ratio": sum(valid) / len(valid) if valid else None,
        "kept_ratio_per_layer": dict(
            zip(map(str, stats.get("drop_layers", [])), per_layer, strict=True)
        ),
        "final_kept_share": kept[-1] / seen[0] if seen[0] else None,
    }


@dataclass
class EngineRun:
    outputs: list[str]
    first_tokens: list[int | None]
    seconds: float
    startup_seconds: float
    stats: dict[str, Any] | None
    # One entry per generate() call (per prompt when batch_size is 1).
    batch_seconds: list[float]
    batch_stats: list[dict[str, Any] | None]
    # Each prompt's time to first token (vLLM's request metrics; None where it has none).
    ttft_seconds: list[float | None] = field(default_factory=list)


def start_engine(
    path: Path,
    *,
    llm_kwargs: dict[str, Any],
    additional_config: dict[str, Any] | None,
    request_metrics: bool = False,
) -> tuple[Any, float]:
    """A ``vllm.LLM`` for ``path`` (eager, prefix caching off) and its start-up seconds.
    ``request_metrics``: vLLM's stats on, so each output's metrics hold its time to
    first token."""
    from vllm import LLM

    kwargs = {"enforce_eager": True, **llm_kwargs, "enable_prefix_caching": False}
    if request_metrics:  # unless the caller's llm_kwargs say otherwise
        kwargs.setdefault("disable_log_stats", False)
    if additional_config is not None:
        kwargs["additional_config"] = additional_config
    # In-process engine core: faster start on CPU, and no spawn of a __main__-less caller.
    # Only for this engine: the variable must not leak into the caller's later engines.
    key = "VLLM_ENABLE_V1_MULTIPROCESSING"
    before = os.environ.get(key)
    os.environ.setdefault(key, "0")
    t0 = time.perf_counter()
    try:
        llm = LLM(str(path), **kwargs)
    finally:
        if before is None:
            os.environ.pop(key, None)
            # The in-process engine core froze vLLM's environment variables; let later
            # engines of this process read them again.
            import vllm.envs as envs

            getattr(envs, "disable_envs_cache", lambda: None)()
    return llm, time.perf_counter() - t0


def generate(
    llm: Any,
    prompts: Sequence[str],
    max_tokens: Sequence[int],
    *,
    progress: bool,
    desc: str,
    batch_size: int = 1,
    warmup: bool = True,
) -> EngineRun:
    """Generate greedily for every prompt on a running engine (see :func:`run_engine`)."""
    from vllm import SamplingParams

    run = EngineRun([], [], 0.0, 0.0, None, [], [])
    bar = Progress(len(prompts), desc, progress)
    try:
        if warmup and prompts:
            warm = SamplingParams(temperature=0.0, max_tokens=1)
            llm.generate([prompts[0][:2048]], warm, use_tqdm=False)
        first = last = read_stats(llm)
        t0 = time.perf_counter()
        for i in range(0, len(prompts), batch_size):
            chunk = list(prompts[i : i + batch_size])
            params = [
                SamplingParams(temperature=0.0, max_tokens=m) for m in max_tokens[i:][:batch_size]
            ]
            tb = time.perf_counter()
            for out in llm.generate(chunk, params, use_tqdm=False):
                ids = out.outputs[0].token_ids
                run.outputs.append(out.outputs[0].text)
                run.first_tokens.append(int(ids[0]) if len(ids) else None)
                latency = getattr(getattr(out, "metrics", None), "first_token_latency", None)
                run.ttft_seconds.append(None if latency is None else float(latency))
            run.batch_seconds.append(time.perf_counter() - tb)
            now = read_stats(llm)
            run.batch_stats.append(stats_delta(now, last))
            last = now
            bar.update(len(chunk))
        run.seconds = time.perf_counter() - t0
        run.stats = stats_delta(last, first)
    finally:
        bar.close()
    return run


def stop_engine(llm: Any) -> None:
    """Free the engine (and its KV cache) before the next one starts."""
    _shutdown(llm)
    gc.collect()


def run_engine(
    path: Path,
    prompts: Sequence[str],
    max_tokens: Sequence[int],
    *,
    llm_kwargs: dict[str, Any],
    additional_config: dict[str, Any] | None,
    progress: bool,
    desc: str,
    batch_size: int = 1,
    warmup: bool = True,
) -> EngineRun:
    """Start one engine, generate greedily for every prompt, free the engine.

    Prompts go one ``generate`` call per ``batch_size``: on CPU, long prefills are
    compute-bound, so batching gains little, and one prompt per call gives per-prompt
    times, kept ratios and a progress bar that moves. ``warmup`` first prefills the first
    prompt once, untimed and outside the stats, so the
    first timed prompt does not pay one-off kernel set-up.
    """
    llm, startup = start_engine(path, llm_kwargs=llm_kwargs, additional_config=additional_config)
    try:
        run = generate(
            llm,
            prompts,
            max_tokens,
            progress=progress,
            desc=desc,
            batch_size=batch_size,
            warmup=warmup,
        )
    finally:
        stop_engine(llm)
        del llm
        gc.collect()
    run.startup_seconds = startup
    return run


def _shutdown(llm: Any) -> None:
    # Release the engine (and its KV cache) before the next one starts.
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - best effort: older/newer vLLMs differ here
        pass


def _max_positions(path: Path) -> int | None:
    import json

    cfg = json.loads((path / "config.json").read_text())
    cfg = cfg.get("text_config") or cfg
    return cfg.get("max_position_embeddings")


def sized_llm_kwargs(
    path: Path, kw: dict[str, Any], prompt_tokens: Sequence[int], budgets: Sequence[int]
) -> dict[str, Any]:
    """``kw`` plus a ``max_model_len`` that fits the longest prompt and its output, and a
    step (``max_num_batched_tokens``) that holds a whole prompt."""
    kw = dict(kw)
    need = max(n + b for n, b in zip(prompt_tokens, budgets, strict=True))
    limit = _max_positions(path)
    if limit is not None and need > limit:
        raise ValueError(
            f"the longest prompt plus its output budget needs {need} positions but the model "
            f"has {limit}; use a length of at most {limit - max(budgets)} or fewer new tokens"
        )
    kw.setdefault("max_model_len", need if limit is None else min(need + 16, limit))
    # A prompt split over several steps (chunked prefill) cannot be scored, so UniPrefill
    # runs it dense: give one step room for the longest prompt so every prompt is tested.
    kw.setdefault("max_num_batched_tokens", kw["max_model_len"])
    return kw


def _accuracy(samples: Sequence[Sample], scores: Sequence[float]) -> dict[str, dict[str, float]]:
    acc: dict[str, dict[str, list[float]]] = {}
    for s, sc in zip(samples, scores, strict=True):
        acc.setdefault(s.task, {}).setdefault(str(s.target_len), []).append(sc)
    return {t: {n: 100.0 * sum(v) / len(v) for n, v in d.items()} for t, d in acc.items()}


def _mean(table: dict[str, dict[str, float]]) -> float | None:
    vals = [v for d in table.values() for v in d.values()]
    return sum(vals) / len(vals) if vals else None


def run_eval(
    model: str | Path,
    *,
    tasks: Iterable[str] = TASKS,
    lengths: Iterable[int] = (1024,),
    samples_per_task: int = 2,
    seed: int = 0,
    uniprefill_config: dict[str, Any] | None = None,
    max_new_tokens: int | None = None,
    progress: bool = False,
    llm_kwargs: dict[str, Any] | None = None,
    dense: bool = True,
) -> dict[str, Any]:
    """Run the suite dense and (if ``uniprefill_config`` is given) with UniPrefill.

    ``model`` is a model directory or a tiny arch name ("llama", "gemma3", "qwen3_next").
    Accuracies are RULER string-match percentages per task and target length.
    """
    from transformers import AutoTokenizer

    tasks, lengths = list(tasks), sorted(set(lengths))
    path, arch_kwargs = resolve_model(model)
    tok = AutoTokenizer.from_pretrained(str(path))
    samples = generate_suite(tasks, lengths, samples_per_task, token_counter(tok), seed)
    budgets = [max_new_tokens or DEFAULT_MAX_NEW_TOKENS[s.task] for s in samples]
    kw = sized_llm_kwargs(
        path,
        {**arch_kwargs, **(llm_kwargs or {})},
        [s.n_tokens for s in samples],
        budgets,
    )
    prompts = [s.prompt for s in samples]

    import vllm

    result: dict[str, Any] = {
        "model": str(model),
        "model_path": str(path),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "vllm_version": vllm.__version__,
        "tasks": tasks,
        "lengths": lengths,
        "samples_per_task": samples_per_task,
        "seed": seed,
        "uniprefill_config": uniprefill_config,
        "llm_kwargs": {k: v for k, v in kw.items()},
    }
    runs: dict[str, EngineRun] = {}
    if dense:
        runs["dense"] = run_engine(
            path,
            prompts,
            budgets,
            llm_kwargs=kw,
            additional_config=None,
            progress=progress,
            desc="dense",
        )
    if uniprefill_config is not None:
        runs["uniprefill"] = run_engine(
            path,
            prompts,
            budgets,
            llm_kwargs=kw,
            additional_config={"uniprefill": dict(uniprefill_config)},
            progress=progress,
            desc="uniprefill",
        )
    per_sample = [s.to_dict() for s in samples]
    for name, run in runs.items():
        scores = [string_match_all(o, s.answers) for o, s in zip(run.outputs, samples, strict=True)]
        for row, out, sc, ft in zip(per_sample, run.outputs, scores, run.first_tokens, strict=True):
            row[f"{name}_output"], row[f"{name}_score"], row[f"{name}_first_token"] = out, sc, ft
        if len(run.batch_seconds) == len(samples):  # one prompt per call: per-sample detail
            for row, sec, st in zip(per_sample, run.batch_seconds, run.batch_stats, strict=True):
                row[f"{name}_seconds"] = sec
                if name == "uniprefill":
                    row["uniprefill_kept_share"] = kept_summary(st)["final_kept_share"]
        acc = _accuracy(samples, scores)
        result[name] = {
            "accuracy": acc,
            "mean": _mean(acc),
            "seconds": run.seconds,
            "startup_seconds": run.startup_seconds,
        }
        if name == "uniprefill":
            result[name].update(kept_summary(run.stats), stats=run.stats)
    if "dense" in runs and "uniprefill" in runs:
        d, u = result["dense"]["accuracy"], result["uniprefill"]["accuracy"]
        result["diff"] = {t: {n: u[t][n] - d[t][n] for n in d[t]} for t in d}
        result["mean_diff"] = result["uniprefill"]["mean"] - result["dense"]["mean"]
        same = [
            a == b
            for a, b in zip(
                runs["dense"].first_tokens, runs["uniprefill"].first_tokens, strict=True
            )
        ]
        result["first_token_agreement"] = sum(same) / len(same)
    result["samples"] = per_sample
    return result


def format_table(result: dict[str, Any]) -> str:
    """A Markdown table: one row per task and length, dense vs UniPrefill and their difference."""
    modes = [m for m in ("dense", "uniprefill") if m in result]
    both = len(modes) == 2
    head = ["task", "length", *modes] + (["diff"] if both else [])
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for task, by_len in result[modes[0]]["accuracy"].items():
        for n in by_len:
            cells = [task, n] + [f"{result[m]['accuracy'][task][n]:.1f}" for m in modes]
            if both:
                cells.append(f"{result['diff'][task][n]:+.1f}")
            rows.append("| " + " | ".join(cells) + " |")
    cells = ["**mean**", ""] + [f"{result[m]['mean']:.1f}" for m in modes]
    if both:
        cells.append(f"{result['mean_diff']:+.1f}")
    rows.append("| " + " | ".join(cells) + " |")
    if "uniprefill" in result:
        kr = result["uniprefill"].get("kept_ratio")
        share = result["uniprefill"].get("final_kept_share")
        rows += [
            "",
            "mean kept ratio per drop layer: "
            + ("n/a (plugin stats not available)" if kr is None else f"{kr:.3f}")
            + ("" if share is None else f"; prompt share kept after the last drop: {share:.3f}"),
        ]
    return "\n".join(rows)
