"""Worker side: the stats RPC (``worker_extension_cls``), start-up logging and warm-up."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from uniprefill.config import UniPrefillConfig
from uniprefill.vllm.runtime import UniPrefillRuntime
from uniprefill.vllm.segments import graphs_compiled

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

logger = logging.getLogger("vllm.uniprefill")

EXTENSION_CLS = "uniprefill.vllm.worker.UniPrefillWorkerExtension"
STATS_METHOD = "uniprefill_stats"
CONFIGURE_METHOD = "uniprefill_configure"
# Settings the scheduler's prefix-cache cap reads (requests.may_drop, scheduler.py).
FIXED_WITH_PREFIX_CACHING = ("min_prompt_len", "sink", "last_q", "dense_prefix_tokens")


class UniPrefillWorkerExtension:
    """Mixed into vLLM's worker class when UniPrefill is on (``worker_extension_cls``).

    ``LLM.collective_rpc("uniprefill_stats")`` calls it by name, so no pickled
    function crosses processes.
    """

    def _uniprefill_runtime(self) -> UniPrefillRuntime:
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        rt = getattr(model, "uniprefill", None)
        if rt is None:
            # The extension is only installed with UniPrefill on: its model must be ours.
            raise RuntimeError(
                f"uniprefill is enabled but the worker runs {type(model).__name__}, "
                "not UniPrefill's model class"
            )
        return rt

    def uniprefill_stats(self) -> dict[str, Any]:
        rt = self._uniprefill_runtime()
        out = rt.stats.as_dict()
        out["records"] = len(rt.table)
        out["stashed"] = len(rt.stash.by_slot)
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        out["compiled_drop_steps"] = model.drop_steps_compiled
        out["segment_graphs_compiled"] = graphs_compiled()
        # Freed by the scheduler, as its notices to this worker said (free_kv_blocks).
        out["kv_blocks_freed"] = rt.kv_freeing.blocks_freed if rt.kv_freeing else 0
        return out

    def uniprefill_configure(self, options: dict[str, Any]) -> dict[str, Any]:
        """Change the selection settings of a running engine (benchmarks, calibration).

        ``options`` are ``additional_config["uniprefill"]`` keys; they apply from the
        next step on. The drop layers are fixed at start-up: ``drop_layers`` may only
        repeat them.
        """
        rt = self._uniprefill_runtime()
        new = UniPrefillConfig.from_dict({**rt.config.to_dict(), **options})
        if new.drop_layers is not None and tuple(new.drop_layers) != rt.drop_layers:
            raise ValueError(
                f"drop_layers {list(new.drop_layers)} differ from the engine's "
                f"{list(rt.drop_layers)}; they are fixed at start-up"
            )
        new.check_schedule(rt.drop_layers)
        if new.free_kv_blocks != rt.config.free_kv_blocks:
            raise ValueError(
                "free_kv_blocks is fixed at start-up (it decides the KV cache's groups)"
            )
        cache = self.vllm_config.cache_config  # type: ignore[attr-defined]
        fixed = [n for n in FIXED_WITH_PREFIX_CACHING if getattr(new, n) != getattr(rt.config, n)]
        if fixed and cache.enable_prefix_caching:
            raise ValueError(
                f"{', '.join(fixed)} are fixed at start-up while prefix caching is on "
                "(the scheduler decides by them what a prompt may publish to the cache)"
            )
        rt.config = new
        return {"config": new.to_dict(), "drop_layers": list(rt.drop_layers)}


def tp_allreduce() -> Callable[[torch.Tensor], None] | None:
    """fp32 SUM of block scores over this rank's tensor-parallel group (None without TP)."""
    from vllm.distributed import get_tensor_model_parallel_world_size, get_tp_group

    if get_tensor_model_parallel_world_size() == 1:
        return None
    from uniprefill.ops.tp import make_allreduce

    return make_allreduce(get_tp_group().device_group)


def log_start(model: Any, rt: UniPrefillRuntime) -> None:
    from uniprefill.vllm.metrics import publish_from_worker

    publish_from_worker(rt.stats, model.uniprefill_vllm_config)  # for a server's /metrics
    logger.info(
        "uniprefill: %s, drop layers %s, %s",
        model.family.family,
        list(rt.drop_layers),
        rt.config.to_dict(),
    )


def warm_up(model: Any, rt: UniPrefillRuntime, max_num_reqs: int) -> None:
    """Compile the selection kernels before the first request (GPU; CPU compiles nothing)."""
    if not rt.drop_layers or rt.device.type != "cuda":
        return
    attn = model.scoring_attention()
    if attn is None:  # a pipeline rank without a drop layer
        return
    t0 = time.perf_counter()
    counts = rt.warm_up(
        attn.num_heads,
        attn.num_kv_heads,
        attn.head_size,
        model.uniprefill_vllm_config.model_config.dtype,
        float(attn.impl.scale),
        max_num_reqs,
    )
    logger.info(
        "uniprefill: selection kernels compiled for %s requests in %.1f s",
        counts,
        time.perf_counter() - t0,
    )
