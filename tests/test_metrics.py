"""The worker's counter file and the front end's stat logger, without a server
(tests/test_serve.py checks /metrics end to end)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from prometheus_client import REGISTRY  # noqa: E402

from uniprefill.vllm import metrics  # noqa: E402
from uniprefill.vllm.records import DropStats  # noqa: E402


def test_publish_writes_at_once_on_drops_else_at_most_once_a_second(tmp_path) -> None:
    stats = DropStats(drop_layers=(1, 3))
    assert not stats.publish(0.0)  # no path: nothing published
    stats.publish_path = str(tmp_path / "c.json")
    assert not stats.publish(0.0)  # no reader created the file: nothing written
    assert not (tmp_path / "c.json").exists()
    metrics.write_atomic(stats.publish_path, {})
    assert not stats.publish(0.5)  # looks for the reader's file at most once a second
    assert stats.publish(1.0)
    stats.prepared_steps += 1
    assert not stats.publish(1.5)  # only a step: waits for the interval
    stats.dropped_prefills += 1
    stats.add(0, 100, 60)
    assert stats.publish(1.6)  # a drop: at once
    assert not stats.publish(1.7)  # nothing changed
    stats.host_prepare_s += 0.01
    assert stats.publish(2.7)
    data = json.loads((tmp_path / "c.json").read_text())
    assert data["seen_tokens"] == [100, 0] and data["dropped_prefills"] == 1


def _config(instance_id: str, uniprefill: bool = True) -> SimpleNamespace:
    return SimpleNamespace(
        additional_config={"uniprefill": {}} if uniprefill else {},
        instance_id=instance_id,
        model_config=SimpleNamespace(served_model_name="m"),
    )


def test_stat_logger_moves_counters_by_the_difference(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(metrics, "stats_dir", lambda: str(tmp_path))
    log = metrics.UniPrefillStatLogger(_config("t0"), engine_index=0)
    log.record(None, None)  # only its own marker file yet: nothing
    assert log.counters is None
    stats = DropStats(drop_layers=(1, 3))
    stats.publish_path = metrics.stats_path("t0", 0)
    stats.dropped_prefills, stats.seen, stats.kept = 2, [200, 120], [120, 50]
    assert stats.publish(0.0)
    try:
        log.record(None, None)
        labels = {"model_name": "m", "engine": "0"}
        value = REGISTRY.get_sample_value
        assert value("vllm:uniprefill_dropped_prefills_total", labels) == 2
        assert value("vllm:uniprefill_kept_tokens_total", {**labels, "drop_layer": "3"}) == 50
        stats.dropped_prefills += 1
        stats.add(0, 10, 4)
        assert stats.publish(0.1)
        log.log()
        assert value("vllm:uniprefill_dropped_prefills_total", labels) == 3
        assert value("vllm:uniprefill_prompt_tokens_total", {**labels, "drop_layer": "1"}) == 210
    finally:
        for c in (log.counters or {}).values():
            REGISTRY.unregister(c)


def test_stat_logger_is_inert_without_uniprefill(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(metrics, "stats_dir", lambda: str(tmp_path))
    path = metrics.stats_path("t1", 0)
    log = metrics.UniPrefillStatLogger(_config("t1", uniprefill=False), engine_index=0)
    metrics.write_atomic(path, DropStats(drop_layers=(1,)).as_dict())
    log.record(None, None)
    assert log.counters is None


def test_worker_strips_the_ray_dp_suffix() -> None:
    config = SimpleNamespace(instance_id="abc_dp2", parallel_config=SimpleNamespace())
    config.parallel_config.data_parallel_rank = 2
    assert metrics.worker_stats_path(config) == metrics.stats_path("abc", 2)


def test_a_dense_dp_engine_publishes_under_its_index() -> None:
    # vLLM runs each dense DP engine as DP=1 (rank 0); the index keeps which it is.
    pc = SimpleNamespace(data_parallel_rank=0, data_parallel_index=1)
    config = SimpleNamespace(instance_id="abc", parallel_config=pc)
    assert metrics.worker_stats_path(config) == metrics.stats_path("abc", 1)


def test_engines_of_one_front_end_share_the_counters(monkeypatch, tmp_path) -> None:
    # Data parallelism: one logger per engine in the front end's process.
    monkeypatch.setattr(metrics, "stats_dir", lambda: str(tmp_path))
    logs = [metrics.UniPrefillStatLogger(_config("t2"), engine_index=i) for i in (0, 1)]
    try:
        for i, log in enumerate(logs):
            stats = DropStats(drop_layers=(1, 3))
            stats.publish_path = metrics.stats_path("t2", i)
            stats.dropped_prefills = i + 1
            assert stats.publish(0.0)
            log.record(None, None)
        assert logs[0].counters == logs[1].counters
        for i in (0, 1):
            labels = {"model_name": "m", "engine": str(i)}
            assert (
                REGISTRY.get_sample_value("vllm:uniprefill_dropped_prefills_total", labels) == i + 1
            )
    finally:
        for c in (logs[0].counters or {}).values():
            REGISTRY.unregister(c)
