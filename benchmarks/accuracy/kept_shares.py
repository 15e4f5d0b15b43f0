"""Kept share per drop layer at several top_p values, one engine, JSON after every request.

    HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=1 OMP_NUM_THREADS=1 \
        taskset -c 1 python benchmarks/accuracy/kept_shares.py MODEL_DIR --json OUT.json

What ``uniprefill calibrate`` measures about the model's attention, without its accuracy
part: each prompt is prefilled once per top_p (prompt-major, switching the setting in the
running engine between requests, so a run cut short still has every value on the same
prompts), one output token each, no dense pass unless 1.0 is among the values (then
also the CPU TTFT ratio against it, ``ttft_ratio_vs_dense``). After every request the
JSON is rewritten with the per-request counters and the kept share per drop layer so
far (kept / seen at that layer, summed over the prompts) and the share of the prompt
left after the last one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

from uniprefill.eval.calibrate import DEFAULT_TOP_PS, suite_prompts, switch_config
from uniprefill.eval.ruler import ALL_TASKS, TASKS, token_counter
from uniprefill.eval.runner import (
    kept_summary,
    read_stats,
    sized_llm_kwargs,
    start_engine,
    stats_delta,
    stop_engine,
)


def _summed(rows: list[dict]) -> dict:
    kept = [sum(col) for col in zip(*(r["kept_tokens"] for r in rows), strict=True)]
    seen = [sum(col) for col in zip(*(r["seen_tokens"] for r in rows), strict=True)]
    out = kept_summary(
        {"kept_tokens": kept, "seen_tokens": seen, "drop_layers": rows[0]["drop_layers"]}
    )
    return {"prompts": len(rows), "kept_tokens": kept, "seen_tokens": seen, **out}


def _ttft_ratios(rows: list[dict], top_ps: list[float]) -> dict:
    """Per top_p, the median over prompts of dense seconds / seconds at that top_p (one
    output token: the prefill), on the prompts measured at both."""
    dense = {r["prompt"]: r["seconds"] for r in rows if r["top_p"] == 1.0}
    out = {}
    for tp in top_ps:
        ratios = [
            dense[r["prompt"]] / r["seconds"]
            for r in rows
            if r["top_p"] == tp and r["prompt"] in dense and r["seconds"] > 0
        ]
        if tp < 1.0 and ratios:
            out[str(tp)] = {"median": statistics.median(ratios), "prompts": len(ratios)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--top-p", default=",".join(map(str, DEFAULT_TOP_PS)))
    ap.add_argument("--tasks", default=",".join(TASKS), help=f"from {ALL_TASKS}")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--samples", type=int, default=1, help="per task")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument(
        "--first-prompt", type=int, default=0, help="skip the prompts before this index (resume)"
    )
    args = ap.parse_args()

    # UniPrefill needs vLLM's V2 runner; without a Triton CPU backend its bookkeeping
    # kernels run in Triton's interpreter (as the uniprefill CLI does). Before vLLM loads.
    from uniprefill.cpu_triton import enable

    enable()
    from transformers import AutoTokenizer

    top_ps = [float(p) for p in args.top_p.split(",")]
    counter = token_counter(AutoTokenizer.from_pretrained(str(args.model_dir)))
    prompts = suite_prompts(
        counter, args.tasks.split(","), [args.length], args.samples, args.seed, 1
    )
    kw = sized_llm_kwargs(
        args.model_dir, {"dtype": args.dtype}, [p.n_tokens for p in prompts], [1] * len(prompts)
    )
    result: dict = {
        "model": str(args.model_dir),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "llm_kwargs": kw,
        "prompts": [{"task": p.task, "n_tokens": p.n_tokens} for p in prompts],
        "top_p": top_ps,
        "rows": [],
        "summary": {},
    }

    from vllm import SamplingParams

    one = SamplingParams(temperature=0.0, max_tokens=1)
    t0 = time.perf_counter()
    llm, startup = start_engine(
        args.model_dir, llm_kwargs=kw, additional_config={"uniprefill": {"top_p": top_ps[0]}}
    )
    result["startup_seconds"] = round(startup, 1)
    try:
        llm.generate(["warm-up " * 64], one, use_tqdm=False)
        for i, p in enumerate(prompts):
            if i < args.first_prompt:
                continue
            for top_p in top_ps:
                switch_config(llm, {"top_p": top_p})
                before, tb = read_stats(llm), time.perf_counter()
                out = llm.generate([p.text], one, use_tqdm=False)[0]
                st = stats_delta(read_stats(llm), before)
                row = {
                    "prompt": i,
                    "task": p.task,
                    "n_tokens": p.n_tokens,
                    "top_p": top_p,
                    "seconds": round(time.perf_counter() - tb, 1),
                    "first_token": out.outputs[0].token_ids[0],
                    "drop_layers": st["drop_layers"],
                    "kept_tokens": st["kept_tokens"],
                    "seen_tokens": st["seen_tokens"],
                    "dropped_prefills": st["dropped_prefills"],
                    **kept_summary(st),
                }
                result["rows"].append(row)
                print(
                    json.dumps(
                        {k: row[k] for k in ("prompt", "top_p", "seconds")}
                        | {"kept": row["kept_ratio_per_layer"]}
                    ),
                    flush=True,
                )
                done = [tp for tp in top_ps if any(r["top_p"] == tp for r in result["rows"])]
                result["summary"] = {
                    str(tp): _summed([r for r in result["rows"] if r["top_p"] == tp]) for tp in done
                }
                if 1.0 in done:  # dense in the same engine: the CPU TTFT ratio per value
                    result["ttft_ratio_vs_dense"] = _ttft_ratios(result["rows"], done)
                result["elapsed_seconds"] = round(time.perf_counter() - t0, 1)
                args.json.write_text(json.dumps(result, indent=1) + "\n")
    finally:
        stop_engine(llm)


if __name__ == "__main__":
    main()
