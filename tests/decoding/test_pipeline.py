"""The one request path (decoding/pipeline.py): the one context rule at its edge for the API, the
server and the engine alike; a healed row's stop rule and stream; per-row sampling (`pick_rows`);
plain decoding as the engine without a proposer."""
from __future__ import annotations

import pytest
import torch

from specdec.api import generate, load
from specdec.decoding.engine import Engine, Request, plain_generate
from specdec.decoding.pipeline import Options, Prompt, encode, prepare, request, stop_rule
from specdec.decoding.reference import reference_generate
from specdec.decoding.sampling import RowGenerators, SamplingConfig, pick, pick_rows
from specdec.decoding.stopping import StopRule
from specdec.errors import SpecdecError
from specdec.serve.requests import Params
from specdec.serve.service import Job, Service

INDENTED = "def f(x):\n    "


@pytest.fixture(scope="module")
def target(tiny_checkpoint):
    return load(tiny_checkpoint)


@pytest.mark.parametrize("heal", [False, True])
def test_one_context_rule_at_its_edge_for_the_api_the_server_and_the_engine(target, heal):
    """A prompt of n tokens may ask for context - n + 1 new tokens (the last one is never fed
    back), and not one more, whoever sends it."""
    context = target.model.config.max_position_embeddings
    text = "x " * 100 + "y" * (not heal)
    prompt = encode(target.tokenizer, text, heal=heal)
    assert bool(prompt.healed) == heal
    edge = context - prompt.length + 1
    result = generate(target, text, max_new_tokens=edge, heal=heal)
    assert result.finish_reasons == ["length"] and len(result.tokens[0]) == edge
    service = Service(target, None, 0, "plain", capacity=1, max_queue=1)
    job = Job(Params(text, None, edge, SamplingConfig(), (), heal=heal))
    service.encode(job)
    assert (job.prompt.ids, job.prompt.healed, job.prompt.stop) == (prompt.ids, prompt.healed, prompt.stop)
    for refuse in (lambda: generate(target, text, max_new_tokens=edge + 1, heal=heal),
                   lambda: service.encode(Job(Params(text, None, edge + 1, SamplingConfig(), (), heal=heal))),
                   lambda: Engine(target.admitted, None, 0, 1, context + 1).submit(
                       Request(prompt.ids + [0] * heal, StopRule(edge + 1)))):
        with pytest.raises(SpecdecError, match=f"needs {context + 1} positions but the model's context is {context}"):
            refuse()


def healed_row(target, first: int, rest: list[int], max_new_tokens: int, stop: tuple[str, ...]):
    """The row of INDENTED healed with `first` as its first token, then fed `rest`."""
    row = request(target.tokenizer, encode(target.tokenizer, INDENTED), Options(max_new_tokens, stop=stop), None,
                  None).row
    for token in [first, *rest]:
        if row.done:
            break
        row.emit(token)
    return row


def test_a_stop_string_inside_the_healed_first_token_cuts_there(target):
    """The first token of a healed row covers the prompt's trailing whitespace and may carry
    more text: a stop string starting in that extra text ends the row at that very token."""
    healed = encode(target.tokenizer, INDENTED).healed
    table = target.tokenizer.token_bytes
    first = next(i for i, b in enumerate(table) if b and b.startswith(healed.encode())
                 and len(b) > len(healed.encode()))  # e.g. a deeper indentation
    extra = table[first][len(healed.encode()):].decode()
    rest = target.tokenizer.encode(" = 1\n")
    row = healed_row(target, first, rest, 8, (extra[:1],))
    assert row.finish_reason == "stop" and row.tokens == [first] and row.text() == ""
    row = healed_row(target, first, rest, 8, ("= 1",))
    assert row.tokens == [first, *rest[:len(row.tokens) - 1]] and row.text() == extra + " "
    row = healed_row(target, first, rest, 2, ())
    assert row.finish_reason == "length" and row.text() == target.tokenizer.decode([first, rest[0]])[len(healed):]


