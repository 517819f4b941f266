"""The EAGLE head (eagle.py) and its proposer (proposers/eagle.py): what the head computes while
drafting k tokens with its KV cache is what the training-time test unrolls; through the engine,
token-identical to the reference under greedy decoding for k = 1..8 at batch 1 and 4; the target's
distribution under sampling (the engine's chi-square + TV test with 100,000 samples, at T=1 and
with top-k/top-p), which fails when drafts are not drawn from the reported draft_probs; the
features come from the verify forward; clear errors for bad input."""
from __future__ import annotations

import copy
import dataclasses
import functools
import json

import pytest
import torch

from specdec.decoding.engine import plain_generate, speculative_generate
from specdec.decoding.reference import reference_generate
from specdec.decoding.stopping import StopRule
from specdec.errors import SpecdecError
from specdec.lm.checkpoint import load_model, save_model, sha256
from specdec.lm.kv_cache import cache_for
from specdec.proposers import EagleProposer, VocabOptions, base
from specdec.heads.eagle import LAYOUTS, EagleHead, initial_head, load_eagle, save_eagle
from specdec.heads.mtp import load_mtp
from specdec.train.losses import eagle_backward, eagle_metrics, eagle_targets

from ..decoding import test_engine_sampling as sampling_test
from ..spec_helpers import own_continuations, tiny_llama
from ..decoding.test_engine import GREEDY, PROMPTS, RULE, TARGET, assert_matches_reference

STEPS = 4  # draft steps unrolled in training


@functools.cache
def distilled(target=TARGET, layer_ids=(0, 1), draft_vocab: int | None = None, steps: int = 80,
              layout: str = "specdec") -> EagleHead:
    """A head trained briefly on the frozen target's own continuations (greedy and sampled), so
    that it agrees with the target often but not always: acceptance and rejection both happen."""
    data, g = own_continuations(target)  # (96, 32)
    V = target.config.vocab_size
    ids = torch.arange(V) if draft_vocab is None else torch.bincount(data.flatten(), minlength=V).topk(
        draft_vocab).indices.sort().values
    torch.manual_seed(1)
    frozen = copy.deepcopy(target).requires_grad_(False)
    head = initial_head(frozen, layer_ids, ids, layout)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
    with torch.enable_grad():  # also when first asked for under no_grad
        for _ in range(steps):
            eagle_backward(frozen, head, data[torch.randint(0, len(data), (16,), generator=g)], STEPS, 0.8, 1.0)
            opt.step()
            opt.zero_grad()
    head.token_counts = torch.bincount(data.flatten(), minlength=V)  # as training records them
    return head.eval()


def proposer(target=TARGET, **kw):
    return EagleProposer(head=distilled(target, **kw), target=target)


# ---- one head for training and drafting ----

@pytest.mark.parametrize("layout", LAYOUTS)
@torch.no_grad()
def test_drafting_with_the_cache_computes_what_the_training_time_test_unrolls(layout):
    """From every base position T-1 of a window: the cached forward over positions 0..T-1 with the
    target's features, then k-1 single steps on the head's own outputs (as the proposer drafts)
    give the unrolled step outputs at base T-1, to float32 rounding; in both weight layouts."""
    head, target = distilled(layout=layout), TARGET
    B, S = 2, 14
    x = torch.randint(0, 64, (B, S + STEPS), generator=torch.Generator().manual_seed(3))
    out = target(x[:, :S], output_layers=head.layer_ids)
    features = torch.cat([out.layers[i] for i in head.layer_ids], -1)
    unrolled = [h for _, h in head.unroll(features, x[:, 1:S + STEPS], target.model.embed_tokens, STEPS)]
    embed, cfg = target.model.embed_tokens, target.config
    for T in range(1, S + 1):
        cache = cache_for(1, cfg.num_key_value_heads, cfg.head_dim, B, 64, torch.float32, "cpu")
        prev = head(embed(x[:, 1:T + 1]), head.fuse(features[:, :T]), head.window(None, cache, T))[:, -1:]
        cache.advance(T)
        torch.testing.assert_close(prev[:, 0], unrolled[0][:, T - 1], rtol=1e-5, atol=1e-5)
        for j in range(1, STEPS):
            prev = head(embed(x[:, T + j:T + j + 1]), prev, head.window(None, cache, 1))
            cache.advance(1)
            torch.testing.assert_close(prev[:, 0], unrolled[j][:, T - 1], rtol=1e-5, atol=1e-5)


