"""Tables and plots of ``bench_ttft.py``'s JSON (also ``bench_ttft.py --plot-from``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from common import KB, log


def fmt_len(n: int) -> str:
    return f"{n // KB}K" if n % KB == 0 else str(n)


def point_order(p: dict[str, Any]) -> tuple:
    """Table order: model, concurrency, length, then dense, top-p, keep ratios high to low."""
    mode = p.get("mode", "")
    rank = {"dense": 0, "dense_compiled": 1}.get(mode, 2 if mode.startswith("topp") else 3)
    # keep<R>, or keep<R1>/<R2>/... (one ratio per drop layer: ordered by the first)
    ratio = -float(mode[4:].split("/")[0]) if mode.startswith("keep") else 0.0
    return (p["model"], p["concurrency"], p["length"], rank, ratio)


def merged_results(files: list[str]) -> dict[str, Any]:
    """Several runs' JSON as one document (``--plot-from``): a point measured again in a
    later file replaces the same point of an earlier one."""
    doc: dict[str, Any] = {"points": [], "errors": [], "env": {}}
    for f in files:
        d = json.loads(Path(f).read_text())
        doc["points"] += d["points"]
        doc["errors"] += d.get("errors", [])
        doc["env"] = d.get("env", doc["env"])
    latest = {(p["model"], p["length"], p["concurrency"], p.get("mode")): p for p in doc["points"]}
    doc["points"] = sorted(latest.values(), key=point_order)
    return doc


def markdown_table(doc: dict[str, Any]) -> str:
    rows = [
        "| model | length | conc | mode | TTFT median (s) | TTFT speedup | prefill tok/s | "
        "throughput gain | kept per drop layer | alive after last drop | work share |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in doc["points"]:
        if "mode" not in p:
            rows.append(
                f"| {p['model']} | {fmt_len(p['length'])} | {p['concurrency']} | - | "
                f"{p['skipped']} | | | | | | |"
            )
            continue
        kept = p.get("kept")
        kept_s = (
            " ".join(f"{x:.2f}" if x is not None else "-" for x in kept["per_layer_kept"])
            if kept
            else ""
        )
        work = f"{kept['work_share']:.2f}" if kept else ""
        alive = f"{kept['alive_after'][-1]:.3f}" if kept else ""
        sp = f"{p['speedup_ttft']:.2f}x" if p.get("speedup_ttft") else ""
        gain = f"{100 * p['throughput_gain']:+.0f}%" if p.get("throughput_gain") is not None else ""
        rows.append(
            f"| {p['model']} | {fmt_len(p['length'])} | {p['concurrency']} | {p['mode']}"
            f"{' (' + p['flag'] + ')' if p.get('flag') else ''} | "
            f"{p['ttft_median_s']:.3f} | {sp} | {p['prefill_tok_s']:,.0f} | {gain} | "
            f"{kept_s} | {alive} | {work} |"
        )
    compiled = compiled_table(doc)
    if compiled:
        rows += ["", compiled]
    if doc.get("errors"):
        rows.append("")
        rows.append("Errors:")
        for e in doc["errors"]:
            rows.append(f"- {e['where']}: {e['error']}")
    return "\n".join(rows) + "\n"


def compiled_table(doc: dict[str, Any]) -> str:
    """Every mode against plain compiled vLLM, where that was measured: TTFT speedup and
    prefill throughput ratio (the steadier of the two at concurrency > 1)."""
    base = {
        (p["model"], p["length"], p["concurrency"]): (p["ttft_median_s"], p["wall_median_s"])
        for p in doc["points"]
        if p.get("mode") == "dense_compiled"
    }
    body = []
    for p in sorted((p for p in doc["points"] if "mode" in p), key=point_order):
        key = (p["model"], p["length"], p["concurrency"])
        if key not in base or p["mode"] == "dense_compiled":
            continue
        ttft, wall = base[key]
        body.append(
            f"| {p['model']} | {fmt_len(p['length'])} | {p['concurrency']} | {ttft:.3f} | "
            f"{p['mode']} | {p['ttft_median_s']:.3f} | {ttft / p['ttft_median_s']:.2f}x | "
            f"{wall / p['wall_median_s']:.2f}x |"
        )
    if not body:  # only compiled points (a --compiled-only file on its own)
        return ""
    head = [
        "Against plain vLLM with its defaults (compiled, CUDA graphs, plugin off):",
        "",
        "| model | length | conc | compiled dense TTFT (s) | mode | TTFT (s) "
        "| TTFT speedup vs compiled | throughput vs compiled |",
        "|---|---|---|---|---|---|---|---|",
    ]
    return "\n".join(head + body)


def make_plots(doc: dict[str, Any], out_dir: Path) -> list[Path]:
    """One PNG per model: speedup vs prompt length, one line per (concurrency, mode).

    Left: mean TTFT speedup; right: prefill throughput speedup (dense wall / wall).
    Points carrying a ``flag`` (e.g. polluted by kernel compilation) are left out.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib missing: no plots")
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    pts = [
        p
        for p in doc["points"]
        if "mode" in p and not p["mode"].startswith("dense") and not p.get("flag")
    ]
    gpu = doc.get("env", {}).get("gpu", "").split(",")[0]
    for model in sorted({p["model"] for p in pts}):
        mp = [p for p in pts if p["model"] == model]
        fig, axes = plt.subplots(1, 2, figsize=(10.5, 4.2), sharey=True)
        modes = sorted({p["mode"] for p in mp})
        styles = {m: s for m, s in zip(modes, ["-", "--", ":", "-."] * 3, strict=False)}
        concs = sorted({p["concurrency"] for p in mp})
        colors = {c: f"C{i}" for i, c in enumerate(concs)}
        lens = sorted({p["length"] for p in mp})
        for ax, key, title in (
            (axes[0], "speedup_ttft", "mean TTFT speedup"),
            (axes[1], "throughput_gain", "prefill throughput speedup"),
        ):
            for mode in modes:
                for c in concs:
                    line = sorted(
                        (p["length"], p[key] + (1.0 if key == "throughput_gain" else 0.0))
                        for p in mp
                        if p["mode"] == mode and p["concurrency"] == c and p.get(key) is not None
                    )
                    if not line:
                        continue
                    xs, ys = zip(*line, strict=True)
                    ax.plot(
                        xs,
                        ys,
                        styles[mode],
                        marker="o",
                        color=colors[c],
                        label=f"{mode}, concurrency {c}",
                    )
            ax.axhline(1.0, color="grey", lw=0.8)
            ax.set_xscale("log", base=2)
            ax.set_xticks(lens)
            ax.set_xticklabels([fmt_len(x) for x in lens])
            ax.set_xlabel("prompt length (tokens)")
            ax.set_title(title, fontsize=9)
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("x vs dense (same engine)")
        axes[1].legend(fontsize=7)
        fig.suptitle(
            f"UniPrefill on {model} (random weights), {gpu}, vLLM "
            f"{doc.get('env', {}).get('vllm', '')}",
            fontsize=10,
        )
        fig.tight_layout()
        path = out_dir / f"ttft_speedup_{model}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
        log(f"plot {path}")
    work = _plot_work_share(plt, pts, out_dir, gpu)
    if work is not None:
        written.append(work)
    return written


