"""The block head (block.py) and its proposer (proposers/block.py): the logits of a block's slots in
one training forward (train/anchors.py's layout) are the proposer's cached drafting logits for the
same prefix, with either attention inside the block; through the engine, token-identical to the
reference under greedy decoding for k = 1..8 at batch 1 and 4, held-out prompts and a tree; the
target's distribution under sampling (the engine's chi-square + TV test with 100,000 samples, at
T=1, with top-k/top-p and with a draft vocabulary), which fails when the drafts' probabilities are
written as if they had been drawn one after another; clear errors for bad input."""
from __future__ import annotations

import copy
import functools
import json

import pytest
import safetensors.torch
import torch

from specdec.decoding.engine import plain_generate, speculative_generate
from specdec.decoding.protocol import Outcome
from specdec.decoding.sampling import row_probabilities
from specdec.decoding.stopping import StopRule
from specdec.errors import SpecdecError
from specdec.lm.checkpoint import save_model, sha256
from specdec.proposers import BlockProposer
from specdec.heads.block import BlockHead, initial_head, load_block, save_block
from specdec.train.anchors import block_layout
from specdec.train.losses import block_backward, block_metrics, eagle_targets

from ..decoding import test_engine_sampling as sampling_test
from ..spec_helpers import own_continuations, tiny_llama
from ..decoding.test_engine import GREEDY, PROMPTS, RULE, TARGET, assert_matches_reference

BLOCK = 8
ATTENTION = ("bidirectional", "causal")


@functools.cache
def distilled(target=TARGET, layer_ids=(0, 1), draft_vocab: int | None = None, steps: int = 80,
              attention: str = "bidirectional", layers: int = 1) -> BlockHead:
    """A head trained briefly on the frozen target's own continuations (greedy and sampled), so that
    it agrees with the target often but not always: acceptance and rejection both happen."""
    data, g = own_continuations(target)  # (96, 32)
    V = target.config.vocab_size
    ids = torch.arange(V) if draft_vocab is None else torch.bincount(data.flatten(), minlength=V).topk(
        draft_vocab).indices.sort().values
    torch.manual_seed(1)
    frozen = copy.deepcopy(target).requires_grad_(False)
    head = initial_head(frozen, layer_ids, ids, BLOCK, layers, attention == "causal")
    opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
    with torch.enable_grad():  # also when first asked for under no_grad
        for _ in range(steps):
            block_backward(frozen, head, data[torch.randint(0, len(data), (16,), generator=g)], 8, 1.0, g)
            opt.step()
            opt.zero_grad()
    head.token_counts = torch.bincount(data.flatten(), minlength=V)  # as training records them
    return head.eval()


def proposer(target=TARGET, **kw) -> BlockProposer:
    return BlockProposer(head=distilled(target, **kw), target=target)


def features_of(head, target, tokens):
    out = target(tokens, output_layers=head.layer_ids)
    return torch.cat([out.layers[i] for i in head.layer_ids], -1)


# ---- one head for training and drafting ----

