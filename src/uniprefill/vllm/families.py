"""Per-architecture facts UniPrefill needs: layer types, default schedules, module names.

Nothing here imports vLLM, so the front end can validate a configuration before
any worker starts. A family reads the Hugging Face config to tell which decoder
layers are full-attention layers (the only layers that may score and drop tokens),
names the UniPrefill model class that vLLM loads in place of its own (through
``model_class_overrides``), and names the pieces of a vLLM decoder layer that the
staged forward hooks:

* ``attention(layer)``: the vLLM ``Attention`` module of a full-attention
  layer, whose inputs are the post-RoPE q and k used for scoring;
* ``mixer_modules`` / ``ffn_modules``: the sub-modules of a decoder layer before
  and from its gather point, in call order. The first FFN module is the one each
  layer calls with ``(hidden_states, residual)`` right after its token mixer; the
  selection is applied there, so the drop layer's own attention saw every token and
  its MLP/MoE and every later layer see only the kept ones
  (``uniprefill.vllm.segments`` splits a drop layer there).

A fourth family is one entry here plus one small model class in
``uniprefill.vllm.models``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

FULL = "full_attention"
SLIDING = "sliding_attention"
LINEAR = "linear_attention"


def _text_config(hf_config: Any) -> Any:
    return getattr(hf_config, "text_config", None) or hf_config


def _llama_layer_types(cfg: Any) -> list[str]:
    if getattr(cfg, "sliding_window", None):
        raise ValueError(
            "uniprefill: this Llama-family config sets sliding_window; only pure "
            "full-attention Llama models are supported"
        )
    return [FULL] * int(cfg.num_hidden_layers)


def _gemma3_layer_types(cfg: Any) -> list[str]:
    types = getattr(cfg, "layer_types", None)
    if types:
        return [FULL if t == FULL else SLIDING for t in types]
    pattern = int(getattr(cfg, "sliding_window_pattern", 6))
    return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(cfg.num_hidden_layers)]


def _qwen3_next_layer_types(cfg: Any) -> list[str]:
    types = getattr(cfg, "layer_types", None)
    if types:
        return [FULL if t == FULL else LINEAR for t in types]
    interval = int(getattr(cfg, "full_attention_interval", 4))
    return [FULL if (i + 1) % interval == 0 else LINEAR for i in range(cfg.num_hidden_layers)]


def _llama_schedule(types: Sequence[str]) -> tuple[int, ...]:
    # Llama-3.1-8B (32 layers) uses layers 7, 11, ..., 27; scale to other depths.
    n = len(types)
    picks = {round(n * f / 32) for f in (7, 11, 15, 19, 23, 27)}
    return tuple(sorted(i for i in picks if 0 < i < n - 1))


def _gemma3_schedule(types: Sequence[str]) -> tuple[int, ...]:
    # Gemma-3-12B (48 layers) uses its global layers 29, 35, 41: the full layers
    # between 60% and 86% of the depth.
    n = len(types)
    return tuple(i for i, t in enumerate(types) if t == FULL and 0.6 <= i / n <= 0.86)


def _qwen3_next_schedule(types: Sequence[str]) -> tuple[int, ...]:
    # Qwen3-Next (48 layers, full attention every 4th) uses 7, 11, ..., 43: every
    # full-attention layer but the first and the last.
    full = [i for i, t in enumerate(types) if t == FULL]
    return tuple(full[1:-1])


@dataclass(frozen=True)
class ModelFamily:
    family: str
    architectures: tuple[str, ...]
    # "module:Class" vLLM loads instead of its own class when UniPrefill is on.
    model_class: str
    layer_types: Callable[[Any], list[str]]
    default_schedule: Callable[[Sequence[str]], tuple[int, ...]]
    mixer_modules: tuple[str, ...]
    ffn_modules: tuple[str, ...]
    # Flags of a layer that act on the mixer's output (off in the FFN half).
    ffn_attrs_off: tuple[str, ...] = ()

    @property
    def gather_module(self) -> str:
        return self.ffn_modules[0]

    def attention(self, layer: Any) -> Any:
        """The vLLM ``Attention`` module of a full-attention decoder layer."""
        return layer.self_attn.attn

    def types_for(self, hf_config: Any) -> list[str]:
        return self.layer_types(_text_config(hf_config))

    def resolve_drop_layers(
        self, hf_config: Any, requested: Sequence[int] | None
    ) -> tuple[int, ...]:
        """The validated drop-layer schedule: ``requested`` or the family default."""
        types = self.types_for(hf_config)
        layers = tuple(requested) if requested is not None else self.default_schedule(types)
        for i in layers:
            if i >= len(types):
                raise ValueError(
                    f"drop_layers: layer {i} does not exist; {self.family} model has "
                    f"{len(types)} layers (allowed 0..{len(types) - 1})"
                )
            if types[i] != FULL:
                full = [j for j, t in enumerate(types) if t == FULL]
                raise ValueError(
                    f"drop_layers: layer {i} is a {types[i]} layer; a drop layer must be a "
                    f"full-attention layer, allowed: {full}"
                )
        return layers

    def has_sliding_window(self, hf_config: Any) -> bool:
        return SLIDING in self.types_for(hf_config)


FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily(
        family="llama",
        architectures=("LlamaForCausalLM",),
        model_class="uniprefill.vllm.models.llama:UniPrefillLlamaForCausalLM",
        layer_types=_llama_layer_types,
        default_schedule=_llama_schedule,
        mixer_modules=("input_layernorm", "self_attn"),
        ffn_modules=("post_attention_layernorm", "mlp"),
    ),
    ModelFamily(
        family="gemma3",
        architectures=("Gemma3ForCausalLM",),
        model_class="uniprefill.vllm.models.gemma3:UniPrefillGemma3ForCausalLM",
        layer_types=_gemma3_layer_types,
        default_schedule=_gemma3_schedule,
        # Gemma 3 normalises the attention output alone, then adds the residual
        # in pre_feedforward_layernorm: that call is the first to carry both.
        mixer_modules=("input_layernorm", "self_attn", "post_attention_layernorm"),
        ffn_modules=("pre_feedforward_layernorm", "mlp", "post_feedforward_layernorm"),
    ),
    ModelFamily(
        family="qwen3_next",
        architectures=("Qwen3NextForCausalLM",),
        model_class="uniprefill.vllm.models.qwen3_next:UniPrefillQwen3NextForCausalLM",
        layer_types=_qwen3_next_layer_types,
        default_schedule=_qwen3_next_schedule,
        mixer_modules=("input_layernorm", "self_attn"),
        ffn_modules=("post_attention_layernorm", "mlp"),
        # layer_scale multiplies the attention output, before the gather point.
        ffn_attrs_off=("layer_scale",),
    ),
)

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(a for fam in FAMILIES for a in fam.architectures)


def family_for(architectures: Sequence[str] | None) -> ModelFamily:
    """The family of a model's ``architectures`` list, or a ``ValueError``."""
    for arch in architectures or ():
        for family in FAMILIES:
            if arch in family.architectures:
                return family
    raise ValueError(
        f"uniprefill does not support architecture {list(architectures or [])}; "
        f"supported: {list(SUPPORTED_ARCHITECTURES)}. Remove the 'uniprefill' entry of "
        "additional_config to run this model without it."
    )
