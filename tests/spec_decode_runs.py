"""Shared runs of the speculative-decoding tests (tests/test_spec_decode.py for n-gram
drafts, tests/test_eagle.py for an EAGLE drafter), on the tiny Llama.

The prompts have random heads (they drop) and tails repeating a short cycle: with the
suite's drops, the tiny model's greedy output then repeats one token on the first
prompt, and without drops it repeats the cycle on the other two, so drafts get
accepted. Engines run in this process (two process start-ups fewer each), and since
closing one tears down vLLM's process-wide parallel groups, at most one lives at a
time.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from uniprefill.testing import spec_decode_counts, tiny_drop_layers, tiny_llm
from uniprefill.vllm.worker import CONFIGURE_METHOD

ARCH = "llama"
SMALL = {"block_size": 16, "last_q": 16, "sink": 16}
DROPS = {"keep_ratio": 0.3, "drop_layers": tiny_drop_layers(ARCH), **SMALL}
MAX_TOKENS = 24
# (seed, cycle length) of each prompt's repeating tail.
PROMPT_SEEDS = ((60, 1), (22, 5), (34, 5))


def prompts() -> list[list[int]]:
    out = []
    for seed, cycle in PROMPT_SEEDS:
        rng = random.Random(seed)
        ids = [rng.randrange(5, 900) for _ in range(300)]
        loop = [rng.randrange(5, 900) for _ in range(cycle)]
        out.append(ids + (loop * 120)[:120])
    return out


# How many tokens the tiny Llama's greedy output repeats after repeating_prompt().
REPEATS = 9


def repeating_prompt() -> list[int]:
    """A random head and a one-token tail after which the tiny Llama's greedy output,
    with DROPS and without, repeats its first token REPEATS times."""
    rng = random.Random(102)
    ids = [rng.randrange(5, 900) for _ in range(300)]
    return ids + [rng.randrange(5, 900)] * 120


def greedy(max_tokens: int = MAX_TOKENS) -> Any:
    import vllm

    return vllm.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def generate(llm: Any, batch: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    params = greedy(max_tokens)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def staggered(llm: Any, batch: list[list[int]]) -> list[list[int]]:
    """Each prompt joins while the earlier ones verify drafts; tokens in prompt order."""
    engine = llm.llm_engine
    done: dict[str, list[int]] = {}
    step = 0
    while step < 300 and (step < 3 * len(batch) or engine.has_unfinished_requests()):
        if step % 3 == 0 and step // 3 < len(batch):
            i = step // 3
            engine.add_request(f"s{i}", {"prompt_token_ids": batch[i]}, greedy())
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        step += 1
    return [done[f"s{i}"] for i in range(len(batch))]


def run(llm: Any, fn: Any) -> tuple[list[list[int]], dict[str, int]]:
    """``fn(llm)``'s tokens and the speculative-decoding counters it moved."""
    before = spec_decode_counts(llm)
    tokens = fn(llm)
    after = spec_decode_counts(llm)
    return tokens, {k: after[k] - before[k] for k in after}


def configure(llm: Any, options: dict[str, Any]) -> dict[str, Any]:
    """Apply ``options`` on every worker; the settings before them."""
    old = llm.collective_rpc(CONFIGURE_METHOD, args=({},))[0]["config"]
    llm.collective_rpc(CONFIGURE_METHOD, args=(options,))
    return old


def dense_run(llm: Any, batch: list[list[int]]) -> tuple[list[list[int]], dict[str, int]]:
    """``run`` of ``batch`` with nothing dropped (top_p 1.0), the engine's settings put
    back afterwards."""
    old = configure(llm, {"top_p": 1.0, "keep_ratio": None})
    try:
        return run(llm, lambda engine: generate(engine, batch))
    finally:
        configure(llm, old)


def hf_greedy(path: Path, batch: list[list[int]], drops: bool) -> list[list[int]]:
    """Greedy tokens of the Hugging Face implementation, with DROPS or dense."""
    import torch
    from hf_reference import greedy_with_drops, load

    model = load(path, torch.float32)
    layers = DROPS["drop_layers"] if drops else []
    sel = {k: DROPS[k] for k in ("keep_ratio", "block_size", "last_q", "sink")}
    return [greedy_with_drops(model, p, MAX_TOKENS, layers, **sel)[0] for p in batch]


def in_process_llm(
    path: Path,
    uniprefill: dict[str, Any] | None,
    spec: dict[str, Any] | None,
    arch: str = ARCH,
) -> Any:
    """An engine whose engine core and worker run in this process, on the V2 runner."""
    import vllm.envs as envs

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        mp.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
        llm = tiny_llm(
            path,
            arch,
            uniprefill,
            max_model_len=1024,
            max_num_batched_tokens=1024,
            speculative_config=dict(spec) if spec is not None else None,
            disable_log_stats=False,  # vLLM's speculative-decoding counters
        )
    getattr(envs, "disable_envs_cache", lambda: None)()
    return llm


def references(path: Path) -> dict[str, list[list[int]]]:
    """The Hugging Face reference's greedy tokens of ``prompts()``, with DROPS and dense."""
    batch = prompts()
    return {"drops": hf_greedy(path, batch, True), "dense": hf_greedy(path, batch, False)}


def plain_and_freeing_runs(path: Path, spec: dict[str, Any]) -> dict[str, Any]:
    """Plain vLLM's speculative decoding on ``prompts()`` and, with DROPS and
    ``free_kv_blocks``, the same prompts joining one by one: each engine started, run and
    closed in turn (two in-process engines cannot live at once)."""
    from uniprefill.testing import shutdown_engine
    from uniprefill.vllm.stats import collect

    batch = prompts()
    out: dict[str, Any] = {}
    plain = in_process_llm(path, None, spec)
    try:
        out["plain"] = run(plain, lambda llm: generate(llm, batch))
    finally:
        shutdown_engine(plain)
    freeing = in_process_llm(path, {**DROPS, "free_kv_blocks": True}, spec)
    try:
        out["freeing"] = run(freeing, lambda llm: staggered(llm, batch))
        out["kv_blocks_freed"] = collect(freeing)["kv_blocks_freed"]
    finally:
        shutdown_engine(freeing)
    return out
