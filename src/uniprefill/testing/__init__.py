"""Test helpers: tiny randomly initialised models of the supported architectures, built offline."""

from uniprefill.testing.tiny_models import (
    ARCHS,
    build_tiny_model,
    build_tiny_tokenizer,
    cached_tiny_model,
    tiny_config,
    vllm_kwargs,
)

__all__ = [
    "ARCHS",
    "build_tiny_model",
    "build_tiny_tokenizer",
    "cached_tiny_model",
    "tiny_config",
    "vllm_kwargs",
]
