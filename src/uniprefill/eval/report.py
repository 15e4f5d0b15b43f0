"""Merge ``uniprefill eval --json`` results and report the paired dense-vs-UniPrefill gap.

Every sample is scored twice on the same prompt (dense, then UniPrefill), so the
honest summary is paired: the mean per-sample difference with a bootstrap
confidence interval, and how many samples got better, worse or stayed equal.
Cell means alone hide that a +10 can be one flipped sample out of ten.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True)
class PairedSample:
    model: str
    config: str  # the UniPrefill settings of the run, e.g. "top_p=0.99 drop_layers=14,22"
    task: str
    length: int
    dense: float  # share of expected answers found, 0..1
    uniprefill: float
    same_output: bool
    same_first_token: bool
    kept_share: float | None


@dataclass(frozen=True)
class GroupSummary:
    key: tuple[Any, ...]
    n: int
    dense: float  # mean score, points (0..100)
    uniprefill: float
    diff: float  # mean paired difference, points
    ci_low: float  # bootstrap 95% interval of ``diff``
    ci_high: float
    better: int
    worse: int
    same_output: float  # share of samples with identical generated text
    same_first_token: float
    kept_share: float | None  # mean prompt share alive after the last drop


def load_samples(paths: Iterable[Path]) -> list[PairedSample]:
    """Paired samples from eval JSON files (files without a UniPrefill run are refused)."""
    out: list[PairedSample] = []
    for path in paths:
        doc = json.loads(Path(path).read_text())
        if "uniprefill" not in doc or "dense" not in doc:
            raise ValueError(f"{path}: needs both a dense and a UniPrefill run (no --dense-only)")
        model = Path(str(doc.get("model", path))).name
        config = config_label(doc.get("uniprefill_config") or {})
        for s in doc["samples"]:
            out.append(
                PairedSample(
                    model=model,
                    config=config,
                    task=s["task"],
                    length=int(s["target_len"]),
                    dense=float(s["dense_score"]),
                    uniprefill=float(s["uniprefill_score"]),
                    same_output=s["dense_output"] == s["uniprefill_output"],
                    same_first_token=s["dense_first_token"] == s["uniprefill_first_token"],
                    kept_share=s.get("uniprefill_kept_share"),
                )
            )
    return out


def config_label(config: dict[str, Any]) -> str:
    """A short, stable label of a UniPrefill config ("defaults" when nothing was set)."""
    parts = []
    for key in sorted(config):
        value = config[key]
        if isinstance(value, (list, tuple)):
            value = ",".join(str(v) for v in value)
        parts.append(f"{key}={value}")
    return " ".join(parts) or "defaults"


def bootstrap_ci(
    diffs: Sequence[float], *, resamples: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """95% percentile bootstrap interval of the mean of ``diffs`` (deterministic from seed)."""
    d = np.asarray(diffs, dtype=np.float64)
    if d.size == 0:
        return (float("nan"), float("nan"))
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, d.size, size=(resamples, d.size))].mean(axis=1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return float(lo), float(hi)


def summarize(samples: Sequence[PairedSample], by: Sequence[str]) -> list[GroupSummary]:
    """One summary per distinct value of the ``by`` fields (e.g. ``("model", "length")``)."""
    groups: dict[tuple[Any, ...], list[PairedSample]] = {}
    for s in samples:
        groups.setdefault(tuple(getattr(s, f) for f in by), []).append(s)
    out = []
    for key in sorted(groups):
        g = groups[key]
        diffs = [100.0 * (s.uniprefill - s.dense) for s in g]
        lo, hi = bootstrap_ci(diffs)
        kept = [s.kept_share for s in g if s.kept_share is not None]
        out.append(
            GroupSummary(
                key=key,
                n=len(g),
                dense=100.0 * float(np.mean([s.dense for s in g])),
                uniprefill=100.0 * float(np.mean([s.uniprefill for s in g])),
                diff=float(np.mean(diffs)),
                ci_low=lo,
                ci_high=hi,
                better=sum(s.uniprefill > s.dense for s in g),
                worse=sum(s.uniprefill < s.dense for s in g),
                same_output=float(np.mean([s.same_output for s in g])),
                same_first_token=float(np.mean([s.same_first_token for s in g])),
                kept_share=float(np.mean(kept)) if kept else None,
            )
        )
    return out


def format_summary(rows: Sequence[GroupSummary], by: Sequence[str]) -> str:
    """A Markdown table of :func:`summarize` output."""
    head = [
        *by,
        "n",
        "dense",
        "uniprefill",
        "diff [95% CI]",
        "better / worse",
        "same output",
        "same 1st token",
        "kept share",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        kept = "" if r.kept_share is None else f"{r.kept_share:.3f}"
        cells = [
            *(str(k) for k in r.key),
            str(r.n),
            f"{r.dense:.1f}",
            f"{r.uniprefill:.1f}",
            f"{r.diff:+.1f} [{r.ci_low:+.1f}, {r.ci_high:+.1f}]",
            f"{r.better} / {r.worse}",
            f"{100 * r.same_output:.0f}%",
            f"{100 * r.same_first_token:.0f}%",
            kept,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_by_length(samples: Sequence[PairedSample], path: Path) -> Path:
    """Accuracy vs prompt length, dense and UniPrefill, one panel per model and UniPrefill
    config (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summarize(samples, ("model", "config", "length"))
    panels = sorted({r.key[:2] for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 3.8), squeeze=False)
    for ax, (model, config) in zip(axes[0], panels, strict=True):
        mine = [r for r in rows if r.key[:2] == (model, config)]
        xs = [r.key[2] for r in mine]
        ax.plot(xs, [r.dense for r in mine], "o-", label="dense")
        ax.errorbar(
            xs,
            [r.uniprefill for r in mine],
            yerr=[[r.diff - r.ci_low for r in mine], [r.ci_high - r.diff for r in mine]],
            fmt="s--",
            capsize=3,
            label="UniPrefill (bars: 95% CI of the paired diff)",
        )
        for r in mine:
            if r.kept_share is not None:
                ax.annotate(
                    f"kept {r.kept_share:.2f}",
                    (r.key[2], r.uniprefill),
                    fontsize=7,
                    textcoords="offset points",
                    xytext=(4, -12),
                )
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs)
        ax.set_xticklabels([f"{x // 1024}K" if x % 1024 == 0 else str(x) for x in xs])
        ax.set_xlabel("prompt length (tokens)")
        ax.set_ylabel("RULER-style score (mean over tasks and samples)")
        ax.set_title(f"{model}, UniPrefill {config}", fontsize=9)
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
