"""Entry point of the ``vllm.general_plugins`` group.

vLLM calls :func:`register` in every process it starts (front end, engine core,
workers), possibly several times. Loading the plugin changes nothing until an
engine is created with ``additional_config={"uniprefill": {...}}``: without that
entry vLLM runs as if UniPrefill were not installed, on any vLLM version.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("vllm.uniprefill")


def register() -> None:
    try:
        from uniprefill.vllm import patches

        patches.apply()
    except Exception as exc:  # never stop vLLM from starting because of the plugin
        logger.warning("uniprefill: could not load (%s: %s); it stays off", type(exc).__name__, exc)
