"""Accuracy evaluation: a RULER-style synthetic suite and a dense-vs-UniPrefill runner."""

from uniprefill.eval.ruler import TASKS, Sample, generate_suite, make_sample, string_match_all
from uniprefill.eval.runner import format_table, run_eval

__all__ = [
    "TASKS",
    "Sample",
    "format_table",
    "generate_suite",
    "make_sample",
    "run_eval",
    "string_match_all",
]
