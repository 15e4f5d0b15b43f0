"""The KV slot arithmetic of the later stages (``uniprefill.vllm.stages.slot_mapping``).

Inside vLLM it is checked once against vLLM's own slot mapping (model_state.py) and
by the decode tests; here its two forms are checked against a plain loop.
"""

from __future__ import annotations

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
