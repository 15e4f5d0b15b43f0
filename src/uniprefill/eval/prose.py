"""Real-text haystacks for the suite: facts hidden in prose, one- and two-hop questions.

The filler suite hides its needles in eight repeated sentences; real prompts are prose,
and real questions combine facts. With no downloads, the prose is the documentation
that ships with Python itself: the docstrings of a fixed list of standard-library
modules, split into paragraphs (:func:`paragraphs`; 1,130 paragraphs, 222,000
characters, some 55K tokens on Python 3.11). A sample starts at a random paragraph
and reads on in order, so neighbouring paragraphs belong together; it is cut to length
by words, and each fact goes in at the paragraph break after its depth. The same
Python version gives the same prompts; the version is recorded with the results
(:func:`source`).

Facts use invented names (pseudo-words), so no answer can come from what the model
learned: ``prose_fact`` asks for the code of one of four archives; ``prose_2hop`` names
an archive's keeper in one sentence and the keeper's code in another, placed apart,
and asks for the code kept by the archive's keeper (four such pairs, one asked).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import random
import sys
from collections.abc import Callable

# Modules whose documentation is mostly prose (sorted members give a fixed order).
MODULES: tuple[str, ...] = (
    "argparse",
    "asyncio.events",
    "calendar",
    "collections",
    "configparser",
    "contextlib",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "email.message",
    "enum",
    "fractions",
    "functools",
    "http.client",
    "http.server",
    "inspect",
    "json",
    "logging",
    "pathlib",
    "pickle",
    "shutil",
    "statistics",
    "string",
    "subprocess",
    "tarfile",
    "textwrap",
    "threading",
    "typing",
    "unittest.case",
    "urllib.parse",
    "zipfile",
)
_MIN_CHARS = 80  # shorter paragraphs are mostly signatures and one-liners


def source() -> str:
    """Where the prose comes from (recorded beside results)."""
    return f"docstrings of {len(MODULES)} standard-library modules, Python {sys.version.split()[0]}"


@functools.lru_cache(maxsize=1)
def paragraphs() -> tuple[str, ...]:
    """The prose, as paragraphs with their whitespace collapsed, in a fixed order."""
    out: list[str] = []
    for name in MODULES:
        module = importlib.import_module(name)
        docs = [inspect.getdoc(module)]
        for attr in sorted(vars(module)):
            obj = vars(module)[attr]
            if attr.startswith("_") or getattr(obj, "__module__", None) != name:
                continue
            docs.append(inspect.getdoc(obj))
            if inspect.isclass(obj):
                docs += [inspect.getdoc(m) for k, m in sorted(vars(obj).items()) if k[0] != "_"]
        for doc in docs:
            for para in (doc or "").split("\n\n"):
                text = " ".join(para.split())
                if len(text) >= _MIN_CHARS and text not in out:
                    out.append(text)
    return tuple(out)


@functools.lru_cache(maxsize=1)
def _words() -> tuple[str, ...]:
    """The paragraphs as one stream of words; a paragraph's last word ends in a newline."""
    out: list[str] = []
    for para in paragraphs():
        words = para.split()
        out += words[:-1] + [words[-1] + "\n"]
    return tuple(out)


def _word(rng: random.Random) -> str:
    return "".join(rng.choice("bcdfghklmnprstvz") + rng.choice("aeiou") for _ in range(3))


def _names(rng: random.Random, n: int) -> list[str]:
    seen: dict[str, None] = {}
    while len(seen) < n:
        seen.setdefault(_word(rng).capitalize(), None)
    return list(seen)


def prose_task(rng: random.Random, hops: int) -> tuple[Callable[[int], str], list[str]]:
    """``(render(n_paragraphs) -> prompt, answers)`` of a one- or two-hop sample."""
    n_keys = 4
    places, keepers = _names(rng, n_keys), _names(rng, n_keys)
    codes = [str(rng.randrange(1_000_000, 10_000_000)) for _ in range(n_keys)]
    if hops == 1:
        facts = [
            f"The access code of the {p} archive is {c}."
            for p, c in zip(places, codes, strict=True)
        ]
        question = (
            f"What is the access code of the {places[0]} archive mentioned in the text? "
            f"The access code of the {places[0]} archive is"
        )
    else:
        facts = [
            f"The keeper of the {p} archive is {k}." for p, k in zip(places, keepers, strict=True)
        ]
        facts += [f"{k} keeps the access code {c}." for k, c in zip(keepers, codes, strict=True)]
        question = (
            f"Who keeps the {places[0]} archive, and which access code does that keeper "
            f"keep? Answer with the code. The access code kept by the keeper of the "
            f"{places[0]} archive is"
        )
    inserts = [(rng.random(), f) for f in facts]
    if hops == 2:  # the asked pair apart: keeper in the first half, code in the second
        inserts[0] = (rng.uniform(0.05, 0.45), facts[0])
        inserts[n_keys] = (rng.uniform(0.55, 0.95), facts[n_keys])
    words = _words()
    start = rng.randrange(len(words))
    head = (
        "Read the following documentation. Some facts about archives are hidden in it; "
        "you will be asked about them afterwards.\n"
    )

    def render(n: int) -> str:
        units = [words[(start + i) % len(words)] for i in range(n)]
        for depth, fact in sorted(inserts, key=lambda x: x[0], reverse=True):
            at = round(depth * n)
            while at < n and not units[at - 1].endswith("\n"):
                at += 1  # the next paragraph break (or the end)
            units.insert(at, fact + "\n")
        return head + " ".join(units).replace("\n ", "\n").rstrip() + "\n" + question

    return render, [codes[0]]
