"""The structured workload: 54 JSON-output tasks made here (JSON extraction from short texts,
tool-call arguments, enum classification), each a chat prompt and its JSON Schema, and a run of
one decoding configuration over them with validity, tokens/s, forced share and α.

`validate(value, schema)` checks the subset of JSON Schema these schemas use (object with
properties / required / additionalProperties false, string with maxLength, integer and number with
minimum / maximum, boolean, enum, array of such items with maxItems), so the validity rate does not
rely on the library that constrained the output.

A number of unbounded precision lets a small model write digits until max_new_tokens (SmolLM2
wrote 0.0000000001222222223333... for a confidence in [0, 1]), which ends with finish reason
"length", exactly as it should; the classifications therefore ask for an integer percentage.

`bench_structured` is `specdec bench structured`: plain constrained decoding (k = 0, no forced
drafts: the baseline, as vLLM and llama.cpp decode under a grammar) against forced drafts alone and
forced drafts with each drafter (which also drafts under the mask), interleaved task by task,
greedy and sampled (seeded, so every configuration emits the same tokens), with the mask's cost
against a plain step; `format_structured` prints its table with the conditions.

This module knows nothing about the engine's internals: it calls api.generate.
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch

from ..decoding.constraint import Constraint, compile_constraint, masked
from ..decoding.guided import GrammarDrafts

PEOPLE = [("Ada Lovelace", 36, "London"), ("Alan Turing", 41, "Manchester"), ("Grace Hopper", 85, "Arlington"),
          ("Edsger Dijkstra", 72, "Nuenen"), ("Barbara Liskov", 84, "Boston"), ("Donald Knuth", 86, "Stanford"),
          ("Margaret Hamilton", 87, "Boston"), ("Linus Torvalds", 54, "Portland"), ("Frances Allen", 88, "Peru"),
          ("John Backus", 82, "Ashland"), ("Radia Perlman", 72, "Redmond"), ("Ken Thompson", 81, "Menlo Park"),
          ("Dennis Ritchie", 70, "Berkeley"), ("Hedy Lamarr", 85, "Orlando"), ("Tim Berners-Lee", 69, "Oxford"),
          ("Katherine Johnson", 101, "Newport News"), ("Niklaus Wirth", 89, "Zurich"), ("Guido van Rossum", 68,
                                                                                          "Belmont")]
TOOLS = [("get_weather", {"city": {"type": "string", "maxLength": 30},
                          "unit": {"enum": ["celsius", "fahrenheit"]}}, "What is the weather in {city} in celsius?"),
         ("book_table", {"restaurant": {"type": "string", "maxLength": 30}, "people": {"type": "integer", "minimum": 1,
                                                                                        "maximum": 20},
                         "time": {"type": "string", "maxLength": 8}}, "Book a table for {n} at Luigi's at 19:30."),
         ("send_email", {"to": {"type": "string", "maxLength": 40}, "subject": {"type": "string", "maxLength": 40},
                         "urgent": {"type": "boolean"}}, "Email {name} about the meeting; it is urgent."),
         ("convert_currency", {"amount": {"type": "number", "minimum": 0}, "from": {"enum": ["USD", "EUR", "GBP"]},
                               "to": {"enum": ["USD", "EUR", "GBP"]}}, "Convert {n}0 dollars to euros.")]
LABELS = [("sentiment", ["positive", "negative", "neutral"], ["I loved this film.", "The food was cold and bland.",
                                                              "The parcel arrived on Tuesday."]),
          ("topic", ["sports", "politics", "science", "music"], ["The striker scored twice.",
                                                                 "The senate passed the bill.",
                                                                 "The telescope found a new planet."]),
          ("language", ["english", "french", "german", "spanish"], ["Bonjour, comment allez-vous?",
                                                                    "Guten Morgen!", "Where is the station?"]),
          ("urgency", ["low", "medium", "high"], ["The server is down for all users.",
                                                  "Please update the docs when you can.",
                                                  "The build is slow today."])]


@dataclass(frozen=True)
class Task:
    kind: str       # "extraction" | "tool-call" | "classification"
    prompt: str     # the user's message
    schema: dict


def obj(properties: dict) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


def tasks() -> list[Task]:
    """18 extractions, 24 tool calls, 12 classifications: 54 tasks, each with its own schema."""
    out = []
    person = {"name": {"type": "string", "maxLength": 30}, "age": {"type": "integer", "minimum": 0, "maximum": 130},
              "city": {"type": "string", "maxLength": 30}}
    for i, (name, age, city) in enumerate(PEOPLE):
        extra = [{}, {"retired": {"type": "boolean"}}, {"skills": {"type": "array", "items": {
            "type": "string", "maxLength": 20}, "maxItems": 3}}][i % 3]
        text = f"{name} is {age} years old and lives in {city}."
        out.append(Task("extraction", f"Extract the person as JSON. Text: {text}", obj({**person, **extra})))
    for i, (name, age, city) in enumerate(PEOPLE[:6]):
        for tool, params, ask in TOOLS:
            question = ask.format(city=city, n=2 + i, name=name.split()[0])
            out.append(Task("tool-call", f"Call {tool} for this request, arguments as JSON: {question}", obj(params)))
    for field, labels, texts in LABELS:
        for text in texts:
            out.append(Task("classification", f"Classify the {field} of this text as JSON, with your confidence in "
                                              f"percent. Text: {text}",
                            obj({field: {"enum": labels}, "confidence": {"type": "integer", "minimum": 0,
                                                                          "maximum": 100}})))
    return out


def validate(value, schema: dict) -> bool:
    """Whether value satisfies the schema (the subset of JSON Schema used here)."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema["type"]
    if kind == "object":
        props = schema["properties"]
        return (isinstance(value, dict) and set(schema.get("required", ())) <= set(value)
                and (schema.get("additionalProperties", True) or set(value) <= set(props))
                and all(validate(v, props[k]) for k, v in value.items() if k in props))
    if kind == "array":
        return (isinstance(value, list) and len(value) <= schema.get("maxItems", len(value))
                and all(validate(v, schema["items"]) for v in value))
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
    if kind == "boolean":
        return isinstance(value, bool)
    numeric = isinstance(value, int) if kind == "integer" else isinstance(value, (int, float))
    return (numeric and not isinstance(value, bool) and schema.get("minimum", value) <= value
            <= schema.get("maximum", value))


