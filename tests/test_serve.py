"""`uniprefill serve`, the documented server command: its argv, and end to end on CPU.

The end-to-end test runs the command the docs give (``uniprefill serve MODEL --top-p ...``)
on 127.0.0.1, sends completions with the ``openai`` client, checks that the server log
reports a dropped prefill, and stops the server with Ctrl-C (SIGINT).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from uniprefill.cli import main
from uniprefill.serve import SERVER_MODULE, serve_command, serve_env

# One INFO line per prefill that dropped tokens (logger ``vllm.uniprefill``, the worker):
# the share of the prompt alive after each drop layer, "%.3f".
DROPPED_LINE = re.compile(
    r"uniprefill: request (\S+) prefill dropped: prompt_tokens=(\d+) kept_share=\[([0-9., ]+)\]"
)


def test_serve_command_has_the_engine_flags_and_config() -> None:
    argv = serve_command("/m", {"top_p": 0.98}, ["--port", "8001"], python="py")
    assert argv[:5] == ["py", "-m", SERVER_MODULE, "--model", "/m"]
    assert not any("prefix-caching" in a or "eager" in a for a in argv)  # vLLM's defaults
    cfg = argv[argv.index("--additional-config") + 1]
    assert json.loads(cfg) == {"uniprefill": {"top_p": 0.98}}
    assert argv[-2:] == ["--port", "8001"]
    assert json.loads(serve_command("/m")[-1]) == {"uniprefill": {}}


def test_serve_env_sets_the_cpu_kv_cache_only_when_unset() -> None:
    assert serve_env({}, cpu=True)["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert serve_env({"VLLM_CPU_KVCACHE_SPACE": "2"}, cpu=True)["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert "VLLM_CPU_KVCACHE_SPACE" not in serve_env({}, cpu=False)


def test_serve_dry_run_prints_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["serve", "/m", "--top-p", "0.9", "--dry-run", "--port", "9", "--", "--seed", "3"])
        == 0
    )
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"-m {SERVER_MODULE} --model /m --additional-config" in line
    assert """'{"uniprefill":{"top_p":0.9}}'""" in line
    assert line.endswith("--port 9 --seed 3")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    pytest.fail(f"server not healthy after {timeout:.0f} s:\n{log.read_text()[-4000:]}")


def _stop(proc: subprocess.Popen, timeout: float = 60) -> int | None:
    """Ctrl-C the server; kill its own process group only if it does not stop."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        return None


def test_serve_end_to_end_on_cpu(tiny_llama: Path, tmp_path: Path) -> None:
    import psutil
    from openai import OpenAI
    from transformers import AutoTokenizer

    from uniprefill.eval.ruler import make_sample, token_counter

    count = token_counter(AutoTokenizer.from_pretrained(str(tiny_llama)))
    long_prompt = make_sample("niah_single", 1536, 0, count, seed=0).prompt  # drops at 0.9
    short_prompt = "The grass is green. The sky is"  # shorter than sink + last_q: kept

    port = _free_port()
    log = tmp_path / "server.log"
    cmd = [sys.executable, "-m", "uniprefill.cli", "serve", str(tiny_llama), "--top-p", "0.9"]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--dtype", "float32"]
    cmd += ["--max-model-len", "2048", "--max-num-batched-tokens", "2048", "--max-num-seqs", "4"]
    cmd += ["--enforce-eager"]  # torch.compile on 2 CPU cores would add minutes of start-up
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    env["PYTHONUNBUFFERED"] = "1"
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    children: list = []
    try:
        _wait_healthy(proc, f"http://127.0.0.1:{port}/health", log, timeout=300)
        children = psutil.Process(proc.pid).children(recursive=True)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120)
        (model,) = [m.id for m in client.models.list().data]
        assert model == str(tiny_llama)
        long = client.completions.create(
            model=model, prompt=long_prompt, max_tokens=4, temperature=0
        )
        short = client.completions.create(
            model=model, prompt=short_prompt, max_tokens=4, temperature=0
        )
        for c in (long, short):
            assert len(c.choices) == 1 and c.usage.completion_tokens >= 1
        n_prompt = long.usage.prompt_tokens
        assert 1400 <= n_prompt <= 1536
    finally:
        code = _stop(proc)
    text = log.read_text()
    assert code is not None, "the server did not stop on SIGINT:\n" + text[-3000:]
    # vLLM's engine-core process goes with it.
    _, alive = psutil.wait_procs(children, timeout=30)
    for p in alive:  # only what this test started
        p.kill()
    assert not alive, f"still running after the server stopped: {alive}"

    # The dropped prefill is reported, once, with the prompt's length; the short one is not.
    found = [m for m in DROPPED_LINE.finditer(text)]
    assert found, "no 'prefill dropped' line in the server log:\n" + text[-3000:]
    (m,) = found
    assert int(m.group(2)) == long.usage.prompt_tokens
    shares = [float(x) for x in m.group(3).split(",")]
    assert len(shares) == 4  # tiny Llama, 6 layers: drop layers 1, 2, 3, 4
    assert shares == sorted(shares, reverse=True) and 0.0 < shares[-1] < 1.0
