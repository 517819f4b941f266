"""The parallel draft model (proposers/parallel.py) and its training (train/anchors.py, the parallel
objective): one training forward computes at every block slot what one drafting forward over
[prefix, mask x (k-1)] computes; through the engine, token-identical to the reference under greedy
decoding for k = 1..8 at batch 1 and 4 (chains and trees); the target's distribution under
sampling (the engine's chi-square + TV test with 100,000 samples, at T=1, with top-k/top-p and a
draft vocabulary), which fails when the draft probabilities are written as if the drafts had been
drawn one after another; clear errors for bad input."""
from __future__ import annotations

import copy
import functools
import json

import pytest
import torch

from specdec.api import Loaded, load_drafter
from specdec.decoding.engine import speculative_generate
from specdec.decoding.sampling import Draws
from specdec.decoding.stopping import StopRule
from specdec.errors import SpecdecError
from specdec.lm.arch import Arch
from specdec.lm.checkpoint import PARALLEL_KIND, WEIGHTS, save_model, save_token_counts, sha256
from specdec.lm.model import LlamaForCausalLM
from specdec.lm.tokenizer import Tokenizer
from specdec.proposers import ParallelDraftProposer
from specdec.proposers import parallel as parallel_module
from specdec.train.anchors import block_acceptance, block_layout, random_anchors
from specdec.train.losses import parallel_backward, parallel_logits, parallel_metrics
from specdec.train.objectives import with_vocabulary

from ..decoding import test_engine_sampling as sampling_test
from ..spec_helpers import own_continuations, tiny_llama
from ..decoding.test_engine import GREEDY, PROMPTS, RULE, TARGET, assert_matches_reference

BLOCK = 8


def parallel_draft_for(target: LlamaForCausalLM, seed: int = 3) -> LlamaForCausalLM:
    """A fresh tiny draft with one token more than `target` (its mask token)."""
    cfg = target.config
    torch.manual_seed(seed)
    draft = LlamaForCausalLM(Arch(vocab_size=cfg.vocab_size + 1, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=8, max_position_embeddings=cfg.max_position_embeddings,
                                  tie_word_embeddings=True))
    return draft


@functools.cache
def distilled(target=TARGET, steps: int = 120) -> LlamaForCausalLM:
    """A parallel draft trained briefly by the parallel objective on the target's own continuations,
    so that its block slots agree with the target often but not always."""
    data, g = own_continuations(target)  # (96, 32)
    draft = parallel_draft_for(target)
    opt = torch.optim.AdamW(draft.parameters(), lr=1e-2)
    frozen = copy.deepcopy(target).requires_grad_(False)
    with torch.enable_grad():
        for step in range(steps):
            anchors = random_anchors(data.shape[1] - 1, BLOCK, 6, g)
            layout = block_layout(data.shape[1] - 1, anchors, BLOCK)
            parallel_backward(draft, frozen, data[torch.randint(0, len(data), (16,), generator=g)], layout,
                              target.config.vocab_size, 1.0)
            opt.step()
            opt.zero_grad()
    draft.token_counts = torch.bincount(data.flatten(), minlength=target.config.vocab_size)
    return draft.eval()


def proposer(target=TARGET, draft_vocab=None):
    draft = distilled(target)
    return ParallelDraftProposer(model=draft, mask_token_id=target.config.vocab_size, block=BLOCK,
                          draft_vocab=draft_vocab, token_counts=draft.token_counts)


# ---- one layout for training and drafting ----