@pytest.mark.parametrize("attention,layers", [("bidirectional", 1), ("causal", 1), ("bidirectional", 2)])
@torch.no_grad()
def test_drafting_with_the_cache_computes_what_one_training_forward_gives(attention, layers):
    """Rows of different lengths (the pending positions padded) drafting k slots: the proposer's
    logits equal those of the block anchored at each row's last context position in one training
    forward over the whole window, to float32 rounding; then again after an observed step whose
    accepted tokens join the cache (committed entries and new pending ones)."""
    head = distilled(attention=attention, layers=layers)
    p = BlockProposer(head=head, target=TARGET)
    S = 24
    x = torch.randint(0, 64, (2, S + 1), generator=torch.Generator().manual_seed(3))
    features = features_of(head, TARGET, x[:, :S])                                    # (2, S, nC)
    anchors = torch.arange(S - BLOCK)
    layout = block_layout(S, anchors, BLOCK, causal=head.causal)
    h = head.training_outputs(features, x[:, 1:S + 1], TARGET.model.embed_tokens, layout.positions,
                              layout.visible)
    trained = head.logits(h[:, layout.slots])                                         # (2, A, k, N)
    for k in (BLOCK, 3):
        ends = [5, 9]  # context x_0..x_T of each row: T = end; features f_0..f_{T-1}
        prompts = [x[b, :ends[b] + 1].tolist() for b in range(2)]
        hidden = torch.stack([torch.nn.functional.pad(features[b, :ends[b]], (0, 0, 0, max(ends) - ends[b]))
                              for b in range(2)])
        state = p.start(40, k, 2)
        p.join(state, prompts, hidden, [GREEDY] * 2)
        logits = p.block_logits(state, k)                                             # (2, k, N)
        for b in range(2):
            torch.testing.assert_close(logits[b], trained[b, ends[b] - 1, :k], rtol=1e-4, atol=1e-4)
        # a verification step emitted 3 and 1 tokens (the true ones): they are pending, the rest is cached
        counts = [3, 1]
        tokens = [x[b, ends[b] + 1:ends[b] + 1 + counts[b]].tolist() + [0] * (3 - counts[b]) for b in range(2)]
        new = torch.stack([torch.nn.functional.pad(features[b, ends[b]:ends[b] + counts[b]], (0, 0, 0, 3 - counts[b]))
                           for b in range(2)])
        p.observe(state, Outcome([c - 1 for c in counts], tokens, counts, new))
        logits = p.block_logits(state, k)
        for b in range(2):
            torch.testing.assert_close(logits[b], trained[b, ends[b] + counts[b] - 1, :k], rtol=1e-4, atol=1e-4)


# ---- greedy: token-identical ----

@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("k", range(1, 9))
def test_greedy_output_equals_reference(k, batch):
    groups = [PROMPTS] if batch == 4 else [[p] for p in PROMPTS]
    for group in groups:
        rows, metrics = speculative_generate(TARGET, proposer(), group, RULE, GREEDY, k)
        for prompt, row in zip(group, rows):
            assert_matches_reference(prompt, row.tokens)
        assert metrics.emitted == sum(len(r.tokens) for r in rows)
    if batch == 4 and k > 1:  # the distilled head is neither useless nor perfect: both paths were taken
        assert 0 < metrics.accepted < metrics.proposed


def test_held_out_prompts_causal_attention_a_draft_vocabulary_and_a_tree():
    """Prompts unlike the training data, 40 new tokens, k = 5 and 8, a causal head, drafting over 24
    of the 64 ids, and the static tree of each slot's best tokens: the output equals the reference
    and every draft is one of the allowed ids."""
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (2, 9, 17)]
    rule = StopRule(40)
    for kw, widths in (({}, None), ({"attention": "causal"}, None), ({"draft_vocab": 24}, None),
                       ({}, (3, 2, 2, 1, 1)), ({"draft_vocab": 24}, (2, 2, 2, 2, 2))):
        p = proposer(**kw)
        allowed = set(p.draft_ids.tolist())
        drafted = []
        propose = p.propose
        p.propose = lambda *args: drafted.append(propose(*args)) or drafted[-1]  # record every proposal
        for k in ((5,) if widths else (5, 8)):
            rows, metrics = speculative_generate(TARGET, p, prompts, rule, GREEDY, k, widths=widths)
            for prompt, row in zip(prompts, rows):
                assert_matches_reference(prompt, row.tokens, rule)
            assert metrics.accepted > 0
        assert {t for d in drafted for b in range(d.tokens.shape[0])
                for t in d.tokens[b, :d.lengths[b]].tolist()} <= allowed
        if widths:
            assert all(d.parents is not None for d in drafted if d.tokens.shape[1])
        assert len(allowed) == (24 if "draft_vocab" in kw else 64)


