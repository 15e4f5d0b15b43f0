"""The wheel carries the CPU guard at the top of site-packages, and the entry points."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_contents(tmp_path: Path) -> None:
    # Build from a copy: setuptools leaves build/ and *.egg-info behind in the source tree.
    src = tmp_path / "src-copy"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(
        ROOT / "src", src / "src", ignore=shutil.ignore_patterns("*.egg-info", "__pycache__")
    )
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    done = subprocess.run(
        [*cmd, "-w", str(tmp_path), str(src)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = tmp_path.glob("uniprefill-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "uniprefill-cpu-guard.pth" in names and "_uniprefill_cpu_guard.py" in names
    assert "uniprefill/serve.py" in names and "uniprefill/eval/speedup.py" in names
    pth = zipfile.ZipFile(wheel).read("uniprefill-cpu-guard.pth").decode()
    assert pth.strip() == "import _uniprefill_cpu_guard"
    meta = next(n for n in names if n.endswith("entry_points.txt"))
    entry = zipfile.ZipFile(wheel).read(meta).decode()
    assert "uniprefill = uniprefill.vllm.plugin:register" in entry
    assert "uniprefill = uniprefill.vllm.metrics:UniPrefillStatLogger" in entry  # /metrics
    assert "uniprefill = uniprefill.cli:main" in entry
