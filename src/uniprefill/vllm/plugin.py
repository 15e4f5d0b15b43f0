"""Entry point of the ``vllm.general_plugins`` group.

vLLM calls :func:`register` in every process it starts (front end, engine
core, workers), possibly several times. Loading the plugin changes nothing
until a model is started with ``additional_config={"uniprefill": {...}}``.
"""

from __future__ import annotations


def register() -> None:
    from uniprefill.vllm import compat

    compat.install()