def valid_json(text: str, schema: dict) -> bool:
    try:
        return validate(json.loads(text), schema)
    except json.JSONDecodeError:
        return False


def run(target, workload: list[Task], max_new_tokens: int = 96, proposer=None, k=None, temperature: float = 0.0,
        seed: int | None = 0, chat: bool = True) -> dict:
    """Every task through api.generate under its schema, one at a time (batch 1), as a chat (or, for
    a model without a chat template, chat=False: the prompt as text): validity (outputs
    that finished and validate / tasks), tokens/s over the whole run, forced share (forced drafts
    emitted / tokens), α and steps (`summed`)."""
    from ..api import generate
    parts = []
    for task in workload:
        t0 = time.perf_counter()
        asked = {"messages": [{"role": "user", "content": task.prompt}]} if chat else {"prompts": task.prompt + "\n"}
        r = generate(target, **asked, max_new_tokens=max_new_tokens,
                     temperature=temperature, seed=seed if temperature else None, proposer=proposer, k=k,
                     constraint=Constraint.json_schema(task.schema))
        s = r.stats
        parts.append({"tasks": 1, "valid": int(r.finish_reasons[0] == "eos" and valid_json(r.texts[0], task.schema)),
                      "hit_length": int(r.finish_reasons[0] == "length"), "tokens": s["new_tokens"],
                      "seconds": time.perf_counter() - t0, **{key: s.get(key, 0) for key in (
                          "steps", "forced", "proposed", "accepted")}})
    return summed(parts)


