"""Self-distilled training text for a target's drafters: the target's own answers to prompts that are
no evaluation prompts, as EAGLE-3 and SpecForge regenerate their data (a drafter learns the target
as it actually writes, not a corpus the target never wrote).

Prompts, both made here and deterministic:
- code: the signature and docstring of functions of the running interpreter's standard library
  (outside its test folders, corpus.HELD_OUT_DIRS), as a completion prompt in HumanEval's form
  (the target continues the function body), encoded as a benchmark encodes HumanEval (the one
  prompt encoding, decoding/pipeline.py: unhealed, without the trailing whitespace);
- chat: requests assembled from the task and subject lists below, rendered with the checkpoint's
  chat template (lm/tokenizer.py).

Each prompt is answered greedily and at temperature `temperature` (seeded, so the answer depends
only on the seed, the prompt and the target) by specdec's batched plain decoding
(decoding/engine.plain_generate). Each answer is one jsonl line {"text": prompt text + answer
text, "kind", "temperature", "answer_tokens", "batch"}: the "text" field is what `specdec train --corpus`
reads (corpus.py). The file is appended one batch at a time and a rerun resumes after its last
complete batch, so an interrupted generation loses at most one batch.

This module knows nothing about drafters, losses or optimisers.
"""
from __future__ import annotations

import ast
import json
import random
import textwrap
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

import torch

from ..decoding.engine import plain_generate
from ..decoding.pipeline import Prompt as Encoded
from ..decoding.pipeline import encode, stop_rule
from ..decoding.sampling import SamplingConfig
from ..errors import SpecdecError
from ..lm.checkpoint import WEIGHTS, load_model, sha256
from ..lm.tokenizer import Tokenizer
from .corpus import HELD_OUT_DIRS, STDLIB, source_files

MAX_DOCSTRING = 1200  # characters: longer docstrings make prompts unlike HumanEval's


@dataclass(frozen=True)
class Recipe:
    """What a self-distilled corpus is made of; recorded beside it and in the trained drafter."""
    code_prompts: int = 1200        # standard-library functions
    chat_prompts: int = 1200        # chat requests
    max_new_tokens: int = 256       # per answer
    temperature: float = 0.8        # the sampled answer's (each prompt is also answered greedily)
    batch: int = 16                 # prompts decoded together
    seed: int = 0                   # picks the prompts and seeds the sampled answers


def code_prompts(n: int, seed: int = 0) -> list[str]:
    """`n` documented standard-library functions (`stdlib_functions`), in an order fixed by the seed."""
    found = [text for _, text in stdlib_functions()]
    random.Random(seed).shuffle(found)
    if len(found) < n:
        raise SpecdecError(f"the standard library has {len(found)} documented functions, fewer than the "
                           f"{n} code prompts asked for; ask for fewer")
    return found[:n]


@lru_cache(maxsize=1)
def stdlib_functions() -> tuple[tuple[str, str], ...]:
    """(file relative to the standard library, prompt) of every public, undecorated function or
    method with a docstring of at most MAX_DOCSTRING characters, outside the test folders: its
    signature and docstring, dedented, as HumanEval's prompts look."""
    root, files = source_files(STDLIB)
    found = []
    for f in files:
        rel = f.relative_to(root)
        if not HELD_OUT_DIRS & set(rel.parts[:-1]):
            found.extend((rel.as_posix(), text) for text in _documented_functions(f))
    return tuple(found)


def _documented_functions(path: Path) -> list[str]:
    """The prompts of one file (see `stdlib_functions`)."""
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
    except (UnicodeDecodeError, SyntaxError, ValueError):
        return []  # a handful of standard-library files are deliberately not UTF-8 or not Python 3
    lines = source.splitlines()
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        if not doc or len(doc) > MAX_DOCSTRING or node.decorator_list:
            continue
        out.append(textwrap.dedent("\n".join(lines[node.lineno - 1:node.body[0].end_lineno])) + "\n")
    return out


