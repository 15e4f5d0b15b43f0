"""The KV-cache spec and block manager of one stage (``free_kv_blocks``, ``kv_blocks.py``).

Registered with vLLM's ``KVCacheSpecRegistry``, its extension point for KV-cache
specs and their managers (vLLM 0.26+).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheSpec


@dataclass(frozen=True, kw_only=True)
class StageAttentionSpec(FullAttentionSpec):
    """Full attention of one stage: layers of different stages never share a group."""

    uniprefill_stage: int = 0

    @classmethod
    def merge(cls, specs: list[KVCacheSpec]) -> StageAttentionSpec:
        stages = {getattr(s, "uniprefill_stage", None) for s in specs}
        if len(stages) != 1 or not all(isinstance(s, StageAttentionSpec) for s in specs):
            # vLLM tells mergeable specs apart by this exception (is_kv_cache_spec_uniform).
            raise AssertionError(
                f"uniprefill: layers of stages {sorted(map(str, stages))} cannot share a "
                "KV-cache group"
            )
        base = FullAttentionSpec.merge(specs)
        values = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init}
        return cls(**values, uniprefill_stage=stages.pop())

    def is_uniform_with_collection(self, kv_cache_specs: dict[str, KVCacheSpec]) -> bool:
        return all(
            isinstance(s, StageAttentionSpec) and s.uniprefill_stage == self.uniprefill_stage
            for s in kv_cache_specs.values()
        )


def stage_spec(spec: KVCacheSpec, stage: int) -> StageAttentionSpec:
    """``spec`` (a layer's own) as the spec of stage ``stage``; only plain full attention."""
    if type(spec) is not FullAttentionSpec or spec.sliding_window or spec.attention_chunk_size:
        raise ValueError(
            f"uniprefill: free_kv_blocks supports full-attention layers only, got {spec!r}"
        )
    values = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.init}
    return StageAttentionSpec(**values, uniprefill_stage=stage)


class StageAttentionManager(FullAttentionManager):
    """vLLM's full-attention block manager, plus freeing a stage's dropped range."""

    def free_dropped(self, request_id: str, first: int, count: int) -> int:
        """Return blocks ``[first, first + count)`` to the pool; how many were freed."""
        blocks = self.req_to_blocks.get(request_id)
        if not blocks or count <= 0:
            return 0
        live = sum(not b.is_null for b in blocks[first : first + count])
        self._remove_blocks_in_range(request_id, first, first + count)
        return live


def register() -> None:
    """Map :class:`StageAttentionSpec` to its manager in vLLM's spec registry (idempotent)."""
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    # The registry fills vLLM's own specs lazily, only while it is empty: fill it first.
    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(
        StageAttentionSpec, StageAttentionManager, uniform_type_base_spec=FullAttentionSpec
    )
