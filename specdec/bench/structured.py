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

This module knows nothing about the engine's internals: it calls api.generate.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

from ..decoding.constraint import Constraint

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
    emitted / tokens), α and steps."""
    from ..api import generate
    valid = tokens = forced = steps = proposed = accepted = 0
    lengths = 0
    t0 = time.perf_counter()
    for task in workload:
        asked = {"messages": [{"role": "user", "content": task.prompt}]} if chat else {"prompts": task.prompt + "\n"}
        r = generate(target, **asked, max_new_tokens=max_new_tokens,
                     temperature=temperature, seed=seed if temperature else None, proposer=proposer, k=k,
                     constraint=Constraint.json_schema(task.schema))
        s = r.stats
        valid += r.finish_reasons[0] == "eos" and valid_json(r.texts[0], task.schema)
        lengths += r.finish_reasons[0] == "length"
        tokens += s["new_tokens"]
        forced += s.get("forced", 0)
        steps += s.get("steps", 0)
        proposed += s.get("proposed", 0)
        accepted += s.get("accepted", 0)
    seconds = time.perf_counter() - t0
    return {"tasks": len(workload), "valid": valid, "validity": valid / len(workload), "hit_length": lengths,
            "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "forced_share": forced / tokens if tokens else 0.0, "steps": steps,
            "alpha": accepted / proposed if proposed else None}