TASKS = (
    "Explain {} to a curious twelve-year-old.",
    "What are the main advantages and disadvantages of {}?",
    "Write a short poem about {}.",
    "Give me three practical tips related to {}.",
    "Summarize the history of {} in a few sentences.",
    "How would you describe {} to someone who has never heard of it?",
    "Write a friendly email inviting a colleague to a talk about {}.",
    "List five interesting facts about {}.",
    "What is a common misconception about {}?",
    "Write a two-paragraph story in which {} plays an important part.",
    "Compare {} with something similar and explain the difference.",
    "What questions should a beginner ask when learning about {}?",
    "Write a Python function related to {} and explain how it works.",
    "Why does {} matter in everyday life?",
    "Give a step-by-step plan for a weekend project about {}.",
    "Write a short dialogue between a teacher and a student about {}.",
)

SUBJECTS = (
    "photosynthesis", "the water cycle", "black holes", "volcanoes", "the human heart", "honey bees",
    "the printing press", "electric cars", "recycling", "compound interest", "time zones", "the moon landing",
    "sourdough bread", "chess openings", "learning a new language", "remote work", "public libraries",
    "the Roman Empire", "solar panels", "sleep", "coffee", "rainforests", "the internet", "vaccines",
    "sorting algorithms", "binary numbers", "recursion", "version control", "databases", "unit testing",
    "climate change", "the stock market", "budgeting", "gardening", "marathon training", "meditation",
    "jazz music", "the Olympic Games", "bicycles", "earthquakes", "the immune system", "machine learning",
    "prime numbers", "the Pythagorean theorem", "renewable energy", "ocean tides", "migratory birds",
    "friendship", "public speaking", "writing a resume", "job interviews", "cooking pasta", "board games",
    "the solar system", "DNA", "antibiotics", "the French Revolution", "origami", "photography", "bridges",
    "trains", "airplanes", "weather forecasts", "hash tables", "encryption", "open-source software",
    "spreadsheets", "the Python language", "regular expressions", "caching", "operating systems", "robots",
    "coral reefs", "deserts", "mountains", "museums", "traffic lights", "clocks", "maps", "money",
)


def chat_requests(n: int, seed: int = 0) -> list[str]:
    """`n` distinct user requests: tasks x subjects, in an order fixed by the seed."""
    every = [task.format(subject) for task in TASKS for subject in SUBJECTS]
    if len(every) < n:
        raise SpecdecError(f"there are {len(every)} chat requests, fewer than the {n} asked for; ask for fewer")
    random.Random(seed + 1).shuffle(every)
    return every[:n]


@dataclass(frozen=True)
class Prompt:
    kind: str           # "code" or "chat"
    text: str           # the prompt as text (a chat rendered by the template)
    encoded: Encoded    # what the target is given: its ids, and a chat's end-of-turn stop


def prompts(tokenizer: Tokenizer, recipe: Recipe) -> list[Prompt]:
    """The recipe's code prompts (encoded as a benchmark encodes HumanEval: unhealed, without the
    trailing whitespace) and chat prompts (one user message, rendered by the checkpoint's chat
    template), by the one prompt encoding (decoding/pipeline.py), alternating while both last: a
    corpus cut short keeps both kinds."""
    code = [Prompt("code", text.rstrip(), encode(tokenizer, text.rstrip(), heal=False))
            for text in code_prompts(recipe.code_prompts, recipe.seed)]
    chat = []
    if recipe.chat_prompts:
        rendering = tokenizer.chat_template()
        for request in chat_requests(recipe.chat_prompts, recipe.seed):
            messages = [{"role": "user", "content": request}]
            chat.append(Prompt("chat", rendering.render(messages), encode(tokenizer, messages=messages)))
    both = min(len(code), len(chat))
    return [p for pair in zip(code, chat) for p in pair] + code[both:] + chat[both:]


def jobs(recipe: Recipe, count: int) -> list[tuple[float, list[int]]]:
    """(temperature, prompt indices) of each batch: each batch of prompts greedily, then sampled."""
    return [(t, list(range(i, min(i + recipe.batch, count))))
            for i in range(0, count, recipe.batch) for t in (0.0, recipe.temperature)]


