"""Prefix caching with UniPrefill: a dropping prompt publishes only its dense head.

vLLM publishes a request's full KV blocks to its prefix cache as they are
scheduled, before the step runs. A prompt that drops holds, in every layer after
its first drop layer, the K/V of its kept tokens packed at the start of its blocks:
those blocks hold neither the tokens nor the values their hashes name, and a later
request that reused them would attend to the wrong keys. Only tokens that no layer
dropped, and that attended only to such tokens, have dense K/V at every layer: a
prompt's cached prefix and its first ``dense_prefix_tokens`` (which the worker never
drops, see ``runtime.py``). So for every request that may drop, the scheduler
publishes blocks up to that length and no further, for the request's whole life
(decode tokens land after the compacted ones too), and nothing before its last
chunk is scheduled (earlier chunks leave the later layers' K/V to the last chunk,
which writes it in the same forward, layer by layer, before any request that hits
those blocks reads them, as in plain vLLM). Requests that run dense publish
as in plain vLLM. Per KV-cache group: the same length for every group, since
UniPrefill drops in full-attention and sliding-window layers alike; hybrid models
with Mamba-style state are refused with prefix caching (``engine.py``).

With ``free_kv_blocks`` the same scheduler also returns the blocks a prompt's
stages no longer hold to the pool, as soon as the step's output brings the worker's
kept records back (``update_from_output``), and tells the workers what it freed on
its next ``SchedulerOutput`` (``kv_blocks.py``). It runs in the engine core's
process, which builds the KV-cache manager from the specs the workers report: the
stage spec's manager is registered here, before vLLM's scheduler builds it.

The cap lives on vLLM's ``KVCacheCoordinator.cache_blocks``, the one call through
which every group publishes (``KVCacheManager.allocate_slots`` and the scheduler's
own ``cache_blocks``), wrapped on this scheduler's coordinator instance. The
scheduler class is vLLM's (``Scheduler`` or ``AsyncScheduler``, whichever the
config picks) with this mixin, set as ``scheduler_cls`` (patches.py lists it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from uniprefill.config import uniprefill_config
from uniprefill.vllm import kv_blocks
from uniprefill.vllm.kv_specs import StageAttentionManager
from uniprefill.vllm.kv_specs import register as register_stage_specs
from uniprefill.vllm.requests import may_drop

if TYPE_CHECKING:  # vLLM's types, named so a type checker flags a renamed attribute
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
    from vllm.v1.request import Request

# Tokens of a request its KV blocks may be published for (absent: no cap).
PUBLISH_CAP = "uniprefill_publish_cap"


class UniPrefillSchedulerMixin:
    """Caps what requests that may drop publish to the prefix cache (prefix caching on),
    and frees the KV blocks their stages no longer need (``free_kv_blocks``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # The engine core's process (not the worker's, with vLLM's multi-process engine
        # core): the stage specs need their manager before vLLM's scheduler makes one.
        register_stage_specs()
        super().__init__(*args, **kwargs)
        vllm_config = self.vllm_config  # type: ignore[attr-defined]
        self.uniprefill = uniprefill_config(vllm_config.additional_config)
        coordinator = getattr(self.kv_cache_manager, "coordinator", None)  # type: ignore[attr-defined]
        if vllm_config.cache_config.enable_prefix_caching:
            _cap_publishing(coordinator)
        # Stage groups' managers (free_kv_blocks), with the stage each one holds.
        self._stage_managers = [
            m
            for m in getattr(coordinator, "single_type_managers", ())
            if isinstance(m, StageAttentionManager) and m.kv_cache_spec.uniprefill_stage > 0
        ]
        if self.uniprefill is not None and self.uniprefill.free_kv_blocks:
            if not self._stage_managers:
                raise RuntimeError(
                    "uniprefill: free_kv_blocks is on but the KV cache has no per-stage "
                    "groups (no drop layers, or this vLLM grouped the layers otherwise)"
                )
        # Blocks freed since the last SchedulerOutput, per request (the workers' notice).
        self._freed_notice: dict[str, int] = {}

    def add_request(self, request: Request) -> None:
        cfg = self.uniprefill
        prompt_len = int(request.num_prompt_tokens)
        if cfg is not None and may_drop(cfg, prompt_len, request.sampling_params):
            setattr(request, PUBLISH_CAP, min(cfg.dense_prefix_tokens, prompt_len))
        super().add_request(request)  # type: ignore[misc]

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        out = super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        if self._stage_managers:
            self._free_dropped_blocks(kv_blocks.records_of(model_runner_output))
        return out

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        out = super().schedule(*args, **kwargs)  # type: ignore[misc]
        if self._stage_managers and self._freed_notice:
            setattr(out, kv_blocks.FREED_ATTR, self._freed_notice)
            self._freed_notice = {}
        return out

    def _free_dropped_blocks(self, records: list[kv_blocks.KeptRecord]) -> None:
        """Free what the worker's records say the stages no longer hold.

        Called after vLLM has taken the step's output in: a record whose request is no
        longer running (finished by this very step, aborted, or preempted: its blocks
        are all gone and its recompute will drop anew) is stale and skipped.
        """
        requests = self.requests  # type: ignore[attr-defined]
        for rec in records:
            request = requests.get(rec.req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            freed = 0
            for manager in self._stage_managers:
                kept = rec.kept[manager.kv_cache_spec.uniprefill_stage - 1]
                first, count = kv_blocks.freed_blocks(rec.total_tokens, kept, manager.block_size)
                freed += manager.free_dropped(rec.req_id, first, count)
            if freed:
                self._freed_notice[rec.req_id] = self._freed_notice.get(rec.req_id, 0) + freed


def _cap_publishing(coordinator: KVCacheCoordinator | None) -> None:
    publish = getattr(coordinator, "cache_blocks", None)
    if not callable(publish):
        raise RuntimeError(
            "uniprefill: this vLLM's KV cache manager has no coordinator.cache_blocks; "
            "prefix caching with UniPrefill is not supported on it "
            "(enable_prefix_caching=False)"
        )

    def cache_blocks(request: Request, num_computed_tokens: int) -> None:
        cap = getattr(request, PUBLISH_CAP, None)
        if cap is None:
            publish(request, num_computed_tokens)
        elif num_computed_tokens >= request.num_prompt_tokens:
            publish(request, min(num_computed_tokens, cap))
        # else: an earlier chunk of a prompt in chunks; its later layers' K/V are
        # written by the last chunk, so nothing of it is published before then.

    coordinator.cache_blocks = cache_blocks


class UniPrefillScheduler(UniPrefillSchedulerMixin, Scheduler):
    pass


class UniPrefillAsyncScheduler(UniPrefillSchedulerMixin, AsyncScheduler):
    pass
