"""Correctness of UniPrefill under torch.compile and CUDA graphs (run on the GPU).

CUDA graphs exist only on the GPU, so CI cannot test them. This check runs one batch
of mixed long and short prompts, greedy, through several engines of one model and
compares the tokens:

* ``plain`` (vLLM's defaults, plugin off) == ``p1`` (plugin on, top_p 1.0): with
  nothing dropped the plugin must change nothing, graphs included;
* ``keep`` (keep_ratio 0.5, FULL_AND_PIECEWISE graphs: decode replays FULL graphs
  that read the per-stage lengths and slots) == ``keep_pw`` (PIECEWISE graphs only:
  attention runs outside the graphs with metadata built for the step): the per-stage
  buffers a FULL graph reads must hold what the step needs;
* ``keep`` == ``keep_torch`` (the same, with the decode steps' stage lengths, slots and
  remapped block tables from torch ops instead of one Triton launch,
  ``ops/triton_stage_fill.py``);
* ``keep_eager`` (enforce_eager): reported, not required equal (other kernels).

With ``--eagle K`` every engine drafts K tokens with an EAGLE head (``--eagle-method
eagle3``: an EAGLE-3 head, reading the target's auxiliary hidden states; dummy weights, so
few drafts are accepted; what is checked is that verification steps, the drafter's
prompt pass and its FULL graphs leave the tokens as the checks above require).
With ``--tp 2`` every engine runs tensor parallel, and each rank's drop counters are
read: the ranks must keep the same tokens at every drop layer (``ranks agree``). With
``--pp 2`` every engine runs two pipeline stages; the tensor-parallel ranks of each
stage must agree, and the stats are the last stage's (it counts every drop layer).

Usage: ``python benchmarks/check_compiled.py --out $OUT`` (``--smoke-cpu`` on a CPU,
where there are no graphs: the engines still run and must agree).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import LOG_PREFIX, build_model_dir, close_llm, log, random_prompts  # noqa: E402

from uniprefill.config import STAGE_FILL_ENV  # noqa: E402
from uniprefill.testing import spec_decode_counts, write_eagle_drafter_config  # noqa: E402

LOG_PREFIX[0] = "check_compiled"
ENGINES = ("plain", "p1", "keep", "keep_pw", "keep_torch", "keep_eager")


def engine_kwargs(name: str, a: argparse.Namespace) -> dict[str, Any]:
    kw: dict[str, Any] = dict(
        max_model_len=a.max_len,
        max_num_batched_tokens=a.budget,
        enable_prefix_caching=False,
        load_format="dummy",
        seed=0,
        dtype=a.dtype,
    )
    if a.tp > 1:
        # NCCL only: vLLM's custom all-reduce and symmetric-memory paths stay off (the
        # device machines forbid NVLink multicast).
        kw.update(tensor_parallel_size=a.tp, disable_custom_all_reduce=True)
    if a.pp > 1:
        kw.update(pipeline_parallel_size=a.pp, distributed_executor_backend="mp")
    if a.smoke_cpu:
        kw["dtype"] = "float32"
    else:
        kw["gpu_memory_utilization"] = 0.85
    up = {"drop_layers": a.drop_layers} if a.drop_layers else {}
    if name == "p1":
        kw["additional_config"] = {"uniprefill": {**up, "top_p": 1.0}}
    elif name.startswith("keep"):
        kw["additional_config"] = {"uniprefill": {**up, "keep_ratio": 0.5}}
    if a.model == "qwen3next" and not a.smoke_cpu:
        # vLLM 0.26's default SM90 GDN prefill kernel is not on the H200 image.
        kw.setdefault("additional_config", {})["gdn_prefill_backend"] = "triton"
    if a.eagle:
        kw["speculative_config"] = {
            "method": a.eagle_method,
            "model": str(a.drafter),
            "num_speculative_tokens": a.eagle,
        }
        kw["disable_log_stats"] = False  # vLLM's speculative-decoding counters
    if name == "keep_pw":
        kw["compilation_config"] = {"cudagraph_mode": "PIECEWISE"}
    if name == "keep_eager" or a.eager:
        kw["enforce_eager"] = True
    return kw


def run_engine(name: str, mdir: Path, a: argparse.Namespace) -> dict[str, Any]:
    import vllm

    from uniprefill.vllm.stats import collect_ranks, ranks_agree

    kw = engine_kwargs(name, a)
    log(f"{name}: {kw}")
    t0 = time.time()
    # keep_torch: the decode steps' stage fill in torch ops instead of one Triton launch
    # (the engine's processes read the variable at start-up).
    os.environ[STAGE_FILL_ENV] = "torch" if name == "keep_torch" else "auto"
    llm = vllm.LLM(str(mdir), **kw)
    start = time.time() - t0
    try:
        sp = vllm.SamplingParams(temperature=0.0, max_tokens=a.decode, ignore_eos=True)
        outs = llm.generate(random_prompts(a.lengths, seed=0), sp, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        per_rank = collect_ranks(llm)
        spec = spec_decode_counts(llm) if a.eagle else {}
        # The last pipeline stage's first rank counts every drop layer (stats.output_rank).
        stats = per_rank[len(per_rank) - a.tp] if per_rank else None
    finally:
        close_llm(llm)
    log(f"{name}: up in {start:.0f} s; stats {stats}" + (f"; drafts {spec}" if spec else ""))
    # Tensor-parallel ranks of one pipeline stage make the same choices.
    stages = [per_rank[i : i + a.tp] for i in range(0, len(per_rank), a.tp)]
    agree = all(ranks_agree(ranks) for ranks in stages)
    if len(per_rank) > 1:
        log(f"{name}: {len(per_rank)} ranks, counters {'AGREE' if agree else 'DIFFER'}")
    return {
        "tokens": tokens,
        "stats": stats,
        "spec_decode": spec,
        "per_rank": per_rank,
        "ranks_agree": agree,
        "startup_s": start,
        "kwargs": kw,
    }


def agreement(x: list[list[int]], y: list[list[int]]) -> list[int]:
    """Per prompt: how many leading tokens agree."""
    out = []
    for a, b in zip(x, y, strict=True):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        out.append(n)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama8b")
    p.add_argument("--layers", type=int, default=8, help="first N layers of the shape")
    p.add_argument("--drop-layers", default="", help="comma list (default: family's)")
    p.add_argument("--lengths", default="6000,300,4000,2500,100,1200")
    p.add_argument("--decode", type=int, default=64)
    p.add_argument("--budget", type=int, default=8192)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--out", default=os.environ.get("OUT", "results"))
    p.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    p.add_argument("--pp", type=int, default=1, help="pipeline_parallel_size")
    p.add_argument("--eager", action="store_true", help="every engine enforce_eager")
    p.add_argument("--eagle", type=int, default=0, help="draft K tokens with an EAGLE head")
    p.add_argument("--eagle-method", choices=("eagle", "eagle3"), default="eagle")
    p.add_argument("--smoke-cpu", action="store_true")
    a = p.parse_args(argv)
    a.lengths = [int(x) for x in a.lengths.split(",")]
    a.drop_layers = [int(x) for x in a.drop_layers.split(",") if x]
    if a.smoke_cpu:
        a.model, a.layers, a.lengths, a.decode, a.budget = (
            "tiny-llama",
            None,
            [700, 40, 500],
            8,
            2048,
        )
    a.max_len = max(a.lengths) + a.decode + 64
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    mdir = build_model_dir(
        a.model, Path("/tmp/uniprefill_check_models"), a.max_len, a.dtype, a.layers
    )
    drafter_dir = mdir.parent / f"{mdir.name}-{a.eagle_method}"
    a.drafter = write_eagle_drafter_config(mdir, drafter_dir, a.eagle_method) if a.eagle else None
    runs: dict[str, Any] = {}
    doc: dict[str, Any] = {"argv": sys.argv, "started": time.strftime("%F %T %Z"), "runs": runs}
    for name in a.engines.split(","):
        try:
            runs[name] = run_engine(name, mdir, a)
        except Exception as e:  # noqa: BLE001 - record and go on with the other engines
            log(f"{name}: FAILED {e!r}")
            runs[name] = {"error": repr(e)}
        (out / "check_compiled.json").write_text(json.dumps(doc, indent=1, default=str))
    checks = {}
    for x, y, required in (
        ("plain", "p1", True),
        ("keep", "keep_pw", True),
        ("keep", "keep_torch", True),
        ("keep", "keep_eager", False),
    ):
        if "tokens" in runs.get(x, {}) and "tokens" in runs.get(y, {}):
            agree = agreement(runs[x]["tokens"], runs[y]["tokens"])
            equal = runs[x]["tokens"] == runs[y]["tokens"]
            checks[f"{x}=={y}"] = {"equal": equal, "required": required, "agree": agree}
            log(f"{x} vs {y}: {'EQUAL' if equal else 'DIFFER'} (leading tokens equal {agree})")
    for name, run in runs.items():
        if len(run.get("per_rank", [])) > 1:
            checks[f"{name}: ranks agree"] = {"equal": run["ranks_agree"], "required": True}
    doc["checks"] = checks
    (out / "check_compiled.json").write_text(json.dumps(doc, indent=1, default=str))
    failed = [k for k, c in checks.items() if c["required"] and not c["equal"]]
    log("RESULT " + ("FAIL " + ", ".join(failed) if failed else "all required checks equal"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
