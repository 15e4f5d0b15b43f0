"""Predicted prefill (TTFT) speedup from the kept shares, fitted on the H200 measurements.

A model of the H200 runs in docs/benchmarks.md, not a measurement of your machine. Those
runs were on one H200 with vLLM 0.26.0, random weights of three real shapes
(Llama-3.1-8B, Gemma-3-12B text, Qwen3-Next-80B-A3B cut to 16 layers), one prompt at a
time (concurrency 1), 8K-128K tokens, in ``keep_ratio`` and ``top_p`` 0.99 modes. Raw
results: ``benchmarks/gpu/results/2026-12-02{b,c,d}_h200_*.json``. A different GPU, model
size, batch or vLLM release gives other numbers. The speedup of a *shape* follows how much
work is left, and kept shares are what ``uniprefill calibrate`` measures on your model.

**Work left.** With ``alive[i]`` the share of prompt tokens still alive after drop layer
``d[i]`` (the product of the kept shares up to it), layers ``0..d[0]`` see every token and
layers ``d[i]+1 .. d[i+1]`` see ``alive[i]``. Over the ``L`` layers:

* ``w1`` (the *work share*, as in docs/benchmarks.md) = mean token share per layer. The
  GEMMs, norms, MoE and linear or sliding-window attention scale with it;
* ``w2`` = mean of the squared share. Causal full attention scales with it.

**Time model** (per architecture family and prompt length; ``r`` = TTFT with UniPrefill /
dense TTFT in the same eager engine)::

    r = max(o + (1 - h) * w1 + h * w2, r_min)

``h`` is the share of dense prefill time that scales like attention (it grows with the
length), ``o`` the fixed cost UniPrefill adds (scoring, one host sync per drop layer), and
``r_min`` the best measured ratio at that point. Short Qwen3-Next prompts are
launch-bound: keeping fewer blocks stops helping there, and the model never predicts more
than was measured. ``o`` and ``h`` are least-squares fits to each family's measured
points at each length; :func:`fit` recomputes them from the raw JSON (a test checks that
:data:`FITS` matches it). Residuals are in :data:`FITS` (``max_rel_err``).

At 8K ``h`` comes out negative for Gemma 3 and Qwen3-Next: there the time per layer has a
part that does not shrink with the tokens (kernel launches), which the fit folds into
``h``. Llama had no measured point between work share 0.54 and 1 (no ``top_p`` run), so
its curve there rests on the model, whose ``o`` is about 0 from 32K up.

**Against plain vLLM.** UniPrefill needs ``enforce_eager``; users run vLLM compiled with
CUDA graphs. ``c = compiled dense TTFT / eager dense TTFT``, measured at the same points
(Gemma 3: 0.71-0.75, compiled is faster; Llama: 1.0; Qwen3-Next: 0.88-1.08, measured in
another lease than its eager run), and the speedup against compiled vLLM is ``c / r``.

Between measured lengths the parameters are interpolated linearly in log2(length);
outside 8K-128K the nearest measured length is used and the prediction says so.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Benchmark model name (bench_ttft.py MODELS) -> family, and the shape it stands for.
BENCH_MODELS = {"llama8b": "llama", "gemma3": "gemma3", "qwen3next": "qwen3_next"}
SHAPES = {
    "llama": "Llama-3.1-8B shape",
    "gemma3": "Gemma-3-12B text shape",
    "qwen3_next": "Qwen3-Next-80B-A3B shape (16 layers)",
}
# The files the fit reads, in the order docs/benchmarks.md merges them (later wins).
RESULT_FILES = (
    "2026-12-02b_h200_hybrid.json",
    "2026-12-02b_h200_llama.json",
    "2026-12-02b_h200_qwen3next_conc.json",
    "2026-12-02c_h200_gemma_conc.json",
    "2026-12-02c_h200_llama_compiled.json",
    "2026-12-02d_h200_qwen3next_compiled.json",
)
SOURCE = "H200, vLLM 0.26.0, random weights, concurrency 1 (docs/benchmarks.md)"


@dataclass(frozen=True)
class PointFit:
    """The fitted time model of one family at one prompt length."""

    o: float  # fixed overhead, share of dense TTFT
    h: float  # attention-like (quadratic) share of dense TTFT
    r_min: float  # best measured TTFT ratio (the launch-bound floor)
    compiled: float | None  # compiled dense TTFT / eager dense TTFT (None: not measured)
    n: int  # measured points used
    max_rel_err: float  # largest |predicted / measured - 1| of the TTFT ratio
    w1_min: float  # smallest measured work share (below: extrapolated)


# Fitted by fit() from RESULT_FILES; tests/test_speedup.py recomputes and compares.
# PointFit(o, h, r_min, compiled, n, max_rel_err, w1_min)
FITS: dict[str, dict[int, PointFit]] = {
    "llama": {
        8192: PointFit(0.0485, 0.3013, 0.3541, 1.0086, 3, 0.0037, 0.3242),
        32768: PointFit(0.0005, 0.4411, 0.2877, 0.9983, 3, 0.0057, 0.3083),
        65536: PointFit(-0.0067, 0.5389, 0.276, None, 3, 0.0006, 0.3059),
        131072: PointFit(-0.0061, 0.6912, 0.2699, 0.9991, 3, 0.0024, 0.3047),
    },
    "gemma3": {
        8192: PointFit(0.0172, -0.1213, 0.7164, 0.7117, 4, 0.018, 0.6882),
        32768: PointFit(0.0025, 0.1675, 0.6718, 0.7454, 4, 0.0057, 0.6802),
        131072: PointFit(0.0003, 0.2817, 0.6619, None, 4, 0.0075, 0.678),
    },
    "qwen3_next": {
        8192: PointFit(0.0807, -1.0273, 0.7977, 1.0751, 4, 0.073, 0.3835),
        32768: PointFit(0.0376, 0.0535, 0.449, 0.8821, 4, 0.0268, 0.3618),
        65536: PointFit(0.0293, 0.3504, 0.3736, None, 4, 0.0097, 0.3582),
        131072: PointFit(0.0067, 0.4994, 0.3236, 0.9109, 4, 0.0122, 0.3561),
    },
}


# ---- work share ------------------------------------------------------------------------------
def alive_after(kept_per_layer: Sequence[float | None]) -> list[float]:
    """Share of prompt tokens alive after each drop layer (``None``: nothing scored there)."""
    out, share = [], 1.0
    for k in kept_per_layer:
        if k is not None:
            share *= float(k)
        out.append(share)
    return out


def work_shares(
    kept_per_layer: Sequence[float | None], drop_layers: Sequence[int], num_layers: int
) -> tuple[float, float]:
    """``(w1, w2)``: mean token share per layer and mean squared share (see module doc)."""
    if len(kept_per_layer) != len(drop_layers):
        raise ValueError("one kept share per drop layer")
    if not drop_layers:
        return 1.0, 1.0
    d = list(drop_layers)
    if d != sorted(d) or d[0] < 0 or d[-1] >= num_layers:
        raise ValueError(f"drop layers {d} must increase within 0..{num_layers - 1}")
    alive = alive_after(kept_per_layer)
    w1 = w2 = float(d[0] + 1)
    for i, a in enumerate(alive):
        span = (d[i + 1] if i + 1 < len(d) else num_layers - 1) - d[i]
        w1 += a * span
        w2 += a * a * span
    return w1 / num_layers, w2 / num_layers


# ---- prediction ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Prediction:
    family: str
    length: int
    w1: float
    w2: float
    vs_eager: float  # TTFT speedup against dense vLLM in the same eager engine
    vs_compiled: float | None  # against plain vLLM with its defaults (compiled, CUDA graphs)
    notes: tuple[str, ...]  # where the prediction leaves the measured range

    def to_dict(self) -> dict[str, Any]:
        return {
            "family": self.family,
            "shape": SHAPES[self.family],
            "length": self.length,
            "work_share": self.w1,
            "work_share_sq": self.w2,
            "speedup_vs_eager": self.vs_eager,
            "speedup_vs_compiled": self.vs_compiled,
            "notes": list(self.notes),
            "source": SOURCE,
        }


def family_of(architectures: Iterable[str]) -> str | None:
    """The key of FITS whose time model stands for these architectures (the registry's
    ``speed_fit``: dense full-attention families use the Llama fit), or None."""
    from uniprefill.vllm.families import family_for

    try:
        return family_for(list(architectures)).speed_fit
    except ValueError:
        return None


def _interp(points: dict[int, PointFit], length: int, attr: str) -> tuple[float | None, bool]:
    """``attr`` at ``length``: linear in log2(length) between measured lengths where it is
    known, the nearest known one outside them (second value: True if clamped)."""
    known = sorted((n, getattr(p, attr)) for n, p in points.items() if getattr(p, attr) is not None)
    if not known:
        return None, True
    if length <= known[0][0]:
        return known[0][1], length < known[0][0]
    if length >= known[-1][0]:
        return known[-1][1], length > known[-1][0]
    for (n0, v0), (n1, v1) in zip(known, known[1:], strict=False):
        if n0 <= length <= n1:
            t = (math.log2(length) - math.log2(n0)) / (math.log2(n1) - math.log2(n0))
            return v0 + t * (v1 - v0), False
    raise AssertionError("unreachable")


def predict(
    family: str,
    length: int,
    kept_per_layer: Sequence[float | None],
    drop_layers: Sequence[int],
    num_layers: int,
    fits: dict[str, dict[int, PointFit]] | None = None,
) -> Prediction:
    """Predicted H200 TTFT speedup at ``length`` tokens for these kept shares."""
    table = (FITS if fits is None else fits).get(family)
    if not table:
        raise KeyError(f"no H200 fit for family {family!r}; have {sorted(FITS)}")
    w1, w2 = work_shares(kept_per_layer, drop_layers, num_layers)
    notes = []
    o, clamped = _interp(table, length, "o")
    h, _ = _interp(table, length, "h")
    r_min, _ = _interp(table, length, "r_min")
    w1_min, _ = _interp(table, length, "w1_min")
    c, c_clamped = _interp(table, length, "compiled")
    assert o is not None and h is not None and r_min is not None and w1_min is not None
    if clamped:
        lo, hi = min(table), max(table)
        notes.append(f"length outside the measured {lo // 1024}K-{hi // 1024}K: nearest used")
    if c_clamped and c is not None:
        at = sorted(n for n, p in table.items() if p.compiled is not None)
        notes.append(
            "compiled baseline measured at " + ", ".join(f"{n // 1024}K" for n in at) + " only"
        )
    if w1 < w1_min - 1e-9:
        notes.append(
            f"work share {w1:.2f} below the smallest measured ({w1_min:.2f}): capped at the "
            "best measured speedup"
        )
    if not any(k is not None and k < 1.0 for k in kept_per_layer):
        return Prediction(family, length, w1, w2, 1.0, c, tuple(notes))
    r = max(o + (1.0 - h) * w1 + h * w2, r_min)
    return Prediction(family, length, w1, w2, 1.0 / r, None if c is None else c / r, tuple(notes))


# ---- fit ---------------------------------------------------------------------------------------
def _points(files: Iterable[Path]) -> tuple[dict, dict[str, tuple[int, list[int]]]]:
    latest: dict[tuple[str, int, int, str], dict[str, Any]] = {}
    shapes: dict[str, tuple[int, list[int]]] = {}
    for f in files:
        doc = json.loads(Path(f).read_text())
        for name, m in doc.get("models", {}).items():
            if m.get("num_layers"):
                shapes[name] = (int(m["num_layers"]), list(m["drop_layers"]))
        for p in doc["points"]:
            if "mode" in p:  # a point measured again in a later file replaces the earlier
                latest[(p["model"], p["length"], p["concurrency"], p["mode"])] = p
    return latest, shapes


def fit(results_dir: Path) -> dict[str, dict[int, PointFit]]:
    """Fit :data:`FITS` from the raw H200 results (concurrency 1 only)."""
    import numpy as np

    latest, shapes = _points(Path(results_dir) / f for f in RESULT_FILES)
    out: dict[str, dict[int, PointFit]] = {}
    for bench, family in BENCH_MODELS.items():
        num_layers, _ = shapes[bench]
        lengths = sorted({k[1] for k in latest if k[0] == bench and k[2] == 1})
        for length in lengths:
            pts = [
                p
                for (m, n, c, mode), p in sorted(latest.items())
                if (m, n, c) == (bench, length, 1) and mode.startswith(("keep", "topp"))
            ]
            ws = [
                work_shares(p["kept"]["per_layer_kept"], p["stats"]["drop_layers"], num_layers)
                for p in pts
            ]
            r = np.array([1.0 / p["speedup_ttft"] for p in pts])
            w1 = np.array([w[0] for w in ws])
            w2 = np.array([w[1] for w in ws])
            # Launch-bound points (slower than a point that keeps more) set the floor only.
            order = np.argsort(-w1)
            use = np.ones(len(pts), dtype=bool)
            best = np.inf
            for i in order:
                if r[i] > best + 1e-12:
                    use[i] = False
                best = min(best, r[i])
            a = np.c_[np.ones(use.sum()), w2[use] - w1[use]]
            (o, h), *_ = np.linalg.lstsq(a, r[use] - w1[use], rcond=None)
            r_min = float(r.min())
            pred = np.maximum(o + (1 - h) * w1 + h * w2, r_min)
            dense = latest.get((bench, length, 1, "dense"))
            comp = latest.get((bench, length, 1, "dense_compiled"))
            compiled = comp["ttft_median_s"] / dense["ttft_median_s"] if comp and dense else None
            out.setdefault(family, {})[length] = PointFit(
                o=round(float(o), 4),
                h=round(float(h), 4),
                r_min=round(r_min, 4),
                compiled=None if compiled is None else round(compiled, 4),
                n=len(pts),
                max_rel_err=round(float(np.max(np.abs(pred / r - 1))), 4),
                w1_min=round(float(w1.min()), 4),
            )
    return out


def fit_table(fits: dict[str, dict[int, PointFit]] | None = None) -> str:
    """The fitted parameters as a Markdown table (docs/benchmarks.md)."""
    rows = [
        "| family | length | o | h | best measured | compiled / eager dense | points | max error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for family, table in (FITS if fits is None else fits).items():
        for n, p in sorted(table.items()):
            comp = "" if p.compiled is None else f"{p.compiled:.2f}"
            rows.append(
                f"| {family} | {n // 1024}K | {p.o:+.3f} | {p.h:.3f} | {1 / p.r_min:.2f}x | "
                f"{comp} | {p.n} | {100 * p.max_rel_err:.1f}% |"
            )
    return "\n".join(rows)
