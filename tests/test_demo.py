"""The README's main command, `uniprefill demo`, end to end on the tiny Llama."""

from __future__ import annotations

import pytest

from uniprefill.cli import main
from uniprefill.demo import COLUMNS, format_demo_table


def _table(out: str) -> tuple[list[str], list[list[str]], list[str]]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("tiny llama:"))
    head = [c.strip() for c in lines[start + 1].split("|")]
    rows = []
    i = start + 3
    while i < len(lines) and lines[i].strip():
        rows.append([c.strip() for c in lines[i].split("|")])
        i += 1
    return head, rows, lines[i + 1 :]


def test_demo_runs_and_drops_on_the_longest_prompt(capfd: pytest.CaptureFixture[str]) -> None:
    assert main(["demo"]) == 0
    head, rows, legend = _table(capfd.readouterr().out)
    assert head == list(COLUMNS)
    assert len(rows) == 3
    assert [int(r[0]) for r in rows] == sorted(int(r[0]) for r in rows)
    kept = [float(r[1]) for r in rows]
    assert all(0.0 < k <= 1.0 for k in kept)
    # The demo's point: the longest prompt loses tokens with the demo's top_p.
    assert kept[-1] < 1.0
    # Token cells carry the id and its text; where nothing was dropped the run is the
    # dense computation: same first token.
    for r, k in zip(rows, kept, strict=True):
        assert r[2].split()[0].isdigit() and "'" in r[2]
        if k == 1.0:
            assert r[2] == r[3]
    for r in rows:
        assert r[6].endswith("x") and float(r[6][:-1]) > 0
    text = " ".join(legend)
    assert "kept share:" in text and "speedup = dense s / uniprefill s" in text
    assert "Why it is slower here" in text and "uniprefill calibrate" in text


def test_demo_table_explains_itself() -> None:
    row = {
        "prompt_tokens": 1532,
        "kept_share": 0.84,
        "first_token_dense": 901,
        "first_token_uniprefill": 17,
        "first_text_dense": " the",
        "first_text_uniprefill": " sky",
        "dense_s": 0.20,
        "uniprefill_s": 0.25,
    }
    text = format_demo_table([row], "llama", {"top_p": 0.9}, {"layers": 6, "drop_layers": [1]})
    head, rows, legend = _table(text)
    assert rows == [["1532", "0.84", "901 ' the'", "17 ' sky'", "0.20", "0.25", "0.80x"]]
    assert "6 layers" in text and "drop layers [1]" in text and "{'top_p': 0.9}" in text
    assert all(len(line) <= 100 for line in legend)
