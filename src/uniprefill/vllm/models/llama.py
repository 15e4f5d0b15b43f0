"""vLLM's model class with UniPrefill's staged forward for dropping steps."""

from __future__ import annotations

from vllm.model_executor.models.llama import LlamaForCausalLM

from uniprefill.vllm.families import family_for
from uniprefill.vllm.models.base import UniPrefillModel


class UniPrefillLlamaForCausalLM(UniPrefillModel, LlamaForCausalLM):
    family = family_for(["LlamaForCausalLM"])
