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


def test_bench_structured_prints_each_configuration_against_plain_constrained_decoding(capsys, tmp_path):
    """`specdec bench structured` on the toy target: the baseline, forced drafts alone and forced +
    n-gram, greedy and T=1, each with validity, tokens/s, forced share, α and its speedup; the
    conditions and one JSON line."""
    from specdec.cli import main
    assert main(["bench", "structured", "--model", str(api.TOY_TARGET), "--prompts", "2", "--ks", "3",
                 "--no-auto", "--max-new-tokens", "40", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    table, line = out.rsplit("\n", 2)[0], out.rsplit("\n", 2)[1]
    result = json.loads(line)
    assert json.loads((tmp_path / "structured.json").read_text()) == result
    names = ["plain constrained (k=0)", "forced k=3", "forced + ngram k=3"]
    assert [(r["configuration"], r["temperature"]) for r in result["rows"]] == [(n, t) for t in (0, 1) for n in names]
    for r in result["rows"]:
        assert r["tasks"] == 2 and r["tokens"] > 0 and f"| {r['configuration']} | {r['temperature']:g} |" in table
        assert (r["configuration"] == names[0]) == (r["speedup"] == 1.0)
        baseline = next(b for b in result["rows"] if b["configuration"] == names[0] and b["temperature"] ==
                        r["temperature"])
        assert r["forced"] == baseline["forced"] > 0  # the output's forced tokens: the same output, the same count
    plain, forced = result["rows"][:2]
    assert forced["tokens"] == plain["tokens"] and forced["steps"] < plain["steps"]  # same output, fewer steps
    assert result["mask"]["mask_share_of_step"] > 0 and "baseline: plain constrained decoding" in table
    assert result["conditions"]["workload"].startswith("structured: 2 of the 54 tasks")