def generate_corpus(target: str | Path, out: str | Path, recipe: Recipe = Recipe(), progress=None) -> Path:
    """Write (or finish) the self-distilled corpus of `target` (a checkpoint folder) at `out`
    (.jsonl) and its recipe and the target's weights hash at `out` + ".json"; return `out`. A
    corpus begun with another recipe or target is refused."""
    out, target = Path(out), Path(target)
    about = out.with_suffix(out.suffix + ".json")
    wanted = {"recipe": asdict(recipe), "target_sha256": sha256(target / WEIGHTS)}
    if about.exists() and json.loads(about.read_text()) != wanted:
        raise SpecdecError(f"{out} was generated with another recipe or target ({about}); delete both to "
                           "generate it again, or write to another file")
    out.parent.mkdir(parents=True, exist_ok=True)
    if not about.exists():
        about.write_text(json.dumps(wanted, indent=1))
    tokenizer = Tokenizer.load(target)
    rows = prompts(tokenizer, recipe)
    todo = jobs(recipe, len(rows))
    done = _complete_batches(out, todo)
    if progress:
        progress(done, len(todo))
    if done == len(todo):
        return out
    model = load_model(target, dtype=torch.float32)
    for b, (temperature, picks) in enumerate(todo[done:], start=done):
        batch = [rows[i] for i in picks]
        answers = answer(model, tokenizer, batch, recipe, temperature)
        lines = [json.dumps({"text": p.text + a, "kind": p.kind, "temperature": temperature, "answer_tokens": n,
                             "batch": b}) for p, (a, n) in zip(batch, answers)]
        with out.open("a", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
        if progress:
            progress(b + 1, len(todo))
    return out


def answer(model, tokenizer: Tokenizer, batch: list[Prompt], recipe: Recipe, temperature: float
           ) -> list[tuple[str, int]]:
    """(answer text, answer tokens) of each prompt of one batch, ended by the checkpoint's EOS ids
    and the template's end of turn; a sampled batch is seeded by the recipe's seed (Gumbel noise
    fixed by seed and position, sampling.py)."""
    stops = tuple(sorted({s for p in batch for s in p.encoded.stop}))
    rule = stop_rule(tokenizer, recipe.max_new_tokens, stops)
    sampling = SamplingConfig(temperature, seed=recipe.seed if temperature else None)
    rows, _ = plain_generate(model, [p.encoded.ids for p in batch], rule, sampling, sampling.generator())
    return [(r.text(), len(r.tokens)) for r in rows]


def _complete_batches(out: Path, todo: list[tuple[float, list[int]]]) -> int:
    """How many of the first batches `out` holds whole; whatever follows them (a batch cut short by
    an interruption) is dropped from the file."""
    if not out.exists():
        return 0
    text = out.read_text(encoding="utf-8")
    lines = [line for line in text.splitlines(keepends=True) if line.endswith("\n")]
    kept, done = 0, 0
    while done < len(todo) and kept + len(todo[done][1]) <= len(lines):
        batch = lines[kept:kept + len(todo[done][1])]
        if any(json.loads(line)["batch"] != done for line in batch):
            break
        kept, done = kept + len(batch), done + 1
    if kept < len(lines) or not text.endswith("\n") and text:  # untouched when whole: training keys on its mtime
        out.write_text("".join(lines[:kept]), encoding="utf-8")
    return done


def corpus_for(target: str | Path, run: str | Path, recipe: Recipe) -> Path:
    """The self-distilled corpus of a training run folder (run/selfdistill/corpus.jsonl), generated
    or finished first, with a progress bar."""
    from tqdm import tqdm

    with tqdm(desc="self-distilled answers", unit="batch", dynamic_ncols=True) as bar:
        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)
        return generate_corpus(target, Path(run) / "selfdistill" / "corpus.jsonl", recipe, progress)
