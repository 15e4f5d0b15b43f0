"""One measured point of ``bench_ttft.py``: a timed batch, its record, and the time
the sweep predicts for the next point (split out of ``bench_ttft.py``)."""

from __future__ import annotations

import argparse
import fnmatch
import statistics
import time
from typing import Any

from ttft_report import fmt_len

from uniprefill.eval.speedup import alive_after, work_shares
from uniprefill.vllm.stats import kept_ratios


def run_batch(llm: Any, sp: Any, prompts: list[dict[str, Any]]) -> dict[str, Any]:
    """One ``llm.generate`` call: its wall time and each request's TTFT."""
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


def point_seed(a: argparse.Namespace, rep: int, length: int, conc: int, mode_index: int = 0) -> int:
    """Prompt seed of one measurement: the same for every mode, or with
    ``--prefix-caching`` distinct per mode, so no mode hits another's cached blocks."""
    seed = 1000 * rep + length + conc
    return seed + 1_000_003 * mode_index if a.prefix_caching else seed


def kept_summary(stats: dict[str, Any] | None, num_layers: int) -> dict[str, Any] | None:
    """Per drop layer: kept/seen; share of the prompt alive after it; layer-token work share
    (``uniprefill.eval.speedup``'s definitions)."""
    if not stats or not stats["seen_tokens"] or stats["seen_tokens"][0] == 0:
        return None
    per_layer = kept_ratios(stats)
    work, _ = work_shares(per_layer, stats["drop_layers"], num_layers)
    return {"per_layer_kept": per_layer, "alive_after": alive_after(per_layer), "work_share": work}


def mode_point(
    name: str,
    length: int,
    conc: int,
    mode: str,
    runs: dict[str, Any],
    dense: dict[str, Any] | None,
    num_layers: int,
) -> dict[str, Any]:
    """The JSON record of one mode at one point, from its repeats (``runs``: ``wall_s``,
    ``ttft_mean_s`` and ``ttft_all_s`` lists, ``ttft_source``, summed ``stats``) and the
    dense mode's (``None``: not measured)."""
    wall = statistics.median(runs["wall_s"])
    ttft = statistics.median(runs["ttft_mean_s"])
    dense_wall = statistics.median(dense["wall_s"]) if dense and dense["wall_s"] else None
    dense_ttft = statistics.median(dense["ttft_mean_s"]) if dense and dense["wall_s"] else None
    return {
        "model": name,
        "length": length,
        "concurrency": conc,
        "mode": mode,
        "repeats": len(runs["wall_s"]),
        "ttft_median_s": ttft,  # median over repeats of the batch's mean TTFT
        "ttft_p50_all_s": statistics.median(runs["ttft_all_s"]),
        "ttft_min_all_s": min(runs["ttft_all_s"]),
        "ttft_max_all_s": max(runs["ttft_all_s"]),
        "wall_median_s": wall,
        "wall_all_s": runs["wall_s"],
        "ttft_mean_all_reps_s": runs["ttft_mean_s"],
        "prefill_tok_s": conc * length / wall,
        "ttft_source": runs.get("ttft_source"),
        "speedup_ttft": (dense_ttft / ttft) if dense_ttft else None,
        "throughput_gain": (dense_wall / wall - 1.0) if dense_wall else None,
        "stats": runs["stats"],
        "kept": kept_summary(runs["stats"], num_layers) if mode != "dense" else None,
    }


def points_at(doc: dict[str, Any], name: str, length: int, conc: int) -> list[dict[str, Any]]:
    """The measured (not skipped) points of one model, length and concurrency."""
    return [
        p
        for p in doc["points"]
        if p.get("model") == name
        and p["length"] == length
        and p["concurrency"] == conc
        and "mode" in p
    ]


def dense_point(doc: dict[str, Any], name: str, length: int, conc: int) -> dict[str, Any] | None:
    return next((p for p in points_at(doc, name, length, conc) if p["mode"] == "dense"), None)


def point_line(doc: dict[str, Any], name: str, length: int, conc: int) -> str:
    parts = []
    for p in points_at(doc, name, length, conc):
        s = f"{p['mode']}: {p['ttft_median_s']:.3f}s"
        if p["speedup_ttft"] and p["mode"] != "dense":
            s += f" x{p['speedup_ttft']:.2f}"
        if p["kept"]:
            s += f" work {p['kept']['work_share']:.2f}"
        parts.append(s)
    return f"RESULT {name} L={length} c={conc} | " + " | ".join(parts)


class PointCost:
    """Predicts the seconds of the sweep's next point from the points measured so far."""

    def __init__(self, repeats: int) -> None:
        self.repeats = repeats
        self.dense_cost: list[tuple[int, int, float]] = []  # (length, conc, dense wall s)
        self.mode_factor: float | None = None  # point wall (all modes) / dense wall / repeats

    def measured(self, length: int, conc: int, per_mode: dict[str, dict[str, Any]]) -> None:
        dense = per_mode.get("dense")
        if not dense or not dense["wall_s"]:
            return
        dense_wall = statistics.median(dense["wall_s"])
        self.dense_cost.append((length, conc, dense_wall))
        total = sum(sum(pm["wall_s"]) for pm in per_mode.values())
        self.mode_factor = total / dense_wall / max(len(dense["wall_s"]), 1)

    def predict_s(self, length: int, conc: int, num_modes: int) -> float:
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
        return dense * factor * self.repeats
