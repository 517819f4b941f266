"""The structured workload (bench/structured.py): at least 50 tasks, each with its own schema that
llguidance compiles, and a validator that accepts what a schema allows and refuses what it does not;
one task run end to end on the toy target (plain constrained decoding)."""
from __future__ import annotations

import json

from specdec import api
from specdec.bench.structured import obj, run, tasks, valid_json, validate
from specdec.decoding.constraint import Constraint, compile_constraint


def test_the_workload_has_50_distinct_schemas_of_three_kinds_that_compile():
    workload = tasks()
    assert len(workload) >= 50 and len({json.dumps(t.schema, sort_keys=True) + t.prompt for t in workload}) == len(
        workload)
    assert {t.kind for t in workload} == {"extraction", "tool-call", "classification"}
    toy = api.load(api.TOY_TARGET)
    for task in workload:
        compile_constraint(Constraint.json_schema(task.schema), toy.tokenizer, toy.model.config.vocab_size)


def test_the_validator_accepts_what_the_schema_allows_and_refuses_the_rest():
    schema = obj({"name": {"type": "string", "maxLength": 5}, "n": {"type": "integer", "minimum": 0, "maximum": 9},
                  "x": {"type": "number"}, "ok": {"type": "boolean"}, "tag": {"enum": ["a", "b"]},
                  "list": {"type": "array", "items": {"type": "string"}, "maxItems": 2}})
    good = {"name": "Ada", "n": 3, "x": 0.5, "ok": True, "tag": "a", "list": ["p"]}
    assert validate(good, schema)
    for bad in [{**good, "name": "Ada Lovelace"}, {**good, "n": 10}, {**good, "n": 1.5}, {**good, "ok": 1},
                {**good, "n": True}, {**good, "tag": "c"}, {**good, "list": ["p", "q", "r"]}, {**good, "extra": 1},
                {k: v for k, v in good.items() if k != "n"}]:
        assert not validate(bad, schema), bad
    assert not valid_json('{"name": "Ada"', schema)


def test_a_run_reports_validity_forced_share_and_alpha():
    toy = api.load(api.TOY_TARGET)
    workload = [t for t in tasks() if t.kind == "classification"][:2]
    result = run(toy, workload, max_new_tokens=40, proposer=api.load_drafter(toy, "ngram"), k=4,
                 chat=False)
    assert result["tasks"] == 2 and result["validity"] == (result["tasks"] - result["hit_length"]) / 2
    assert 0 < result["forced_share"] < 1 and result["alpha"] is not None
