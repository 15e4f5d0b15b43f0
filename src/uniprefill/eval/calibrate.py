"""``uniprefill calibrate``: choose ``top_p`` for a model from accuracy and predicted speed.

One engine with UniPrefill loaded runs the same prompts once per setting: first with
``top_p`` 1.0 (the dense reference: nothing is scored and every step is vLLM's own
forward), then at each ``top_p`` of the grid, switching the setting between passes. Per
setting it reports

* the score against dense on the same prompts: the paired mean difference with a
  bootstrap 95% interval (:mod:`uniprefill.eval.report`);
* the kept share at each drop layer (:func:`uniprefill.vllm.stats.kept_ratios`) and the
  work share it leaves;
* the TTFT speedup that share predicts for the model's architecture family on the H200
  measurements (:mod:`uniprefill.eval.speedup`), against plain vLLM as deployed
  (compiled, CUDA graphs);

and recommends the fastest setting whose loss stays within a budget (default 0.5 points).
With ``schedules`` (``--schedule``, repeated) it compares drop schedules too: one engine
per schedule (the dense pass runs once, in the first), and the recommendation names the
schedule as well as ``top_p``. ``--schedule auto`` compares the family default with an
earlier schedule (:meth:`uniprefill.vllm.families.ModelFamily.candidate_schedules`).
Prompts are the RULER-style suite (:mod:`uniprefill.eval.ruler`) or a JSONL file of
``{"prompt": ..., "answers": [...]}`` (answers optional: without them a prompt scores 1
when UniPrefill's output equals the dense output exactly).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TextIO

from uniprefill.eval import speedup
from uniprefill.eval.prose import source as prose_source
from uniprefill.eval.report import PairedSample, summarize
from uniprefill.eval.ruler import (
    PROSE_TASKS,
    TASKS,
    generate_suite,
    string_match_all,
    token_counter,
)
from uniprefill.eval.runner import (
    DEFAULT_MAX_NEW_TOKENS,
    EngineRun,
    generate,
    kept_summary,
    resolve_model,
    sized_llm_kwargs,
    start_engine,
    stop_engine,
)

DEFAULT_TOP_PS: tuple[float, ...] = (0.9, 0.95, 0.98, 0.99, 0.995, 0.999)
DEFAULT_BUDGET = 0.5  # points (RULER-style score, 0..100)
DEFAULT_PREDICT_LENGTHS: tuple[int, ...] = (8192, 32768, 131072)
# A trained model on CPU: 4 prompts per task at 4K. A tiny random model (the built-in
# arch names): one short prompt per task and short answers, so the whole grid runs in
# well under a minute on two CPU cores.
DEFAULTS = {"lengths": [4096], "samples": 4, "max_new_tokens": None}
TINY_DEFAULTS = {"lengths": [1024], "samples": 1, "max_new_tokens": 8}
# The tiny Qwen3-Next has full attention at layers 1 and 3 only, and the default schedule
# skips the first and the last full layer, so it would drop nothing (as in the demo).
TINY_DROP_LAYERS = {"qwen3_next": [1]}


@dataclass(frozen=True)
class Setting:
    """One pass: a top_p at a drop schedule (None: the model family's default)."""

    top_p: float
    drop_layers: tuple[int, ...] | None = None

    @property
    def label(self) -> str:
        if self.drop_layers is None:
            return _label(self.top_p)
        return f"layers {','.join(map(str, self.drop_layers))} {_label(self.top_p)}"


DENSE = Setting(1.0)


@dataclass(frozen=True)
class Prompt:
    text: str
    answers: tuple[str, ...] | None  # None: score = same output as dense
    max_tokens: int
    task: str
    length: int  # target length (the suite) or the prompt's own token count (a file)
    n_tokens: int


def suite_prompts(
    counter: Any,
    tasks: Sequence[str],
    lengths: Sequence[int],
    samples: int,
    seed: int,
    max_new_tokens: int | None,
) -> list[Prompt]:
    out = []
    for s in generate_suite(list(tasks), sorted(set(lengths)), samples, counter, seed):
        budget = max_new_tokens or DEFAULT_MAX_NEW_TOKENS[s.task]
        out.append(Prompt(s.prompt, s.answers, budget, s.task, s.target_len, s.n_tokens))
    return out


def file_prompts(path: Path, counter: Any, max_new_tokens: int | None) -> list[Prompt]:
    """Prompts from JSONL (one object per line) or a JSON list: ``prompt`` (required),
    ``answers`` (strings expected in the output), ``max_tokens``, ``task`` (a label)."""
    text = Path(path).read_text()
    if text.lstrip().startswith("["):
        rows = json.loads(text)
    else:
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise ValueError(f"{path}: entry {i} needs a string 'prompt'")
        answers = row.get("answers")
        if answers is not None:
            if isinstance(answers, str):
                answers = [answers]
            answers = tuple(str(a) for a in answers)
        n = counter(row["prompt"])
        budget = int(row.get("max_tokens") or max_new_tokens or 32)
        out.append(Prompt(row["prompt"], answers, budget, str(row.get("task", "file")), n, n))
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


# ---- switching the setting inside the running engine --------------------------------------
def switch_config(llm: Any, cfg: dict[str, Any]) -> bool:
    """Set UniPrefill's settings on every worker of a running engine (the plugin's RPC)."""
    from uniprefill.vllm.worker import CONFIGURE_METHOD

    return bool(llm.collective_rpc(CONFIGURE_METHOD, args=(cfg,)))


# ---- the run ----------------------------------------------------------------------------------
def _model_info(path: Path) -> dict[str, Any]:
    cfg = json.loads((path / "config.json").read_text())
    text = cfg.get("text_config") or cfg
    archs = cfg.get("architectures") or []
    family = speedup.family_of(archs)
    return {
        "architectures": archs,
        "family": family,
        "num_layers": text.get("num_hidden_layers") or cfg.get("num_hidden_layers"),
    }


def auto_schedules(path: Path) -> list[tuple[int, ...]]:
    """``--schedule auto``: the family default and, where it differs, an earlier one."""
    from transformers import AutoConfig

    from uniprefill.vllm.families import family_for

    hf_config = AutoConfig.from_pretrained(str(path))
    return family_for(hf_config.architectures).candidate_schedules(hf_config)


def _label(top_p: float) -> str:
    return "dense" if top_p >= 1.0 else f"top_p={top_p:g}"


AUTO = "auto"  # --schedule auto: the model family's candidate schedules


def check_schedules(
    schedules: Sequence[Sequence[int] | str], config: dict[str, Any]
) -> list[tuple[int, ...]]:
    """The drop schedules to compare, each checked with the other options ``config``
    (``ValueError`` naming ``--schedule``): none empty or given twice, and not beside
    ``drop_layers``; ``auto`` alone (resolved once the model is known: ``[]`` here)."""
    from uniprefill.config import UniPrefillConfig

    if schedules and "drop_layers" in config:
        raise ValueError("--schedule and --drop-layers: give the schedules with --schedule")
    if AUTO in schedules:
        if len(schedules) > 1:
            raise ValueError("--schedule auto: give it alone (it picks the schedules itself)")
        return []
    plans = [tuple(int(x) for x in sched) for sched in schedules]
    if len(set(plans)) != len(plans):
        raise ValueError(f"--schedule: a schedule is given twice ({plans})")
    for plan in plans:
        if not plan:
            raise ValueError("--schedule: an empty schedule (give layer indices, e.g. 6,12)")
        UniPrefillConfig.from_dict({**config, "drop_layers": list(plan)})
    return plans


def run_calibration(
    model: str | Path,
    *,
    top_ps: Sequence[float] = DEFAULT_TOP_PS,
    prompts_file: Path | None = None,
    tasks: Sequence[str] = TASKS,
    lengths: Sequence[int] | None = None,
    samples: int | None = None,
    seed: int = 0,
    max_new_tokens: int | None = None,
    uniprefill_config: dict[str, Any] | None = None,
    llm_kwargs: dict[str, Any] | None = None,
    budget: float = DEFAULT_BUDGET,
    strict: bool = False,
    predict_lengths: Sequence[int] = DEFAULT_PREDICT_LENGTHS,
    progress: bool = True,
    log: TextIO | None = None,
    on_pass: Callable[[dict[str, Any]], None] | None = None,
    schedules: Sequence[Sequence[int] | str] = (),
) -> dict[str, Any]:
    """Run the grid and return the calibration (what ``--json`` writes).

    ``schedules``: drop schedules to compare (one engine each), or ``["auto"]`` (the
    family's candidates); empty: the configured ``drop_layers`` or the family's default.
    ``on_pass`` gets the calibration of the settings done so far after each pass, so a
    long run that is cut off keeps what it measured."""
    from transformers import AutoTokenizer

    from uniprefill.testing import ARCHS

    log = sys.stderr if log is None else log
    top_ps = sorted({float(p) for p in top_ps})
    if not top_ps or any(not 0.0 < p < 1.0 for p in top_ps):
        raise ValueError(f"top_p values must lie in (0, 1), got {top_ps}")
    tiny = str(model) in ARCHS
    defaults = TINY_DEFAULTS if tiny else DEFAULTS
    lengths = list(lengths or defaults["lengths"])
    samples = samples or int(defaults["samples"])
    if max_new_tokens is None:
        max_new_tokens = defaults["max_new_tokens"]
    base = dict(uniprefill_config or {})
    base.pop("top_p", None)
    base.pop("keep_ratio", None)
    plans = check_schedules(schedules, base)
    if tiny and str(model) in TINY_DROP_LAYERS and not schedules:  # a schedule replaces it
        base.setdefault("drop_layers", TINY_DROP_LAYERS[str(model)])

    path, arch_kwargs = resolve_model(model)
    info = _model_info(path)
    if AUTO in schedules:
        plans = check_schedules(auto_schedules(path), base)
    counter = token_counter(AutoTokenizer.from_pretrained(str(path)))
    if prompts_file is not None:
        prompts = file_prompts(prompts_file, counter, max_new_tokens)
    else:
        prompts = suite_prompts(counter, tasks, lengths, samples, seed, max_new_tokens)
    texts = [p.text for p in prompts]
    budgets = [p.max_tokens for p in prompts]
    kw = sized_llm_kwargs(
        path, {**arch_kwargs, **(llm_kwargs or {})}, [p.n_tokens for p in prompts], budgets
    )
    settings = [Setting(p, sched) for sched in (plans or [None]) for p in top_ps]
    runs: dict[Setting, EngineRun] = {}
    notes: list[str] = []

    def calibration(done: Sequence[Setting]) -> dict[str, Any]:
        import vllm

        result = _summarize(
            str(model), info, prompts, runs, done, budget, strict, list(predict_lengths)
        )
        result.update(
            model_path=str(path),
            date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            vllm_version=vllm.__version__,
            uniprefill_config=base,
            llm_kwargs=kw,
            prompts={
                "source": str(prompts_file) if prompts_file else "ruler-style suite",
                "tasks": sorted({p.task for p in prompts}),
                "lengths": sorted({p.length for p in prompts}),
                "samples_per_task": None if prompts_file else samples,
                "seed": None if prompts_file else seed,
                "count": len(prompts),
                "prose": prose_source() if set(tasks) & set(PROSE_TASKS) else None,
            },
        )
        result["warnings"] = notes + result["warnings"]
        result["complete"] = len(done) == len(settings)  # False: a pass-by-pass write
        return result

    passes = [DENSE, *settings]
    llm, engine_plan = None, None
    try:
        for i, st in enumerate(passes):
            sched = st.drop_layers or (plans[0] if plans else None)
            cfg = {**base, "top_p": st.top_p}
            if sched is not None:
                cfg["drop_layers"] = list(sched)
            print(f"[{i + 1}/{len(passes)}] {st.label} ...", file=log, flush=True)
            if llm is not None and sched != engine_plan:  # a schedule is fixed at start-up
                stop_engine(llm)
                llm = None
            if llm is None:
                llm, _ = start_engine(
                    path,
                    llm_kwargs=kw,
                    additional_config={"uniprefill": cfg},
                    request_metrics=True,  # each prompt's TTFT
                )
                engine_plan = sched
            else:
                switch_config(llm, cfg)  # one engine: the next step uses the new top_p
            runs[st] = generate(
                llm, texts, budgets, progress=progress, desc=st.label, warmup=(i == 0)
            )
            if on_pass is not None and i > 0:
                on_pass(calibration(passes[1 : i + 1]))
    finally:
        if llm is not None:
            stop_engine(llm)
            del llm
    return calibration(settings)


def _total(seconds: Sequence[float | None]) -> float | None:
    """The prompts' summed times to first token (None unless every prompt has one)."""
    if not seconds or any(t is None for t in seconds):
        return None
    return float(sum(t for t in seconds if t is not None))


def _ratio(dense: float | None, run: float | None) -> float | None:
    return dense / run if dense is not None and run else None


def _score(prompt: Prompt, output: str, dense_output: str) -> float:
    if prompt.answers is None:
        return 1.0 if output == dense_output else 0.0
    return string_match_all(output, prompt.answers)


def _summarize(
    model: str,
    info: dict[str, Any],
    prompts: Sequence[Prompt],
    runs: dict[Setting, EngineRun],
    settings: Sequence[Setting],
    budget: float,
    strict: bool,
    predict_lengths: list[int],
) -> dict[str, Any]:
    from uniprefill.vllm.stats import kept_ratios

    dense = runs[DENSE]
    dense_scores = [_score(p, o, o) for p, o in zip(prompts, dense.outputs, strict=True)]
    family, num_layers = info["family"], info["num_layers"]
    configs = []
    rows = [
        {
            "task": p.task,
            "length": p.length,
            "n_tokens": p.n_tokens,
            "answers": None if p.answers is None else list(p.answers),
            "dense_output": dense.outputs[i],
            "dense_score": dense_scores[i],
            "runs": {},
        }
        for i, p in enumerate(prompts)
    ]
    for setting in settings:
        run = runs[setting]
        top_p, label = setting.top_p, setting.label
        paired = []
        for i, p in enumerate(prompts):
            score = _score(p, run.outputs[i], dense.outputs[i])
            kept = kept_summary(run.batch_stats[i])["final_kept_share"] if run.batch_stats else None
            paired.append(
                PairedSample(
                    model=model,
                    config=label,
                    task=p.task,
                    length=p.length,
                    dense=dense_scores[i],
                    uniprefill=score,
                    same_output=run.outputs[i] == dense.outputs[i],
                    same_first_token=run.first_tokens[i] == dense.first_tokens[i],
                    kept_share=kept,
                )
            )
            rows[i]["runs"][label] = {"output": run.outputs[i], "score": score, "kept_share": kept}
        (g,) = summarize(paired, ["config"])
        stats = run.stats or {}
        kept_layers = kept_ratios(stats) if stats else []
        drop_layers = list(stats.get("drop_layers", []))
        alive = speedup.alive_after(kept_layers)
        entry: dict[str, Any] = {
            "top_p": top_p,
            "label": label,
            "schedule": None if setting.drop_layers is None else list(setting.drop_layers),
            "n": g.n,
            "score": g.uniprefill,
            "diff": g.diff,
            "ci_low": g.ci_low,
            "ci_high": g.ci_high,
            "better": g.better,
            "worse": g.worse,
            "same_output": g.same_output,
            "same_first_token": g.same_first_token,
            "drop_layers": drop_layers,
            "kept_per_layer": kept_layers,
            "alive_after": alive,
            "final_kept_share": alive[-1] if alive else None,
            "dropped_prefills": stats.get("dropped_prefills"),
            "seconds": run.seconds,
            "ttft_s": _total(run.ttft_seconds),
            "ttft_speedup": _ratio(_total(dense.ttft_seconds), _total(run.ttft_seconds)),
            "work_share": None,
            "work_share_sq": None,
            "predictions": [],
        }
        if drop_layers and num_layers:
            w1, w2 = speedup.work_shares(kept_layers, drop_layers, int(num_layers))
            entry["work_share"], entry["work_share_sq"] = w1, w2
            if family is not None:
                entry["predictions"] = [
                    speedup.predict(family, n, kept_layers, drop_layers, int(num_layers)).to_dict()
                    for n in predict_lengths
                ]
        bound = g.ci_low if strict else g.diff
        entry["within_budget"] = bool(bound >= -budget)
        configs.append(entry)

    warnings = []
    dense_mean = 100.0 * sum(dense_scores) / len(dense_scores)
    if dense_mean < 5.0 and any(p.answers is not None for p in prompts):
        warnings.append(
            f"dense scores {dense_mean:.1f} points: this model cannot do these tasks, so the "
            "loss budget says nothing here (use a trained model or your own --prompts)"
        )
    widths = [c["ci_high"] - c["ci_low"] for c in configs]
    if widths and max(widths) > 2 * budget:
        warnings.append(
            f"with {len(prompts)} prompts the 95% intervals are up to {max(widths):.1f} points "
            f"wide, against a budget of {budget:g}: add --samples (or prompts), or use --strict, "
            "before trusting small differences"
        )
    if family is None:
        warnings.append(
            f"no H200 speed model for {info['architectures']}: settings ranked by work share"
        )
    if not any(c["dropped_prefills"] for c in configs):
        warnings.append("no prompt was dropped at any top_p: are the prompts long enough?")
    recommended = recommend(configs, predict_lengths)
    return {
        "model": model,
        "architectures": info["architectures"],
        "family": family,
        "shape": speedup.SHAPES.get(family or ""),
        "num_layers": num_layers,
        "budget": budget,
        "criterion": "ci_low" if strict else "mean",
        "predict_lengths": predict_lengths,
        "speed_source": speedup.SOURCE,
        "dense": {
            "score": dense_mean,
            "seconds": dense.seconds,
            "ttft_s": _total(dense.ttft_seconds),
        },
        "configs": configs,
        "recommended": recommended,
        "warnings": warnings,
        "samples": rows,
    }


def _speed_key(c: dict[str, Any]) -> float:
    """Higher is faster: predicted speedup at the longest length, else 1 / work share."""
    if c["predictions"]:
        return float(c["predictions"][-1]["speedup_vs_eager"])
    return 1.0 / c["work_share"] if c["work_share"] else 1.0


def recommend(configs: Sequence[dict[str, Any]], predict_lengths: Sequence[int]) -> dict | None:
    """The fastest setting within budget that drops something (ties: the higher top_p).
    With compared schedules it names the schedule (``drop_layers``) too."""
    ok = [c for c in configs if c["within_budget"] and c["dropped_prefills"]]
    if not ok:
        return None
    best = max(ok, key=lambda c: (round(_speed_key(c), 3), c["top_p"]))
    rec = {"top_p": best["top_p"], "label": best["label"]}
    if best.get("schedule") is not None:
        rec["drop_layers"] = best["schedule"]
    return rec


# ---- output -----------------------------------------------------------------------------------
def _fmt_len(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def format_calibration(result: dict[str, Any]) -> str:
    fam, lens = result["family"], result["predict_lengths"]
    pr = result["prompts"]
    compared = any(c.get("schedule") is not None for c in result["configs"])
    crit = "95% CI low end" if result["criterion"] == "ci_low" else "mean difference"
    speed_head = (
        "H200 TTFT speedup vs vLLM at " + " / ".join(_fmt_len(n) for n in lens)
        if fam
        else "work share"
    )
    lines = [
        f"uniprefill calibrate: {result['model']} ({', '.join(result['architectures'])}, "
        f"{result['num_layers']} layers)",
        f"prompts: {pr['count']} from {pr['source']}"
        + (f", lengths {', '.join(_fmt_len(n) for n in pr['lengths'])}" if pr["lengths"] else "")
        + f"; dense score {result['dense']['score']:.1f}",
        "",
        f"| {'setting' if compared else 'top_p'} | score | diff vs dense [95% CI] "
        "| worse / better | same output "
        f"| kept per drop layer | left after last drop | work share | {speed_head} "
        f"| TTFT here vs dense | within {result['budget']:g} pts |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rec = (result.get("recommended") or {}).get("label")
    for c in result["configs"]:
        kept = " ".join("-" if k is None else f"{k:.2f}" for k in c["kept_per_layer"])
        left = "" if c["final_kept_share"] is None else f"{c['final_kept_share']:.3f}"
        work = "" if c["work_share"] is None else f"{c['work_share']:.2f}"
        if c["predictions"]:
            sp = " / ".join(
                "n/a" if p["speedup_vs_compiled"] is None else f"{p['speedup_vs_compiled']:.2f}x"
                for p in c["predictions"]
            )
        else:
            sp = work
        here = "" if c.get("ttft_speedup") is None else f"{c['ttft_speedup']:.2f}x"
        mark = " **recommended**" if c["label"] == rec else ""
        name = c["label"] if compared else f"{c['top_p']:g}"
        lines.append(
            f"| {name}{mark} | {c['score']:.1f} | {c['diff']:+.1f} "
            f"[{c['ci_low']:+.1f}, {c['ci_high']:+.1f}] | {c['worse']} / {c['better']} | "
            f"{100 * c['same_output']:.0f}% | {kept} | {left} | {work} | {sp} | {here} | "
            f"{'yes' if c['within_budget'] else 'no'} |"
        )
    lines.append("")
    if rec is None and not any(c["dropped_prefills"] for c in result["configs"]):
        lo = min(c["top_p"] for c in result["configs"])
        lines.append(
            "recommended: none: no setting dropped a token on these prompts, so there is "
            f"nothing to gain; try longer prompts (--lengths) or a top_p below {lo:g}."
        )
    elif rec is None:
        hi = max(c["top_p"] for c in result["configs"])
        lines.append(
            f"recommended: none: no setting that drops tokens stays within "
            f"{result['budget']:g} points ({crit}); try top_p above {hi:g}, or serve dense."
        )
    else:
        c = next(c for c in result["configs"] if c["label"] == rec)
        what = f"top_p {c['top_p']:g}"
        if c.get("schedule") is not None:
            what += f" at drop layers {','.join(map(str, c['schedule']))}"
        text = (
            f"recommended: {what}: {c['diff']:+.1f} points [{c['ci_low']:+.1f}, "
            f"{c['ci_high']:+.1f}] against dense ({crit} within {result['budget']:g}), "
            f"{c['final_kept_share']:.0%} of the prompt left after the last drop"
        )
        if c["predictions"]:
            p = c["predictions"][-1]
            comp = p["speedup_vs_compiled"]
            text += (
                f"; predicted {p['speedup_vs_eager']:.2f}x TTFT at {_fmt_len(p['length'])} "
                "against eager vLLM"
                + ("" if comp is None else f", {comp:.2f}x against compiled vLLM")
            )
        lines.append(text + ".")
        flags = [f"--top-p {c['top_p']:g}"]
        chosen = dict(result.get("uniprefill_config") or {})
        if c.get("schedule") is not None:
            chosen["drop_layers"] = c["schedule"]
        for key, value in sorted(chosen.items()):
            if isinstance(value, (list, tuple)):
                value = ",".join(map(str, value))
            flags.append(f"--{key.replace('_', '-')} {value}")
        lines.append(f"serve it with: uniprefill serve {result['model_path']} " + " ".join(flags))
        if not compared:
            lines.append(
                "schedule: the family default only; --schedule auto also tries an earlier one "
                "(on Qwen2.5-Coder-1.5B it kept the accuracy with less work: docs/accuracy.md)"
            )
    if fam:
        lines += [
            "",
            f"Speedups: predicted for the {result['shape']} on one H200 (vLLM 0.26.0, one "
            "prompt at a time) from this run's kept shares, against plain vLLM with its "
            "defaults (compiled, CUDA graphs); the JSON also has them against eager vLLM. "
            "A model of the H200 measurements, not a timing of this machine: "
            "docs/benchmarks.md, src/uniprefill/eval/speedup.py.",
        ]
        notes = sorted({n for c in result["configs"] for p in c["predictions"] for n in p["notes"]})
        if notes:
            lines.append("Prediction notes: " + "; ".join(notes) + ".")
    if any(c.get("ttft_speedup") is not None for c in result["configs"]):
        lines.append(
            "TTFT here: dense's summed time to first token over this setting's, the same "
            "prompts one at a time in the same engine, on this machine (eager, prefix "
            "caching off): measured, not predicted."
        )
    for w in result["warnings"]:
        lines.append(f"warning: {w}")
    return "\n".join(lines)


def plot_calibration(result: dict[str, Any], path: Path) -> Path:
    """Left: score difference (95% CI) against predicted speedup, one point per top_p.
    Right: kept share at each drop layer per top_p. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = result["configs"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2))
    xs = [_speed_key(c) for c in configs]
    ys = [c["diff"] for c in configs]
    err = [[c["diff"] - c["ci_low"] for c in configs], [c["ci_high"] - c["diff"] for c in configs]]
    ax.errorbar(xs, ys, yerr=err, fmt="o", capsize=3)
    labels: dict[tuple[float, float], list[str]] = {}
    for x, y, c in zip(xs, ys, configs, strict=True):  # one label per spot: "0.99, 0.995"
        name = c["label"].replace("top_p=", "") if c.get("schedule") else f"{c['top_p']:g}"
        labels.setdefault((round(x, 3), round(y, 2)), []).append(name)
    for (x, y), names in labels.items():
        ax.annotate(", ".join(names), (x, y), textcoords="offset points", xytext=(5, 5), fontsize=8)
    rec = (result.get("recommended") or {}).get("label")
    for x, y, c in zip(xs, ys, configs, strict=True):
        if c["label"] == rec:
            ax.plot([x], [y], "r*", markersize=14, label=f"recommended ({rec})")
    ax.axhline(-result["budget"], color="grey", ls="--", label=f"budget -{result['budget']:g}")
    ax.axhline(0, color="black", lw=0.5)
    if result["family"]:
        n = _fmt_len(result["predict_lengths"][-1])
        ax.set_xlabel(f"predicted H200 TTFT speedup at {n} vs eager vLLM ({result['shape']})")
    else:
        ax.set_xlabel("1 / work share")
    ax.set_ylabel("score difference vs dense, points (95% CI)")
    ax.set_title(f"{Path(result['model']).name}: {result['prompts']['count']} prompts", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    for c in configs:
        if c["kept_per_layer"]:
            ks = [1.0 if k is None else k for k in c["kept_per_layer"]]
            bx.plot([str(d) for d in c["drop_layers"]], ks, "o-", label=c["label"])
    bx.set_xlabel("drop layer")
    bx.set_ylabel("kept share (of the tokens reaching the layer)")
    bx.set_ylim(0, 1.05)
    bx.grid(alpha=0.3)
    bx.legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
