"""A RULER-style synthetic long-context suite, generated locally and deterministically.

Five tasks after RULER (Hsieh et al., 2024): single-key needle retrieval, multi-key
needle (distractor keys), multi-value needle (all values of one key), variable tracking
(assignment chains), common-word extraction. Two more hide their facts in real prose
instead of filler (:data:`PROSE_TASKS`, from :mod:`uniprefill.eval.prose`): one fact
among distractors, and a two-hop question whose two facts sit apart. Each sample is
padded to a target length counted with the model's own tokenizer, so "4K" means 4K model tokens.
Scoring is RULER's string match: the fraction of expected strings found in the output.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

TASKS: tuple[str, ...] = ("niah_single", "niah_multikey", "niah_multivalue", "vt", "cwe")
# Real text instead of filler: facts hidden in prose (issue 25), reported apart from the
# synthetic suite. ``prose_2hop`` needs two facts that sit apart in the text.
PROSE_TASKS: tuple[str, ...] = ("prose_fact", "prose_2hop")
ALL_TASKS: tuple[str, ...] = TASKS + PROSE_TASKS

TokenCounter = Callable[[str], int]

# Plain filler the needles hide in; bland on purpose so it carries no competing facts.
_FILLER = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "The sea is deep.",
    "Here we go.",
    "There and back again.",
    "The road goes on and on.",
    "The day is long and the night is short.",
)

_CONSONANTS = "bcdfghjklmnprstvwz"
_VOWELS = "aeiou"


@dataclass(frozen=True)
class Sample:
    """One prompt of the suite; ``n_tokens`` is its length in the counting tokenizer."""

    task: str
    target_len: int
    index: int
    prompt: str
    answers: tuple[str, ...]
    n_tokens: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "task": self.task,
            "target_len": self.target_len,
            "index": self.index,
            "answers": list(self.answers),
            "n_tokens": self.n_tokens,
        }


def token_counter(tokenizer: Any) -> TokenCounter:
    """Count tokens as vLLM will see the prompt (special tokens such as BOS included)."""

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=True)["input_ids"])

    return count


def string_match_all(output: str, answers: Sequence[str]) -> float:
    """RULER's metric: fraction of ``answers`` contained in ``output``, case-insensitive."""
    if not answers:
        return 1.0
    low = output.lower()
    return sum(a.lower() in low for a in answers) / len(answers)


# ---------------------------------------------------------------------------------------
# building blocks


def _rng(seed: int, *parts: object) -> random.Random:
    # str seeds hash with sha512 in ``random``: stable across processes and platforms.
    return random.Random(":".join(str(p) for p in (seed, *parts)))


def _pseudo_word(rng: random.Random, syllables: int = 3) -> str:
    return "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(syllables))


def _distinct_words(rng: random.Random, n: int, syllables: int = 3) -> list[str]:
    seen: dict[str, None] = {}
    while len(seen) < n:
        seen.setdefault(_pseudo_word(rng, syllables), None)
    return list(seen)


def _number(rng: random.Random) -> str:
    return str(rng.randrange(1_000_000, 10_000_000))  # 7 digits, as in RULER


def _haystack(n_units: int, inserts: Sequence[tuple[float, str]]) -> str:
    """``n_units`` filler sentences with each ``(depth, text)`` placed at that depth."""
    units = [_FILLER[i % len(_FILLER)] for i in range(n_units)]
    # Insert from the deepest so earlier indices stay valid; ties keep the given order.
    order = sorted(range(len(inserts)), key=lambda j: (inserts[j][0], j), reverse=True)
    for j in order:
        depth, text = inserts[j]
        units.insert(round(depth * n_units), text)
    return " ".join(units)


def _fit(render: Callable[[int], str], count: TokenCounter, target: int, what: str) -> str:
    """The longest ``render(n)`` whose token count is <= ``target``."""
    base = count(render(0))
    if base > target:
        raise ValueError(f"{what}: the template alone is {base} tokens, over target {target}")
    probe = 64
    per_unit = max((count(render(probe)) - base) / probe, 1e-3)
    lo, hi = 0, max(1, int((target - base) / per_unit * 1.1) + 2)
    while count(render(hi)) <= target:  # make sure ``hi`` is over the target
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # invariant: render(lo) fits, render(hi) does not
        mid = (lo + hi) // 2
        if count(render(mid)) <= target:
            lo = mid
        else:
            hi = mid
    return render(lo)


# ---------------------------------------------------------------------------------------
# tasks: each returns (render(n_units) -> prompt, answers)

_NIAH_HEAD = (
    "Some special magic numbers are hidden within the following text. Make sure to "
    "memorize them. I will quiz you about the numbers afterwards.\n"
)