@pytest.mark.parametrize("causal", [True, False])
@torch.no_grad()
def test_the_training_layout_computes_what_one_drafting_forward_computes(causal):
    """Slot i of every anchor in ONE training forward equals the output at position i of a forward
    over [x_0..x_a, mask x (k-1)] alone (causal inside the block; or all of the block)."""
    draft = parallel_draft_for(TARGET)
    mask = TARGET.config.vocab_size
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, mask, (2, 30), generator=g)
    k = 5
    anchors = torch.tensor([0, 7, 8, 25])
    layout = block_layout(30, anchors, k, causal)
    window, masks = parallel_logits(draft, tokens, layout, mask, mask)   # (2, 30, V), (2, A, k-1, V)
    for b in range(2):
        for i, a in enumerate(anchors.tolist()):
            alone = torch.tensor([tokens[b, :a + 1].tolist() + [mask] * (k - 1)])
            visible = torch.ones(1, a + k, a + k, dtype=torch.bool).tril()
            if not causal:
                visible[0, a + 1:, a + 1:] = True
            logits = draft(alone, attention_mask=visible).logits[0, a:, :mask]   # (k, V)
            torch.testing.assert_close(window[b, a], logits[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(masks[b, i], logits[1:], atol=1e-5, rtol=1e-5)


def test_the_proposer_drafts_the_block_that_one_forward_gives():
    """Through the proposer (a KV cache, pending tokens, rows of different lengths): the greedy block
    is the argmax of the slots of a full forward over [sequence, mask x (m-1)]."""
    p = proposer()
    draft, mask = p.model, p.mask
    prompts = [[5, 9, 2], [1, 2, 3, 1, 2, 3, 1], [7]]
    state = p.start(40, 6, 3)
    p.join(state, prompts, None, [GREEDY] * 3)
    proposal = p.propose(state, torch.tensor([6, 3, 6]), (1,) * 6, Draws())
    for b, prompt in enumerate(prompts):
        seq = torch.tensor([prompt + [mask] * 5])
        expected = draft(seq).logits[0, len(prompt) - 1:, :mask].argmax(-1)
        assert proposal.tokens[b].tolist() == expected.tolist()
    assert proposal.lengths.tolist() == [6, 3, 6] and proposal.draft_probs is None
    assert state.cache.lengths.tolist() == [3, 7, 1]  # the prompts, no mask entries


@torch.no_grad()
def test_validation_alpha_is_the_greedy_acceptance_of_drafting():
    """block_acceptance on a window of the target's own greedy continuation equals what the engine
    counts drafting from those prefixes, slot by slot."""
    draft = distilled()
    data, _ = own_continuations(TARGET)
    greedy_rows = data[:4, :25]  # greedy continuations: every window token is the target's choice
    layout = block_layout(24, torch.tensor([2, 9]), 4)
    figures = parallel_metrics(draft, TARGET, greedy_rows, layout, TARGET.config.vocab_size)
    alphas, reached = figures[4:8], figures[8:]
    assert reached[0] == 8 and all(0 <= a <= 1 for a in alphas)
    # the same count by hand: slot i accepted where slots < i were and its argmax is the target's
    _, masks = parallel_logits(draft, greedy_rows[:, :-1], layout, TARGET.config.vocab_size, TARGET.config.vocab_size)
    window = draft(greedy_rows[:, :-1]).logits[..., :64]
    greedy = TARGET(greedy_rows[:, :-1]).logits.argmax(-1)
    drafts = torch.cat([window[:, layout.slots[:, 0]].argmax(-1)[..., None], masks.argmax(-1)], 2)
    accepted, counted = block_acceptance(drafts, greedy, greedy_rows, layout)
    assert counted.tolist() == reached and (accepted / counted.clamp(min=1)).tolist() == pytest.approx(alphas)
    hits = (drafts == greedy[:, layout.labels]).int().cumprod(2)  # on greedy data: reached = prefix accepted
    assert accepted.tolist() == hits.sum((0, 1)).tolist()


# ---- greedy: token-identical to the reference ----

@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("k", range(1, 9))
def test_greedy_output_equals_reference(k, batch):
    groups = [PROMPTS] if batch == 4 else [[p] for p in PROMPTS]
    for group in groups:
        rows, metrics = speculative_generate(TARGET, proposer(), group, RULE, GREEDY, k)
        for prompt, row in zip(group, rows):
            assert_matches_reference(prompt, row.tokens)
        assert metrics.emitted == sum(len(r.tokens) for r in rows)
    if batch == 4:  # the distilled draft is neither useless nor perfect: both paths were taken
        assert 0 < metrics.accepted < metrics.proposed


@pytest.mark.parametrize("widths", [(3, 2, 2), (2, 1, 3, 1)])
def test_trees_from_one_block_and_held_out_prompts(widths):
    """The per-slot top-w of one block forward as a tree, and a draft vocabulary, on prompts unlike
    the training data: output equals the reference; k = auto too."""
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (2, 9, 17)]
    rule = StopRule(40)
    for p in (proposer(), proposer(draft_vocab=24)):
        for k, w in ((len(widths), widths), ("auto", widths), (5, None)):
            rows, metrics = speculative_generate(TARGET, p, prompts, rule, GREEDY, k, widths=w)
            for prompt, row in zip(prompts, rows):
                assert_matches_reference(prompt, row.tokens, rule)
            assert k == "auto" or metrics.accepted > 0


def test_stops_inside_accepted_blocks_and_the_end_of_the_context():
    prompts = [[(7 * i) % 64 for i in range(60)], [(11 * i + 3) % 64 for i in range(58)], [1, 2], [9]]
    rule = StopRule(max_new_tokens=5)
    rows, _ = speculative_generate(TARGET, proposer(), prompts, rule, GREEDY, 6)
    for prompt, row in zip(prompts, rows):
        assert_matches_reference(prompt, row.tokens, rule)
        assert len(row.tokens) == 5


# ---- sampling: the engine's distribution test ----

SAMPLING_TARGET = sampling_test.TARGET  # vocab 16, one layer
CONFIGS = [("T=1", 3, None), ("T=0.7,top-k=8,top-p=0.9", 3, None), ("T=1", 2, 10)]  # the last: 10 of 16 ids
SAMPLES = 100_000


def counts_for(setting: str, k: int, monkeypatch, draft_vocab: int | None = None):
    monkeypatch.setitem(sampling_test.PROPOSERS, "parallel", lambda: proposer(SAMPLING_TARGET, draft_vocab))
    monkeypatch.setattr(sampling_test, "N", SAMPLES)
    return sampling_test.speculative_counts("parallel", sampling_test.SETTINGS[setting], k)


@pytest.mark.parametrize("setting,k,draft_vocab", CONFIGS)
def test_speculative_sampling_matches_the_target_distribution(setting, k, draft_vocab, monkeypatch):
    counts, metrics = counts_for(setting, k, monkeypatch, draft_vocab)
    result = sampling_test.distribution_test(counts, sampling_test.exact_joint(sampling_test.SETTINGS[setting]))
    print(f"\nparallel {setting} k={k}: p={result[0]:.3g} TV={result[1]:.4f} (bound {result[2]:.4f}) "
          f"alpha={metrics.acceptance_rate:.3f} tau={metrics.mean_acceptance_length:.3f}")
    assert sampling_test.passes(result), result
    assert metrics.accepted > 0.1 * SAMPLES  # drafts were really accepted


def test_the_distribution_test_fails_for_probabilities_of_drafts_drawn_one_after_another(monkeypatch):
    """A proposer bug: the drafts are drawn from the block's slots (each given the prefix only), but the
    probabilities reported are those of drafts drawn one after another (slot i given the drafts before
    it: the draft fed [prefix, d_1..d_{i-1}] instead of the masks)."""
    real = parallel_module.draw_block

    def sequential_probs(logits, samplings, draws, vocab, vocab_size):
        tokens, probs, scores = real(logits, samplings, draws, vocab, vocab_size)
        if tokens.shape[0] != SAMPLES or sequential_probs.done:  # the first step: every row after the prompt
            return tokens, probs, scores
        sequential_probs.done = True
        fed = torch.cat([sequential_probs.prefix, tokens[:, :-1]], 1)         # (B, P + m - 1)
        again = sequential_probs.model(fed).logits[:, -tokens.shape[1]:, :vocab_size]
        _, wrong, _ = real(again, samplings, Draws(torch.Generator().manual_seed(0)), vocab, vocab_size)
        return tokens, wrong, scores

    p = proposer(SAMPLING_TARGET)
    sequential_probs.model = p.model
    sequential_probs.prefix = torch.tensor([sampling_test.PROMPT] * SAMPLES)
    sequential_probs.done = False
    monkeypatch.setattr(parallel_module, "draw_block", sequential_probs)
    monkeypatch.setitem(sampling_test.PROPOSERS, "parallel", lambda: p)
    monkeypatch.setattr(sampling_test, "N", SAMPLES)
    setting = CONFIGS[0][0]
    # one step drafts the three tokens counted: k=3 and only the first proposal differs from the truth
    counts, _ = sampling_test.speculative_counts("parallel", sampling_test.SETTINGS[setting], 3)
    result = sampling_test.distribution_test(counts, sampling_test.exact_joint(sampling_test.SETTINGS[setting]))
    print(f"\nsequential probabilities: p={result[0]:.3g} TV={result[1]:.4f} (bound {result[2]:.4f})")
    assert not sampling_test.passes(result), result


# ---- checkpoints and bad input ----

def test_save_load_round_trip_and_refusals(tmp_path):
    """The shipped target's tokenizer with a tiny target of its vocabulary and a parallel draft saved
    as training writes it; loaded back it drafts as before; bad folders are refused before loading."""
    from specdec.api import TOY_TARGET
    tok = TOY_TARGET / "tokenizer.json"
    V = Tokenizer.load(TOY_TARGET).vocab_size
    target = tiny_llama(0, vocab=V, hidden=16, heads=2, kv_heads=1)
    save_model(target, tmp_path / "target", tokenizer_file=tok)
    draft = parallel_draft_for(target)
    meta = {"kind": PARALLEL_KIND, "parallel": {"mask_token_id": V, "block": 4,
                                               "target_sha256": sha256(tmp_path / "target" / WEIGHTS)}}
    save_model(draft, tmp_path / "draft", tokenizer_file=tok, meta=meta)
    save_token_counts(tmp_path / "draft", torch.ones(V, dtype=torch.long))
    loaded = Loaded(target, Tokenizer.load(tmp_path / "target"), tmp_path / "target")
    p = load_drafter(loaded, "parallel", tmp_path / "draft")
    assert (p.mask, p.max_depth, p.vocab_size) == (V, 4, V)
    with pytest.raises(SpecdecError, match="trained for blocks of 4 drafts; k=5"):
        speculative_generate(target, p, [[1, 2]], StopRule(8), GREEDY, 5)
    rows, _ = speculative_generate(target, p, [[1, 2]], StopRule(8), GREEDY, "auto")  # auto stays within 4
    assert len(rows[0].tokens) == 8

    def edited(name, change):
        folder = tmp_path / name
        save_model(draft, folder, tokenizer_file=tok, meta=change(json.loads(json.dumps(meta))))
        return folder

    no_mask = edited("plain", lambda m: {"kind": "target-or-draft-model"})
    with pytest.raises(SpecdecError, match="not a parallel draft .* names no mask token"):
        load_drafter(loaded, "parallel", no_mask)
    other = edited("other", lambda m: {**m, "parallel": {**m["parallel"], "target_sha256": "0" * 64}})
    with pytest.raises(SpecdecError, match="trained for another target"):
        load_drafter(loaded, "parallel", other)
    wrong_id = edited("wrong-id", lambda m: {**m, "parallel": {**m["parallel"], "mask_token_id": 3}})
    with pytest.raises(SpecdecError, match="mask token is its last id"):
        load_drafter(loaded, "parallel", wrong_id)


def test_a_plain_draft_grows_its_mask_token_row():
    draft = parallel_draft_for(TARGET)
    state = {k: v for k, v in draft.hf_state_dict().items()}
    smaller = {**state, "model.embed_tokens.weight": state["model.embed_tokens.weight"][:-1]}
    grown = with_vocabulary(smaller, 65)
    assert grown["model.embed_tokens.weight"].shape == (65, 32)
    torch.testing.assert_close(grown["model.embed_tokens.weight"][-1], smaller["model.embed_tokens.weight"].mean(0))
    assert with_vocabulary(state, 65)["model.embed_tokens.weight"] is state["model.embed_tokens.weight"]


@pytest.mark.skipif(not __import__("specdec.kernels", fromlist=["x"]).can_store_bf16(),
                    reason="the CPU kernels are not available here")
@torch.inference_mode()
def test_the_step_as_one_kernel_call_drafts_what_the_separate_calls_draft():
    """A parallel draft with bf16-stored matrices (its layers one Stack): the one-call step gives the
    same drafts, and for sampled rows and trees the same logits bit for bit, as the separate calls."""
    from specdec.lm.model import store_matrices
    cfg = TARGET.config
    torch.manual_seed(4)
    draft = LlamaForCausalLM(Arch(vocab_size=cfg.vocab_size + 1, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=16, max_position_embeddings=cfg.max_position_embeddings,
                                  tie_word_embeddings=True))
    from specdec.train.objectives import init_weights
    init_weights(draft, std=0.3)
    store_matrices(draft.eval())
    native = ParallelDraftProposer(model=draft, mask_token_id=cfg.vocab_size, block=BLOCK)
    separate = ParallelDraftProposer(model=draft, mask_token_id=cfg.vocab_size, block=BLOCK)
    separate.native = False
    assert native.native
    prompts = [[5, 9, 2], [1, 2, 3, 1, 2, 3, 1], [7]]
    from specdec.decoding.sampling import SamplingConfig
    for sampling, widths in ((GREEDY, (1,) * 6), (SamplingConfig(temperature=1.0), (1,) * 6), (GREEDY, (3, 2, 1, 1, 1, 1))):
        proposals = []
        for p in (native, separate):
            state = p.start(40, 6, 3)
            p.join(state, prompts, None, [sampling] * 3)
            proposals.append(p.propose(state, torch.tensor([6, 3, 6]), widths, Draws(torch.Generator().manual_seed(0))))
            assert state.cache.lengths.tolist() == [3, 7, 1]
        a, b = proposals
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.lengths, b.lengths)
        assert (a.draft_probs is None) == (b.draft_probs is None)
        if a.draft_probs is not None:
            assert torch.equal(a.draft_probs, b.draft_probs)


def test_the_export_refuses_a_parallel_draft_naming_what_vllm_lacks(tmp_path):
    """vLLM's parallel drafting reads the mask token as an id of the verifier's vocabulary; the shipped
    parallel draft's is one id past it: refused with the reason, nothing written."""
    from specdec.export import export
    from specdec.proposers import DRAFTERS
    with pytest.raises(SpecdecError, match="pard_token.*mask token is an extra id past it \\(16384\\)"):
        export(DRAFTERS["parallel"].folder(), tmp_path / "out")
    assert not (tmp_path / "out").exists()
