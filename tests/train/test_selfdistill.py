"""Self-distilled corpora (train/selfdistill.py) on the shipped toy target given a chat template: the
greedy answers are the target's own greedy continuations (the reference decoder's, one prompt at a
time), the sampled ones its seeded samples, the code prompts come from outside the standard
library's test folders, the file is what `specdec train --corpus` reads, a second run is the same
file, an interrupted file resumes to the same bytes and a whole one is left untouched.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from specdec.decoding.reference import reference_generate
from specdec.decoding.sampling import SamplingConfig
from specdec.decoding.stopping import StopRule
from specdec.errors import SpecdecError
from specdec.lm.tokenizer import template
from specdec.lm.checkpoint import load_model
from specdec.lm.tokenizer import Tokenizer
from specdec.train.corpus import HELD_OUT_DIRS, Corpus
from specdec.train.selfdistill import Recipe, code_prompts, generate_corpus, jobs, prompts, stdlib_functions

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ("{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] }}<|endoftext|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}")
RECIPE = Recipe(code_prompts=3, chat_prompts=2, max_new_tokens=6, temperature=0.8, batch=2, seed=3)


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("selfdistill") / "target"
    shutil.copytree(ROOT / "models" / "target", path)
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "<|endoftext|>",
                                                            "bos_token": "<|bos|>"}))
    return path


@pytest.fixture(scope="module")
def corpus(chat_target, tmp_path_factory) -> Path:
    return generate_corpus(chat_target, tmp_path_factory.mktemp("out") / "corpus.jsonl", RECIPE)


def test_answers_are_the_targets_own_greedy_and_seeded_continuations(chat_target, corpus):
    tokenizer = Tokenizer.load(chat_target)
    model = load_model(chat_target, dtype=torch.float32)
    rows = [json.loads(line) for line in corpus.read_text().splitlines()]
    asked = prompts(tokenizer, RECIPE)
    stops = template(chat_target).stops
    order = [(t, i) for t, picks in jobs(RECIPE, len(asked)) for i in picks]
    assert len(rows) == 2 * len(asked) == 10
    assert [p.kind for p in asked] == ["code", "chat", "code", "chat", "code"]
    assert [(r["kind"], r["temperature"]) for r in rows[:4]] == [("code", 0), ("chat", 0), ("code", 0.8), ("chat", 0.8)]
    for row, (temperature, i) in zip(rows, order):
        sampling = SamplingConfig(temperature, seed=RECIPE.seed if temperature else None)
        want = reference_generate(model, asked[i].encoded.ids, StopRule(RECIPE.max_new_tokens, tokenizer.eos_ids,
                                                                stops, tokenizer.decode), sampling)
        assert row["temperature"] == temperature
        assert row["text"] == asked[i].text + want.text()
        assert row["answer_tokens"] == len(want.tokens)
    assert asked[1].text.startswith("<|bos|>user\n") and asked[1].text.endswith("<|bos|>assistant\n")


def test_the_same_recipe_writes_the_same_file_and_resumes_to_it(chat_target, corpus, tmp_path):
    again = tmp_path / "again.jsonl"
    generate_corpus(chat_target, again, RECIPE)
    assert again.read_bytes() == corpus.read_bytes()
    lines = corpus.read_text().splitlines(keepends=True)
    again.write_text("".join(lines[:5]) + lines[5][:7])  # two batches whole, the third cut inside its second line
    generate_corpus(chat_target, again, RECIPE)
    assert again.read_bytes() == corpus.read_bytes()
    written = again.stat().st_mtime_ns
    generate_corpus(chat_target, again, RECIPE)  # whole: left untouched, so a training run keyed on it resumes
    assert again.stat().st_mtime_ns == written
    with pytest.raises(SpecdecError, match="another recipe or target"):
        generate_corpus(chat_target, again, Recipe(code_prompts=2, chat_prompts=0, max_new_tokens=4))


def test_the_corpus_is_training_text_and_its_code_prompts_no_test_files(corpus):
    docs = Corpus([str(corpus)]).splits
    assert sum(map(len, docs.values())) == 10
    functions = stdlib_functions()
    assert len(functions) > 2000
    assert not any(HELD_OUT_DIRS & set(Path(name).parts[:-1]) for name, _ in functions)
    for prompt in code_prompts(40, seed=1):
        assert prompt.startswith(("def ", "async def ")) and prompt.rstrip().endswith(("\"", "'"))
