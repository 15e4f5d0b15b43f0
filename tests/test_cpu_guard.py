"""The CPU guard that hides PyPI's CUDA-built torchvision beside torch's CPU build."""

from __future__ import annotations

import subprocess
import sys

from _uniprefill_cpu_guard import broken_packages

CPU_TORCH = "torch-2.13.0+cpu.dist-info"


def test_hides_pypi_builds_beside_cpu_torch() -> None:
    names = [
        CPU_TORCH,
        "torchvision-0.28.0.dist-info",
        "torchaudio-2.11.1.dist-info",
        "torchcodec-0.17.0.dist-info",
        "torchvision",
        "numpy-2.3.5.dist-info",
    ]
    assert broken_packages(names, "x86_64", "linux") == ["torchvision", "torchaudio", "torchcodec"]


def test_leaves_everything_else_alone() -> None:
    # CPU builds from the PyTorch index.
    ok = [CPU_TORCH, "torchvision-0.28.0+cpu.dist-info", "torchaudio-2.13.0+cpu.dist-info"]
    assert broken_packages(ok, "x86_64", "linux") == []
    # A CUDA torch (the GPU install): nothing to hide.
    cuda = ["torch-2.11.0+cu130.dist-info", "torchvision-0.26.0.dist-info"]
    assert broken_packages(cuda, "x86_64", "linux") == []
    assert (
        broken_packages(
            ["torch-2.13.0.dist-info", "torchvision-0.28.0.dist-info"], "x86_64", "linux"
        )
        == []
    )
    # Not checked on other machines: left alone.
    pair = [CPU_TORCH, "torchvision-0.28.0.dist-info"]
    assert broken_packages(pair, "aarch64", "linux") == []
    assert broken_packages(pair, "x86_64", "darwin") == []
    # Not installed: nothing to hide ("torchvision-extra" is another project).
    assert broken_packages([CPU_TORCH, "torchvision_extra-1.0.dist-info"], "x86_64", "linux") == []


def test_this_environment_imports_transformers_and_vllm() -> None:
    # What the guard is for: the install the README gives can import vLLM's LLM class.
    code = "import transformers; from transformers import LlamaConfig; from vllm import LLM"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
