"""`uniprefill calibrate`: prompts, recommendation and output; end to end on the tiny Llama."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from uniprefill.cli import main
from uniprefill.eval.calibrate import (
    DEFAULT_TOP_PS,
    file_prompts,
    format_calibration,
    recommend,
    switch_config,
)


def _words(text: str) -> int:
    return len(text.split()) + 1


def test_file_prompts_jsonl_and_json(tmp_path: Path) -> None:
    jsonl = tmp_path / "p.jsonl"
    rows = [
        {"prompt": "a b c", "answers": ["c"], "max_tokens": 5, "task": "mine"},
        {"prompt": "d e", "answers": "e"},
        {"prompt": "f"},
    ]
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    ps = file_prompts(jsonl, _words, None)
    assert [p.answers for p in ps] == [("c",), ("e",), None]
    assert [p.max_tokens for p in ps] == [5, 32, 32]
    assert [p.n_tokens for p in ps] == [4, 3, 2]
    assert ps[0].task == "mine" and ps[1].task == "file"
    as_list = tmp_path / "p.json"
    as_list.write_text(json.dumps(rows))
    assert file_prompts(as_list, _words, 7)[2].max_tokens == 7
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "x"}))
    with pytest.raises(ValueError, match="prompt"):
        file_prompts(bad, _words, None)


def _config(top_p: float, diff: float, speed: float, *, low: float | None = None) -> dict:
    return {
        "top_p": top_p,
        "label": f"top_p={top_p:g}",
        "diff": diff,
        "ci_low": diff - 1 if low is None else low,
        "within_budget": diff >= -0.5,
        "dropped_prefills": 3,
        "work_share": 1 / speed,
        "predictions": [{"speedup_vs_eager": speed}],
    }


def test_recommend_takes_the_fastest_within_budget() -> None:
    configs = [
        _config(0.9, -3.0, 2.5),
        _config(0.99, -0.4, 1.8),
        _config(0.995, 0.0, 1.5),
        _config(0.999, 0.0, 1.2),
    ]
    assert recommend(configs, [131072]) == {"top_p": 0.99, "label": "top_p=0.99"}
    # Equal predicted speed: the higher top_p (keeps more).
    tie = [_config(0.99, 0.0, 1.0), _config(0.999, 0.0, 1.0)]
    assert recommend(tie, [131072])["top_p"] == 0.999
    # Nothing dropped anywhere, or nothing within budget: no recommendation.
    none = [{**_config(0.99, 0.0, 1.0), "dropped_prefills": 0}]
    assert recommend(none, [131072]) is None
    assert recommend([_config(0.9, -3.0, 2.5)], [131072]) is None


def test_switch_config_calls_the_plugins_named_rpc() -> None:
    calls = []

    class Engine:
        def collective_rpc(self, method, args=()):
            calls.append((method, args))
            return [{"config": args[0]}]

    assert switch_config(Engine(), {"top_p": 0.9}) is True
    assert calls == [("uniprefill_configure", ({"top_p": 0.9},))]


def test_calibrate_tiny_llama_end_to_end(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """The default grid on the built-in tiny Llama, as a user would run it."""
    out_json, out_png = tmp_path / "cal.json", tmp_path / "cal.png"
    assert main(["calibrate", "llama", "--json", str(out_json), "--plot", str(out_png)]) == 0
    captured = capfd.readouterr()
    result = json.loads(out_json.read_text())

    assert [c["top_p"] for c in result["configs"]] == list(DEFAULT_TOP_PS)
    assert result["complete"]  # written after every pass too, incomplete until the last
    assert result["family"] == "llama" and result["num_layers"] == 6
    assert result["prompts"]["count"] == 5  # one 1K prompt per task
    for c in result["configs"]:
        assert c["drop_layers"] == [1, 2, 3, 4]
        assert len(c["kept_per_layer"]) == 4
        assert all(k is None or 0.0 < k <= 1.0 for k in c["kept_per_layer"])
        assert c["ci_low"] <= c["diff"] <= c["ci_high"]
        assert 0.0 < c["work_share"] <= 1.0
        assert [p["length"] for p in c["predictions"]] == [8192, 32768, 131072]
        # Measured here, from each request's metrics: dense's summed TTFT over this one's.
        assert c["ttft_s"] > 0 and c["ttft_speedup"] == result["dense"]["ttft_s"] / c["ttft_s"]
        for p in c["predictions"]:
            assert p["speedup_vs_eager"] > 0 and "H200" in p["source"]
    # A lower top_p never keeps more (same prompts, same engine).
    works = [c["work_share"] for c in result["configs"]]
    assert all(a <= b + 0.02 for a, b in zip(works, works[1:], strict=False))
    assert result["configs"][0]["dropped_prefills"] > 0
    # Random weights score 0 dense: every setting is "within budget", and the output says
    # that this proves nothing.
    assert result["recommended"] is not None
    assert any("cannot do these tasks" in w for w in result["warnings"])
    assert len(result["samples"]) == 5 and "top_p=0.9" in result["samples"][0]["runs"]

    out = captured.out
    assert "| top_p | score | diff vs dense [95% CI]" in out
    assert "H200 TTFT speedup vs vLLM at 8K / 32K / 128K" in out
    assert "| TTFT here vs dense |" in out and "measured, not predicted" in out
    assert "recommended: top_p" in out and "serve it with: uniprefill serve" in out
    assert "schedule: the family default only; --schedule auto" in out
    assert format_calibration(result) in out
    # Progress on stderr; the plot, or a clear message where matplotlib is missing.
    assert "[7/7] top_p=0.999" in captured.err
    if importlib.util.find_spec("matplotlib"):
        assert out_png.stat().st_size > 0
    else:
        assert not out_png.exists()
        assert "matplotlib is not installed" in captured.err


def _full(top_p: float, diff: float, kept: float, dropped: int) -> dict:
    pred = {"length": 131072, "speedup_vs_eager": 1 / kept, "speedup_vs_compiled": 1 / kept}
    return {
        **_config(top_p, diff, 1 / kept),
        "score": 40.0 + diff,
        "ci_high": diff + 1,
        "worse": 1,
        "better": 0,
        "same_output": 0.5,
        "kept_per_layer": [kept, None],
        "final_kept_share": kept,
        "dropped_prefills": dropped,
        "predictions": [{**pred, "notes": ["length outside the measured 8K-128K"]}],
    }


def _result(configs: list[dict]) -> dict:
    return {
        "model": "m",
        "model_path": "/models/m",
        "architectures": ["LlamaForCausalLM"],
        "num_layers": 30,
        "family": "llama",
        "shape": "Llama-3.1-8B shape",
        "predict_lengths": [131072],
        "prompts": {"count": 20, "source": "ruler-style suite", "lengths": [4096]},
        "dense": {"score": 40.0},
        "budget": 0.5,
        "criterion": "mean",
        "configs": configs,
        "recommended": recommend(configs, [131072]),
        "uniprefill_config": {"drop_layers": [14, 22]},
        "warnings": ["w1"],
    }


def test_format_calibration_says_what_to_run() -> None:
    text = format_calibration(_result([_full(0.99, -3.0, 0.2, 5), _full(0.999, -0.2, 0.6, 5)]))
    row = next(line for line in text.splitlines() if line.startswith("| 0.999"))
    assert "**recommended**" in row and "0.60 -" in row and "| yes |" in row
    assert "serve it with: uniprefill serve /models/m --top-p 0.999 --drop-layers 14,22" in text
    assert "Prediction notes: length outside the measured 8K-128K." in text
    assert text.endswith("warning: w1")

    lossy = format_calibration(_result([_full(0.99, -3.0, 0.2, 5)]))
    assert "no setting that drops tokens stays within 0.5 points" in lossy
    assert "top_p above 0.99" in lossy
    idle = format_calibration(_result([_full(0.99, 0.0, 1.0, 0)]))
    assert "no setting dropped a token" in idle


def _scheduled(sched: list[int], top_p: float, diff: float, kept: float) -> dict:
    c = _full(top_p, diff, kept, 5)
    label = f"layers {','.join(map(str, sched))} top_p={top_p:g}"
    return {**c, "schedule": sched, "label": label, "drop_layers": sched}


def test_a_compared_schedule_is_named_in_the_recommendation() -> None:
    configs = [
        _scheduled([6, 12], 0.99, -3.0, 0.2),  # fastest but over budget
        _scheduled([6, 12], 0.999, -0.2, 0.6),
        _scheduled([4, 8], 0.999, 0.0, 0.5),  # within budget and faster: chosen
    ]
    result = {**_result(configs), "uniprefill_config": {}}
    assert result["recommended"] == {
        "top_p": 0.999,
        "label": "layers 4,8 top_p=0.999",
        "drop_layers": [4, 8],
    }
    text = format_calibration(result)
    assert "| setting | score |" in text
    row = next(line for line in text.splitlines() if "**recommended**" in line)
    assert row.startswith("| layers 4,8 top_p=0.999 **recommended** |")
    assert "recommended: top_p 0.999 at drop layers 4,8:" in text
    assert "serve it with: uniprefill serve /models/m --top-p 0.999 --drop-layers 4,8" in text


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--schedule", "1,3", "--drop-layers", "2"], "--schedule and --drop-layers"),
        (["--schedule", "1,3", "--schedule", "1,3"], "a schedule is given twice"),
        (["--schedule", ","], "an empty schedule"),
        (["--schedule", "3,1"], "drop_layers"),
        (["--schedule", "auto", "--schedule", "1,3"], "--schedule auto: give it alone"),
        (["--schedule", "auto", "--drop-layers", "2"], "--schedule and --drop-layers"),
    ],
)
def test_calibrate_refuses_bad_schedules_before_starting(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["calibrate", "llama", *argv])
    assert message in str(exc.value)


def test_schedule_auto_gives_the_familys_candidates(tiny_model) -> None:
    """``--schedule auto`` on a checkpoint: its family's default, then the earlier one."""
    from uniprefill.eval.calibrate import auto_schedules

    assert auto_schedules(tiny_model("gemma3")) == [(5,), (2,)]
    assert auto_schedules(tiny_model("llama")) == [(1, 2, 3, 4)]  # both rules agree