def test_the_engine_hands_over_the_declared_layers_from_the_verify_forward():
    """prompt_hidden and every Outcome.hidden are the declared layers' outputs, concatenated, as a
    full forward over the sequence computes them (no extra pass: the engine asks the verify
    forward for them)."""
    seen = []

    class Spy:
        name, vocab_size, features, trees, max_depth = "spy", None, (1, 0), False, None

        def start(self, max_len, k, capacity, nodes=None):
            return None

        def join(self, state, prompts, prompt_hidden, samplings):
            seen.append(prompt_hidden)

        def leave(self, state, keep):
            pass

        def propose(self, state, limits, widths, draws):
            return base.Proposal(torch.full((1, 2), 7), limits.clone(), None)

        def observe(self, state, outcome):
            seen.append(outcome.hidden[:, :int(outcome.counts[0])])

    prompt = PROMPTS[2]
    rows, _ = speculative_generate(TARGET, Spy(), [prompt], StopRule(10), GREEDY, 2)
    sequence = torch.tensor([prompt + rows[0].tokens])
    full = TARGET(sequence, output_layers=(0, 1))
    expected = torch.cat([full.layers[1], full.layers[0]], -1)[:, :-1]  # the last token is never fed
    torch.testing.assert_close(torch.cat(seen, 1), expected[:, :sum(s.shape[1] for s in seen)], rtol=1e-4, atol=1e-4)


# ---- greedy: token-identical ----

@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("k", range(1, 9))
def test_greedy_output_equals_reference(k, batch, layout):
    groups = [PROMPTS] if batch == 4 else [[p] for p in PROMPTS]
    for group in groups:
        rows, metrics = speculative_generate(TARGET, proposer(layout=layout), group, RULE, GREEDY, k)
        for prompt, row in zip(group, rows):
            assert_matches_reference(prompt, row.tokens)
        assert metrics.emitted == sum(len(r.tokens) for r in rows)
    if batch == 4:  # the distilled head is neither useless nor perfect: both paths were taken
        assert 0 < metrics.accepted < metrics.proposed


def test_held_out_prompts_longer_runs_and_a_draft_vocabulary():
    """Prompts unlike the training data, 40 new tokens, k = 5 and 8, drafting over 24 of the 64 ids:
    the output equals the reference and every draft is one of the 24."""
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (2, 9, 17)]
    rule = StopRule(40)
    for kw in ({}, {"draft_vocab": 24}):
        p = proposer(**kw)
        allowed = set(p.draft_ids.tolist())
        for k in (5, 8):
            rows, metrics = speculative_generate(TARGET, p, prompts, rule, GREEDY, k)
            for prompt, row in zip(prompts, rows):
                assert_matches_reference(prompt, row.tokens, rule)
            assert metrics.accepted > 0
        assert len(allowed) == (24 if kw else 64)


def test_a_smaller_draft_vocabulary_at_drafting_time():
    """The head's 64 ids cut to its 20 most frequent when drafting: output equals the reference,
    drafts are only those ids; a head saved without counts cannot be cut."""
    head = distilled()
    p = EagleProposer(head=head, target=TARGET, draft_vocab=20)
    allowed = set(p.draft_ids.tolist())
    assert allowed == set(head.token_counts.topk(20).indices.tolist())
    drafted = []
    propose = p.propose
    p.propose = lambda *args: drafted.append(propose(*args)) or drafted[-1]  # record every proposal
    for k in (2, 6):
        rows, metrics = speculative_generate(TARGET, p, PROMPTS, RULE, GREEDY, k)
        for prompt, row in zip(PROMPTS, rows):
            assert_matches_reference(prompt, row.tokens)
        assert metrics.accepted > 0
    assert {t for d in drafted for b in range(d.tokens.shape[0]) for t in d.tokens[b, :d.lengths[b]].tolist()} <= allowed
    uncounted = copy.deepcopy(head)
    uncounted.token_counts = None
    with pytest.raises(SpecdecError, match="saved without its training token counts"):
        EagleProposer(head=uncounted, target=TARGET, draft_vocab=20)


