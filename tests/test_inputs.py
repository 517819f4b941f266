"""The one validation layer (specdec/inputs.py) for the command and the API: bad input is a clear
error before any output; random bytes, empty and huge values give a clean error or a correct
result, never a traceback (property tests, hypothesis)."""
from __future__ import annotations

import math
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec.api import generate, load
from specdec.cli import build_parser, main
from specdec.errors import SpecdecError

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
TRIED = {}  # property test name -> [cases, clean errors, results]


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    """Exit status, stdout, stderr of `specdec ARGV`; argparse's own refusals exit with 2."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def tally(name: str, ok: bool) -> None:
    counts = TRIED.setdefault(name, [0, 0, 0])
    counts[0] += 1
    counts[1 if not ok else 2] += 1


@pytest.fixture(scope="module", autouse=True)
def report_counts():
    yield
    for name, (cases, errors, results) in TRIED.items():
        print(f"\n{name}: {cases} cases, {errors} clean errors, {results} results, 0 tracebacks")


@pytest.mark.parametrize("argv, message", [
    (["simulate", "--alpha", "1.5", "--verify-ms", "1", "2", "3"], "--alpha (an acceptance rate) must be in [0, 1]"),
    (["simulate", "--alpha", "0.5", "--ks", "-1", "--verify-ms", "1", "2"], "--ks values (draft lengths k) must be >= 1"),
    (["simulate", "--alpha", "nan", "--verify-ms", "1", "2"], "must be a finite number"),
    (["simulate", "--alpha", "0.5", "--ks", "4", "--verify-ms", "1", "2"], "reach 5 tokens"),
    (["simulate", "--alpha", "0.5", "--verify-tokens", "1", "2"], "give both"),
    (["simulate", "--alpha", "0.5", "--moe-experts", "4", "--moe-top-k", "9", "--verify-ms", "1", "2", "3", "4",
      "5", "6", "7", "8", "9"], "--moe-top-k must be in 1..4"),
    (["bench", "--prompts", "0"], "--prompts must be >= 1, got 0"),
    (["bench", "plain", "--prompts", "0"], "--prompts must be >= 1, got 0"),
    (["bench", "--ks", "-1"], "draft lengths k) must be >= 1"),
    (["bench", "--repeats", "0"], "--repeats must be >= 1"),
    (["bench", "--temperatures", "inf"], "must be a finite number"),
])
def test_bad_simulate_and_bench_arguments_are_refused_before_any_output(capsys, argv, message):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and message in err and out == "", err


@pytest.mark.parametrize("extra, message", [
    (["-k", "3"], "-k applies to --draft"),
    (["--heads", "x"], "--heads applies to --draft mtp"),
    (["--draft", "ngram", "--ngram-min", "4", "--ngram-max", "2"], "--ngram-min 4 is larger than --ngram-max 2"),
    (["--draft", "mtp", "--draft-vocab", "0"], "--draft-vocab must be >= 1"),
    (["--draft", "eagle", "--draft-vocab", "auto"], "--draft-vocab auto (the cost model's size) is a draft model's"),
    (["--draft", "self", "--draft-vocab", "auto"], "--draft-vocab auto (the cost model's size) is a draft model's"),
    (["--draft", "draft-model", "--draft-vocab", "many"], "--draft-vocab takes a number of token ids or auto or full"),
    (["--draft", "draft-model", "--stop-below", "0"], "--stop-below (a probability) must be in (0, 1]"),
    (["--draft", "self", "--stop-below", "0.3"], "--stop-below applies to --draft draft-model"),
    (["--seed", "-3"], "seed must be in 0.."),
    (["--temperature", "nan"], "temperature must be a finite number"),
])
def test_bad_generate_options_are_refused_before_any_output(capsys, tiny_checkpoint, extra, message):
    code, out, err = run_cli(capsys, "generate", "--model", tiny_checkpoint, "--prompt", "x", *extra)
    assert code == 2 and message in err and out == "", err


def test_every_flag_has_help_and_shows_its_default():
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.choices and isinstance(a.choices, dict)).choices
    for name, sub in subparsers.items():
        text = sub.format_help()
        for action in sub._actions:
            if action.dest == "help":
                continue
            flag = f"specdec {name} {'/'.join(action.option_strings) or action.dest}"
            assert action.help, f"{flag} has no help text"
            if action.default is not None and action.default is not False:
                shown = sub._get_formatter()._get_help_string(action)  # the help line as printed
                assert "default" in shown.lower(), f"{flag} does not show its default {action.default!r}"
        assert "(default: None)" not in text and "(default: False)" not in text


def bytes_prompt():
    """Command-line arguments as the OS hands them over: UTF-8 text or any bytes, decoded with
    surrogateescape."""
    return st.one_of(st.text(min_size=1, max_size=40), st.binary(min_size=0, max_size=40)).map(
        lambda p: os.fsdecode(p.encode("utf-8") if isinstance(p, str) else p))


@FUZZ
@given(prompt=bytes_prompt(), max_new=st.one_of(st.integers(-3, 6), st.sampled_from([10 ** 6, 2 ** 64])),
       temperature=st.one_of(st.floats(0, 2), st.floats(allow_nan=True, allow_infinity=True)),
       top_p=st.one_of(st.none(), st.floats(0.05, 1), st.floats(-1, 2)),
       seed=st.one_of(st.none(), st.integers(0, 1000), st.integers(-2 ** 70, 2 ** 70)))
def test_property_the_command_never_prints_a_traceback(capsys, tiny_checkpoint, prompt, max_new, temperature,
                                                       top_p, seed):
    argv = ["generate", "--model", tiny_checkpoint, "--prompt", prompt, "--max-new-tokens", max_new,
            "--temperature", temperature, "--json"]
    argv += ["--top-p", top_p] if top_p is not None else []
    argv += ["--seed", seed] if seed is not None else []
    code, out, err = run_cli(capsys, *argv)  # anything but SpecdecError / argparse's exit raises here
    assert code in (0, 2) and "Traceback" not in err
    assert (out == "") == (code == 2)
    tally("command (generate, random bytes and values)", code == 0)


@pytest.fixture(scope="module")
def target(tiny_checkpoint):
    return load(tiny_checkpoint)


ANY_PROMPT = st.one_of(st.text(min_size=1, max_size=30), st.lists(st.text(min_size=1, max_size=20), max_size=3),
                       st.text(max_size=30), st.binary(max_size=10), st.none(), st.integers(),
                       st.lists(st.one_of(st.text(max_size=20), st.none(), st.binary(max_size=5)), max_size=3),
                       st.just("x" * 5000))


@FUZZ
@given(prompts=ANY_PROMPT, max_new=st.one_of(st.integers(0, 5), st.integers(-2, 5), st.just(10 ** 9), st.none()),
       k=st.one_of(st.none(), st.just(0), st.integers(-2, 4)),
       top_k=st.one_of(st.none(), st.integers(1, 10 ** 6), st.integers(-2, 2), st.floats()),
       stop=st.one_of(st.just(()), st.text(max_size=3), st.lists(st.text(max_size=3), max_size=2)))
def test_property_the_api_gives_a_clean_error_or_a_correct_result(target, prompts, max_new, k, top_k, stop):
    try:
        result = generate(target, prompts, max_new_tokens=max_new, k=k, top_k=top_k, stop=stop,
                          temperature=0.8 if top_k is not None else 0.0, seed=1)
    except SpecdecError:
        tally("API generate (random prompts and values)", False)
        return
    n = 1 if isinstance(prompts, str) else len(prompts)
    assert len(result.texts) == len(result.tokens) == len(result.finish_reasons) == n
    assert all(len(t) <= max_new for t in result.tokens)
    assert all(r in ("eos", "stop", "length") for r in result.finish_reasons)
    tally("API generate (random prompts and values)", True)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(alpha=st.one_of(st.floats(0, 1), st.floats(allow_nan=True, allow_infinity=True)),
       ks=st.one_of(st.lists(st.integers(1, 4), max_size=3), st.lists(st.integers(-3, 12), max_size=3)),
       cost=st.one_of(st.floats(0, 1), st.floats(-1, 5)), batch=st.one_of(st.just(1), st.integers(-1, 3)),
       ms=st.one_of(st.lists(st.floats(0.01, 50), min_size=10, max_size=40),
                    st.lists(st.floats(-1, 50, allow_nan=False), min_size=1, max_size=40)))
def test_property_simulate_rejects_before_printing_or_prints_a_table(capsys, alpha, ks, cost, batch, ms):
    argv = ["simulate", "--alpha", alpha, "--draft-cost", cost, "--batch-size", batch, "--verify-ms", *ms]
    argv += ["--ks", *ks] if ks else []
    code, out, err = run_cli(capsys, *argv)
    assert code in (0, 2) and "Traceback" not in err
    if code == 2:
        assert out == "", "part of the table was printed before the error"
    else:
        assert out.count("\n| ") >= 1 and math.isfinite(alpha) and 0 <= alpha <= 1
    tally("command (simulate, random values)", code == 0)


def test_simulate_warns_about_an_impossible_verify_curve(capsys):
    code, out, err = run_cli(capsys, "simulate", "--alpha", "0.5", "--ks", "2", "--verify-ms", "1", "0.23", "1.3")
    assert code == 0 and "| 2 |" in out and "noisy verify curve" in err and "n=2: 0.23x" in err
    code, out, err = run_cli(capsys, "simulate", "--alpha", "0.5", "--ks", "2", "--verify-ms", "1", "1.2", "1.4")
    assert code == 0 and "noisy" not in err


def test_the_registry_says_which_drafter_takes_which_option():
    """The draft options' owners and the drafters a message lists come from the registry: none is
    forgotten (the self-draft once was)."""
    from specdec import inputs
    from specdec.cli.common import DRAFT_OPTIONS, draft_options_given, flag
    from specdec.proposers.drafters import DRAFTERS, option_owners

    args = build_parser().parse_args(["generate", "--prompt", "x"])
    assert set(DRAFT_OPTIONS) == set(option_owners()) - {"counted_only"}  # counted_only: the benchmark's alone
    assert set(draft_options_given(args)) == {flag(option) for option in option_owners()} - {"--counted-only"}
    with pytest.raises(SpecdecError) as refused:
        inputs.draft_length(3, None, None)
    assert all(name in str(refused.value) for name in DRAFTERS)
    inputs.draft_options("self", {"--draft-vocab": 64, "--dynamic-tree": True})
    with pytest.raises(SpecdecError, match="--heads applies to --draft mtp or eagle or block"):
        inputs.draft_options("self", {"--heads": "x"})
