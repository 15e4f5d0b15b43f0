"""UniPrefill: block-wise dynamic token dropping for faster long-context prefill in vLLM."""

from uniprefill.config import UniPrefillConfig

__version__ = "0.1.0"

__all__ = ["UniPrefillConfig", "__version__"]