def test_prompts_up_to_the_end_of_the_context_and_stops_inside_accepted_runs():
    prompts = [[(7 * i) % 64 for i in range(60)], [(11 * i + 3) % 64 for i in range(58)], [1, 2], [9]]
    rule = StopRule(max_new_tokens=5)
    rows, _ = speculative_generate(TARGET, proposer(), prompts, rule, GREEDY, 6)
    for prompt, row in zip(prompts, rows):
        assert_matches_reference(prompt, row.tokens, rule)
        assert len(row.tokens) == 5
    ref = reference_generate(TARGET, PROMPTS[2], RULE, GREEDY).tokens
    for eos in ref[2:10]:
        rule = StopRule(24, eos_id=eos)
        rows, _ = speculative_generate(TARGET, proposer(), PROMPTS, rule, GREEDY, 4)
        for prompt, row in zip(PROMPTS, rows):
            expected = reference_generate(TARGET, prompt, rule, GREEDY)
            assert (row.tokens, row.finish_reason) == (expected.tokens, expected.finish_reason)


# ---- sampling: the engine's distribution test ----

SAMPLING_TARGET = sampling_test.TARGET  # vocab 16, one layer
CONFIGS = [("T=1", 3, None), ("T=0.7,top-k=8,top-p=0.9", 3, None), ("T=1", 2, 10)]  # the last: 10 of 16 ids
SAMPLES = 100_000


def counts_for(setting: str, k: int, monkeypatch, draft_vocab: int | None = None):
    monkeypatch.setitem(sampling_test.PROPOSERS, "eagle",
                        lambda: proposer(SAMPLING_TARGET, layer_ids=(0,), draft_vocab=draft_vocab))
    monkeypatch.setattr(sampling_test, "N", SAMPLES)
    return sampling_test.speculative_counts("eagle", sampling_test.SETTINGS[setting], k)


@pytest.mark.parametrize("setting,k,draft_vocab", CONFIGS)
def test_speculative_sampling_matches_the_target_distribution(setting, k, draft_vocab, monkeypatch):
    counts, metrics = counts_for(setting, k, monkeypatch, draft_vocab)
    result = sampling_test.distribution_test(counts, sampling_test.exact_joint(sampling_test.SETTINGS[setting]))
    print(f"\neagle {setting} k={k}: p={result[0]:.3g} TV={result[1]:.4f} (bound {result[2]:.4f}) "
          f"alpha={metrics.acceptance_rate:.3f} tau={metrics.mean_acceptance_length:.3f}")
    assert sampling_test.passes(result), result
    assert metrics.accepted > 0.1 * SAMPLES  # drafts were really accepted


def test_the_distribution_test_fails_when_drafts_are_not_drawn_from_draft_probs(monkeypatch):
    """A proposer bug: drafting the head's argmax while reporting its distribution as draft_probs."""
    monkeypatch.setattr(base, "sample", lambda probs, generator: probs.argmax(-1))  # where drafts are drawn
    setting, k, _ = CONFIGS[0]
    counts, _ = counts_for(setting, k, monkeypatch)
    result = sampling_test.distribution_test(counts, sampling_test.exact_joint(sampling_test.SETTINGS[setting]))
    print(f"\nwrong drafts: p={result[0]:.3g} TV={result[1]:.4f} (bound {result[2]:.4f})")
    assert not sampling_test.passes(result), result


# ---- validation alpha ----

