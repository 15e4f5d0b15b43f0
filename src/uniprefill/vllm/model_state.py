"""The V2 model runner's per-model state, with UniPrefill's request table and stages.

vLLM asks the model for its state class (``get_model_state_cls``); UniPrefill's
class derives from the one vLLM would pick (default, or Mamba-hybrid for
Qwen3-Next) and adds, through the state's own hooks:

* ``add_request`` / ``remove_request``: a row of the request table per request,
  freed with the request (finished, aborted, preempted);
* ``prepare_attn``: plans the step (which rows drop), and when compacted requests
  are in the batch (or a FULL CUDA graph runs, which reads them every replay)
  writes each later stage's sequence lengths and KV slots into persistent buffers
  (on a GPU in one Triton launch, ``ops/triton_stage_fill.py``) and builds that
  stage's metadata with the stage's own builders; vLLM's own call then builds only
  the groups of stage 0 (with ``free_kv_blocks`` each stage has groups of its own);
* :meth:`~UniPrefillStateMixin.stage_metadata`: a later stage's metadata in a step
  that drops (called by the model's dropping forward as it enters the stage).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from uniprefill.config import STAGE_FILL_ENV
from uniprefill.ops.select import triton_usable
from uniprefill.vllm import kv_blocks, versions
from uniprefill.vllm.requests import min_prompt_len, request_top_p, runs_dense
from uniprefill.vllm.runtime import UniPrefillRuntime
from uniprefill.vllm.stages import StageBatch, StageGroups, check_batch_fields, slot_mapping
from uniprefill.vllm.stages import split_groups as split_stage_groups
from uniprefill.vllm.step import StageWalk, StepPlan

if TYPE_CHECKING:  # vLLM's types, named so a type checker flags a renamed attribute
    from vllm.config import VllmConfig
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.core.sched.output import NewRequestData
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.worker.gpu.input_batch import InputBatch
    from vllm.v1.worker.utils import AttentionGroup

_CLASSES: dict[type, type] = {}


def base_state_class(vllm_config: VllmConfig) -> type:
    """The state class vLLM would pick for this model (``versions.py``)."""
    return versions.base_model_state_class(vllm_config)


def model_state_class(vllm_config: VllmConfig) -> type:
    """UniPrefill's state class over the base class vLLM would choose for this model."""
    base = base_state_class(vllm_config)
    if base not in _CLASSES:
        _CLASSES[base] = type(f"UniPrefill{base.__name__}", (UniPrefillStateMixin, base), {})
    return _CLASSES[base]


def _is_own_layer(own_layers: frozenset[str], vllm_config: VllmConfig, name: str) -> bool:
    """Whether a KV-cache group's layer is the model's; only a drafter's may not be."""
    if name in own_layers:
        return True
    if vllm_config.speculative_config is None:
        raise RuntimeError(
            f"uniprefill: KV-cache layer {name!r} is not a module of the model and no "
            "drafter is configured; its stage cannot be told"
        )
    return False


def _use_triton_fill(device: torch.device) -> bool:
    choice = os.environ.get(STAGE_FILL_ENV, "auto")
    if choice not in ("auto", "triton", "torch"):
        raise ValueError(f"{STAGE_FILL_ENV}={choice!r}: use auto, triton or torch")
    if choice == "triton" and not triton_usable(device):
        raise ValueError(f"{STAGE_FILL_ENV}=triton: Triton cannot run on {device}")
    return choice == "triton" or (choice == "auto" and device.type == "cuda")