def test_prompts_up_to_the_end_of_the_context_and_one_token_prompts():
    prompts = [[(7 * i) % 64 for i in range(60)], [(11 * i + 3) % 64 for i in range(58)], [1, 2], [9]]
    rule = StopRule(max_new_tokens=5)
    rows, _ = speculative_generate(TARGET, proposer(), prompts, rule, GREEDY, 6)
    for prompt, row in zip(prompts, rows):
        assert_matches_reference(prompt, row.tokens, rule)
        assert len(row.tokens) == 5


# ---- sampling: the engine's distribution test ----

SAMPLING_TARGET = sampling_test.TARGET  # vocab 16, one layer
CONFIGS = [("T=1", 3, None), ("T=0.7,top-k=8,top-p=0.9", 3, None), ("T=1", 3, 10)]  # the last: 10 of 16 ids
SAMPLES = 100_000


class Sequential(BlockProposer):
    """Wrong: each slot's draft is drawn from the block's distribution, but its draft_probs are
    written as if the drafts had been drawn one after another: slot j's distribution given the
    drafts before it (the head's next-token distribution after the context extended by them, with
    the target's own features there)."""

    def start(self, max_len, k, capacity, nodes=None):
        self.history = []  # each row's tokens x_0..x_T
        return super().start(max_len, k, capacity, nodes)

    def join(self, state, prompts, prompt_hidden, samplings):
        self.history += [list(p) for p in prompts]
        super().join(state, prompts, prompt_hidden, samplings)

    def leave(self, state, keep):
        self.history = [self.history[b] for b in keep]
        super().leave(state, keep)

    def observe(self, state, outcome):
        self.history = [h + t[:n] for h, t, n in zip(self.history, outcome.tokens, outcome.counts)]
        super().observe(state, outcome)

    def propose(self, state, limits, widths, draws):
        proposal = super().propose(state, limits, widths, draws)
        B, m = proposal.tokens.shape
        if m == 0:
            return proposal
        lengths = torch.tensor([len(h) for h in self.history])                            # (B,) T + 1
        seq = torch.tensor([h + [0] * (int(lengths.max()) - len(h)) for h in self.history])
        seq = torch.cat([seq, torch.zeros(B, m, dtype=torch.long)], 1)
        seq.scatter_(1, lengths[:, None] + torch.arange(m)[None], proposal.tokens)         # (B, T+1+m) context, drafts
        head = self.head
        with torch.no_grad():  # the head's causal next-token outputs: entry t predicts x_{t+2}
            features = features_of(head, self.target, seq[:, :-1])
            S = features.shape[1]
            h = head.training_outputs(features, seq[:, 1:], self.target.model.embed_tokens, torch.arange(S),
                                      torch.ones(S, S, dtype=torch.bool).tril())
            at = (lengths[:, None] - 2 + torch.arange(m)[None]).clamp(min=0)              # (B, m) after d_1..d_j
            logits = head.logits(h.gather(1, at[..., None].expand(-1, -1, h.shape[2])), self.vocab.unembedding)
        probs = proposal.draft_probs.clone()
        for j in range(1, m):
            p = row_probabilities(logits[:, j], state.samplings)
            probs[:, j] = p.new_zeros(B, self.vocab_size).index_copy_(1, self.vocab.ids, p)
        return type(proposal)(proposal.tokens, proposal.lengths, probs, proposal.parents)


def counts_for(setting: str, k: int, monkeypatch, draft_vocab: int | None = None, cls=BlockProposer):
    monkeypatch.setitem(sampling_test.PROPOSERS, "block", lambda: cls(
        distilled(SAMPLING_TARGET, layer_ids=(0,), draft_vocab=draft_vocab), SAMPLING_TARGET))
    monkeypatch.setattr(sampling_test, "N", SAMPLES)
    return sampling_test.speculative_counts("block", sampling_test.SETTINGS[setting], k)