def test_validation_alpha_is_the_greedy_acceptance_of_drafting():
    """On the target's own greedy continuations (every window token is the target's choice),
    eagle_metrics' alpha_1 is the fraction of positions where the head's first draft is accepted,
    as drafting one token from every position measures it."""
    head = distilled()
    prompts = torch.randint(0, 64, (8, 2), generator=torch.Generator().manual_seed(5)).tolist()
    rows, _ = plain_generate(TARGET, prompts, StopRule(20), GREEDY)
    batch = torch.tensor([p + r.tokens for p, r in zip(prompts, rows)])  # (8, 22)
    figures = eagle_metrics(TARGET, head, batch, STEPS)
    alphas, reached = figures[STEPS:2 * STEPS], figures[2 * STEPS:]
    with torch.no_grad():
        out = TARGET(batch[:, :-1], output_layers=head.layer_ids)
        features = torch.cat([out.layers[i] for i in head.layer_ids], -1)
        h = next(head.unroll(features, batch[:, 1:], TARGET.model.embed_tokens, 1))[1][:, :-1]
        first = head.draft_ids[head.logits(h).argmax(-1)]
    assert reached[0] == first.numel()
    assert alphas[0] == pytest.approx(float((first == batch[:, 2:]).float().mean()))
    assert all(0 <= a <= 1 for a in alphas) and reached == sorted(reached, reverse=True)


def test_training_reads_the_draft_vocabularys_logits_without_the_full_unembedding():
    """eagle_targets(greedy=False), what the backward pass uses: the target unembeds over the draft
    vocabulary's rows alone and gives the same features and log-probabilities there."""
    head = distilled(draft_vocab=24)
    batch = torch.randint(0, 64, (3, 12), generator=torch.Generator().manual_seed(6))
    full, drafted = eagle_targets(TARGET, head, batch, STEPS), eagle_targets(TARGET, head, batch, STEPS, greedy=False)
    assert drafted.argmax is None and drafted.log_probs.shape == full.log_probs.shape == (3, 11, 24)
    assert torch.equal(drafted.features, full.features)
    torch.testing.assert_close(drafted.log_probs, full.log_probs, rtol=1e-5, atol=1e-5)


def test_a_bf16_teacher_gives_the_targets_training_loss_to_bf16_precision():
    """eagle_backward's teacher (the long run's, where the CPU multiplies bf16 in hardware): the
    features and distribution come from the bf16 copy, and the loss is the fp32 target's to ~1%."""
    batch = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(7))
    teacher = copy.deepcopy(TARGET).to(torch.bfloat16)
    heads = [copy.deepcopy(distilled()) for _ in range(2)]
    exact = eagle_backward(TARGET, heads[0], batch, STEPS, 0.8, 1.0)
    taught = eagle_backward(TARGET, heads[1], batch, STEPS, 0.8, 1.0, teacher)
    assert taught != exact  # the teacher computed them
    assert taught == pytest.approx(exact, rel=0.03)
    for a, b in zip(heads[0].parameters(), heads[1].parameters()):
        assert a.grad.dtype == torch.float32 and torch.allclose(a.grad, b.grad, rtol=0.1, atol=1e-3)


# ---- checkpoint and bad input ----

@pytest.mark.parametrize("layout", LAYOUTS)
def test_save_load_round_trip_and_refusals(tmp_path, layout):
    target_dir, other_dir = tmp_path / "target", tmp_path / "other"
    save_model(TARGET, target_dir, dtype=torch.float32)
    save_model(tiny_llama(7), other_dir, dtype=torch.float32)
    head = distilled(layout=layout)
    folder = save_eagle(head, tmp_path / "eagle", sha256(target_dir / "model.safetensors"),
                        meta={"speculators": {"eagle_aux_hidden_state_layer_ids": [1, 2]}}, dtype=torch.float32)
    loaded = load_eagle(folder, target_dir)
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), loaded.state_dict().values()))
    meta = json.loads((folder / "heads.json").read_text())
    assert meta["kind"] == "eagle3" and meta["layer_ids"] == [0, 1] and meta["draft_vocab_size"] == 64
    assert meta["layout"] == layout and loaded.layout == layout
    with pytest.raises(SpecdecError, match="belongs to the target with .* train a head for this target"):
        load_eagle(folder, other_dir)
    with pytest.raises(SpecdecError, match="holds draft heads .* `--draft eagle --heads PATH`"):
        load_model(folder)
    with pytest.raises(SpecdecError, match="kind 'eagle3', not MTP heads"):
        load_mtp(folder, target_dir)
    with pytest.raises(SpecdecError, match="is a model checkpoint .* not an EAGLE head"):
        load_eagle(target_dir, target_dir)


