"""Sampled requests on CPU, where ``uniprefill.cpu_triton`` runs vLLM's Triton kernels in
Triton's interpreter (issue 26, trap 0).

With the interpreter's "cpu" backend registered, vLLM's top-k/top-p filter took a Triton
kernel the interpreter cannot run, and the first request with top_k, top_p or n > 1 and
top_k killed the engine (``AttributeError: 'int' object has no attribute 'to'``). The
shim sends that filter to vLLM's PyTorch implementation instead.
"""

from __future__ import annotations

import gc
import random
from pathlib import Path
from typing import Any

import pytest

from uniprefill.cpu_triton import TOP_K_TOP_P_MODULE, needed
from uniprefill.testing import shutdown_engine

pytestmark = pytest.mark.skipif(not needed(), reason="only where the interpreter shim is on")


def test_the_top_k_top_p_filter_is_vllms_pytorch_one() -> None:
    import importlib

    module = importlib.import_module(TOP_K_TOP_P_MODULE)
    assert module.HAS_TRITON is False
    from vllm.triton_utils import HAS_TRITON

    assert HAS_TRITON  # the V2 runner still sees (interpreted) Triton


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> Any:
    import vllm

    from uniprefill.testing import vllm_kwargs

    engine = vllm.LLM(
        str(tiny_llama),
        enforce_eager=True,
        max_model_len=2048,
        max_num_batched_tokens=2048,
        max_num_seqs=8,
        seed=0,
        additional_config={"uniprefill": {"top_p": 0.9}},
        **vllm_kwargs("llama"),
    )
    yield engine
    shutdown_engine(engine)
    del engine
    gc.collect()


def _prompt(n: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    return {"prompt_token_ids": [rng.randrange(5, 900) for _ in range(n)]}


def test_sampling_options_in_one_batch(llm: Any) -> None:
    import vllm

    S = vllm.SamplingParams
    params = [
        S(temperature=0.8, top_p=0.9, max_tokens=4),
        S(temperature=1.0, top_k=5, max_tokens=4),
        S(temperature=1.0, top_k=1, n=2, max_tokens=4),
        S(temperature=1.0, min_p=0.1, seed=3, max_tokens=4),
        S(temperature=0.7, top_k=5, top_p=0.5, min_p=0.05, seed=1, n=3, max_tokens=4),
        S(temperature=1.0, presence_penalty=1.0, repetition_penalty=1.2, max_tokens=4),
        S(temperature=1.0, top_k=3, logprobs=3, prompt_logprobs=2, max_tokens=4),
        S(temperature=0.0, max_tokens=4),
    ]
    # A long prompt among them: UniPrefill drops tokens in the same steps.
    prompts = [_prompt(1500 if i == 0 else 40, seed=i) for i in range(len(params))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for p, o in zip(params, outs, strict=True):
        assert len(o.outputs) == p.n
        assert all(len(c.token_ids) == 4 for c in o.outputs)

    # top_k 1 is greedy, whatever the temperature; n=2 gives it twice.
    greedy = llm.generate(prompts[2], S(temperature=0.0, max_tokens=4), use_tqdm=False)
    top1 = [list(c.token_ids) for c in outs[2].outputs]
    assert top1 == [list(greedy[0].outputs[0].token_ids)] * 2


def test_seeded_sampling_repeats(llm: Any) -> None:
    import vllm

    sp = vllm.SamplingParams(temperature=1.0, top_p=0.8, top_k=20, seed=7, max_tokens=6)
    runs = [llm.generate(_prompt(60, seed=9), sp, use_tqdm=False) for _ in range(2)]
    assert runs[0][0].outputs[0].token_ids == runs[1][0].outputs[0].token_ids