def spread_tasks(n: int | None) -> list[Task]:
    """n of the 54 tasks, evenly spread over the three kinds (all: None)."""
    workload = tasks()
    if n is None or n >= len(workload):
        return workload
    return [workload[i * len(workload) // n] for i in range(n)]


def configurations(drafters: dict, ks: list[int], auto: bool) -> dict:
    """name -> (proposer, k): the baseline (plain constrained decoding), forced drafts alone at each
    k, and forced drafts with each of `drafters` (name -> proposer) at each k (and k = "auto" where
    `auto`)."""
    configs = {BASELINE: (None, None)}
    configs.update({f"forced k={k}": (GrammarDrafts(), k) for k in ks})
    for method, proposer in drafters.items():
        configs.update({f"forced + {method} k={k}": (proposer, k) for k in [*ks, *(["auto"] if auto else [])]})
    return configs


BASELINE = "plain constrained (k=0)"


def bench_structured(target, configs: dict, temperatures: list[float], workload: list[Task],
                     max_new_tokens: int = 96, repeats: int = 1) -> dict:
    """Every configuration on every task, interleaved (all configurations on one task, then the
    next; the whole pass `repeats` times), at each temperature (seed 0); per configuration the
    totals (`run`'s figures) and its tokens/s over the baseline's, the median over repeats. A
    target without a chat template gets the prompts as text."""
    chat, rows = target.tokenizer.has_chat_template, []
    for proposer, k in configs.values():  # warm-up, untimed: kernels, allocator, -k auto's verify curve
        run(target, workload[:1], 8, proposer, k, chat=chat)
    for temperature in temperatures:
        passes = [{name: [] for name in configs} for _ in range(repeats)]
        for parts in passes:
            for task in workload:
                for name, (proposer, k) in configs.items():
                    parts[name].append(run(target, [task], max_new_tokens, proposer, k, temperature, chat=chat))
        for name in configs:
            totals = [summed(parts[name]) for parts in passes]
            ratios = [t["tokens_per_s"] / summed(parts[BASELINE])["tokens_per_s"] for t, parts in zip(totals, passes)]
            rows.append({"configuration": name, "temperature": temperature, **totals[len(totals) // 2],
                         "speedup": statistics.median(ratios), "speedups": ratios})
    return {"rows": rows, "mask": mask_cost(target, workload[0]), "conditions": conditions(
        target, workload, chat, max_new_tokens, temperatures, repeats)}


def summed(parts: list[dict]) -> dict:
    """One configuration's `run` results over several tasks, added up."""
    total = {key: sum(p[key] for p in parts) for key in ("tasks", "valid", "hit_length", "tokens", "seconds",
                                                          "steps", "forced", "proposed", "accepted")}
    return {**total, "validity": total["valid"] / total["tasks"], "tokens_per_s": total["tokens"] / total["seconds"],
            "forced_share": total["forced"] / total["tokens"] if total["tokens"] else 0.0,
            "alpha": total["accepted"] / total["proposed"] if total["proposed"] else None}


@torch.inference_mode()
def mask_cost(target, task: Task) -> dict:
    """The mask per token (the grammar's bitmask, unpacked, applied to a row of logits) against a
    plain one-token step of the target, medians over one valid document of the task's schema."""
    vocab = target.model.config.vocab_size
    matcher = compile_constraint(Constraint.json_schema(task.schema), target.tokenizer, vocab).matcher()
    ids = target.tokenizer.encode(json.dumps(example(task.schema), separators=(",", ":")))
    logits, bits = torch.randn(1, vocab), np.zeros((1, matcher.words), dtype=np.int32)
    cache = target.model.new_cache(1, len(ids) + 1)
    mask_s, step_s = [], []
    for t in ids:
        t0 = time.perf_counter()
        matcher.mask_into(bits[0])
        masked(logits, bits)
        t1 = time.perf_counter()
        target.model(torch.tensor([[t]]), cache=cache)
        step_s.append(time.perf_counter() - t1)
        mask_s.append(t1 - t0)
        matcher.advance([t])
    mask, step = statistics.median(mask_s), statistics.median(step_s)
    return {"mask_per_token_ms": 1e3 * mask, "plain_step_ms": 1e3 * step, "mask_share_of_step": mask / step}


def example(schema: dict):
    """A small value of the schema (mask_cost's document)."""
    if "enum" in schema:
        return schema["enum"][0]
    return {"object": lambda: {k: example(v) for k, v in schema["properties"].items()}, "array": lambda: [],
            "string": lambda: "Ada", "boolean": lambda: True, "integer": lambda: schema.get("minimum", 0) + 1,
            "number": lambda: 2.5}[schema["type"]]()


def conditions(target, workload: list[Task], chat: bool, max_new_tokens: int, temperatures: list[float],
               repeats: int) -> dict:
    from .conditions import hardware, model_info, software
    return {"target": model_info(target.model, target.path),
            "workload": f"structured: {len(workload)} of the {len(tasks())} tasks (bench/structured.py), each "
                        f"{'a chat prompt' if chat else 'a prompt as text (no chat template)'} under its JSON Schema",
            "max_new_tokens": max_new_tokens,
            "sampling": f"temperatures {temperatures}, seed 0 when sampled", "batch_size": 1, "repeats": repeats,
            "baseline": "plain constrained decoding: k = 0, no forced drafts, the same masks",
            "tokens_per_s": "output tokens / wall time, each request's prefill and schema compilation included",
            "hardware": hardware(), "software": software(), "torch_threads": torch.get_num_threads()}


def format_structured(result: dict) -> str:
    lines = ["| configuration | T | valid | tokens | steps | tokens/s | forced share | α | speedup (min-max) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        alpha = "–" if r["alpha"] is None else f"{r['alpha']:.2f}"
        lines.append(f"| {r['configuration']} | {r['temperature']:g} | {r['validity']:.0%} | {r['tokens']} | "
                     f"{r['steps']} | {r['tokens_per_s']:.1f} | {r['forced_share']:.0%} | {alpha} | "
                     f"**{r['speedup']:.2f}x** ({min(r['speedups']):.2f}-{max(r['speedups']):.2f}) |")
    m, c = result["mask"], result["conditions"]
    lines.append(f"\nmask {m['mask_per_token_ms']:.2f} ms per token against a plain step of {m['plain_step_ms']:.1f} "
                 f"ms ({m['mask_share_of_step']:.1%}). {c['target']['name']} ({c['target']['dtype']}), "
                 f"{c['workload']}, batch 1, "
                 f"max_new_tokens {c['max_new_tokens']}, {c['sampling']}, median of {c['repeats']} interleaved "
                 f"repeat(s); baseline: {c['baseline']}; {c['hardware']['cpu']}, {c['torch_threads']} threads")
    return "\n".join(lines) + "\n" + json.dumps(result)
