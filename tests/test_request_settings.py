"""Per-request UniPrefill settings through vLLM's per-request extension
(``SamplingParams.extra_args``; the OpenAI server's ``vllm_xargs``), issue 26.

A request may turn UniPrefill off or set its own ``min_prompt_len`` and ``top_p``, within a batch of
requests with other settings; a bad value is refused before admission and nothing else
changes. The server side (400 with the field's name) is in tests/test_serve.py.
"""

from __future__ import annotations

import gc
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from uniprefill.testing import shutdown_engine
from uniprefill.vllm.requests import may_drop, request_settings, runs_dense


def _sp(**extra: Any) -> Any:
    return SimpleNamespace(extra_args=extra, prompt_logprobs=None, max_tokens=8, logprobs=None)


def test_settings_parse_and_validate() -> None:
    assert request_settings(_sp()) == {}
    assert request_settings(SimpleNamespace(extra_args=None)) == {}
    assert request_settings(_sp(uniprefill_enabled=False)) == {"enabled": False}
    assert request_settings(_sp(uniprefill_enabled="true")) == {"enabled": True}
    assert request_settings(_sp(uniprefill_enabled=0)) == {"enabled": False}
    assert request_settings(_sp(uniprefill_min_prompt_len=7)) == {"min_prompt_len": 7}
    assert request_settings(_sp(uniprefill_top_p=0.5)) == {"top_p": 0.5}
    assert request_settings(_sp(uniprefill_top_p=1)) == {"top_p": 1.0}
    assert request_settings(_sp(uniprefill_top_p="0.95")) == {"top_p": 0.95}  # --vllm-xargs
    assert request_settings(_sp(other_plugin=1)) == {}  # other keys are not ours
    bad = [
        ({"uniprefill_enabled": "maybe"}, "uniprefill_enabled must be true or false"),
        ({"uniprefill_enabled": 0.5}, "uniprefill_enabled must be true or false"),
        ({"uniprefill_min_prompt_len": -1}, "uniprefill_min_prompt_len must be an integer >= 0"),
        ({"uniprefill_min_prompt_len": 1.5}, "uniprefill_min_prompt_len must be an integer >= 0"),
        ({"uniprefill_top_p": 0}, r"uniprefill_top_p must be a number in \(0, 1\], got 0"),
        ({"uniprefill_top_p": 1.5}, r"uniprefill_top_p must be a number in \(0, 1\]"),
        ({"uniprefill_top_p": True}, r"uniprefill_top_p must be a number in \(0, 1\]"),
        ({"uniprefill_top_p": "high"}, r"uniprefill_top_p must be a number in \(0, 1\]"),
    ]
    for extra, message in bad:
        with pytest.raises(ValueError, match=message):
            request_settings(_sp(**extra))


def test_dense_and_may_drop_follow_the_request() -> None:
    cfg = SimpleNamespace(
        min_prompt_len=1000, selection=SimpleNamespace(scorable=lambda n: n > 256)
    )
    assert runs_dense(_sp(uniprefill_enabled=False))
    assert not runs_dense(_sp(uniprefill_enabled=True))
    assert not may_drop(cfg, 500, _sp())  # the engine's min_prompt_len
    assert may_drop(cfg, 500, _sp(uniprefill_min_prompt_len=0))  # the request's
    assert not may_drop(cfg, 2000, _sp(uniprefill_min_prompt_len=4000))
    assert not may_drop(cfg, 2000, _sp(uniprefill_enabled=False))
    # A bad value that got past the front end runs dense, never fails the engine.
    assert runs_dense(_sp(uniprefill_min_prompt_len=-3))


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> Any:
    import vllm

    from uniprefill.testing import vllm_kwargs

    # The engine drops only prompts of 4000+ tokens: a request's own min_prompt_len
    # must be able to lower it as well as raise it.
    engine = vllm.LLM(
        str(tiny_llama),
        enforce_eager=True,
        max_model_len=2048,
        max_num_batched_tokens=8192,
        max_num_seqs=8,
        enable_prefix_caching=False,
        seed=0,
        additional_config={"uniprefill": {"top_p": 0.9, "min_prompt_len": 4000}},
        **vllm_kwargs("llama"),
    )
    yield engine
    shutdown_engine(engine)
    del engine
    gc.collect()


def _prompts(n: int) -> list[dict[str, Any]]:
    rng = random.Random(1)
    return [{"prompt_token_ids": [rng.randrange(5, 900) for _ in range(1500)]} for _ in range(n)]


def test_mixed_settings_in_one_batch_match_each_request_alone(llm: Any) -> None:
    import vllm

    from uniprefill.vllm.stats import collect, since

    def sp(**extra: Any) -> Any:
        return vllm.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, extra_args=extra)

    drop = {"uniprefill_min_prompt_len": 0}
    settings = [
        {},  # the engine's min_prompt_len (4000): dense
        drop,  # drops at the engine's top_p (0.9)
        {**drop, "uniprefill_enabled": False},  # off: dense
        {"uniprefill_min_prompt_len": 1000},  # drops
        {**drop, "uniprefill_top_p": 1.0},  # its own top_p 1.0: dense
        {**drop, "uniprefill_top_p": 0.3},  # its own top_p: keeps less than at 0.9
    ]
    dropping = [False, True, False, True, False, True]
    prompts = _prompts(len(settings))
    prompts[5] = prompts[1]  # the same prompt at 0.9 and at 0.3
    before = collect(llm)
    batch = llm.generate(prompts, [sp(**s) for s in settings], use_tqdm=False)
    assert since(before, collect(llm))["dropped_prefills"] == sum(dropping)
    kept = []
    for prompt, s, out, drops in zip(prompts, settings, batch, dropping, strict=True):
        before = collect(llm)
        (alone,) = llm.generate([prompt], sp(**s), use_tqdm=False)
        delta = since(before, collect(llm))
        assert delta["dropped_prefills"] == int(drops), s
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids, s
        kept.append(delta["kept_tokens"])
    assert sum(kept[5]) < sum(kept[1]), kept  # the request's top_p took effect


def test_a_bad_value_is_refused_and_the_engine_goes_on(llm: Any) -> None:
    import vllm

    bad = vllm.SamplingParams(max_tokens=2, extra_args={"uniprefill_min_prompt_len": -1})
    # vLLM's VLLMValidationError: the OpenAI server answers it with a 400.
    with pytest.raises(Exception, match="uniprefill_min_prompt_len must be an integer >= 0"):
        llm.generate(_prompts(1), bad, use_tqdm=False)
    (out,) = llm.generate(_prompts(1), vllm.SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2
