"""The README's main job in one command: a tiny model, dense vLLM vs vLLM + UniPrefill.

Builds a tiny random model offline (cached), prefills a few long-ish needle prompts
dense and with UniPrefill, and prints prompt length, kept ratio, first token of each,
and time. Random weights say nothing about accuracy; this shows the plumbing works.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from uniprefill.eval.ruler import make_sample, token_counter
from uniprefill.eval.runner import kept_summary, run_engine

DEFAULT_LENGTHS = (512, 1024, 1536)
# Lower than the 0.99 default so a random model visibly drops tokens.
DEFAULT_DEMO_CONFIG: dict[str, Any] = {"top_p": 0.9}
# The tiny Qwen3-Next has full attention at layers 1 and 3 only, and the default
# schedule skips the first and last full layer, so it would drop nothing: name one.
DEMO_DROP_LAYERS: dict[str, list[int]] = {"qwen3_next": [1]}


def run_demo(
    arch: str = "llama",
    *,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    uniprefill_config: dict[str, Any] | None = None,
    max_new_tokens: int = 4,
    out: TextIO = sys.stdout,
) -> list[dict[str, Any]]:
    """Run the demo and print its table to ``out``; return one row per prompt."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from transformers import AutoTokenizer

    from uniprefill.testing import cached_tiny_model, vllm_kwargs

    cfg = dict(DEFAULT_DEMO_CONFIG if uniprefill_config is None else uniprefill_config)
    if arch in DEMO_DROP_LAYERS:
        cfg.setdefault("drop_layers", DEMO_DROP_LAYERS[arch])
    print(f"building tiny {arch} model (cached) ...", file=out, flush=True)
    path = cached_tiny_model(arch)  # type: ignore[arg-type]
    count = token_counter(AutoTokenizer.from_pretrained(str(path)))
    samples = [make_sample("niah_single", n, 0, count, seed=0) for n in lengths]
    prompts = [s.prompt for s in samples]
    kw = {**vllm_kwargs(arch), "max_model_len": max(lengths) + max_new_tokens + 16}  # type: ignore[arg-type]
    budgets = [max_new_tokens] * len(prompts)
    common = {"llm_kwargs": kw, "progress": False, "batch_size": 1}
    print("dense vLLM ...", file=out, flush=True)
    dense = run_engine(path, prompts, budgets, additional_config=None, desc="dense", **common)
    print(f"vLLM + UniPrefill {cfg} ...", file=out, flush=True)
    up = run_engine(
        path, prompts, budgets, additional_config={"uniprefill": cfg}, desc="uniprefill", **common
    )
    rows = []
    for i, s in enumerate(samples):
        summary = kept_summary(up.batch_stats[i])
        rows.append(
            {
                "prompt_tokens": s.n_tokens,
                "kept_share": summary["final_kept_share"],
                "first_token_dense": dense.first_tokens[i],
                "first_token_uniprefill": up.first_tokens[i],
                "dense_s": dense.batch_seconds[i],
                "uniprefill_s": up.batch_seconds[i],
            }
        )
    print(format_demo_table(rows, arch), file=out)
    if up.stats is None:
        print("(kept ratio n/a: the UniPrefill plugin is not loaded or exposes no stats)", file=out)
    return rows


def format_demo_table(rows: Sequence[dict[str, Any]], arch: str) -> str:
    cols = ["prompt tokens", "kept share", "1st token dense", "1st token uniprefill"]
    cols += ["dense s", "uniprefill s"]
    head = " | ".join(cols)
    lines = [f"tiny {arch}", head, "-" * len(head)]
    for r in rows:
        kept = "n/a" if r["kept_share"] is None else f"{r['kept_share']:.2f}"
        cells = [r["prompt_tokens"], kept, r["first_token_dense"], r["first_token_uniprefill"]]
        cells += [f"{r['dense_s']:.2f}", f"{r['uniprefill_s']:.2f}"]
        lines.append(" | ".join(f"{c!s:>{len(h)}}" for h, c in zip(cols, cells, strict=True)))
    return "\n".join(lines)