def test_a_character_split_across_tokens_is_streamed_whole(target):
    ids = target.tokenizer.encode("aé€b")
    assert len(ids) > len("aé€b")                                           # bytes of é and € in separate tokens
    pieces: list[str] = []
    row = request(target.tokenizer, Prompt([0]), Options(20), None,
                  lambda request, sent, tokens: pieces.extend(piece for piece, _ in sent))
    for token in ids:
        row.row.emit(token)
        row.on_tokens(row, [token], 0)
    assert "".join(pieces) == "aé€b" and all("\ufffd" not in p for p in pieces) and "a" in pieces


def test_every_option_reaches_the_engines_request(target):
    options = Options(7, SamplingConfig(0.5, top_k=3, seed=4), ("\n\n",), special_tokens=True, heal=False,
                      skip_special_tokens=False)
    prompt = prepare(target.tokenizer, 256, options, "<|endoftext|>x")
    assert prompt.ids == target.tokenizer.prefix + target.tokenizer.encode("<|endoftext|>x", True)
    generator = torch.Generator()
    row = request(target.tokenizer, prompt, options, generator, None)
    assert (row.prompt, row.sampling, row.generator, row.on_tokens) == (prompt.ids, options.sampling, generator, None)
    rule = stop_rule(target.tokenizer, 7, ("\n\n",), skip_special_tokens=False)
    assert (row.rule.max_new_tokens, row.rule.eos_ids, row.rule.stop_strings) == (7, rule.eos_ids, ("\n\n",))
    assert row.rule.decode(prompt.ids) == rule.decode(prompt.ids) == "<|endoftext|><|endoftext|>x"


def test_healing_a_batch_is_healing_each_prompt_alone(target):
    """Healed rows of one batch, beside an unhealed one, each decode as they do alone (seeded: the
    noise of a token depends on its seed and position only), each first token extending its text."""
    texts = [INDENTED, "import os\n", "x = 1", "for x in y:\n        "]
    together = generate(target, texts, max_new_tokens=5, temperature=1.0, seed=3)
    alone = [generate(target, t, max_new_tokens=5, temperature=1.0, seed=3).tokens[0] for t in texts]
    assert together.tokens == alone and together.stats["healed_prompts"] == 3
    for text, tokens in zip(texts, together.tokens):
        healed = encode(target.tokenizer, text).healed
        assert target.tokenizer.token_bytes[tokens[0]].startswith(healed.encode())


def test_pick_rows_is_pick_for_each_row_under_its_own_settings():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)                                                             # (B, V)
    configs = [SamplingConfig(), SamplingConfig(0.7, seed=11), SamplingConfig(1.3, top_p=0.9)]
    generators = [torch.Generator().manual_seed(b) for b in range(3)]
    positions = [5, 9, 2]
    picked = pick_rows(logits, configs, RowGenerators(generators), positions)
    alone = [pick(logits[b:b + 1], cfg, torch.Generator().manual_seed(b), positions[b:b + 1])
             for b, cfg in enumerate(configs)]
    assert picked.tolist() == torch.cat(alone).tolist()
    assert picked[0] == logits[0].argmax()


def test_plain_decoding_is_the_engine_without_a_proposer_and_equals_the_reference(target):
    prompts = [[0, 5, 6, 7], [0, 9], [0, 11, 12, 13, 14, 15]]
    rule = StopRule(12)
    rows, metrics = plain_generate(target.model, prompts, rule, SamplingConfig())
    assert [r.tokens for r in rows] == [reference_generate(target.model, p, rule, SamplingConfig()).tokens
                                        for p in prompts]
    assert metrics.proposed == 0 and metrics.emitted == 36
    with pytest.raises(SpecdecError, match="k must be 0"):
        Engine(target.admitted, None, 3, 1, 32)
