"""Which requests run their prefill dense (UniPrefill leaves them whole)."""

from __future__ import annotations

from typing import Any


def runs_dense(new_req_data: Any) -> bool:
    """Requests whose output needs every prompt position: prompt logprobs."""
    params = getattr(new_req_data, "sampling_params", None)
    return params is not None and getattr(params, "prompt_logprobs", None) is not None