@pytest.mark.parametrize("setting,k,draft_vocab", CONFIGS)
def test_speculative_sampling_matches_the_target_distribution(setting, k, draft_vocab, monkeypatch):
    counts, metrics = counts_for(setting, k, monkeypatch, draft_vocab)
    result = sampling_test.distribution_test(counts, sampling_test.exact_joint(sampling_test.SETTINGS[setting]))
    print(f"\nblock {setting} k={k}: p={result[0]:.3g} TV={result[1]:.4f} (bound {result[2]:.4f}) "
          f"alpha={metrics.acceptance_rate:.3f} tau={metrics.mean_acceptance_length:.3f}")
    assert sampling_test.passes(result), result
    assert metrics.accepted > 0.1 * SAMPLES  # drafts were really accepted


def test_the_distribution_test_fails_when_draft_probs_are_written_as_if_drawn_one_after_another(monkeypatch):
    setting, k, _ = CONFIGS[0]
    counts, _ = counts_for(setting, k, monkeypatch, cls=Sequential)
    result = sampling_test.distribution_test(counts, sampling_test.exact_joint(sampling_test.SETTINGS[setting]))
    print(f"\nsequential draft_probs: p={result[0]:.3g} TV={result[1]:.4f} (bound {result[2]:.4f})")
    assert not sampling_test.passes(result), result


# ---- validation alpha ----

def test_validation_alpha_per_slot_is_the_greedy_acceptance_of_drafting():
    """On the target's own greedy continuations, block_metrics' alpha_1 is the fraction of anchors
    whose slot-0 draft is the target's next token, and slot i is reached only where slots < i were
    accepted."""
    head = distilled()
    prompts = torch.randint(0, 64, (8, 2), generator=torch.Generator().manual_seed(5)).tolist()
    rows, _ = plain_generate(TARGET, prompts, StopRule(20), GREEDY)
    batch = torch.tensor([p + r.tokens for p, r in zip(prompts, rows)])  # (8, 22)
    anchors = 200  # more than fit: every anchor
    figures = block_metrics(TARGET, head, batch, anchors, torch.Generator().manual_seed(0))
    alphas, reached = figures[BLOCK:2 * BLOCK], figures[2 * BLOCK:]
    with torch.no_grad():
        targets = eagle_targets(TARGET, head, batch, 1)
        h = head.training_outputs(targets.features, targets.ahead, TARGET.model.embed_tokens,
                                  torch.arange(21), torch.ones(21, 21, dtype=torch.bool).tril())
        first = head.draft_ids[head.logits(h).argmax(-1)][:, :21 - BLOCK]              # slot 0 at every anchor
    assert reached[0] == first.numel()
    assert alphas[0] == pytest.approx(float((first == batch[:, 2:2 + 21 - BLOCK]).float().mean()))
    assert all(0 <= a <= 1 for a in alphas) and reached == sorted(reached, reverse=True)


# ---- checkpoint and bad input ----

def test_save_load_round_trip_and_refusals(tmp_path):
    target_dir, other_dir = tmp_path / "target", tmp_path / "other"
    save_model(TARGET, target_dir, dtype=torch.float32)
    save_model(tiny_llama(7), other_dir, dtype=torch.float32)
    head = distilled(attention="causal")
    folder = save_block(head, tmp_path / "block", sha256(target_dir / "model.safetensors"), dtype=torch.float32)
    loaded = load_block(folder, target_dir)
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), loaded.state_dict().values()))
    meta = json.loads((folder / "heads.json").read_text())
    assert (meta["kind"], meta["layer_ids"], meta["block"], meta["attention"], meta["num_layers"]) == (
        "block", [0, 1], BLOCK, "causal", 1)
    assert loaded.causal and loaded.block == BLOCK
    with pytest.raises(SpecdecError, match="belongs to the target with .* train a head for this target"):
        load_block(folder, other_dir)
    with pytest.raises(SpecdecError, match="is a model checkpoint .* not a block head"):
        load_block(target_dir, target_dir)
    shallow = tmp_path / "shallow"  # a target lacking layer 1: refused before its weights are read or hashed
    save_model(tiny_llama(7, layers=1), shallow, dtype=torch.float32)
    with pytest.raises(SpecdecError, match=r"target's decoder layers \[0, 1\], but the target .*shallow has 1"):
        load_block(folder, shallow)