class _StageBuffers:
    """Per-stage lengths, slots and builders that outlive a step (graphs read them)."""

    def __init__(
        self,
        runtime: UniPrefillRuntime,
        attn_groups: list[list[AttentionGroup]],
        vllm_config: VllmConfig,
        device: torch.device,
        own_layers: frozenset[str],
    ) -> None:
        from vllm.v1.kv_cache_interface import AttentionSpec

        self.stages: list[StageGroups] = split_stage_groups(
            attn_groups,
            runtime.drop_layers,
            lambda spec: isinstance(spec, AttentionSpec),
            vllm_config,
            device,
            is_own=functools.partial(_is_own_layer, own_layers, vllm_config),
        )
        sched = vllm_config.scheduler_config
        num_stages, num_groups = len(runtime.drop_layers), len(attn_groups)
        self.seq_lens = torch.zeros(
            (num_stages, sched.max_num_seqs), dtype=torch.int32, device=device
        )
        self.slots = torch.full(
            (num_stages, num_groups, sched.max_num_batched_tokens),
            -1,
            dtype=torch.int64,
            device=device,
        )
        # Block size in the units of the block tables the runner hands prepare_attn.
        self.block_size = {
            gid: versions.block_table_block_size(group)
            for gid, groups in enumerate(attn_groups)
            for group in groups
            if isinstance(group.kv_cache_spec, AttentionSpec)
        }
        self.checked = False
        if runtime.config.free_kv_blocks:
            runtime.kv_freeing = self._find_stage_groups(runtime, sched.max_num_seqs, device)
        self.freeing: kv_blocks.KVBlockFreeing | None = runtime.kv_freeing
        # A decode step's stage lengths, slots and remapped tables in one Triton launch
        # on a GPU; torch ops elsewhere (docs/kv-blocks.md, "Host cost").
        self.jobs: torch.Tensor | None = None
        self._job_tables: tuple[int, ...] = ()
        if _use_triton_fill(device):
            self._set_jobs(num_stages, device)

    def _find_stage_groups(
        self, runtime: UniPrefillRuntime, max_rows: int, device: torch.device
    ) -> kv_blocks.KVBlockFreeing:
        """free_kv_blocks: each stage's KV-cache groups, and the freeing's owner over them."""
        group_stage: dict[int, int] = {}
        sizes = set()
        for s, stage in enumerate(self.stages, start=1):
            for gid, groups in enumerate(stage.groups):
                for group in groups:
                    spec = group.kv_cache_spec
                    if getattr(spec, "uniprefill_stage", None) != s:
                        raise RuntimeError(
                            f"uniprefill: free_kv_blocks is on but KV-cache group {gid} "
                            f"holds layers of stage {s} with spec {spec!r}"
                        )
                    group_stage[gid] = s
                    sizes.add((spec.block_size, self.block_size[gid]))
        if len(sizes) != 1:
            raise RuntimeError(f"uniprefill: stage KV-cache groups differ in block size {sizes}")
        block_size, table_block_size = sizes.pop()
        return kv_blocks.KVBlockFreeing(
            block_size, table_block_size, group_stage, len(runtime.table.req_ids), max_rows, device
        )

    def unstaged_groups(
        self, attn_groups: list[list[AttentionGroup]]
    ) -> list[list[AttentionGroup]]:
        """``attn_groups`` without the stage groups of ``free_kv_blocks`` (their layers'
        metadata comes from the stage builds): vLLM's own call builds one group, not S+1."""
        if self.freeing is None:
            return attn_groups
        staged = self.freeing.groups
        return [[] if gid in staged else groups for gid, groups in enumerate(attn_groups)]

    def _set_jobs(self, num_stages: int, device: torch.device) -> None:
        """The fill's (stage - 1, table, KV-cache group, block size) jobs: with
        free_kv_blocks one per stage group and its own table, else every stage over each
        attention group's table."""
        if self.freeing is not None:
            stages = self.freeing.stages.tolist()
            self._job_tables = self.freeing.groups
            jobs = [
                (s - 1, i, g) for i, (s, g) in enumerate(zip(stages, self._job_tables, strict=True))
            ]
        else:
            self._job_tables = tuple(self.block_size)
            jobs = [(s, k, g) for s in range(num_stages) for k, g in enumerate(self._job_tables)]
        rows = [(*job, self.block_size[job[2]]) for job in jobs]
        self.jobs = torch.tensor(rows, dtype=torch.int32, device=device)

    def fill(
        self,
        runtime: UniPrefillRuntime,
        batch: InputBatch,
        block_tables: tuple[torch.Tensor, ...],
        num_tokens: int,
    ) -> tuple[torch.Tensor, ...]:
        """Every stage's lengths and slots, and with free_kv_blocks the stage groups'
        remapped tables, in one launch (``ops/triton_stage_fill.py``); the step's block
        tables with the remapped ones in place."""
        from uniprefill.ops.triton_stage_fill import fill_stages

        assert self.jobs is not None
        freeing = self.freeing
        remapped = None
        if freeing is not None:
            tables = freeing.stage_tables(block_tables)
            remapped = freeing.remap_buffer(tables, tables.shape[1], tables.shape[2])
        elif len(self._job_tables) == 1:
            tables = block_tables[self._job_tables[0]].unsqueeze(0)
        else:
            tables = torch.stack([block_tables[g] for g in self._job_tables])
        fill_stages(
            tables,
            freeing.freed if freeing is not None else None,
            batch.idx_mapping,
            runtime.table.dropped_gpu,
            batch.seq_lens,
            batch.query_start_loc,
            self.jobs,
            batch.num_reqs,
            batch.num_reqs_after_padding,
            num_tokens,
            self.seq_lens,
            self.slots,
            remapped,
        )
        if freeing is None:
            return block_tables
        assert remapped is not None
        return freeing.remapped_tables(block_tables, remapped)

    def tables(
        self, runtime: UniPrefillRuntime, batch: InputBatch, block_tables: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, ...]:
        """The step's block tables, each stage group's with its requests' freed ranges skipped."""
        if runtime.kv_freeing is None:
            return block_tables
        return runtime.kv_freeing.remap(batch.idx_mapping[: batch.num_reqs], block_tables)


