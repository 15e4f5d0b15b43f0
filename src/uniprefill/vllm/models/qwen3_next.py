"""vLLM's model class with UniPrefill's staged forward for dropping steps."""

from __future__ import annotations

from vllm.model_executor.models.qwen3_next import Qwen3NextForCausalLM

from uniprefill.vllm.families import family_for
from uniprefill.vllm.models.base import UniPrefillModel


class UniPrefillQwen3NextForCausalLM(UniPrefillModel, Qwen3NextForCausalLM):
    family = family_for(["Qwen3NextForCausalLM"])
