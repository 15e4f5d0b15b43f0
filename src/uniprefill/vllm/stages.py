"""Attention metadata per stage, built by vLLM's own model state from a rebuilt batch.

Layers after a drop layer see fewer tokens (in the drop step) and shorter KV (in
every later step). Their metadata is vLLM's: the base model state's
``prepare_attn`` runs again on a copy of the step's ``InputBatch`` whose token
fields describe the stage, with a metadata builder of the stage's own (builders
keep persistent buffers that captured CUDA graphs read, so stages never share
one). :data:`BATCH_FIELDS` says, for every field of vLLM's ``InputBatch``, whether
a stage replaces it or keeps it; a vLLM whose ``InputBatch`` has a field not
listed there is refused at start-up, so no field passes through unexamined.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:  # vLLM's types, named so a type checker flags a renamed attribute
    from vllm.config import VllmConfig
    from vllm.v1.worker.gpu.input_batch import InputBatch
    from vllm.v1.worker.utils import AttentionGroup

_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")

# What a stage does with each InputBatch field (vLLM 0.26 - 0.32 names).
STAGE, REQUEST, OUTPUT, UNUSED = "stage", "request", "output", "unused"
BATCH_FIELDS: dict[str, str] = {
    # Token-level and length fields: rebuilt for each stage.
    "num_tokens": STAGE,
    "num_tokens_after_padding": STAGE,
    "num_scheduled_tokens": STAGE,
    "query_start_loc": STAGE,
    "query_start_loc_np": STAGE,
    "seq_lens": STAGE,
    "seq_lens_cpu_upper_bound": STAGE,
    "num_computed_tokens_np": STAGE,
    "positions": STAGE,
    "is_padding": STAGE,
    "max_query_len": STAGE,
    # Per-request facts a drop does not change (same requests, same prefill status).
    "req_ids": REQUEST,
    "num_reqs": REQUEST,
    "num_reqs_after_padding": REQUEST,
    "idx_mapping": REQUEST,
    "idx_mapping_np": REQUEST,
    "prefill_len_np": REQUEST,
    "num_computed_prefill_tokens_np": REQUEST,
    "is_prefilling_np": REQUEST,
    "has_prefill": REQUEST,
    "decode_graph_eligible": REQUEST,
    "prefill_runs_as_decode_np": REQUEST,
    "has_structured_output_reqs": REQUEST,
    # Speculative decoding: drafts ride on decode rows, which no stage shortens.
    "num_draft_tokens": REQUEST,
    "num_draft_tokens_per_req": REQUEST,
    # Each request's length limit, set under pipeline parallelism (the non-last ranks'
    # sampled-token receive reads it): a drop does not change it.
    "max_seq_len_np": REQUEST,
    # Read after the forward (sampling), never by attention metadata.
    "input_ids": OUTPUT,
    "expanded_idx_mapping": OUTPUT,
    "expanded_local_pos": OUTPUT,
    "logits_indices": OUTPUT,
    "cu_num_logits": OUTPUT,
    "cu_num_logits_np": OUTPUT,
    # Features UniPrefill refuses at start-up (DCP, R-SWA, vLLM's own fast prefill);
    # checked empty at every rebuild.
    "dcp_local_seq_lens": UNUSED,
    "dcp_local_seq_lens_cpu_upper_bound": UNUSED,
    "prompt_lens": UNUSED,
    "fast_prefill": UNUSED,
}


def check_batch_fields(batch_cls: type) -> None:
    """Refuse a vLLM whose InputBatch has fields this module does not know."""
    names = {f.name for f in dataclasses.fields(batch_cls)}
    unknown = sorted(names - set(BATCH_FIELDS))
    missing = sorted(n for n in ("seq_lens", "query_start_loc", "positions") if n not in names)
    if unknown or missing:
        raise RuntimeError(
            "uniprefill: this vLLM's InputBatch differs from the versions UniPrefill "
            f"knows (unknown fields {unknown}, missing {missing}); per-stage attention "
            "metadata cannot be rebuilt safely. Run UniPrefill with a supported vLLM."
        )


def _check_unused(batch: InputBatch) -> None:
    for name, role in BATCH_FIELDS.items():
        value = getattr(batch, name, None)
        if role == UNUSED and value is not None:
            raise RuntimeError(f"uniprefill: InputBatch.{name} is set ({value!r}); not supported")


def layer_index(name: str) -> int:
    m = _LAYER_INDEX.search(name)
    if m is None:
        raise RuntimeError(f"uniprefill: cannot tell the decoder layer of {name!r}")
    return int(m.group(1))


def stage_of_layer(layer: int, drop_layers: Sequence[int]) -> int:
    """Stage of a layer's token mixer: the number of drop layers before it."""
    return sum(1 for d in drop_layers if d < layer)


