"""A dropping step's forward, in segments between gather points; compiled when vLLM is.

The token set changes only at a drop layer's gather point (right after its token
mixer), so the layers run in segments of fixed token count:

* segment 0: every layer before the first drop layer, then that layer's mixer half;
* segment k: drop layer k's FFN half (from its gather module on), the layers up to
  drop layer k+1, and that layer's mixer half;
* the last segment: the last drop layer's FFN half, the remaining layers, the norm.

A layer's halves are shallow copies of vLLM's decoder layer that share its modules
and weights, with the other half's sub-modules stood in for by :class:`Skipped`
(a norm passes ``hidden_states`` and ``residual`` through, any other module its
first input), so vLLM's own layer ``forward`` runs either half. The runtime's
glue between segments (selection, gather, next stage's metadata) stays eager. In
a compiled engine each segment is ``torch.compile``'d once, with a dynamic token
count, so a dropping step runs Inductor-fused kernels as vLLM's compiled model
does, instead of its unfused PyTorch ops in eager mode.
"""

from __future__ import annotations

import copy
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn


class Skipped(nn.Module):
    """Stands for a sub-module a layer half does not run.

    A norm stand-in returns what vLLM's norms return: ``hidden`` alone, or
    ``(hidden, residual)`` when called with a residual (the fused add-norm). Any other
    module returns its first input only: a second argument is no residual there
    (GPT-OSS calls ``self.attn(hidden_states, positions)``). ``zero`` returns zeros
    instead, for a branch whose output a layer adds to the residual inline
    (Gemma 4): the skipped branch then adds nothing.
    """

    def __init__(self, norm: bool, zero: bool = False) -> None:
        super().__init__()
        self.norm, self.zero = norm, zero

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        hidden = args[0] if args else kwargs.get("hidden_states", kwargs.get("x"))
        if hidden is None:
            raise TypeError(
                f"uniprefill: Skipped got no hidden states ({len(args)} args, {sorted(kwargs)})"
            )
        if self.zero:
            hidden = torch.zeros_like(hidden)
        if not self.norm:
            return hidden
        residual = args[1] if len(args) > 1 else kwargs.get("residual")
        return hidden if residual is None else (hidden, residual)


def _is_norm(module: nn.Module) -> bool:
    # vLLM's RMSNorm, GemmaRMSNorm, Qwen3_5RMSNorm, LayerNorm, ...
    return "norm" in type(module).__name__.lower()


def layer_half(
    layer: nn.Module,
    skip: Sequence[str],
    attrs_off: Sequence[str] = (),
    zero: Sequence[str] = (),
    attrs: Mapping[str, Any] | None = None,
) -> nn.Module:
    """``layer`` with the sub-modules ``skip`` passed through (those also in ``zero``
    return zeros), flags ``attrs_off`` off and attributes ``attrs`` set."""
    attrs = dict(attrs or {})
    missing = [name for name in (*skip, *attrs_off, *attrs) if not hasattr(layer, name)]
    if missing:
        raise RuntimeError(
            f"uniprefill: {type(layer).__name__} has no {missing}; this vLLM's decoder "
            "layer differs from what UniPrefill splits at the gather point"
        )
    half = copy.copy(layer)
    half._modules = dict(layer._modules)  # its own module table; weights stay shared
    for name in skip:
        half._modules[name] = Skipped(norm=_is_norm(layer._modules[name]), zero=name in zero)
    for name in attrs_off:
        object.__setattr__(half, name, False)
    for name, value in attrs.items():
        object.__setattr__(half, name, value)
    return half


class Segment:
    """Layers (or halves) run on one token set, with the model's final norm if last.

    ``taps`` are piece indices before which the residual stream (hidden plus
    residual) is returned too, in order: an EAGLE-3 drafter's auxiliary hidden states
    (vLLM's ``aux_hidden_state_layers``); ``len(pieces)`` is before the final norm.
    """

    def __init__(
        self, pieces: Sequence[nn.Module], norm: nn.Module | None, taps: Sequence[int] = ()
    ) -> None:
        self.pieces = list(pieces)
        self.norm = norm
        self.taps = tuple(taps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, ...]]:
        tapped: list[torch.Tensor] = []
        for i, piece in enumerate(self.pieces):
            if i in self.taps:
                tapped.append(hidden if residual is None else hidden + residual)
            hidden, residual = piece(positions=positions, hidden_states=hidden, residual=residual)
        if len(self.pieces) in self.taps:
            tapped.append(hidden if residual is None else hidden + residual)
        if self.norm is not None:
            if residual is None:
                return self.norm(hidden), None, tuple(tapped)
            hidden, _ = self.norm(hidden, residual)
            return hidden, residual, tuple(tapped)
        if residual is None:
            # Layers that add their residual inline and return none (Gemma 4): the
            # runtime gathers a residual at the gather point, and the next layer reads
            # only the hidden states.
            residual = torch.zeros_like(hidden)
        return hidden, residual, tuple(tapped)


