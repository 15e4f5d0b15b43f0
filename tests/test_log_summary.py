"""UniPrefill's INFO summary (``DropStats.log_summary``): at most once per vLLM's stats
interval, only when something changed, with the counters of that interval (issue 26: the
per-request line is DEBUG)."""

from __future__ import annotations

import logging

import pytest

from uniprefill.vllm.records import DropStats


def test_summary_once_per_interval_with_the_intervals_counts(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "10")
    s = DropStats(drop_layers=(1, 3))
    assert s.log_summary(now=0.0) is None  # starts the first interval
    s.add(0, 1000, 900)
    s.add(1, 900, 450)
    s.dropped_prefills += 1
    s.prepared_steps += 4
    s.host_prepare_s += 0.004
    assert s.log_summary(now=5.0) is None  # inside the interval
    with caplog.at_level(logging.INFO, logger="vllm.uniprefill"):
        line = s.log_summary(now=10.0)
    assert line == (
        "uniprefill: last 10.0 s: dropped_prefills=1 kept_share=[0.900, 0.450] "
        "chunked_prefills=0 stash_full=0 restarted=0 steps=4 host_ms_per_step=1.00"
    )
    assert [r.getMessage() for r in caplog.records] == [line]
    # Quiet interval: nothing, even with steps.
    s.prepared_steps += 100
    assert s.log_summary(now=25.0) is None
    # Only the new interval's counts, and "-" where a layer scored nothing.
    s.stash_full += 1
    line = s.log_summary(now=40.0)
    assert line is not None and "dropped_prefills=0 kept_share=[-, -]" in line
    assert "stash_full=1" in line and "steps=0" in line


def test_summary_state_is_not_a_counter() -> None:
    s = DropStats(drop_layers=(1,))
    s.log_summary(now=0.0)
    assert "summary_at" not in s.as_dict() and s == DropStats(drop_layers=(1,))