def _plot_work_share(plt: Any, pts: list[dict[str, Any]], out_dir: Path, gpu: str) -> Path | None:
    """TTFT speedup against work share (concurrency 1), one line per model and length.

    Work share is the average share of prompt tokens a layer still sees; it is what
    a trained model's top-p decides, so this curve is what transfers from random to
    trained weights. The dashed line is 1 / work share (GEMM-bound ideal).
    """
    by_line: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for p in pts:
        if p["concurrency"] == 1 and p.get("kept") and p.get("speedup_ttft"):
            key = (p["model"], p["length"])
            by_line.setdefault(key, []).append((p["kept"]["work_share"], p["speedup_ttft"]))
    if not by_line:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for i, ((model, length), line) in enumerate(sorted(by_line.items())):
        xs, ys = zip(*sorted(line), strict=True)
        ax.plot(xs, ys, marker="o", color=f"C{i}", label=f"{model} {fmt_len(length)}")
    grid = [0.3 + 0.01 * i for i in range(71)]
    ax.plot(grid, [1 / w for w in grid], "k--", lw=0.8, label="1 / work share")
    ax.set_xlabel("work share (mean share of tokens a layer sees)")
    ax.set_ylabel("TTFT speedup vs dense (concurrency 1)")
    ax.set_title(f"UniPrefill speedup vs work share, {gpu}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = out_dir / "ttft_vs_work_share.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    log(f"plot {path}")
    return path