def slot_mapping(
    block_table: torch.Tensor,
    kernel_block_size: int,
    num_computed: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_reqs: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """KV slot of every token: row r's j-th token goes to index ``num_computed[r] + j``.

    ``num_computed`` [R] fills ``out`` [n]; [S, R] (one row of lengths per stage)
    fills ``out`` [S, n] in the same few device ops; with ``block_table`` [S, R, M]
    too (one table per row of lengths: every stage group at once) each row reads its
    own table. ``out`` is filled whole; tokens past the last row get -1 (vLLM's pad
    slot, the KV write skips them). Device ops only, no host sync: safe before a graph
    replay.
    """
    n = out.shape[-1]
    if n == 0:
        return out
    dev = out.device
    qsl = query_start_loc[: num_reqs + 1].to(torch.int64)
    tok = torch.arange(n, device=dev, dtype=torch.int64)
    row = torch.searchsorted(qsl[1:], tok, right=True)
    real = row < num_reqs
    row = row.clamp(max=max(num_reqs - 1, 0))
    index = num_computed[..., row].to(torch.int64) + (tok - qsl[row])
    index = index.clamp(min=0)
    col = index // kernel_block_size
    if block_table.dim() == 3:  # [S, R, M]: row s of the lengths reads table s
        which = torch.arange(block_table.shape[0], device=dev)[:, None]
        block = block_table[which, row, col].to(torch.int64)
    else:
        block = block_table[row, col].to(torch.int64)
    slots = block * kernel_block_size + index % kernel_block_size
    return out.copy_(torch.where(real, slots, -1))


@dataclass
class StageGroups:
    """Attention groups of one stage, each with a metadata builder of its own."""

    groups: list[list[AttentionGroup]]  # per KV-cache group, like the runner's attn_groups
    paged: list[list[AttentionGroup]]  # the same, paged-KV groups only (decode needs no others)
    layer_group: dict[str, int]  # layer name -> KV-cache group id


def split_groups(
    attn_groups: list[list[AttentionGroup]],
    drop_layers: Sequence[int],
    is_paged: Callable[[Any], bool],
    vllm_config: VllmConfig,
    device: torch.device,
    is_own: Callable[[str], bool] = lambda name: True,
) -> list[StageGroups]:
    """Stage 1..S copies of the runner's attention groups, restricted to their layers.

    Layers that are not the model's own (``is_own``: an EAGLE drafter's, which vLLM
    puts in the target's KV-cache groups) stay in no stage: the drafter runs over the
    whole prompt with vLLM's own metadata (docs/usage.md, "Speculative decoding").
    """
    stages = [
        StageGroups([[] for _ in attn_groups], [[] for _ in attn_groups], {}) for _ in drop_layers
    ]
    for gid, groups in enumerate(attn_groups):
        for group in groups:
            kernel_block_size = group.get_metadata_builder(0).kv_cache_spec.block_size
            by_stage: dict[int, list[str]] = {}
            for name in filter(is_own, group.layer_names):
                s = stage_of_layer(layer_index(name), drop_layers)
                if s > 0:
                    by_stage.setdefault(s, []).append(name)
            for s, names in by_stage.items():
                # vLLM's own construction path (its arguments differ across versions).
                copy = dataclasses.replace(group, layer_names=names, metadata_builders=[])
                copy.create_metadata_builders(
                    vllm_config=vllm_config, device=device, kernel_block_size=kernel_block_size
                )
                base, builder = group.get_metadata_builder(0), copy.get_metadata_builder(0)
                if hasattr(base, "_get_workspace_buffer") and hasattr(
                    builder, "set_workspace_buffer"
                ):
                    builder.set_workspace_buffer(base._get_workspace_buffer())
                st = stages[s - 1]
                st.groups[gid].append(copy)
                if is_paged(group.kv_cache_spec):
                    st.paged[gid].append(copy)
                for name in names:
                    st.layer_group[name] = gid
    return stages


@dataclass
class StageBatch:
    """The token-level view of one stage, on host and device."""

    qlen: np.ndarray  # [R] tokens of each row alive in this stage
    ctx: np.ndarray  # [R] tokens already in this stage's KV, per row
    positions: torch.Tensor  # [T] original positions of the alive tokens
    query_start_loc_np: np.ndarray  # int32 [R_padded + 1] (padding rows are empty)
    seq_lens_np: np.ndarray  # int32 [R_padded]
    query_start_loc: torch.Tensor  # the same two on the device
    seq_lens: torch.Tensor

    @classmethod
    def build(
        cls,
        qlen: np.ndarray,
        ctx: np.ndarray,
        positions: torch.Tensor,
        num_reqs_padded: int,
        ctx_device: torch.Tensor | None = None,
    ) -> StageBatch:
        """``ctx`` on the host may be an upper bound (vLLM's ``seq_lens_cpu_upper_bound``);
        ``ctx_device``, where given, is exact and makes the device sequence lengths."""
        qsl = np.zeros(num_reqs_padded + 1, dtype=np.int32)
        np.cumsum(qlen, out=qsl[1 : len(qlen) + 1])
        qsl[len(qlen) + 1 :] = qsl[len(qlen)]
        seq = np.zeros(num_reqs_padded, dtype=np.int32)
        seq[: len(qlen)] = ctx + qlen
        dev = positions.device
        if ctx_device is None:
            seq_dev = torch.from_numpy(seq).to(dev, non_blocking=True)
        else:  # a tensor of its own (on a CPU device .to() would share seq's memory)
            seq_dev = torch.zeros(num_reqs_padded, dtype=torch.int32, device=dev)
            qlen_dev = torch.from_numpy(qlen.astype(np.int32)).to(dev, non_blocking=True)
            seq_dev[: len(qlen)] = ctx_device + qlen_dev
        return cls(
            qlen=qlen,
            ctx=ctx,
            positions=positions,
            query_start_loc_np=qsl,
            seq_lens_np=seq,
            query_start_loc=torch.from_numpy(qsl).to(dev, non_blocking=True),
            seq_lens=seq_dev,
        )

    def input_batch(self, batch: InputBatch) -> InputBatch:
        """``batch`` with its token fields replaced by this stage's."""
        _check_unused(batch)
        num_tokens = int(self.query_start_loc_np[-1])
        values = {
            "num_tokens": num_tokens,
            "num_tokens_after_padding": num_tokens,
            "num_scheduled_tokens": self.qlen.astype(batch.num_scheduled_tokens.dtype),
            "query_start_loc": self.query_start_loc,
            "query_start_loc_np": self.query_start_loc_np,
            "seq_lens": self.seq_lens,
            "seq_lens_cpu_upper_bound": torch.from_numpy(self.seq_lens_np),
            "num_computed_tokens_np": self.ctx.astype(batch.num_computed_tokens_np.dtype),
            "positions": self.positions,
            "is_padding": torch.zeros(num_tokens, dtype=torch.bool, device=self.positions.device),
            "max_query_len": int(self.qlen.max()) if len(self.qlen) else 0,
        }
        have = {f.name for f in dataclasses.fields(batch)}
        return dataclasses.replace(batch, **{k: v for k, v in values.items() if k in have})
