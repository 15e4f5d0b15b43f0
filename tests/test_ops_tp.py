"""Tensor parallelism: ranks holding head slices, summing block scores, agree exactly."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from uniprefill.ops import make_allreduce, select_tokens

WORLD = 2
KW = dict(top_p=0.6, block_size=8, last_q=6, sink=4, impl="reference")


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    lens = [1, 180, 95, 1, 40]
    q = torch.randn(sum(lens), 8, 16, generator=g) * 3
    k = torch.randn(sum(lens), 4, 16, generator=g)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, cu


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, results) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    try:
        group = dist.new_group(ranks=list(range(WORLD)), backend="gloo")
        q, k, cu = _batch()
        hq, hkv = q.shape[1] // WORLD, k.shape[1] // WORLD
        q_r = q[:, rank * hq : (rank + 1) * hq]
        k_r = k[:, rank * hkv : (rank + 1) * hkv]
        sel = select_tokens(q_r, k_r, cu, score_allreduce=make_allreduce(group), **KW)
        results[rank] = (sel.keep.clone(), sel.block_scores.clone(), sel.gather_idx.clone())
    finally:
        dist.destroy_process_group()


def test_tp_ranks_match_single_process() -> None:
    q, k, cu = _batch()
    full = select_tokens(q, k, cu, **KW)
    assert full.num_kept < q.shape[0]  # something is dropped, so the check means something
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(_free_port(), results), nprocs=WORLD, join=True)
    keep0, scores0, idx0 = results[0]
    keep1, scores1, idx1 = results[1]
    assert torch.equal(keep0, keep1) and torch.equal(scores0, scores1) and torch.equal(idx0, idx1)
    assert torch.equal(keep0, full.keep)
    torch.testing.assert_close(scores0, full.block_scores, rtol=1e-5, atol=1e-6)


def test_make_allreduce_refuses_global_default() -> None:
    with pytest.raises(ValueError, match="group"):
        make_allreduce(None)