class UniPrefillStateMixin:
    """Hooks UniPrefill adds to vLLM's model state (mixed in before the base class)."""

    def __init__(self, vllm_config: VllmConfig, model: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(vllm_config, model, *args, **kwargs)  # type: ignore[call-arg]
        from vllm.v1.worker.gpu.input_batch import InputBatch

        check_batch_fields(InputBatch)
        self.uniprefill: UniPrefillRuntime = model.make_uniprefill_runtime(
            self, self.device, vllm_config.scheduler_config.max_num_seqs
        )
        self._stage_buffers: _StageBuffers | None = None
        # The model's module names: a KV-cache group may also hold a drafter's layers.
        self._own_layers = frozenset(name for name, _ in model.named_modules())
        # What the step that drops needs for its later stages' metadata (prepare_attn's
        # build function and arguments), until the next step is prepared.
        self._step_inputs: (
            tuple[Any, InputBatch, tuple[torch.Tensor, ...], KVCacheConfig] | None
        ) = None

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, req_index: int, new_req_data: NewRequestData) -> None:
        super().add_request(req_index, new_req_data)  # type: ignore[misc]
        prompt = list(new_req_data.prompt_token_ids or ())
        prefill = new_req_data.prefill_token_ids
        rt = self.uniprefill
        # A request resumed after a preemption prefills prompt + its generated tokens.
        generated = max(0, len(prefill) - len(prompt)) if prefill is not None else 0
        rt.add_request(
            req_index,
            new_req_data.req_id,
            len(prompt),
            runs_dense(new_req_data.sampling_params),
            # Tokens found in vLLM's prefix cache (dense at every layer, see scheduler.py).
            start=int(new_req_data.num_computed_tokens),
            generated=generated,
        )
        # The request's own min_prompt_len (extra_args), else the engine's.
        rt.table.min_prompt_len[req_index] = min_prompt_len(rt.config, new_req_data.sampling_params)
        rt.table.top_p[req_index] = request_top_p(new_req_data.sampling_params)
        rt.stats.restarted += int(generated > 0)

    def remove_request(self, req_id: str) -> None:
        super().remove_request(req_id)  # type: ignore[misc]
        self.uniprefill.remove_request(req_id)

    # ---- attention metadata ------------------------------------------------------------------
    def prepare_attn(
        self,
        input_batch: InputBatch,
        cudagraph_mode: CUDAGraphMode,
        block_tables: tuple[torch.Tensor, ...],
        slot_mappings: torch.Tensor,
        attn_groups: list[list[AttentionGroup]],
        kv_cache_config: KVCacheConfig,
        for_capture: bool = False,
        **kwargs: Any,
    ) -> dict[str, Any]:
        from vllm.config.compilation import CUDAGraphMode

        base = functools.partial(super().prepare_attn, **kwargs)  # type: ignore[misc]
        args = (block_tables, slot_mappings)
        rt = self.uniprefill
        if not rt.drop_layers:
            rt.plan_dummy(input_batch.num_reqs)
            return base(
                input_batch,
                cudagraph_mode,
                *args,
                attn_groups,
                kv_cache_config,
                for_capture=for_capture,
            )
        t0 = time.perf_counter()
        if self._stage_buffers is None:
            self._stage_buffers = _StageBuffers(
                rt, attn_groups, self.vllm_config, self.device, self._own_layers
            )
        bufs = self._stage_buffers
        full_graph = cudagraph_mode == CUDAGraphMode.FULL
        num_reqs = input_batch.num_reqs
        slots = input_batch.idx_mapping_np[:num_reqs]
        real = not for_capture and rt.table.holds(input_batch.req_ids, slots)
        if real:
            # A FULL graph replays fixed token counts: nothing can drop inside one.
            step = rt.plan(
                input_batch.req_ids,
                slots,
                input_batch.num_scheduled_tokens[:num_reqs],
                input_batch.num_computed_tokens_np[:num_reqs],
                may_drop=not full_graph,
            )
            if not bufs.checked:
                self._check_slot_formula(input_batch, block_tables, slot_mappings)
        else:
            step = rt.plan_dummy(num_reqs)
        compacted = real and bool(step.dropped[:, 1:].any())
        builds_stages = step.dropping or for_capture or full_graph or compacted
        t_vllm = time.perf_counter()
        meta = base(
            input_batch,
            cudagraph_mode,
            *args,
            # Stage groups (free_kv_blocks) get their metadata from the decode fill below.
            # A dropping step keeps vLLM's: a stage whose selection keeps every token
            # runs on it without a stage build.
            bufs.unstaged_groups(attn_groups)
            if builds_stages and not step.dropping
            else attn_groups,
            kv_cache_config,
            for_capture=for_capture,
        )
        t_vllm_end = time.perf_counter()
        self._step_inputs = None
        if step.dropping:
            block_tables = bufs.tables(rt, input_batch, block_tables)
            self._step_inputs = (base, input_batch, block_tables, kv_cache_config)
        elif builds_stages:
            # FULL graphs are captured with (and replay) the stage buffers, so they are
            # filled on every step that may replay one, compacted requests or not.
            self._decode_stages(
                base,
                step,
                input_batch,
                cudagraph_mode,
                block_tables,
                slot_mappings,
                kv_cache_config,
                for_capture,
                compacted,
                meta,
            )
        if real:
            rt.stats.prepared_steps += 1
            rt.stats.host_vllm_prepare_s += t_vllm_end - t_vllm
            rt.stats.host_prepare_s += (t_vllm - t0) + (time.perf_counter() - t_vllm_end)
            rt.stats.log_summary()  # INFO, at most once per vLLM's stats interval
        return meta

    def _decode_stages(
        self,
        base: Any,
        step: StepPlan,
        batch: InputBatch,
        cudagraph_mode: CUDAGraphMode,
        block_tables: tuple[torch.Tensor, ...],
        slot_mappings: torch.Tensor,
        kv_cache_config: KVCacheConfig,
        for_capture: bool,
        compacted: bool,
        meta: dict[str, Any],
    ) -> None:
        """Later stages' metadata for a step whose token set is the same at every layer.

        Writes into the persistent stage buffers: a FULL graph captured with them
        reads the new lengths and slots at its next replay. Without a ``compacted``
        request in the batch (or in a dummy or capture batch) the stages copy vLLM's
        own lengths and slots.
        """
        bufs = self._stage_buffers
        assert bufs is not None
        num_tokens = slot_mappings.shape[1]
        seq = bufs.seq_lens[:, : batch.num_reqs_after_padding]
        slots = bufs.slots[:, :, :num_tokens]
        if bufs.jobs is not None:
            block_tables = bufs.fill(self.uniprefill, batch, block_tables, num_tokens)
        else:
            block_tables = bufs.tables(self.uniprefill, batch, block_tables)
            dropped = self.uniprefill.table.dropped_gpu[batch.idx_mapping] if compacted else None
            self._fill_stages_torch(batch, block_tables, slot_mappings, dropped, seq, slots)
        for s, stage in enumerate(bufs.stages, start=1):
            if not any(stage.paged):
                continue
            stage_batch = dataclasses.replace(batch, seq_lens=seq[s - 1])
            meta.update(
                base(
                    stage_batch,
                    cudagraph_mode,
                    block_tables,
                    slots[s - 1],
                    stage.paged,
                    kv_cache_config,
                    for_capture=for_capture,
                )
            )
            for groups in stage.paged:
                for group in groups:
                    for name in group.layer_names:
                        step.slot_overrides[name] = slots[s - 1, group.kv_cache_group_id]

    def _fill_stages_torch(
        self,
        batch: InputBatch,
        block_tables: tuple[torch.Tensor, ...],
        slot_mappings: torch.Tensor,
        dropped: torch.Tensor | None,
        seq: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        """Every stage's lengths and slots in torch ops (``_StageBuffers.fill`` does the
        same in one Triton launch). Without ``dropped`` the stages copy vLLM's."""
        bufs = self._stage_buffers
        assert bufs is not None
        num_reqs, padded = batch.num_reqs, batch.num_reqs_after_padding
        num_tokens = slots.shape[-1]
        seq.copy_(batch.seq_lens[:padded].expand_as(seq))
        if dropped is None:
            slots.copy_(slot_mappings.expand_as(slots))
            return
        seq[:, :num_reqs] -= dropped[:, 1:].T
        qsl = batch.query_start_loc
        ctx = seq[:, :num_reqs] - (qsl[1 : num_reqs + 1] - qsl[:num_reqs])
        freeing = bufs.freeing
        if freeing is not None and freeing.stacked is not None:
            # One stage per stage group: each group's slots from its own stage's
            # lengths and its remapped table, all groups in one computation.
            group_slots = torch.empty(
                (len(freeing.groups), num_tokens), dtype=slots.dtype, device=slots.device
            )
            slot_mapping(
                freeing.stacked,
                bufs.block_size[freeing.groups[0]],
                ctx[freeing.stage_rows],
                qsl,
                num_reqs,
                group_slots,
            )
            slots[freeing.stage_rows, freeing.group_ids] = group_slots
        else:
            for gid, block_size in bufs.block_size.items():
                slot_mapping(block_tables[gid], block_size, ctx, qsl, num_reqs, slots[:, gid])

    def stage_metadata(self, walk: StageWalk) -> None:
        """Metadata of the walk's stage after a drop layer: new token set, compacted KV."""
        from vllm.config.compilation import CUDAGraphMode
        from vllm.forward_context import get_forward_context

        bufs, inputs = self._stage_buffers, self._step_inputs
        assert bufs is not None and inputs is not None
        base, batch, block_tables, kv_cache_config = inputs
        stage, qlen, ctx = walk.stage, walk.qlen, walk.plan.later_ctx(walk.stage)
        groups = bufs.stages[stage - 1]
        if not any(groups.groups):  # a pipeline rank without attention in this stage
            return
        ctx_dev = self._later_ctx_device(walk, batch, ctx)
        sb = StageBatch.build(qlen, ctx, walk.positions, batch.num_reqs_after_padding, ctx_dev)
        num_tokens = int(qlen.sum())
        slots = torch.full(
            (len(groups.groups), num_tokens), -1, dtype=torch.int64, device=self.device
        )
        for gid, paged in enumerate(groups.paged):
            if paged:
                block_size = bufs.block_size[gid]
                slot_mapping(
                    block_tables[gid],
                    block_size,
                    ctx_dev,
                    sb.query_start_loc,
                    len(qlen),
                    slots[gid],
                )
        meta = base(
            sb.input_batch(batch),
            CUDAGraphMode.NONE,
            block_tables,
            slots,
            groups.groups,
            kv_cache_config,
        )
        fc = get_forward_context()
        fc.attn_metadata.update(meta)
        for name, gid in groups.layer_group.items():
            fc.slot_mapping[name] = slots[gid]

    def _later_ctx_device(
        self, walk: StageWalk, batch: InputBatch, ctx: np.ndarray
    ) -> torch.Tensor:
        """``ctx`` (tokens of each row in the stage's KV before this step) on the device.

        Rows that drop or chunk this step are prefills, exact on the host. Other rows
        (decodes, speculative verifications) take vLLM's device sequence lengths: with
        async scheduling and speculative decoding the host's ``num_computed_tokens`` is
        an upper bound until the step's rejected drafts are known (vLLM's "optimistic
        mirror"); the device knows.
        """
        plan, num_reqs = walk.plan, len(ctx)
        host = torch.from_numpy(ctx.astype(np.int32)).to(self.device, non_blocking=True)
        qsl = batch.query_start_loc
        table = self.uniprefill.table
        device = (
            batch.seq_lens[:num_reqs]
            - (qsl[1 : num_reqs + 1] - qsl[:num_reqs])
            - table.dropped_gpu[batch.idx_mapping[:num_reqs], walk.stage]
        )
        prefill = plan.droppable | plan.stashing | (plan.stash_len > 0)
        exact = torch.from_numpy(prefill).to(self.device, non_blocking=True)
        return torch.where(exact, host, device.to(torch.int32))

    def _check_slot_formula(
        self, batch: InputBatch, block_tables: tuple[torch.Tensor, ...], slot_mappings: torch.Tensor
    ) -> None:
        """Once, on the first real step: our slot arithmetic must equal vLLM's."""
        bufs = self._stage_buffers
        assert bufs is not None
        num_reqs = batch.num_reqs
        qsl = batch.query_start_loc
        ctx = batch.seq_lens[:num_reqs] - (qsl[1 : num_reqs + 1] - qsl[:num_reqs])
        for gid, block_size in bufs.block_size.items():
            ours = torch.empty_like(slot_mappings[gid])
            slot_mapping(block_tables[gid], block_size, ctx, qsl, num_reqs, ours)
            n = batch.num_tokens
            if not torch.equal(ours[:n], slot_mappings[gid, :n]):
                raise RuntimeError(
                    "uniprefill: KV slot arithmetic disagrees with this vLLM's slot mapping "
                    f"(KV-cache group {gid}); this vLLM version is not supported"
                )
        bufs.checked = True