def test_a_target_that_differs_only_in_its_stop_set_keeps_its_head():
    """The end-of-generation ids say when to stop, not what the network computes: a target whose
    config names more of them (a GGUF's eos, eot and end-of-text tokens) keeps the head trained for
    it, and greedy speculation still gives plain decoding's tokens."""
    target = copy.deepcopy(TARGET)
    target.config = dataclasses.replace(TARGET.config, eos_token_id=[*TARGET.config.eos_ids, 0])
    proposer = EagleProposer(head=distilled(), target=target)
    rows, metrics = speculative_generate(target, proposer, PROMPTS, RULE, GREEDY, 3)
    assert [r.tokens for r in rows] == [r.tokens for r in plain_generate(target, PROMPTS, RULE, GREEDY)[0]]
    assert metrics.proposed > 0


def test_bad_input_is_refused_with_the_fix():
    with pytest.raises(SpecdecError, match=r"layer ids \[0, 5\] must be distinct decoder layers .*ids 0..1.*e.g. 0 1"):
        EagleHead(TARGET.config, (0, 5), torch.arange(8))
    with pytest.raises(SpecdecError, match="larger than the target's 64: choose --draft-vocab <= 64"):
        EagleHead(TARGET.config, (0, 1), torch.arange(65) % 64)
    with pytest.raises(SpecdecError, match="built for another target"):
        EagleProposer(head=distilled(), target=tiny_llama(0, hidden=64))
    with pytest.raises(SpecdecError, match="specdec's own LlamaForCausalLM"):
        EagleProposer(head=distilled(), target=torch.nn.Linear(4, 4))
    with pytest.raises(SpecdecError, match="k >= 1 tokens per step, got k=0"):
        speculative_generate(TARGET, proposer(), PROMPTS, RULE, GREEDY, 0)


needs_kernels = pytest.mark.skipif(not __import__("specdec.kernels", fromlist=["x"]).can_store_bf16(),
                                   reason="the CPU kernels are not available here")


def one_call_and_separate(target, native: EagleProposer, separate: EagleProposer):
    """For greedy and T=1 rows: the proposals of the head drafting in one kernel call per level
    (`native`) and by separate calls (`separate.native` False), 5 levels over two toy prompts."""
    from specdec.api import encode_prompts
    from specdec.decoding.sampling import Draws, SamplingConfig
    from specdec.lm.interface import prefill_joining
    separate.native = False
    assert native.native
    prompts = encode_prompts(target, ["def add(a, b):\n", "import os\nfor path in"], 8)
    for sampling in (SamplingConfig(), SamplingConfig(temperature=1.0)):
        proposals = []
        for p in (native, separate):
            cache = target.model.new_cache(2, 80)
            cache.regroup([])
            hidden = prefill_joining(target.model, cache, prompts, p.features)
            state = p.start(80, 5, 2)
            p.join(state, prompts, hidden, [sampling] * 2)
            proposals.append(p.propose(state, torch.tensor([5, 3]), (1,) * 5, Draws(torch.Generator().manual_seed(0))))
        yield sampling, prompts, *proposals


