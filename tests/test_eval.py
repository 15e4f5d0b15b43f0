"""The RULER-style generators, scorer and runner helpers; one short end-to-end run."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from uniprefill.eval.ruler import ALL_TASKS, TASKS, generate_suite, make_sample, string_match_all
from uniprefill.eval.runner import format_table, kept_summary, stats_delta


def _whitespace_counter(text: str) -> int:
    # A stand-in tokenizer: one token per whitespace-separated piece, plus a BOS.
    return len(text.split()) + 1


@pytest.fixture(scope="module")
def tiny_counter(tiny_llama: Path):
    from transformers import AutoTokenizer

    from uniprefill.eval.ruler import token_counter

    return token_counter(AutoTokenizer.from_pretrained(str(tiny_llama)))


@pytest.mark.parametrize("task", ALL_TASKS)
def test_deterministic_from_seed(task: str) -> None:
    a = make_sample(task, 600, 0, _whitespace_counter, seed=5)
    b = make_sample(task, 600, 0, _whitespace_counter, seed=5)
    c = make_sample(task, 600, 0, _whitespace_counter, seed=6)
    d = make_sample(task, 600, 1, _whitespace_counter, seed=5)
    assert a == b
    assert a.prompt != c.prompt and a.prompt != d.prompt


@pytest.mark.parametrize("task", ALL_TASKS)
@pytest.mark.parametrize("length", [512, 2048, 8192])
def test_lengths_and_answers(task: str, length: int, tiny_counter) -> None:
    s = make_sample(task, length, 0, tiny_counter, seed=0)
    assert s.n_tokens == tiny_counter(s.prompt)
    assert 0.97 * length <= s.n_tokens <= length
    assert s.answers and all(a in s.prompt for a in s.answers)


def test_prose_tasks_hide_their_facts_in_real_text(tiny_counter) -> None:
    one = make_sample("prose_fact", 2048, 0, tiny_counter, seed=1)
    two = make_sample("prose_2hop", 2048, 0, tiny_counter, seed=1)
    # The asked fact and three distractors.
    assert len(re.findall(r"The access code of the \w+ archive is \d{7}\.", one.prompt)) == 4
    assert two.prompt.count(" keeps the access code ") == 4
    # The asked keeper fact comes first, its code fact later (each at the paragraph break
    # after a depth drawn from the first and the second half).
    asked = two.prompt.rsplit("keeper of the ", 1)[1].split(" archive")[0]
    keeper = two.prompt.split(f"The keeper of the {asked} archive is ")[1].split(".")[0]
    at_keeper = two.prompt.index(f"The keeper of the {asked} archive is")
    at_code = two.prompt.index(f"{keeper} keeps the access code {two.answers[0]}")
    assert at_keeper < at_code
    assert "The grass is green." not in one.prompt + two.prompt  # no filler


def test_answers_per_task(tiny_counter) -> None:
    by_task = {t: make_sample(t, 1024, 0, tiny_counter, seed=1) for t in TASKS}
    assert len(by_task["niah_single"].answers) == 1
    assert len(by_task["niah_multivalue"].answers) == 4
    assert len(by_task["vt"].answers) == 5
    assert len(by_task["cwe"].answers) == 5
    # multikey: four keys are hidden, one is asked about.
    assert by_task["niah_multikey"].prompt.count("One of the special magic numbers for") == 4
    # cwe: every common word is more frequent than any other word of the list.
    cwe = by_task["cwe"]
    words = cwe.prompt.split("\n")[1].split(", ")
    counts = {w: words.count(w) for w in set(words)}
    rare_max = max(c for w, c in counts.items() if w not in cwe.answers)
    assert min(counts[w] for w in cwe.answers) > rare_max
    # vt: the first variable is assigned the value, the rest chain from it.
    vt = by_task["vt"]
    value = vt.prompt.rsplit("assigned the value ", 1)[1].split(",")[0]
    assert f"VAR {vt.answers[0]} = {value}." in vt.prompt
    for prev, cur in zip(vt.answers, vt.answers[1:], strict=False):
        assert f"VAR {cur} = VAR {prev}." in vt.prompt


def test_template_too_long_is_an_error() -> None:
    with pytest.raises(ValueError, match="over target"):
        make_sample("niah_single", 10, 0, _whitespace_counter, seed=0)


def test_suite_order_and_unknown_task() -> None:
    suite = generate_suite(["vt", "cwe"], [700, 500], 2, _whitespace_counter, seed=0)
    assert [(s.target_len, s.task, s.index) for s in suite][:3] == [
        (700, "vt", 0),
        (700, "vt", 1),
        (700, "cwe", 0),
    ]
    with pytest.raises(ValueError, match="unknown task"):
        generate_suite(["nope"], [500], 1, _whitespace_counter)


def test_string_match_all() -> None:
    assert string_match_all("The number is 1234.", ["1234"]) == 1.0
    assert string_match_all("abc DEF", ["def", "ghi"]) == 0.5
    assert string_match_all("nothing", ["x"]) == 0.0
    assert string_match_all("", []) == 1.0


def test_stats_helpers_and_table() -> None:
    before = {"drop_layers": [2, 4], "kept_tokens": [10, 5], "seen_tokens": [20, 10]}
    after = {"drop_layers": [2, 4], "kept_tokens": [70, 35], "seen_tokens": [120, 70]}
    delta = stats_delta(after, before)
    assert delta["kept_tokens"] == [60, 30] and delta["seen_tokens"] == [100, 60]
    summary = kept_summary(delta)
    assert summary["kept_ratio"] == pytest.approx((0.6 + 0.5) / 2)
    assert summary["final_kept_share"] == pytest.approx(0.3)
    assert kept_summary(None)["kept_ratio"] is None
    result = {
        "dense": {"accuracy": {"vt": {"512": 50.0}}, "mean": 50.0},
        "uniprefill": {"accuracy": {"vt": {"512": 25.0}}, "mean": 25.0, **summary},
        "diff": {"vt": {"512": -25.0}},
        "mean_diff": -25.0,
    }
    table = format_table(result)
    assert "| vt | 512 | 50.0 | 25.0 | -25.0 |" in table and "0.550" in table


def test_cli_config_from_options() -> None:
    from uniprefill.cli import build_parser, method_config

    args = build_parser().parse_args(
        ["eval", "llama", "--lengths", "1k,2048", "--top-p", "0.9", "--drop-layers", "2,4"]
    )
    assert args.lengths == [1024, 2048]
    assert method_config(args) == {"top_p": 0.9, "drop_layers": [2, 4]}


_HAS_PLUGIN = importlib.util.find_spec("uniprefill.vllm.plugin") is not None


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_run_eval_end_to_end(tiny_llama: Path, tmp_path: Path) -> None:
    """Two short prompts through vLLM, dense and (when the plugin exists) with UniPrefill."""
    from uniprefill.eval.runner import run_eval

    cfg = {"top_p": 1.0} if _HAS_PLUGIN else None
    result = run_eval(
        str(tiny_llama),
        tasks=["niah_single", "vt"],
        lengths=[384],
        samples_per_task=1,
        seed=0,
        uniprefill_config=cfg,
        max_new_tokens=4,
        llm_kwargs={"dtype": "float32"},
    )
    assert set(result["dense"]["accuracy"]) == {"niah_single", "vt"}
    assert len(result["samples"]) == 2
    assert all(isinstance(r["dense_output"], str) for r in result["samples"])
    if cfg is not None:
        # top_p = 1 keeps every block: the output must equal dense exactly.
        assert [r["uniprefill_output"] for r in result["samples"]] == [
            r["dense_output"] for r in result["samples"]
        ]
    json.dumps(result)  # JSON-serialisable as written by --json


def test_too_long_for_the_model_is_refused_before_vllm(tiny_llama: Path) -> None:
    from uniprefill.eval.runner import run_eval

    # The tiny model has 4096 positions: a 4096-token prompt leaves no room for output.
    with pytest.raises(ValueError, match="needs .* positions but the model has 4096"):
        run_eval(str(tiny_llama), tasks=["niah_single"], lengths=[4096], samples_per_task=1)


def test_cli_llm_args() -> None:
    from uniprefill.cli import llm_args

    assert llm_args(["disable_hybrid_kv_cache_manager=true", "max_num_seqs=4", "x=abc"]) == {
        "disable_hybrid_kv_cache_manager": True,
        "max_num_seqs": 4,
        "x": "abc",
    }
    with pytest.raises(SystemExit):
        llm_args(["novalue"])
