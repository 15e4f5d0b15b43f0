"""Reference selection operator against a brute-force, loop-based float64 spec."""

from __future__ import annotations

import math

import pytest
import torch

from uniprefill.ops import Selection, select_from_block_scores, select_tokens
from uniprefill.ops.reference import block_offsets, block_scores_reference


def make_batch(
    lens: list[int], hq: int, hkv: int, d: int, seed: int, sharp: float = 3.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random packed q/k; ``sharp`` scales q so attention is peaked and blocks get dropped."""
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    q = torch.randn(t, hq, d, generator=g) * sharp
    k = torch.randn(t, hkv, d, generator=g)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, cu


# ---------------------------------------------------------------------------
# brute force (explicit loops, float64)
# ---------------------------------------------------------------------------


def brute_block_scores(q, k, cu, block_size, last_q, scale) -> list[list[float]]:
    """Per request, per block: float64 attention mass from the last queries, all heads."""
    hq, hkv = q.shape[1], k.shape[1]
    group = hq // hkv
    out = []
    bounds = cu.tolist()
    for b in range(len(bounds) - 1):
        s, e = bounds[b], bounds[b + 1]
        n = e - s
        tok = [0.0] * n
        for h in range(hq):
            kh = k[s:e, h // group].double()
            for i in range(max(n - last_q, 0), n):
                logits = (kh[: i + 1] @ q[s + i, h].double()) * scale
                p = torch.softmax(logits, dim=0)
                for j in range(i + 1):
                    tok[j] += float(p[j])
        nb = math.ceil(n / block_size)
        out.append([sum(tok[j * block_size : (j + 1) * block_size]) for j in range(nb)])
    return out


def brute_keep(
    blocks: list[list[float]],
    lens: list[int],
    *,
    top_p: float,
    block_size: int,
    last_q: int,
    sink: int,
    allow_drop: list[bool] | None = None,
    keep_ratio: float | None = None,
) -> list[bool]:
    keep: list[bool] = []
    for b, n in enumerate(lens):
        droppable = n > sink + last_q and (allow_drop is None or allow_drop[b])
        if not droppable or (top_p >= 1.0 and keep_ratio is None):
            keep += [True] * n
            continue
        sc = blocks[b]
        total = sum(sc)
        order = sorted(range(len(sc)), key=lambda j: (-sc[j], j))
        kept_blocks = set()
        if keep_ratio is not None:
            kept_blocks = set(order[: math.ceil(keep_ratio * len(sc))])
        else:
            before = 0.0
            for j in order:
                if before <= top_p:
                    kept_blocks.add(j)
                before += sc[j] / total
        for p in range(n):
            keep.append(p // block_size in kept_blocks or p < sink or p >= n - last_q)
    return keep


def flat(blocks: list[list[float]], cu: torch.Tensor, block_size: int) -> torch.Tensor:
    """Brute-force block scores in the operator's flat layout."""
    nslots = cu[-1].item() // block_size + cu.numel() - 1
    out = torch.zeros(nslots, dtype=torch.float64)
    off = block_offsets(cu, block_size).tolist()
    for b, sc in enumerate(blocks):
        out[off[b] : off[b] + len(sc)] = torch.tensor(sc, dtype=torch.float64)
    return out


def check_consistent(sel: Selection, cu: torch.Tensor) -> None:
    keep = sel.keep
    assert keep.dtype == torch.bool and keep.shape == (int(cu[-1]),)
    assert sel.new_lens.dtype == torch.int32 and sel.new_cu_seqlens.dtype == torch.int32
    assert sel.gather_idx.dtype == torch.int64
    assert sel.num_kept == int(keep.sum())
    assert torch.equal(sel.gather_idx, torch.nonzero(keep).flatten())
    bounds = cu.tolist()
    lens = [int(keep[bounds[b] : bounds[b + 1]].sum()) for b in range(len(bounds) - 1)]
    assert sel.new_lens.tolist() == lens
    assert sel.new_cu_seqlens.tolist() == [0, *torch.tensor(lens).cumsum(0).tolist()]
    if sel.new_cu_seqlens_cpu is not None:  # the host copy made by the one sync
        assert sel.new_cu_seqlens_cpu.device.type == "cpu"
        assert sel.new_cu_seqlens_cpu.tolist() == sel.new_cu_seqlens.tolist()


SHAPES = [
    # lens, hq, hkv, d, block_size, last_q, sink
    ([70], 2, 2, 8, 8, 4, 4),
    ([1, 90, 1, 33, 5], 4, 1, 16, 8, 8, 4),  # mixed prefill/decode, GQA 4
    ([100, 57, 12], 8, 1, 8, 16, 6, 3),  # GQA 8, lengths not block multiples
    ([64, 129], 8, 2, 16, 4, 5, 7),
    ([8, 9, 200], 4, 4, 32, 32, 8, 0),  # short rows (<= sink+last_q), sink 0
    ([150], 4, 2, 8, 1, 3, 2),  # block size 1
]


@pytest.mark.parametrize("case", range(len(SHAPES)))
@pytest.mark.parametrize("top_p", [0.5, 0.9])
def test_reference_matches_brute_force(case: int, top_p: float) -> None:
    lens, hq, hkv, d, bs, lq, sink = SHAPES[case]
    q, k, cu = make_batch(lens, hq, hkv, d, seed=case)
    scale = 1.0 / math.sqrt(d)
    brute = brute_block_scores(q, k, cu, bs, lq, scale)
    sel = select_tokens(
        q, k, cu, top_p=top_p, block_size=bs, last_q=lq, sink=sink, impl="reference"
    )
    check_consistent(sel, cu)
    # Scores: droppable rows are scored, others are zero.
    ref = flat(brute, cu, bs)
    off = block_offsets(cu, bs).tolist()
    for b, n in enumerate(lens):
        if n <= sink + lq:
            ref[off[b] : off[b + 1]] = 0
    torch.testing.assert_close(sel.block_scores.double(), ref, rtol=1e-5, atol=1e-5)
    # Mask: the loop-based selection on the operator's own scores must agree exactly ...
    own = [sel.block_scores[off[b] : off[b + 1]].double().tolist() for b in range(len(lens))]
    kw = dict(top_p=top_p, block_size=bs, last_q=lq, sink=sink)
    assert sel.keep.tolist() == brute_keep(own, lens, **kw)
    # ... and on these (tie-free) random inputs so must the float64 brute force.
    assert sel.keep.tolist() == brute_keep(brute, lens, **kw)


def test_dropping_happens_in_small_tests() -> None:
    lens, hq, hkv, d, bs, lq, sink = SHAPES[1]
    q, k, cu = make_batch(lens, hq, hkv, d, seed=1)
    sel = select_tokens(q, k, cu, top_p=0.5, block_size=bs, last_q=lq, sink=sink)
    assert sel.num_kept < int(cu[-1])


def test_row_top_p_equals_each_request_alone() -> None:
    # Per-request top_p (issue 26): each row of one batch selects as it would alone with
    # its own top_p; a row at 1.0 keeps everything, exactly.
    lens, row_top_p = [300, 1, 140, 200, 77], [0.5, 0.9, 1.0, 0.95, 0.3]
    q, k, cu = make_batch(lens, 4, 2, 8, seed=5, sharp=3.0)
    kw = dict(block_size=8, last_q=4, sink=4, impl="reference")
    rows = torch.tensor(row_top_p, dtype=torch.float64)
    sel = select_tokens(q, k, cu, top_p=1.0, row_top_p=rows, **kw)
    check_consistent(sel, cu)
    bounds = cu.tolist()
    for b, p in enumerate(row_top_p):
        a, e = bounds[b], bounds[b + 1]
        alone = select_tokens(q[a:e], k[a:e], torch.tensor([0, e - a]), top_p=p, **kw)
        assert sel.keep[a:e].tolist() == alone.keep.tolist(), (b, p)
    assert bool(sel.keep[bounds[2] : bounds[3]].all())  # the row at 1.0
    assert sel.num_kept < sum(lens)
    with pytest.raises(ValueError, match="row_top_p and keep_ratio cannot be combined"):
        select_tokens(q, k, cu, row_top_p=rows, keep_ratio=0.5, **kw)
    with pytest.raises(ValueError, match=r"row_top_p must be None or a float64 tensor \[5\]"):
        select_tokens(q, k, cu, row_top_p=rows.float(), **kw)


def test_top_p_one_keeps_everything() -> None:
    q, k, cu = make_batch([300, 1, 77], 4, 2, 8, seed=3, sharp=10.0)
    sel = select_tokens(q, k, cu, top_p=1.0, block_size=8, last_q=4, sink=4)
    assert bool(sel.keep.all()) and sel.num_kept == 378 and sel.block_scores is None
    check_consistent(sel, cu)
    # Just below 1 with very peaked attention still drops (the special case matters).
    sel = select_tokens(q, k, cu, top_p=0.5, block_size=8, last_q=4, sink=4)
    assert sel.num_kept < 378


@pytest.mark.parametrize("seed", range(3))
def test_sinks_and_last_queries_always_kept(seed: int) -> None:
    lens = [200, 3, 150]
    sink, lq = 10, 7
    q, k, cu = make_batch(lens, 4, 2, 8, seed=seed, sharp=10.0)
    sel = select_tokens(q, k, cu, top_p=0.1, block_size=8, last_q=lq, sink=sink)
    check_consistent(sel, cu)
    bounds = cu.tolist()
    for b, n in enumerate(lens):
        row = sel.keep[bounds[b] : bounds[b + 1]]
        assert bool(row[: min(sink, n)].all()) and bool(row[max(n - lq, 0) :].all())
        if n > sink + lq:
            assert not bool(row.all())  # top_p=0.1 on peaked attention drops something


def test_allow_drop_false_rows_kept_whole() -> None:
    lens = [200, 150, 1]
    q, k, cu = make_batch(lens, 4, 2, 8, seed=5, sharp=10.0)
    allow = torch.tensor([False, True, True])
    sel = select_tokens(q, k, cu, top_p=0.2, block_size=8, last_q=4, sink=4, allow_drop=allow)
    check_consistent(sel, cu)
    assert bool(sel.keep[:200].all())
    assert not bool(sel.keep[200:350].all())
    assert sel.new_lens[0].item() == 200 and sel.new_lens[2].item() == 1


@pytest.mark.parametrize("ratio", [0.05, 0.3, 0.5, 1.0])
def test_keep_ratio_count(ratio: float) -> None:
    lens = [200, 131, 1, 20]
    bs, lq, sink = 8, 4, 4
    q, k, cu = make_batch(lens, 4, 2, 8, seed=6)
    sel = select_tokens(q, k, cu, top_p=0.9, block_size=bs, last_q=lq, sink=sink, keep_ratio=ratio)
    check_consistent(sel, cu)
    off = block_offsets(cu, bs).tolist()
    own = [sel.block_scores[off[b] : off[b + 1]].double().tolist() for b in range(len(lens))]
    assert sel.keep.tolist() == brute_keep(
        own, lens, top_p=0.9, block_size=bs, last_q=lq, sink=sink, keep_ratio=ratio
    )
    # Block-level count: exactly ceil(ratio * nb) score-selected blocks per droppable row.
    blk = select_from_block_scores(
        sel.block_scores,
        cu,
        num_tokens=int(cu[-1]),
        top_p=0.9,
        block_size=bs,
        last_q=0,
        sink=0,
        keep_ratio=ratio,
    )
    bounds = cu.tolist()
    for b, n in enumerate(lens[:2]):
        nb = math.ceil(n / bs)
        row = blk.keep[bounds[b] : bounds[b + 1]]
        kept_blocks = sum(bool(row[j * bs : (j + 1) * bs].any()) for j in range(nb))
        assert kept_blocks == math.ceil(ratio * nb)


def test_deterministic_and_tie_order() -> None:
    q, k, cu = make_batch([300, 200], 4, 2, 8, seed=7)
    a = select_tokens(q, k, cu, top_p=0.7, block_size=8, last_q=4, sink=4)
    b = select_tokens(q, k, cu, top_p=0.7, block_size=8, last_q=4, sink=4)
    assert torch.equal(a.keep, b.keep) and torch.equal(a.block_scores, b.block_scores)
    # All-equal scores: the lower block indices win the ties.
    cu2 = torch.tensor([0, 80], dtype=torch.int32)
    scores = torch.ones(80 // 8 + 1)
    scores[-1] = 0  # tail slot
    sel = select_from_block_scores(
        scores, cu2, num_tokens=80, top_p=0.25, block_size=8, last_q=0, sink=0
    )
    # before-mass 0, .1, .2 <= .25 -> first three blocks kept.
    assert sel.keep.tolist() == [True] * 24 + [False] * 56


@pytest.mark.parametrize("top_p", [0.3, 0.8, 0.95])
def test_kept_mass_at_least_top_p(top_p: float) -> None:
    lens = [400, 250]
    bs = 8
    q, k, cu = make_batch(lens, 4, 2, 8, seed=8)
    scores, off = block_scores_reference(q, k, cu, block_size=bs, last_q=6, scale=0.35)
    sel = select_from_block_scores(
        scores, cu, num_tokens=650, top_p=top_p, block_size=bs, last_q=0, sink=0
    )
    bounds, off = cu.tolist(), off.tolist()
    for b in range(len(lens)):
        sc = scores[off[b] : off[b + 1]].double()
        row = sel.keep[bounds[b] : bounds[b + 1]]
        kept = torch.tensor([bool(row[j * bs]) for j in range(len(sc))])
        assert float(sc[kept].sum() / sc.sum()) >= top_p - 1e-9
        # Minimal: dropping the lowest kept block would fall below top_p.
        assert float((sc[kept].sum() - sc[kept].min()) / sc.sum()) < top_p + 1e-9


def test_empty_and_all_decode_batches() -> None:
    q, k, cu = make_batch([1, 1, 1], 4, 2, 8, seed=9)
    sel = select_tokens(q, k, cu, top_p=0.5, block_size=8, last_q=4, sink=4)
    assert sel.num_kept == 3 and sel.gather_idx.tolist() == [0, 1, 2]
    q0, k0 = torch.zeros(0, 4, 8), torch.zeros(0, 2, 8)
    sel = select_tokens(q0, k0, torch.zeros(1, dtype=torch.int32), top_p=0.5)
    assert sel.num_kept == 0 and sel.gather_idx.numel() == 0


def test_int64_cu_seqlens_and_bf16() -> None:
    q, k, cu = make_batch([120, 60], 4, 2, 8, seed=10)
    a = select_tokens(q, k, cu, top_p=0.6, block_size=8, last_q=4, sink=4)
    b = select_tokens(q, k, cu.long(), top_p=0.6, block_size=8, last_q=4, sink=4)
    assert torch.equal(a.keep, b.keep)
    c = select_tokens(q.bfloat16(), k.bfloat16(), cu, top_p=0.6, block_size=8, last_q=4, sink=4)
    check_consistent(c, cu)


# ---------------------------------------------------------------------------
# argument validation
# ---------------------------------------------------------------------------

_Q, _K, _CU = make_batch([20, 30], 4, 2, 8, seed=0)

BAD = [
    ("top_p", dict(top_p=0.0)),
    ("top_p", dict(top_p=1.5)),
    ("top_p", dict(top_p=-0.1)),
    ("block_size", dict(block_size=48)),
    ("block_size", dict(block_size=0)),
    ("last_q", dict(last_q=-1)),
    ("sink", dict(sink=-3)),
    ("keep_ratio", dict(keep_ratio=0.0)),
    ("keep_ratio", dict(keep_ratio=1.2)),
    ("scale", dict(scale=-1.0)),
    ("impl", dict(impl="cuda")),
    ("q", dict(q=_Q[:, :, 0])),
    ("k", dict(k=_K.double())),
    ("k", dict(k=_K[:10])),
    ("k", dict(k=_K[:, :, :4])),
    ("q heads", dict(k=torch.randn(50, 3, 8))),
    ("cu_seqlens", dict(cu_seqlens=_CU.float())),
    ("cu_seqlens", dict(cu_seqlens=_CU[None])),
    ("cu_seqlens", dict(cu_seqlens=torch.tensor([0, 20, 40], dtype=torch.int32))),
    ("cu_seqlens", dict(cu_seqlens=torch.tensor([0, 30, 20, 50], dtype=torch.int32))),
    ("allow_drop", dict(allow_drop=torch.tensor([True]))),
    ("allow_drop", dict(allow_drop=torch.tensor([1, 0]))),
]


@pytest.mark.parametrize(
    ("name", "override"), BAD, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD)]
)
def test_invalid_arguments(name: str, override: dict) -> None:
    args = dict(q=_Q, k=_K, cu_seqlens=_CU)
    for key in ("q", "k", "cu_seqlens"):
        if key in override:
            args[key] = override.pop(key)
    with pytest.raises(ValueError, match=name):
        select_tokens(
            args["q"],
            args["k"],
            args["cu_seqlens"],
            **{**dict(top_p=0.9, impl="reference"), **override},
        )
