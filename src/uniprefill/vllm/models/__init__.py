"""UniPrefill's model classes: vLLM's own, with a staged forward for dropping steps.

vLLM loads them in place of its classes through ``model_class_overrides`` (set
by ``uniprefill.vllm.engine`` only when UniPrefill is enabled).
"""
