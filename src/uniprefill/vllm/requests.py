"""Which new requests run dense: decided once per request, from its sampling parameters.

Pure (no vLLM import): the worker calls :func:`runs_dense` with the
``sampling_params`` of each ``NewRequestData`` in a step's scheduler output.
"""

from __future__ import annotations

from typing import Any


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
        and prompt_len >= config.min_prompt_len
        and config.selection.scorable(prompt_len)
    )
