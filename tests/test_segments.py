"""A drop layer's two halves (``uniprefill.vllm.segments``) compose to the whole layer.

Off vLLM: small decoder layers written with the calling conventions of vLLM's own,
run whole and as mixer half then FFN half (each with the other half's sub-modules
stood in for by ``Skipped``); the halves must give the whole layer's output.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from uniprefill.vllm.segments import Segment, Skipped, build_segments, layer_half


class AddRMSNorm(nn.Module):
    """vLLM's RMSNorm: ``norm(x)``, or the fused ``norm(x, residual)`` -> (normed, x + residual)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(dim) + 0.5)

    def forward(self, x, residual=None):
        if residual is not None:
            x = x + residual
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
        return normed if residual is None else (normed, x)


class PositionalAttention(nn.Module):
    """Stands for GPT-OSS's OAIAttention: called ``attn(hidden_states, positions)``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, hidden_states, positions):
        return self.proj(hidden_states) * (1 + positions[:, None].float() / 100)


class GptOssLikeLayer(nn.Module):
    """vLLM's gpt_oss.TransformerBlock call order: fused add-norms, positional attention."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.input_layernorm = AddRMSNorm(dim)
        self.attn = PositionalAttention(dim)
        self.post_attention_layernorm = AddRMSNorm(dim)
        self.mlp = nn.Linear(dim, dim)

    def forward(self, hidden_states, positions, residual):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.attn(hidden_states, positions)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class InlineResidualLayer(nn.Module):
    """vLLM's gemma4.Gemma4DecoderLayer call order: sandwich norms, the residual added
    inline after each branch, no residual returned, a layer scalar on the output."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.input_layernorm = AddRMSNorm(dim)
        self.self_attn = nn.Linear(dim, dim)
        self.post_attention_layernorm = AddRMSNorm(dim)
        self.pre_feedforward_layernorm = AddRMSNorm(dim)
        self.mlp = nn.Linear(dim, dim)
        self.post_feedforward_layernorm = AddRMSNorm(dim)
        self.register_buffer("layer_scalar", torch.tensor([0.7]))

    def forward(self, positions, hidden_states, residual, **kwargs):
        residual = hidden_states
        hidden_states = self.input_layernorm(residual)
        hidden_states = self.self_attn(hidden_states)
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = hidden_states + residual
        residual = hidden_states
        hidden_states = self.pre_feedforward_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = self.post_feedforward_layernorm(hidden_states)
        hidden_states = hidden_states + residual
        return hidden_states * self.layer_scalar, None


DIM, TOKENS = 16, 5


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(TOKENS, DIM, generator=gen)
    residual = torch.randn(TOKENS, DIM, generator=gen)
    return torch.arange(TOKENS) * 7, hidden, residual


def test_skipped_norm_passes_the_residual_other_modules_only_the_hidden_states():
    _, hidden, residual = _inputs()
    norm, other = Skipped(norm=True), Skipped(norm=False)
    assert norm(hidden) is hidden
    h, r = norm(hidden, residual)
    assert h is hidden and r is residual
    assert norm(hidden_states=hidden, residual=residual) == (hidden, residual)
    # A second positional argument of a non-norm is no residual (GPT-OSS's positions).
    assert other(hidden, torch.arange(TOKENS)) is hidden
    assert torch.equal(Skipped(norm=True, zero=True)(hidden), torch.zeros_like(hidden))


@torch.no_grad()
@pytest.mark.parametrize("first", [True, False], ids=["no-residual-in", "residual-in"])
def test_gpt_oss_like_halves_compose_to_the_layer(first: bool):
    torch.manual_seed(0)
    layer = GptOssLikeLayer(DIM)
    positions, hidden, residual = _inputs()
    residual_in = None if first else residual
    want = layer(hidden, positions, residual_in)
    mixer = layer_half(layer, skip=("post_attention_layernorm", "mlp"))
    ffn = layer_half(layer, skip=("input_layernorm", "attn"))
    h, r = mixer(positions=positions, hidden_states=hidden, residual=residual_in)
    got = ffn(positions=positions, hidden_states=h, residual=r)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # The old stand-in returned (hidden, positions) for the skipped attention: the FFN
    # half would then have taken the positions for attention output.
    assert isinstance(ffn.attn, Skipped) and not ffn.attn.norm


@torch.no_grad()
def test_inline_residual_halves_compose_to_the_layer():
    """Gemma 4: the skipped branch of each half adds zeros, and the layer scalar
    applies once, in the FFN half."""
    torch.manual_seed(0)
    layer = InlineResidualLayer(DIM)
    positions, hidden, _ = _inputs()
    want, _ = layer(positions, hidden, None)
    ffn_names = ("pre_feedforward_layernorm", "mlp", "post_feedforward_layernorm")
    mixer_names = ("input_layernorm", "self_attn", "post_attention_layernorm")
    zeroed = ("post_attention_layernorm", "pre_feedforward_layernorm")
    segments = build_segments(
        [layer],
        [0],
        AddRMSNorm(DIM),
        mixer=mixer_names,
        ffn=ffn_names,
        zeroed=zeroed,
        mixer_attrs={"layer_scalar": 1.0},
    )
    h, r, _ = segments[0].forward(positions, hidden, None)
    assert r is not None and not r.any()  # a residual for the runtime to gather
    got = segments[1].pieces[0](positions=positions, hidden_states=h, residual=r)[0]
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # Without the zeroed stand-ins each half would add its input to itself.
    bad_mixer = layer_half(layer, skip=ffn_names, attrs={"layer_scalar": 1.0})
    bad = layer_half(layer, skip=mixer_names)
    h_bad, _ = bad_mixer(positions=positions, hidden_states=hidden, residual=None)
    assert not torch.allclose(bad(positions, h_bad, None)[0], want)


@torch.no_grad()
def test_last_segment_norms_with_or_without_a_residual():
    _, hidden, residual = _inputs()
    norm = AddRMSNorm(DIM)
    h, r, _ = Segment([], norm).forward(torch.arange(TOKENS), hidden, residual)
    torch.testing.assert_close(h, norm(hidden, residual)[0])
    h, _, _ = Segment([], norm).forward(torch.arange(TOKENS), hidden, None)
    torch.testing.assert_close(h, norm(hidden))


@torch.no_grad()
def test_segments_tap_the_inputs_of_the_auxiliary_layers():
    """EAGLE-3's auxiliary hidden states: the segments return the residual stream
    entering each tapped layer (``len(layers)``: the final norm's), as vLLM's model
    loop does, also where a tap is a drop layer (its mixer half's input) or the layer
    after one (its FFN half's output)."""
    torch.manual_seed(0)
    layers = [GptOssLikeLayer(DIM) for _ in range(6)]
    norm = AddRMSNorm(DIM)
    positions, hidden, _ = _inputs()
    taps = (0, 1, 2, 4, 6)
    want, residual = [], None
    h = hidden
    for k, layer in enumerate(layers):
        if k in taps:
            want.append(h if residual is None else h + residual)
        h, residual = layer(h, positions, residual)
    want.append(h + residual)
    final = norm(h, residual)[0]
    segments = build_segments(
        layers,
        [1, 3],
        norm,
        mixer=("input_layernorm", "attn"),
        ffn=("post_attention_layernorm", "mlp"),
        taps=(6, *taps),  # in any order, repeated: vLLM's loop appends once, in order
    )
    got, h, r = [], hidden, None
    for segment in segments:
        h, r, tapped = segment.forward(positions, h, r)
        got.extend(tapped)
    assert [len(seg.taps) for seg in segments] == [2, 1, 2]
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(h, final, rtol=1e-6, atol=1e-6)


def test_layer_half_names_missing_sub_modules():
    with pytest.raises(RuntimeError, match="has no \\['self_attn'\\]"):
        layer_half(GptOssLikeLayer(DIM), skip=("self_attn",))