def test_bad_input_is_refused_with_the_fix():
    with pytest.raises(SpecdecError, match=r"layer ids \[0, 5\] must be distinct decoder layers"):
        BlockHead(TARGET.config, (0, 5), torch.arange(8), BLOCK)
    with pytest.raises(SpecdecError, match="drafts 1..8 tokens per step .* k=9 was asked: use -k 1..8"):
        speculative_generate(TARGET, proposer(), PROMPTS, RULE, GREEDY, 9)
    with pytest.raises(SpecdecError, match=r"decoder layers \[0, 1\], but the target LlamaForCausalLM has 1"):
        BlockProposer(head=distilled(), target=tiny_llama(0, layers=1))
    with pytest.raises(SpecdecError, match="built for another target"):
        BlockProposer(head=distilled(), target=tiny_llama(0, hidden=64))
    with pytest.raises(SpecdecError, match="specdec's own LlamaForCausalLM"):
        BlockProposer(head=distilled(), target=torch.nn.Linear(4, 4))


# ---- training through `specdec train --objective block` ----

def test_cli_trains_a_head_that_resumes_exactly_and_drafts_token_identically(capsys, tmp_path):
    """A tiny target, then `specdec train --objective block --target`: a run stopped and resumed
    gives exactly the head of an uninterrupted one, with alpha per slot in its metadata, the target
    untouched; `specdec generate --draft block --heads` gives plain decoding's tokens; k beyond the
    block and the export are refused with the reason."""
    from specdec.train.loop import train

    from ..cli.test_cli import run_cli
    from ..train.test_train import JSON_PKG, tiny_cfg
    target = train(tiny_cfg(tmp_path / "target", steps=8, save_every=8, eval_every=8))
    before = sha256(target / "model.safetensors")
    args = ["train", "--preset", "tiny", "--corpus", JSON_PKG, "--objective", "block", "--target", str(target),
            "--draft-vocab", "128", "--block-size", "4", "--block-anchors", "8", "--steps", "4", "--eval-every", "2",
            "--save-every", "2"]
    assert run_cli(capsys, *args, "--out", str(tmp_path / "cut"), "--stop-after", "2")[0] == 0
    assert run_cli(capsys, *args, "--out", str(tmp_path / "cut"))[0] == 0
    assert run_cli(capsys, *args, "--out", str(tmp_path / "full"))[0] == 0
    heads = tmp_path / "cut" / "heads"
    a, b = (safetensors.torch.load_file(p / "heads.safetensors") for p in (heads, tmp_path / "full" / "heads"))
    assert all(torch.equal(a[k], b[k]) for k in a) and sha256(target / "model.safetensors") == before
    meta = json.loads((heads / "heads.json").read_text())
    assert (meta["kind"], meta["block"], meta["attention"], meta["draft_vocab_size"]) == ("block", 4, "causal", 128)
    assert [s for s, _ in meta["history"]["valid_alpha"]] == [0, 2, 4]
    assert all(len(x) == 4 for _, x in meta["history"]["valid_alpha"]) and (tmp_path / "cut" / "loss.png").exists()
    base = ["generate", "--model", str(target), "--prompt", "def f(x):", "--max-new-tokens", "16", "--json"]
    plain = json.loads(run_cli(capsys, *base)[1])
    for k in ("1", "4"):
        code, out, err = run_cli(capsys, *base, "--draft", "block", "--heads", str(heads), "-k", k)
        assert code == 0, err
        assert json.loads(out)["tokens"] == plain["tokens"]
    code, _, err = run_cli(capsys, *base, "--draft", "block", "--heads", str(heads), "-k", "5")
    assert code == 2 and "drafts 1..4 tokens per step" in err
    code, _, err = run_cli(capsys, "export", str(heads), str(tmp_path / "vllm"))
    assert code == 2 and "holds a block head, which no speculators format holds" in err