def test_calibrate_compares_schedules_on_the_tiny_llama(tmp_path: Path, capfd) -> None:
    """Two schedules, one engine each; the dense pass runs once."""
    out_json = tmp_path / "cal.json"
    argv = ["calibrate", "llama", "--top-p", "0.9,0.99", "--json", str(out_json)]
    assert main([*argv, "--schedule", "1,3", "--schedule", "2,4", "--no-progress"]) == 0
    captured = capfd.readouterr()
    result = json.loads(out_json.read_text())
    seen = [(c["schedule"], c["top_p"], c["drop_layers"]) for c in result["configs"]]
    assert seen == [
        ([1, 3], 0.9, [1, 3]),
        ([1, 3], 0.99, [1, 3]),
        ([2, 4], 0.9, [2, 4]),
        ([2, 4], 0.99, [2, 4]),
    ]
    assert all(c["dropped_prefills"] > 0 for c in result["configs"] if c["top_p"] == 0.9)
    assert result["recommended"]["drop_layers"] in ([1, 3], [2, 4])
    assert "[1/5] dense ..." in captured.err and "[5/5] layers 2,4 top_p=0.99" in captured.err
    assert "serve it with: uniprefill serve" in captured.out and "--drop-layers" in captured.out
    assert "--schedule auto also tries" not in captured.out  # they were compared
