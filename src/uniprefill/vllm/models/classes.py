"""UniPrefill's model classes, built from the family registry on first use.

``UniPrefill<Architecture>`` is :class:`~uniprefill.vllm.models.base.UniPrefillModel`
mixed in before the vLLM class the registry names for that architecture; vLLM imports
it lazily through ``model_class_overrides`` (``"uniprefill.vllm.models.classes:
UniPrefillQwen2ForCausalLM"``), so a family costs no code here. A family whose decoder
layer differs from vLLM's in more than module names would get a class of its own.
"""

from __future__ import annotations

import importlib

from uniprefill.vllm.families import FAMILIES

_PREFIX = "UniPrefill"
_built: dict[str, type] = {}


def model_class(architecture: str) -> type:
    """UniPrefill's class for a registered ``architecture`` (built once per process)."""
    if architecture in _built:
        return _built[architecture]
    family = next((f for f in FAMILIES if architecture in f.architectures), None)
    if family is None:
        raise AttributeError(f"uniprefill has no model class for {architecture!r}")
    module_name, class_name = family.architectures[architecture].split(":")
    try:
        vllm_class = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as e:
        raise ImportError(
            f"uniprefill: {architecture} needs vLLM's {module_name}.{class_name}, which "
            f"this vLLM does not have ({e}); the {family.family} family is unavailable here"
        ) from e
    from uniprefill.vllm.models.base import UniPrefillModel

    cls = type(
        f"{_PREFIX}{architecture}",
        (UniPrefillModel, vllm_class),
        {"family": family, "__module__": __name__, "__qualname__": f"{_PREFIX}{architecture}"},
    )
    _built[architecture] = cls
    return cls


def __getattr__(name: str) -> type:
    if not name.startswith(_PREFIX):
        raise AttributeError(name)
    return model_class(name[len(_PREFIX) :])
