"""Which new requests run dense: decided once per request, from its sampling parameters.

Pure (no vLLM import): the worker calls :func:`runs_dense` with the
``sampling_params`` of each ``NewRequestData`` in a step's scheduler output.
"""

from __future__ import annotations

from typing import Any

# Per-request settings: flat keys of vLLM's per-request extension,
# ``SamplingParams.extra_args`` (the OpenAI server's ``vllm_xargs``, whose values are
# flat: str, int, float or list).
ENABLED_KEY = "uniprefill_enabled"
MIN_PROMPT_LEN_KEY = "uniprefill_min_prompt_len"
TOP_P_KEY = "uniprefill_top_p"


def request_settings(sampling_params: Any) -> dict[str, Any]:
    """The request's own UniPrefill settings from ``extra_args`` (``{}``: the engine's).

    ``uniprefill_enabled``: true/false (or 1/0): false runs this request dense.
    ``uniprefill_min_prompt_len``: an integer >= 0 replacing the engine's
    ``min_prompt_len`` for this request.
    ``uniprefill_top_p``: a number in (0, 1] replacing the engine's ``top_p`` for this
    request (1.0: dense); not on an engine with a forced ``keep_ratio``.
    Raises ``ValueError`` naming the field and its allowed values; the front end turns
    it into a 400 before the request is admitted.
    """
    extra = getattr(sampling_params, "extra_args", None) or {}
    out: dict[str, Any] = {}
    if ENABLED_KEY in extra:
        value = extra[ENABLED_KEY]
        if isinstance(value, str) and value.lower() in ("true", "false"):
            value = value.lower() == "true"
        if value not in (True, False) or isinstance(value, float):  # 1/0 are allowed
            raise ValueError(f"{ENABLED_KEY} must be true or false, got {value!r}")
        out["enabled"] = bool(value)
    if MIN_PROMPT_LEN_KEY in extra:
        value = extra[MIN_PROMPT_LEN_KEY]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{MIN_PROMPT_LEN_KEY} must be an integer >= 0, got {value!r}")
        out["min_prompt_len"] = value
    if TOP_P_KEY in extra:
        value = extra[TOP_P_KEY]
        if isinstance(value, str):  # vllm_xargs from a command line arrive as text
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise ValueError(f"{TOP_P_KEY} must be a number in (0, 1], got {value!r}")
        out["top_p"] = float(value)
    return out


def runs_dense(sampling_params: Any) -> bool:
    """True when a new request must run dense: nothing of its prompt is ever dropped.

    Two kinds of request:

    * **Prompt logprobs** (``prompt_logprobs`` set): they need every prompt position.
    * **Beam search steps**: one token, with logprobs (``max_tokens == 1`` and
      ``logprobs`` set). vLLM (0.27.1 and 0.32.0, ``LLM.beam_search`` and the
      OpenAI server's ``use_beam_search``) runs beam search outside the engine: each
      step sends every live beam as a new request whose prompt is the original
      prompt plus that beam's tokens, with ``SamplingParams(logprobs=2 * beam_width,
      max_tokens=1, temperature=...)``, and ranks the beams by the summed logprobs.
      With prefix caching off (UniPrefill needs it off) every step re-prefills the
      whole sequence, so with drops each step, and each beam, would make its own
      selection over a different token set, and might drop the beam's own generated
      tokens: the beams' scores would be sums of logprobs taken under different
      contexts, comparable neither to each other nor to what a normal request
      decodes. Keeping one selection per beam search is not possible from the
      worker: the requests of one search are not linked (offline ids are a plain
      counter, online ones end in ``-beam-<i>`` plus a random suffix, and nothing
      says where the original prompt ends or when the search is over). So these
      run dense, and ``beam_search`` with UniPrefill on returns exactly the beams of
      dense vLLM.

    The worker cannot tell a beam search step from any other one-token request that
    asks for logprobs (e.g. scoring the next token's distribution): those run dense
    too, which costs only speed, and it is what such scoring wants. A one-token
    request without logprobs (a TTFT benchmark) still drops. ``None`` (a pooling
    request) returns False.
    """
    if sampling_params is None:
        return False
    if _settings_or_dense(sampling_params).get("enabled") is False:
        return True  # the request turned UniPrefill off (extra_args)
    if getattr(sampling_params, "prompt_logprobs", None) is not None:
        return True
    return (
        getattr(sampling_params, "max_tokens", None) == 1
        and getattr(sampling_params, "logprobs", None) is not None
    )


def may_drop(config: Any, prompt_len: int, sampling_params: Any) -> bool:
    """Whether the worker may drop tokens of this prompt, as the scheduler sees it.

    A superset of the prompts the worker drops (it also needs ``top_p < 1`` or a
    ``keep_ratio``, which the stats RPC may change on a running engine): the
    scheduler publishes to the prefix cache only the dense head of these prompts.
    """
    return (
        not runs_dense(sampling_params)
        and prompt_len >= min_prompt_len(config, sampling_params)
        and config.selection.scorable(prompt_len)
    )


def request_top_p(sampling_params: Any) -> float:
    """The request's own top_p (extra_args), NaN where it has none (the engine's)."""
    return float(_settings_or_dense(sampling_params).get("top_p", float("nan")))


def min_prompt_len(config: Any, sampling_params: Any) -> int:
    """The request's ``min_prompt_len``: its own (extra_args), else the engine's."""
    return int(_settings_or_dense(sampling_params).get("min_prompt_len", config.min_prompt_len))


def _settings_or_dense(sampling_params: Any) -> dict[str, Any]:
    # Past the front end's check a bad value cannot arrive; should one (a direct engine
    # client), the request runs dense rather than failing the engine step.
    try:
        return request_settings(sampling_params)
    except ValueError:
        return {"enabled": False}