def _needle(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


def _niah(rng: random.Random, n_keys: int, n_values: int) -> tuple[Callable[[int], str], list]:
    keys = [
        f"{a}-{b}" for a, b in zip(*[iter(_distinct_words(rng, 2 * n_keys, 2))] * 2, strict=False)
    ]
    asked = keys[0]
    values = {k: [_number(rng) for _ in range(n_values if k == asked else 1)] for k in keys}
    inserts = [(rng.random(), _needle(k, v)) for k in keys for v in values[k]]
    rng.shuffle(inserts)
    if n_values > 1:
        question = (
            f"What are all the special magic numbers for {asked} mentioned in the provided "
            f"text? The special magic numbers for {asked} mentioned in the provided text are"
        )
    else:
        question = (
            f"What is the special magic number for {asked} mentioned in the provided text? "
            f"The special magic number for {asked} mentioned in the provided text is"
        )

    def render(n: int) -> str:
        return f"{_NIAH_HEAD}{_haystack(n, inserts)}\n{question}"

    return render, values[asked]


def _vt(rng: random.Random, n_hops: int = 4, n_chains: int = 2) -> tuple[Callable, list]:
    names = [w.upper() for w in _distinct_words(rng, n_chains * (n_hops + 1), 2)]
    chains = [names[c * (n_hops + 1) : (c + 1) * (n_hops + 1)] for c in range(n_chains)]
    values = [str(rng.randrange(10_000, 100_000)) for _ in range(n_chains)]
    while len(set(values)) < n_chains:
        values.append(str(rng.randrange(10_000, 100_000)))
        values = sorted(set(values), key=values.index)
    inserts: list[tuple[float, str]] = []
    for chain, value in zip(chains, values, strict=False):
        # Each chain's statements appear in order, at increasing random depths.
        depths = sorted(rng.random() for _ in chain)
        texts = [f"VAR {chain[0]} = {value}."] + [
            f"VAR {chain[i]} = VAR {chain[i - 1]}." for i in range(1, len(chain))
        ]
        inserts += list(zip(depths, texts, strict=False))
    head = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n"
    question = (
        f"Question: Find all variables that are assigned the value {values[0]} in the text "
        f"above. Answer: According to the chain(s) of variable assignment in the text above, "
        f"{n_hops + 1} variables are assigned the value {values[0]}, they are:"
    )

    def render(n: int) -> str:
        return f"{head}{_haystack(n, inserts)}\n{question}"

    return render, chains[0]


def _cwe(rng: random.Random, target: int, k: int = 5) -> tuple[Callable, list]:
    # Common words must stand out at every length: scale their count with the target.
    freq_common = max(6, min(30, target // 200))
    freq_rare = 2
    words = _distinct_words(rng, k + max(64, target // 2))
    common, rare = words[:k], words[k:]
    order_seed = rng.random()
    head = (
        "Below is a list of words. Some of them appear more often than others. Memorize "
        "the ones that appear most often.\n"
    )
    question = (
        f"Question: What are the {k} most common words in the above list? Answer: The top "
        f"{k} words that appear most often in the list are:"
    )

    def render(n: int) -> str:
        if n > len(rare):
            raise ValueError("cwe: word pool too small for this length")
        items = common * freq_common + rare[:n] * freq_rare
        random.Random(f"{order_seed}:{n}").shuffle(items)
        return f"{head}{', '.join(items)}\n{question}"

    return render, common


def make_sample(task: str, target_len: int, index: int, count: TokenCounter, seed: int) -> Sample:
    """Sample ``index`` of ``task`` at ``target_len`` tokens; the same arguments give the same
    sample."""
    rng = _rng(seed, task, target_len, index)
    if task == "niah_single":
        render, answers = _niah(rng, n_keys=1, n_values=1)
    elif task == "niah_multikey":
        render, answers = _niah(rng, n_keys=4, n_values=1)
    elif task == "niah_multivalue":
        render, answers = _niah(rng, n_keys=1, n_values=4)
    elif task == "vt":
        render, answers = _vt(rng)
    elif task == "cwe":
        render, answers = _cwe(rng, target_len)
    elif task in PROSE_TASKS:
        from uniprefill.eval.prose import prose_task

        render, answers = prose_task(rng, hops=2 if task == "prose_2hop" else 1)
    else:
        raise ValueError(f"unknown task {task!r}; choose from {ALL_TASKS}")
    prompt = _fit(render, count, target_len, task)
    return Sample(task, target_len, index, prompt, tuple(answers), count(prompt))


def generate_suite(
    tasks: Iterable[str],
    lengths: Iterable[int],
    samples_per_task: int,
    count: TokenCounter,
    seed: int = 0,
) -> list[Sample]:
    """All samples for every (task, length), ordered by length then task then index."""
    tasks, lengths = list(tasks), list(lengths)
    for t in tasks:
        if t not in ALL_TASKS:
            raise ValueError(f"unknown task {t!r}; choose from {ALL_TASKS}")
    return [
        make_sample(t, n, i, count, seed)
        for n in lengths
        for t in tasks
        for i in range(samples_per_task)
    ]
