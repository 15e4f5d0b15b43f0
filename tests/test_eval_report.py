"""``uniprefill report``: paired dense-vs-UniPrefill summaries of eval JSON files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from uniprefill.cli import main
from uniprefill.eval.report import bootstrap_ci, format_summary, load_samples, summarize


def _write(
    path: Path,
    rows: list[tuple[str, int, float, float]],
    dense_only: bool = False,
    config: dict | None = None,
) -> Path:
    samples = [
        {
            "task": task,
            "target_len": length,
            "dense_score": d,
            "uniprefill_score": u,
            "dense_output": f"out {d}",
            "uniprefill_output": f"out {u}",
            "dense_first_token": 7,
            "uniprefill_first_token": 7 if d == u else 8,
            "uniprefill_kept_share": 0.8,
        }
        for task, length, d, u in rows
    ]
    doc = {"model": "models/m1", "dense": {}, "samples": samples}
    if config is not None:
        doc["uniprefill_config"] = config
    if not dense_only:
        doc["uniprefill"] = {}
    path.write_text(json.dumps(doc))
    return path


def test_paired_summary(tmp_path: Path) -> None:
    f = _write(
        tmp_path / "a.json",
        [
            ("niah", 4096, 1.0, 1.0),
            ("niah", 4096, 0.0, 1.0),
            ("vt", 4096, 1.0, 0.5),
            ("niah", 8192, 0.5, 0.5),
        ],
    )
    samples = load_samples([f])
    assert len(samples) == 4 and samples[0].model == "m1"
    rows = summarize(samples, ("model", "length"))
    assert [r.key for r in rows] == [("m1", 4096), ("m1", 8192)]
    r = rows[0]
    assert r.n == 3 and r.better == 1 and r.worse == 1
    assert r.dense == pytest.approx(200 / 3) and r.uniprefill == pytest.approx(250 / 3)
    assert r.diff == pytest.approx(50 / 3)
    assert r.ci_low <= r.diff <= r.ci_high
    assert r.same_output == pytest.approx(1 / 3) and r.kept_share == pytest.approx(0.8)
    assert rows[1].diff == 0 and (rows[1].ci_low, rows[1].ci_high) == (0.0, 0.0)
    table = format_summary(rows, ("model", "length"))
    assert "| m1 | 4096 | 3 |" in table and "1 / 1" in table


def test_bootstrap_is_deterministic_and_brackets_the_mean() -> None:
    diffs = [0.0] * 40 + [100.0] * 10
    lo, hi = bootstrap_ci(diffs)
    assert (lo, hi) == bootstrap_ci(diffs)
    assert 0 < lo < 20 < hi < 40


def test_dense_only_file_is_refused(tmp_path: Path) -> None:
    f = _write(tmp_path / "d.json", [("niah", 4096, 1.0, 1.0)], dense_only=True)
    with pytest.raises(ValueError, match="dense and a UniPrefill run"):
        load_samples([f])


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = _write(tmp_path / "a.json", [("niah", 4096, 0.0, 1.0), ("vt", 4096, 1.0, 1.0)])
    assert main(["report", str(f), "--by", "task"]) == 0
    out = capsys.readouterr().out
    assert "| niah | 1 |" in out and "| m1 | 2 |" in out
    with pytest.raises(SystemExit, match="--by takes"):
        main(["report", str(f), "--by", "prompt"])


def test_runs_with_different_configs_stay_apart(tmp_path: Path) -> None:
    a = _write(tmp_path / "a.json", [("niah", 4096, 1.0, 0.0)], config={"top_p": 0.99})
    b = _write(
        tmp_path / "b.json",
        [("niah", 4096, 1.0, 1.0)],
        config={"top_p": 0.99, "drop_layers": [14, 22]},
    )
    c = _write(tmp_path / "c.json", [("niah", 4096, 1.0, 1.0)])
    rows = summarize(load_samples([a, b, c]), ("model", "config"))
    assert [r.key[1] for r in rows] == ["defaults", "drop_layers=14,22 top_p=0.99", "top_p=0.99"]
    assert [r.diff for r in rows] == [0.0, 0.0, -100.0]


def test_cli_overall_table_splits_configs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = _write(tmp_path / "a.json", [("niah", 4096, 1.0, 0.0)], config={"top_p": 0.99})
    b = _write(tmp_path / "b.json", [("niah", 4096, 1.0, 1.0)], config={"top_p": 0.999})
    assert main(["report", str(a), str(b), "--by", "task"]) == 0
    out = capsys.readouterr().out
    assert "| m1 | top_p=0.99 | 1 |" in out and "| m1 | top_p=0.999 | 1 |" in out
