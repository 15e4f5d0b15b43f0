"""``uniprefill`` command line: ``eval`` (dense vs UniPrefill accuracy), ``report``, ``demo``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from uniprefill.eval.ruler import TASKS


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _lengths(text: str) -> list[int]:
    # Accept 4096 or 4k / 4K.
    out = []
    for x in text.split(","):
        x = x.strip().lower()
        if x:
            out.append(int(float(x[:-1]) * 1024) if x.endswith("k") else int(x))
    return out


def _add_method_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("UniPrefill options (unset: the plugin's defaults)")
    g.add_argument("--top-p", type=float)
    g.add_argument("--block-size", type=int)
    g.add_argument("--last-q", type=int)
    g.add_argument("--sink", type=int)
    g.add_argument("--drop-layers", type=_ints, help="comma-separated 0-based layer indices")
    g.add_argument("--keep-ratio", type=float, help="keep this share of blocks instead of top-p")


def method_config(args: argparse.Namespace) -> dict[str, Any]:
    """The ``additional_config["uniprefill"]`` dict from the options that were given."""
    names = ("top_p", "block_size", "last_q", "sink", "drop_layers", "keep_ratio")
    return {n: getattr(args, n) for n in names if getattr(args, n) is not None}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="uniprefill", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    ev = sub.add_parser(
        "eval", help="RULER-style accuracy, dense vs UniPrefill on the same prompts"
    )
    ev.add_argument("model", help="model directory, or a tiny arch: llama, gemma3, qwen3_next")
    ev.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated from {TASKS}")
    ev.add_argument("--lengths", type=_lengths, default=[1024], help="e.g. 4k,8k,16384")
    ev.add_argument("--samples", type=int, default=2, help="samples per task and length")
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("--max-new-tokens", type=int, help="default: a per-task budget")
    ev.add_argument("--dtype", help="vLLM dtype (default: the model's, or the tiny arch's)")
    ev.add_argument("--max-model-len", type=int)
    ev.add_argument(
        "--llm-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra vllm.LLM argument for both runs (VALUE parsed as JSON when it can be), "
        "e.g. disable_hybrid_kv_cache_manager=true",
    )
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
    demo.add_argument("--arch", default="llama", choices=("llama", "gemma3", "qwen3_next"))
    demo.add_argument("--lengths", type=_lengths, default=[512, 1024, 1536])
    _add_method_args(demo)
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


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command != "report":
        # UniPrefill runs on vLLM's V2 runner; on a CPU machine without a Triton CPU
        # backend its bookkeeping kernels run in Triton's interpreter (no-op on GPUs).
        from uniprefill.cpu_triton import enable

        enable()
    if args.command == "eval":
        return _eval(args)
    if args.command == "report":
        return _report(args)
    return _demo(args)


if __name__ == "__main__":
    sys.exit(main())
