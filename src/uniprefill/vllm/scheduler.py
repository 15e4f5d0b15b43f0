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

The cap lives on vLLM's ``KVCacheCoordinator.cache_blocks``, the one call through
which every group publishes (``KVCacheManager.allocate_slots`` and the scheduler's
own ``cache_blocks``), wrapped on this scheduler's coordinator instance. The
scheduler class is vLLM's (``Scheduler`` or ``AsyncScheduler``, whichever the
config picks) with this mixin, set as ``scheduler_cls`` (patches.py lists it).
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from uniprefill.vllm.models.base import uniprefill_config
from uniprefill.vllm.requests import may_drop

# Tokens of a request its KV blocks may be published for (absent: no cap).
PUBLISH_CAP = "uniprefill_publish_cap"


class PublishCapMixin:
    """Caps what requests that may drop publish to the prefix cache."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.uniprefill = uniprefill_config(self.vllm_config.additional_config)  # type: ignore[attr-defined]
        coordinator = getattr(self.kv_cache_manager, "coordinator", None)  # type: ignore[attr-defined]
        publish = getattr(coordinator, "cache_blocks", None)
        if not callable(publish):
            raise RuntimeError(
                "uniprefill: this vLLM's KV cache manager has no coordinator.cache_blocks; "
                "prefix caching with UniPrefill is not supported on it "
                "(enable_prefix_caching=False)"
            )

        def cache_blocks(request: Any, num_computed_tokens: int) -> None:
            cap = getattr(request, PUBLISH_CAP, None)
            if cap is None:
                publish(request, num_computed_tokens)
            elif num_computed_tokens >= request.num_prompt_tokens:
                publish(request, min(num_computed_tokens, cap))
            # else: an earlier chunk of a prompt in chunks; its later layers' K/V are
            # written by the last chunk, so nothing of it is published before then.

        coordinator.cache_blocks = cache_blocks

    def add_request(self, request: Any) -> None:
        cfg = self.uniprefill
        prompt_len = int(request.num_prompt_tokens)
        if cfg is not None and may_drop(cfg, prompt_len, request.sampling_params):
            setattr(request, PUBLISH_CAP, min(cfg.dense_prefix_tokens, prompt_len))
        super().add_request(request)  # type: ignore[misc]


class UniPrefillScheduler(PublishCapMixin, Scheduler):
    pass


class UniPrefillAsyncScheduler(PublishCapMixin, AsyncScheduler):
    pass
