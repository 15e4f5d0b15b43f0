"""UniPrefill settings and their validation.

One frozen dataclass holds every knob of the method. The vLLM plugin builds it
from ``additional_config["uniprefill"]`` (:func:`uniprefill_config`, parsed once per
process for the front end, the scheduler and the model alike); the operator validates
the same numbers through :func:`validate_selection_args` so both paths give the same
errors.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

DEFAULT_TOP_P = 0.99
DEFAULT_BLOCK_SIZE = 64
DEFAULT_LAST_Q = 128
DEFAULT_SINK = 128
# The key of vLLM's ``additional_config`` that turns UniPrefill on.
ENTRY = "uniprefill"
# Which stage fill decode steps use: "auto" (one Triton launch on CUDA devices, torch
# ops elsewhere: on a CPU Triton's interpreter takes ~20 ms a program), "triton" or
# "torch" (to compare the two, as tests and benchmarks/check_compiled.py do).
STAGE_FILL_ENV = "UNIPREFILL_STAGE_FILL"


def validate_selection_args(
    top_p: float,
    block_size: int,
    last_q: int,
    sink: int,
    keep_ratio: float | None = None,
) -> None:
    """Raise ``ValueError`` naming the first parameter outside its allowed range."""
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be a number in (0, 1], got {top_p!r}")
    if (
        isinstance(block_size, bool)
        or not isinstance(block_size, int)
        or block_size < 1
        or block_size & (block_size - 1)
    ):
        raise ValueError(f"block_size must be a power of two >= 1, got {block_size!r}")
    for name, value in (("last_q", last_q), ("sink", sink)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    if keep_ratio is not None and (
        isinstance(keep_ratio, bool)
        or not isinstance(keep_ratio, (int, float))
        or not 0.0 < keep_ratio <= 1.0
    ):
        raise ValueError(f"keep_ratio must be None or a number in (0, 1], got {keep_ratio!r}")


def unscored_len(sink: int, last_q: int) -> int:
    """The longest row the selection never scores: its first ``sink`` and last ``last_q``
    tokens, which are always kept, cover all of it."""
    return sink + last_q


def scorable(length: Any, sink: int, last_q: int) -> Any:
    """Whether rows of ``length`` tokens are long enough to score (an int, or elementwise
    for numpy arrays and tensors): the one rule of the plugin, the scheduler and both
    implementations of the operator (Triton's kernel compares with :func:`unscored_len`)."""
    return length > unscored_len(sink, last_q)


@dataclass(frozen=True)
class SelectionParams:
    """The selection operator's settings, as one value (validated on construction)."""

    top_p: float = DEFAULT_TOP_P
    block_size: int = DEFAULT_BLOCK_SIZE
    last_q: int = DEFAULT_LAST_Q
    sink: int = DEFAULT_SINK
    keep_ratio: float | None = None

    def __post_init__(self) -> None:
        validate_selection_args(
            self.top_p, self.block_size, self.last_q, self.sink, self.keep_ratio
        )

    @property
    def keeps_all(self) -> bool:
        """``top_p`` 1 without a keep ratio keeps every block: the dense path, exactly."""
        return self.top_p >= 1.0 and self.keep_ratio is None

    def scorable(self, length: Any) -> Any:
        """:func:`scorable` with these settings."""
        return scorable(length, self.sink, self.last_q)

    def kwargs(self) -> dict[str, Any]:
        """As keyword arguments of :func:`uniprefill.ops.select_tokens`."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class UniPrefillConfig:
    """Settings of UniPrefill for one model.

    ``drop_layers`` are 0-based decoder-layer indices, each a full-attention
    layer; ``None`` means the model family's default schedule. ``keep_ratio``
    replaces top-p by "keep this fraction of blocks" (benchmarking only: it
    makes speed independent of what random weights attend to); a list gives one
    fraction per drop layer, to replay the kept shares a trained model measured.
    ``max_stash_tokens`` bounds the tokens of prompts prefilled in chunks that wait
    for their last chunk (about 18 KB per token on a Llama-8B shape); a prompt that
    does not fit when it starts runs dense. ``dense_prefix_tokens``: the first tokens
    of every prompt that are never dropped; with vLLM's prefix caching on, they are
    what a prompt that drops publishes for later requests to reuse (its shared
    system prompt, say). ``compile_drop_steps``: whether a step that drops runs its
    layers ``torch.compile``'d in segments between drop layers (``None``: when vLLM
    compiles its own model, i.e. without ``enforce_eager``). ``free_kv_blocks``: give
    the KV blocks of dropped tokens back to vLLM's pool once a prompt's prefill is done
    (docs/kv-blocks.md); ``None``: wherever the model allows it, which the front end
    decides and writes into the engine's ``additional_config``.
    """

    top_p: float = DEFAULT_TOP_P
    block_size: int = DEFAULT_BLOCK_SIZE
    last_q: int = DEFAULT_LAST_Q
    sink: int = DEFAULT_SINK
    drop_layers: tuple[int, ...] | None = None
    keep_ratio: float | tuple[float, ...] | None = None
    min_prompt_len: int = 0
    # Tokens of chunked prompts held between their chunks (None: max_model_len; 0:
    # chunked prompts run dense).
    max_stash_tokens: int | None = None
    dense_prefix_tokens: int = 0
    # Run a dropping step's layers torch.compile'd (None: when vLLM compiles its model).
    compile_drop_steps: bool | None = None
    # Return the blocks of dropped tokens to vLLM's pool after each prefill (one
    # KV-cache group per stage; full-attention models, any executor, TP: docs/kv-blocks.md).
    # None (the default): on wherever the model allows it (the front end resolves it to
    # a bool). Since 2026-12-07: the GPU measurements with vLLM's multi-process engine
    # core held (docs/benchmarks.md, "Freeing ... by default").
    free_kv_blocks: bool | None = None
    enabled: bool = True
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        # Validates the selection settings; kept beside the fields (not one of them).
        ratios = self.keep_ratio
        if isinstance(ratios, (list, tuple)):
            if not ratios:
                raise ValueError("keep_ratio must be a number or a non-empty list, got []")
            ratios = tuple(ratios)
            object.__setattr__(self, "keep_ratio", ratios)
        per_layer = ratios if isinstance(ratios, tuple) else (ratios,)
        stages = tuple(
            SelectionParams(self.top_p, self.block_size, self.last_q, self.sink, r)
            for r in per_layer
        )
        object.__setattr__(self, "_stages", stages)
        for name in ("min_prompt_len", "dense_prefix_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        mst = self.max_stash_tokens
        if mst is not None and (isinstance(mst, bool) or not isinstance(mst, int) or mst < 0):
            raise ValueError(
                f"max_stash_tokens must be None or an integer >= 0, got {self.max_stash_tokens!r}"
            )
        if not isinstance(self.enabled, bool):
            raise ValueError(f"enabled must be true or false, got {self.enabled!r}")
        for name in ("compile_drop_steps", "free_kv_blocks"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be null, true or false, got {value!r}")
        if self.drop_layers is not None:
            layers = self.drop_layers
            if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence):
                raise ValueError(f"drop_layers must be a list of layer indices, got {layers!r}")
            if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layers):
                raise ValueError(f"drop_layers must hold integers >= 0, got {list(layers)!r}")
            if list(layers) != sorted(set(layers)):
                raise ValueError(
                    f"drop_layers must be strictly increasing without repeats, got {list(layers)!r}"
                )
            object.__setattr__(self, "drop_layers", tuple(layers))

    @property
    def selection(self) -> SelectionParams:
        """The selection settings (``top_p``, ``block_size``, ``last_q``, ``sink``,
        ``keep_ratio``) as one value (the first drop layer's, with a list of ratios)."""
        return self._stages[0]  # type: ignore[attr-defined]

    def selection_at(self, drop_index: int) -> SelectionParams:
        """The selection settings of the ``drop_index``-th drop layer."""
        stages = self._stages  # type: ignore[attr-defined]
        return stages[drop_index] if len(stages) > 1 else stages[0]

    def check_schedule(self, drop_layers: Sequence[int]) -> None:
        """A list of keep ratios needs one per drop layer (``ValueError`` otherwise)."""
        if isinstance(self.keep_ratio, tuple) and len(self.keep_ratio) != len(drop_layers):
            raise ValueError(
                f"keep_ratio has {len(self.keep_ratio)} values but the schedule has "
                f"{len(drop_layers)} drop layers {list(drop_layers)}: give one per drop layer"
            )

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | None) -> UniPrefillConfig:
        """Build from the ``"uniprefill"`` entry of vLLM's ``additional_config``.

        Unknown keys are an error (a typo must not silently fall back to a default).
        """
        if raw is None:
            return cls()
        if not isinstance(raw, Mapping):
            raise ValueError(f"additional_config['uniprefill'] must be a mapping, got {raw!r}")
        known = {f.name for f in fields(cls)} - {"extra"}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown uniprefill option(s) {unknown}; allowed: {sorted(known)}")
        kwargs = dict(raw)
        if kwargs.get("drop_layers") is not None and isinstance(kwargs["drop_layers"], list):
            kwargs["drop_layers"] = tuple(kwargs["drop_layers"])
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        for name in ("drop_layers", "keep_ratio"):
            if isinstance(out[name], tuple):
                out[name] = list(out[name])
        return out


def has_entry(additional_config: Any) -> bool:
    """Whether vLLM's ``additional_config`` asks for UniPrefill (enabled or not)."""
    return isinstance(additional_config, dict) and ENTRY in additional_config


def uniprefill_config(additional_config: Any) -> UniPrefillConfig | None:
    """The enabled UniPrefill config in vLLM's ``additional_config``, else ``None``.

    The entry is parsed once per process: the front end, the scheduler, the model and
    the V2-runner choice (read on every access) all get the same object.
    """
    if not has_entry(additional_config):
        return None
    raw = additional_config[ENTRY]
    key = json.dumps(raw, sort_keys=True, default=repr)
    cfg = _PARSED.get(key)
    if cfg is None:
        cfg = _PARSED[key] = UniPrefillConfig.from_dict(raw)
    return cfg if cfg.enabled else None


# Entries parsed in this process, by their JSON text (a few per process at most).
_PARSED: dict[str, UniPrefillConfig] = {}