def build_segments(
    layers: Sequence[nn.Module],
    drop_layers: Sequence[int],
    norm: nn.Module | None,
    mixer: Sequence[str],
    ffn: Sequence[str],
    ffn_attrs_off: Sequence[str] = (),
    zeroed: Sequence[str] = (),
    mixer_attrs: Mapping[str, Any] | None = None,
    first: int = 0,
    taps: Sequence[int] = (),
) -> list[Segment]:
    """``len(drop_layers) + 1`` segments covering ``layers[first:]`` and the final
    ``norm`` (a pipeline rank: its own layers and drop layers; no norm before the last).

    ``mixer`` names the sub-modules a drop layer runs before its gather point,
    ``ffn`` those from its gather module on; ``ffn_attrs_off`` are flags of the
    layer that apply to the mixer's output and must not apply twice. ``zeroed``
    sub-modules return zeros where skipped, and ``mixer_attrs`` are attributes the
    mixer half sets (``DecoderLayout`` says why a family needs them). ``taps`` are
    layer indices ``k`` whose input (the residual stream after layers ``< k``;
    ``len(layers)``: before the final norm) the segments return as well, as vLLM's
    models do for ``aux_hidden_state_layers``: a drop layer's input is its mixer
    half's, in the segment it ends.
    """

    def local_taps(lo: int, hi: int, offset: int) -> list[int]:
        # taps k in [lo, hi]: before piece k - lo (+1 after a previous FFN half)
        return [k - lo + offset for k in sorted(set(taps)) if lo <= k <= hi]

    segments: list[Segment] = []
    start: nn.Module | None = None  # FFN half of the previous drop layer
    for d in drop_layers:
        offset = int(start is not None)
        pieces = ([start] if start is not None else []) + list(layers[first:d])
        pieces.append(layer_half(layers[d], skip=ffn, zero=zeroed, attrs=mixer_attrs))
        segments.append(Segment(pieces, None, local_taps(first, d, offset)))
        start = layer_half(layers[d], skip=mixer, attrs_off=ffn_attrs_off, zero=zeroed)
        first = d + 1
    offset = int(start is not None)
    pieces = ([start] if start is not None else []) + list(layers[first:])
    segments.append(Segment(pieces, norm, local_taps(first, len(layers), offset)))
    return segments


# Graphs Inductor compiled for segments in this process: one per segment once warmed
# up; more means a guard failed at run time (a stall of seconds), which the tests catch.
_graphs_compiled = [0]


def graphs_compiled() -> int:
    return _graphs_compiled[0]


def _inductor(graph: torch.fx.GraphModule, example_inputs: Any) -> Any:
    from torch._inductor.compile_fx import compile_fx

    _graphs_compiled[0] += 1
    return compile_fx(graph, example_inputs)


SegmentFn = Callable[
    [torch.Tensor, torch.Tensor, "torch.Tensor | None"],
    "tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, ...]]",
]


def compile_segment(segment: Segment, index: int) -> SegmentFn:
    """``segment.forward`` under ``torch.compile`` (Inductor, dynamic token count).

    Each segment gets its own code object, so Dynamo keeps one cache entry per
    segment (all segments share ``Segment.forward``'s code otherwise, and more
    segments than Dynamo's cache limit would fall back to eager). vLLM's IR ops
    (RMSNorm) are traced as their PyTorch implementation, which Inductor fuses,
    rather than as opaque custom ops that vLLM's own compiler would lower.
    """
    from vllm.ir import enable_torch_wrap

    code = Segment.forward.__code__.replace(co_name=f"uniprefill_segment_{index}")
    fn = types.FunctionType(code, Segment.forward.__globals__, code.co_name)
    compiled = torch.compile(types.MethodType(fn, segment), fullgraph=True, backend=_inductor)

    def run(
        positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, ...]]:
        for t in (positions, hidden, residual):
            if t is not None:
                torch._dynamo.maybe_mark_dynamic(t, 0)
        with enable_torch_wrap(False):
            return compiled(positions, hidden, residual)

    return run