@needs_kernels
@torch.inference_mode()
@pytest.mark.parametrize("blocks", [False, True])
def test_each_head_step_as_one_kernel_call_drafts_what_the_separate_calls_draft(blocks):
    """The shipped head (bf16-stored, its layer one Stack): one kernel call per level gives the drafts,
    and for sampled rows the draft probabilities, bit for bit, of the separate calls; also where the
    target's embedding is held as Q8_0 blocks (a tied one quantized at load, a file's): the call then
    gets the looked-up rows."""
    from specdec import kernels
    from specdec.api import TOY_TARGET, load, load_drafter
    target = load(TOY_TARGET)
    if blocks:
        embedding = target.model.model.embed_tokens
        embedding.store(kernels.Matrix.store(embedding.weight.detach(), "q8_0"))
    native = load_drafter(target, "eagle", options=VocabOptions(1024))
    separate = EagleProposer(head=native.head, target=target.model, draft_vocab=1024)
    for sampling, _, a, b in one_call_and_separate(target, native, separate):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.lengths, b.lengths)
        assert (a.draft_probs is None) == (b.draft_probs is None) == sampling.greedy
        if a.draft_probs is not None:
            assert torch.equal(a.draft_probs, b.draft_probs)


@needs_kernels
@torch.inference_mode()
def test_an_eagle3_layout_head_drafts_in_one_kernel_call_what_its_pytorch_layer_drafts():
    """EAGLE-3's layer (q/k/v over the 2C-wide [RMSNorm(emb); RMSNorm(g)], the attention added to g)
    runs in the kernels' drafting call: the same drafts as its PyTorch operators over 5 levels and two
    rows, and the same draft probabilities to float32 rounding (a layer that added the attention to
    its projected input, or normalised g as the residual, drafts otherwise); greedy decoding with it
    equals plain decoding."""
    from specdec.api import TOY_TARGET, load
    from specdec.lm.model import store_matrices
    from specdec.heads.eagle import default_layer_ids
    target = load(TOY_TARGET)
    torch.manual_seed(0)
    head = EagleHead(target.model.config, default_layer_ids(target.model.config.num_hidden_layers),
                     torch.arange(target.model.config.vocab_size), layout="eagle3").eval()
    store_matrices(head)
    native = EagleProposer(head=head, target=target.model)
    separate = EagleProposer(head=head, target=target.model)
    for sampling, prompts, a, b in one_call_and_separate(target, native, separate):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.lengths, b.lengths)
        if not sampling.greedy:
            torch.testing.assert_close(a.draft_probs, b.draft_probs, rtol=1e-4, atol=1e-6)
    rows, _ = speculative_generate(target.model, native, prompts, StopRule(12), GREEDY, 3)
    plain, _ = plain_generate(target.model, prompts, StopRule(12), GREEDY)
    assert [r.tokens for r in rows] == [r.tokens for r in plain]


@needs_kernels
@torch.inference_mode()
def test_the_registrys_eagle_head_drafts_from_q8_0_matrices_and_decoding_stays_exact():
    """Loaded through the registry where the kernels run, a bf16 head drafts from Q8_0 matrices (its
    layer, projections and unembedding; a smaller draft vocabulary keeps its rows as stored, each logit
    the number the whole unembedding gives it), in one kernel call per level; greedy output is plain
    decoding's."""
    from specdec.api import TOY_TARGET, load, load_drafter
    from specdec.lm.model import stored_formats
    target = load(TOY_TARGET)
    full = load_drafter(target, "eagle")
    small = load_drafter(target, "eagle", options=VocabOptions(1024))
    assert stored_formats(full.head) == "q8_0" and full.native and small.native
    assert small.vocab.unembedding.stored.format == "q8_0"
    x = torch.randn(3, target.model.config.hidden_size)
    rows = torch.searchsorted(full.draft_ids, small.draft_ids)  # the smaller vocabulary's rows of the whole one
    assert torch.equal(small.vocab.unembedding(x), full.vocab.unembedding(x)[:, rows])
    prompts = [p[:12] for p in PROMPTS]
    rows_spec, _ = speculative_generate(target.model, small, prompts, StopRule(16), GREEDY, 3)
    plain, _ = plain_generate(target.model, prompts, StopRule(16), GREEDY)
    assert [r.tokens for r in rows_spec] == [r.tokens for r in plain]
