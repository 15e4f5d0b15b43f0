"""vLLM's model class with UniPrefill's staged forward for dropping steps."""

from __future__ import annotations

from vllm.model_executor.models.gemma3 import Gemma3ForCausalLM

from uniprefill.vllm.families import family_for
from uniprefill.vllm.models.base import UniPrefillModel


class UniPrefillGemma3ForCausalLM(UniPrefillModel, Gemma3ForCausalLM):
    family = family_for(["Gemma3ForCausalLM"])
