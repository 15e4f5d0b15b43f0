"""The README's main command, `uniprefill demo`, end to end on the tiny Llama."""

from __future__ import annotations

import pytest

from uniprefill.cli import main


def test_demo_runs_and_drops_on_the_longest_prompt(capfd: pytest.CaptureFixture[str]) -> None:
    assert main(["demo"]) == 0
    out = capfd.readouterr().out
    lines = out.splitlines()
    start = lines.index("tiny llama")
    rows = [[c.strip() for c in line.split("|")] for line in lines[start + 3 : start + 6]]
    assert [int(r[0]) for r in rows] == sorted(int(r[0]) for r in rows)
    kept = [float(r[1]) for r in rows]
    assert all(0.0 < k <= 1.0 for k in kept)
    # The demo's point: the longest prompt loses tokens with the demo's top_p.
    assert kept[-1] < 1.0
    # Where nothing was dropped the run is the dense computation: same first token.
    for r, k in zip(rows, kept, strict=True):
        if k == 1.0:
            assert r[2] == r[3]
