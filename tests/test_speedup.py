"""The H200 speed model: work shares, the fit against the raw results, predictions."""

from __future__ import annotations

from pathlib import Path

import pytest

from uniprefill.eval import speedup
from uniprefill.eval.speedup import FITS, fit, predict, work_shares

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "results"


def test_work_shares_by_hand() -> None:
    # 8 layers, drops at 1 and 4: layers 0-1 see all, 2-4 see 0.5, 5-7 see 0.25.
    w1, w2 = work_shares([0.5, 0.5], [1, 4], 8)
    assert w1 == pytest.approx((2 + 3 * 0.5 + 3 * 0.25) / 8)
    assert w2 == pytest.approx((2 + 3 * 0.25 + 3 * 0.0625) / 8)
    assert work_shares([1.0, 1.0], [1, 4], 8) == (1.0, 1.0)
    # A drop layer that scored nothing keeps what the one before left.
    assert work_shares([0.5, None], [1, 4], 8)[0] == pytest.approx((2 + 6 * 0.5) / 8)
    assert work_shares([], [], 8) == (1.0, 1.0)
    with pytest.raises(ValueError):
        work_shares([0.5], [1, 2], 8)
    with pytest.raises(ValueError):
        work_shares([0.5], [9], 8)


def test_work_share_matches_the_benchmark_tables() -> None:
    # docs/benchmarks.md, Llama 128K keep0.5: kept per layer 0.50 0.50 0.50 0.51 0.52 0.53,
    # work share 0.37 (32 layers, drops at 7, 11, ..., 27).
    w1, _ = work_shares([0.50, 0.50, 0.50, 0.51, 0.52, 0.53], [7, 11, 15, 19, 23, 27], 32)
    assert w1 == pytest.approx(0.37, abs=0.005)


@pytest.mark.skipif(not RESULTS.is_dir(), reason="needs the checkout's raw H200 results")
def test_fits_are_the_fit_of_the_raw_results() -> None:
    assert fit(RESULTS) == FITS


def test_fit_error_is_small_where_it_matters() -> None:
    for family, table in FITS.items():
        for length, p in table.items():
            limit = 0.08 if (family, length) == ("qwen3_next", 8192) else 0.03
            assert p.max_rel_err <= limit, (family, length, p)
            assert 0.0 < p.r_min < 1.0
            if p.compiled is not None:
                assert 0.6 < p.compiled < 1.2


def test_predict_reproduces_measured_points() -> None:
    # Llama-3.1-8B shape, 128K, keep0.5: measured 3.22x against eager, 3.22x compiled.
    p = predict("llama", 131072, [0.50, 0.50, 0.50, 0.51, 0.52, 0.53], [7, 11, 15, 19, 23, 27], 32)
    assert p.vs_eager == pytest.approx(3.22, rel=0.02)
    assert p.vs_compiled == pytest.approx(3.22, rel=0.02)
    assert p.notes == ()
    # Gemma-3-12B shape, 32K, keep0.3 (kept 0.30 0.31 0.33 at 29, 35, 41 of 48):
    # 1.49x against eager, 1.11x against compiled vLLM.
    g = predict("gemma3", 32768, [0.30, 0.31, 0.33], [29, 35, 41], 48)
    assert g.vs_eager == pytest.approx(1.49, rel=0.05)
    assert g.vs_compiled == pytest.approx(1.11, rel=0.05)


def test_predict_limits_and_notes() -> None:
    layers, sched = 32, [7, 11, 15, 19, 23, 27]
    # Nothing dropped: dense speed (against eager).
    assert predict("llama", 32768, [1.0] * 6, sched, layers).vs_eager == 1.0
    # More kept, less speed; monotone over a top_p-like sweep.
    speeds = [predict("llama", 32768, [k] * 6, sched, layers).vs_eager for k in (0.3, 0.6, 0.9)]
    assert speeds == sorted(speeds, reverse=True)
    # Below the measured work shares: capped at the best measured speedup, and said so.
    deep = predict("llama", 32768, [0.1] * 6, sched, layers)
    assert deep.vs_eager == pytest.approx(1 / FITS["llama"][32768].r_min)
    assert any("capped" in n for n in deep.notes)
    # Outside 8K-128K: nearest length, and said so.
    short = predict("llama", 2048, [0.5] * 6, sched, layers)
    assert short.vs_eager == pytest.approx(
        predict("llama", 8192, [0.5] * 6, sched, layers).vs_eager
    )
    assert any("outside" in n for n in short.notes)
    # Gemma's compiled baseline was measured at 8K and 32K only.
    g = predict("gemma3", 131072, [0.5] * 3, [29, 35, 41], 48)
    assert any("compiled baseline" in n for n in g.notes)
    # Between measured lengths: between their predictions.
    lo, mid, hi = (
        predict("qwen3_next", n, [0.5] * 3, [3, 7, 11], 16).vs_eager for n in (32768, 45000, 65536)
    )
    assert min(lo, hi) <= mid <= max(lo, hi)
    with pytest.raises(KeyError):
        predict("mistral", 8192, [0.5], [3], 8)


def test_family_of() -> None:
    assert speedup.family_of(["Gemma3ForCausalLM"]) == "gemma3"
    assert speedup.family_of(["Qwen3NextForCausalLM"]) == "qwen3_next"
    # Dense full-attention families are predicted from the Llama shape's measurements.
    assert speedup.family_of(["MistralForCausalLM"]) == "llama"
    assert speedup.family_of(["Qwen2ForCausalLM"]) == "llama"
    assert speedup.family_of(["MixtralForCausalLM"]) is None  # no MoE shape measured
    assert speedup.family_of(["GPT2LMHeadModel"]) is None
    assert "| llama | 128K |" in speedup.fit_table()
