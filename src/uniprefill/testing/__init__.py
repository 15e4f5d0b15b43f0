"""Test helpers: tiny randomly initialised models of the supported architectures, built offline."""

from uniprefill.testing.engines import (
    cores_per_rank,
    shutdown_engine,
    spec_decode_counts,
    tiny_llm,
)
from uniprefill.testing.tiny_models import (
    ARCHS,
    assert_varied_greedy,
    build_tiny_eagle3_drafter,
    build_tiny_eagle_drafter,
    build_tiny_model,
    build_tiny_mtp_model,
    build_tiny_tokenizer,
    cached_tiny_model,
    greedy_tokens,
    random_prompt,
    tiny_config,
    tiny_drop_layers,
    vllm_kwargs,
    write_eagle_drafter_config,
)

__all__ = [
    "ARCHS",
    "assert_varied_greedy",
    "build_tiny_eagle3_drafter",
    "build_tiny_eagle_drafter",
    "build_tiny_model",
    "build_tiny_mtp_model",
    "build_tiny_tokenizer",
    "cached_tiny_model",
    "cores_per_rank",
    "greedy_tokens",
    "random_prompt",
    "shutdown_engine",
    "spec_decode_counts",
    "tiny_llm",
    "tiny_config",
    "tiny_drop_layers",
    "vllm_kwargs",
    "write_eagle_drafter_config",
]
