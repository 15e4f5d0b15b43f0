"""Fused Triton scoring against the reference.

On a machine without CUDA the kernels run under Triton's CPU interpreter, which
must be switched on (TRITON_INTERPRET=1) before triton is imported; so this
module re-runs itself in a subprocess with that variable set and the tests of
the outer process are skipped, leaving the other test modules untouched.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys

import pytest
import torch

HAVE_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
NATIVE = torch.cuda.is_available() and not INTERPRET
RUN_HERE = HAVE_TRITON and (INTERPRET or NATIVE)
DEVICE = "cuda" if NATIVE else "cpu"

needs_kernel = pytest.mark.skipif(
    not RUN_HERE,
    reason="triton not importable"
    if not HAVE_TRITON
    else "no CUDA: run in a TRITON_INTERPRET=1 subprocess by test_interpreter_subprocess",
)


@pytest.mark.skipif(not HAVE_TRITON, reason="triton not importable")
@pytest.mark.skipif(RUN_HERE, reason="kernels run natively / interpreted in this process")
def test_interpreter_subprocess() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def make_batch(lens, hq, hkv, d, seed, dtype=torch.float32, sharp=2.0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    q = (torch.randn(t, hq, d, generator=g) * sharp).to(DEVICE, dtype)
    k = torch.randn(t, hkv, d, generator=g).to(DEVICE, dtype)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, cu.to(DEVICE)


CASES = [
    # lens, hq, hkv, d, last_q
    ([300, 1, 40, 5], 4, 2, 16, 8),  # crosses a 128-key tile, decode row, short rows
    ([130, 77], 8, 1, 64, 20),  # GQA 8, D 64
    ([260], 4, 4, 128, 100),  # GQA 1, D 128, last_q > BLOCK_M: two query chunks
    ([70, 1, 90], 4, 1, 256, 16),  # GQA 4, D 256 (BLOCK_N 64)
    ([50, 33], 2, 2, 80, 12),  # head dim not a power of two
]


@needs_kernel
@pytest.mark.parametrize("case", range(len(CASES)))
def test_token_scores_match_reference(case: int) -> None:
    from uniprefill.ops.reference import droppable_rows, token_scores_reference
    from uniprefill.ops.triton_select import token_scores_triton

    lens, hq, hkv, d, lq = CASES[case]
    q, k, cu = make_batch(lens, hq, hkv, d, seed=case)
    scale = 1.0 / math.sqrt(d)
    got = token_scores_triton(q, k, cu, last_q=lq, scale=scale, sink=4)
    ref = token_scores_reference(
        q, k, cu, last_q=lq, scale=scale, scored=droppable_rows(cu, lq, 4, None)
    )
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_match_reference(dtype: torch.dtype) -> None:
    from uniprefill.ops.reference import droppable_rows, token_scores_reference
    from uniprefill.ops.triton_select import token_scores_triton

    if INTERPRET and dtype == torch.bfloat16:
        pytest.skip("Triton's CPU interpreter gets bf16 tl.dot wrong (seen with triton 3.9)")
    q, k, cu = make_batch([200, 1, 60], 4, 2, 64, seed=3, dtype=dtype)
    got = token_scores_triton(q, k, cu, last_q=16, scale=0.125, sink=4)
    ref = token_scores_reference(
        q, k, cu, last_q=16, scale=0.125, scored=droppable_rows(cu, 16, 4, None)
    )
    torch.testing.assert_close(got, ref, rtol=2e-3, atol=1e-4)


@needs_kernel
@pytest.mark.parametrize(
    "kw",
    [
        dict(top_p=0.5, block_size=8, last_q=8, sink=4),
        dict(top_p=0.9, block_size=16, last_q=16, sink=0, keep_ratio=0.3),
        dict(top_p=0.7, block_size=4, last_q=8, sink=8, allow_drop=[True, False, True, True]),
        dict(top_p=0.8, block_size=256, last_q=8, sink=4),  # block > key tile: torch path
        dict(top_p=0.6, block_size=1, last_q=4, sink=2),
        dict(top_p=1.0, block_size=8, last_q=8, sink=4, row_top_p=[0.5, 1.0, 0.9, 0.7]),
    ],
    ids=["top_p", "keep_ratio", "allow_drop", "block256", "block1", "row_top_p"],
)
def test_selection_matches_reference(kw: dict) -> None:
    from uniprefill.ops import select_tokens

    q, k, cu = make_batch([300, 150, 1, 90], 8, 2, 32, seed=7)
    kw = dict(kw)
    if "allow_drop" in kw:
        kw["allow_drop"] = torch.tensor(kw["allow_drop"], device=DEVICE)
    if "row_top_p" in kw:  # each request's own top_p (issue 26)
        kw["row_top_p"] = torch.tensor(kw["row_top_p"], dtype=torch.float64, device=DEVICE)
    got = select_tokens(q, k, cu, impl="triton", **kw)
    ref = select_tokens(q, k, cu, impl="reference", **kw)
    torch.testing.assert_close(got.block_scores, ref.block_scores, rtol=1e-4, atol=1e-5)
    assert torch.equal(got.keep, ref.keep)
    assert torch.equal(got.gather_idx, ref.gather_idx) and got.num_kept == ref.num_kept
    assert torch.equal(got.new_lens, ref.new_lens)
    assert torch.equal(got.new_cu_seqlens, ref.new_cu_seqlens)
    assert torch.equal(got.new_cu_seqlens_cpu, got.new_cu_seqlens.cpu())
    assert got.num_kept < q.shape[0]
    # Selection stage on the kernel's own scores is deterministic.
    again = select_tokens(q, k, cu, impl="triton", **kw)
    assert torch.equal(again.block_scores, got.block_scores)
    assert torch.equal(again.keep, got.keep)


@needs_kernel
def test_strided_inputs() -> None:
    """q and k as views into a fused qkv buffer (non-contiguous token stride)."""
    from uniprefill.ops import select_tokens

    g = torch.Generator().manual_seed(5)
    qkv = (torch.randn(180, 4 + 2 + 2, 16, generator=g) * 2).to(DEVICE)
    q, k = qkv[:, :4], qkv[:, 4:6]
    cu = torch.tensor([0, 120, 180], dtype=torch.int32, device=DEVICE)
    kw = dict(top_p=0.6, block_size=8, last_q=8, sink=4)
    got = select_tokens(q, k, cu, impl="triton", **kw)
    ref = select_tokens(q.contiguous(), k.contiguous(), cu, impl="reference", **kw)
    torch.testing.assert_close(got.block_scores, ref.block_scores, rtol=1e-4, atol=1e-5)
    assert torch.equal(got.keep, ref.keep)


@needs_kernel
@pytest.mark.parametrize("mode", ["top_p", "keep_ratio", "ties"])
def test_kernel_selection_equals_torch_selection(mode: str, monkeypatch) -> None:
    """Same block scores in, same mask out: the Triton selection kernels vs the torch spec."""
    from uniprefill.ops import select_from_block_scores
    from uniprefill.ops import triton_select as ts

    lens = [300, 1, 90, 170, 0, 64]
    q, k, cu = make_batch(lens, 2, 2, 16, seed=4)
    bs, lq, sink = 8, 4, 4
    nslots = sum(lens) // bs + len(lens)
    g = torch.Generator().manual_seed(9)
    scores = torch.rand(nslots, generator=g) ** 4  # skewed, so top-p drops
    if mode == "ties":
        scores = torch.floor(scores * 4) / 4 + 0.25  # many exact ties
    scores = scores.to(DEVICE)
    ratio = 0.3 if mode == "keep_ratio" else None
    allow = torch.tensor([True, True, True, False, True, True], device=DEVICE)

    def fake_score(q, k, lay, *, last_q, scale, seg):  # inject the scores
        return scores[None].clone()

    monkeypatch.setattr(ts, "_score", fake_score)
    for top_p in (0.3, 0.9):
        kw = dict(
            top_p=top_p, block_size=bs, last_q=lq, sink=sink, allow_drop=allow, keep_ratio=ratio
        )
        got = ts.select_tokens_triton(q, k, cu, scale=1.0, score_allreduce=None, **kw)
        ref = select_from_block_scores(scores, cu, num_tokens=q.shape[0], **kw)
        assert torch.equal(got.keep, ref.keep)
        assert torch.equal(got.gather_idx, ref.gather_idx) and got.num_kept == ref.num_kept
        assert torch.equal(got.new_cu_seqlens, ref.new_cu_seqlens)
        assert torch.equal(got.new_cu_seqlens_cpu, got.new_cu_seqlens.cpu())
        assert torch.equal(got.new_lens, ref.new_lens)
        assert got.num_kept < q.shape[0]


@needs_kernel
def test_kernel_layout_mirrors_scorable() -> None:
    """The layout kernel's scored rows are the rule's: lengths at and around the threshold."""
    from uniprefill.config import scorable, unscored_len
    from uniprefill.ops.reference import droppable_rows
    from uniprefill.ops.triton_select import _layout

    sink, lq = 4, 8
    edge = unscored_len(sink, lq)
    lens = [edge - 1, edge, edge + 1, 1, 0, 3 * edge]
    _, _, cu = make_batch(lens, 2, 2, 16, seed=5)
    allow = torch.tensor([True, True, True, True, True, False], device=DEVICE)
    for allow_drop in (None, allow):
        lay = _layout(cu, allow_drop, min_len=edge, block_n=64, block_size=8)
        ref = droppable_rows(cu, lq, sink, allow_drop)
        assert lay[3, : len(lens)].bool().tolist() == ref.tolist()
    expected = [scorable(n, sink, lq) for n in lens]
    assert expected == [False, False, True, False, False, True]
    assert droppable_rows(cu, lq, sink, None).tolist() == expected


def _stage_fill_reference(tables, freed, idx, dropped, seq_lens, qsl, jobs, n, padded, tokens):
    """The torch composition the model state ran before the kernel (model_state.py)."""
    from uniprefill.vllm.kv_blocks import remap_block_table
    from uniprefill.vllm.stages import slot_mapping

    num_stages = dropped.shape[1] - 1
    seq = seq_lens[:padded].expand(num_stages, padded).clone()
    seq[:, :n] -= dropped[idx[:n].long(), 1:].T
    remapped = tables
    if freed is not None:
        step = torch.zeros((2, tables.shape[0], tables.shape[1]), dtype=freed.dtype)
        step[:, :, :n] = freed[idx[:n].long()].permute(1, 2, 0)
        remapped = remap_block_table(tables, step[0], step[1], torch.empty_like(tables))
    ctx = seq[:, :n] - (qsl[1 : n + 1] - qsl[:n])
    slots = torch.full((num_stages, 3, tokens), -5, dtype=torch.int64)
    for s, t, g, bs in jobs.tolist():
        slot_mapping(remapped[t], bs, ctx[s], qsl, n, slots[s, g])
    return seq, slots, remapped


@needs_kernel
@pytest.mark.parametrize("freeing", [True, False])
def test_stage_fill_kernel_equals_torch_composition(freeing: bool) -> None:
    """Lengths, slots and remapped tables of every stage in one launch = the torch ops:
    decode rows, a multi-token row (speculative verification) crossing blocks, padding
    rows, freed ranges before and after the tokens' blocks."""
    from uniprefill.ops.triton_stage_fill import fill_stages

    g = torch.Generator().manual_seed(3)
    n, padded, rows, cols, num_stages, slots_n = 5, 7, 8, 12, 3, 10
    qlen = torch.tensor([1, 1, 3, 1, 1])
    qsl = torch.zeros(n + 1, dtype=torch.int32)
    qsl[1:] = qlen.cumsum(0)
    tokens = int(qsl[-1]) + 4  # padding tokens get the pad slot
    seq_lens = torch.zeros(padded + 2, dtype=torch.int32)
    seq_lens[:n] = torch.tensor([30, 17, 40, 5, 44], dtype=torch.int32)
    dropped = torch.zeros((slots_n, num_stages + 1), dtype=torch.int32)
    idx = torch.tensor([6, 2, 9, 0, 4], dtype=torch.int32)
    dropped[idx.long()] = torch.tensor(
        [[0, 3, 9, 12], [0, 0, 0, 0], [0, 5, 17, 20], [0, 1, 1, 2], [0, 8, 8, 16]],
        dtype=torch.int32,
    )
    num_tables = num_stages if freeing else 1
    tables = torch.randint(0, 1000, (num_tables, rows, cols), generator=g, dtype=torch.int32)
    freed = None
    if freeing:  # [first, count] per request slot and stage table, in table blocks
        freed = torch.zeros((slots_n, 2, num_tables), dtype=torch.int32)
        freed[6, :, 0] = torch.tensor([2, 3])
        freed[9, :, :] = torch.tensor([[1, 2, 3], [4, 2, 1]])
        freed[4, :, 2] = torch.tensor([7, 2])
        jobs = torch.tensor([[0, 0, 1, 4], [1, 1, 2, 4], [2, 2, 0, 4]], dtype=torch.int32)
    else:  # two attention groups of different block sizes reading two tables
        tables = torch.cat([tables, tables.flip(1)])
        jobs = [[s, t, g, bs] for s in range(num_stages) for t, g, bs in ((0, 1, 4), (1, 2, 8))]
        jobs = torch.tensor(jobs, dtype=torch.int32)
    want = _stage_fill_reference(
        tables, freed, idx, dropped, seq_lens, qsl, jobs, n, padded, tokens
    )
    dev = {k: v.to(DEVICE) for k, v in dict(tables=tables, idx=idx, dropped=dropped,
           seq_lens=seq_lens, qsl=qsl, jobs=jobs).items()}  # fmt: skip
    seq = torch.full((num_stages, padded + 3), -9, dtype=torch.int32, device=DEVICE)
    slots = torch.full((num_stages, 3, tokens + 2), -5, dtype=torch.int64, device=DEVICE)
    remapped = torch.zeros((num_tables, rows + 1, cols), dtype=torch.int32, device=DEVICE)
    fill_stages(
        dev["tables"],
        freed.to(DEVICE) if freed is not None else None,
        dev["idx"],
        dev["dropped"],
        dev["seq_lens"],
        dev["qsl"],
        dev["jobs"],
        n,
        padded,
        tokens,
        seq,
        slots,
        remapped if freeing else None,
    )
    assert torch.equal(seq[:, :padded].cpu(), want[0])
    assert torch.equal(slots[:, :, :tokens].cpu(), want[1])
    assert (slots[:, :, tokens:] == -5).all()
    if freeing:  # the blocks each row's KV spans (attention reads no others)
        for r in range(padded):
            span = -(-int(seq_lens[r]) // 4)
            assert torch.equal(remapped[:, r, :span].cpu(), want[2][:, r, :span]), r
        assert not torch.equal(want[2], tables)  # the freed ranges moved something
