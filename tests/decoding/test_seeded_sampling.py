"""Seeded sampling by Gumbel-max (sampling.gumbel / perturbed, Engine.verify / Engine.pick): the
noise is the hash it claims to be, a seeded request's tokens are exactly distributed as the
target's (the exact-joint test of test_engine_sampling at N = 100,000 seeds, and the same test
failing for noise that forgets the position), and one seed gives the same tokens whatever drafts
them: no draft, a draft model or n-gram lookup, k = 1, 4 or auto, a tree, alone or in a batch of 8
with other requests — the tokens of the reference decoder run with that seed.
"""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from specdec import kernels
from specdec.decoding import sampling
from specdec.decoding.engine import Engine, Request, plain_generate, speculative_generate
from specdec.decoding.reference import reference_generate
from specdec.decoding.sampling import SamplingConfig, gumbel
from specdec.decoding.stopping import StopRule
from specdec.lm.interface import admit
from specdec.proposers import DraftModelProposer, NgramProposer

from ..spec_helpers import noisy_copy, tiny_llama
from .test_engine_sampling import DRAFT, PROMPT, SETTINGS, TARGET, N, V, distribution_test, exact_joint, passes


def python_gumbel(seed: int, position: int, v: int) -> float:
    """The noise of (seed, position, token v), computed with Python integers: the definition."""
    m64, m32 = (1 << 64) - 1, (1 << 32) - 1

    def splitmix(x):
        x = (x + 0x9E3779B97F4A7C15) & m64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m64
        return x ^ (x >> 31)

    def mix(x):
        x ^= x >> 16
        x = (x * 0x7FEB352D) & m32
        x ^= x >> 15
        x = (x * 0x846CA68B) & m32
        return x ^ (x >> 16)

    key = splitmix(splitmix(seed) ^ position)
    x = mix(mix(v ^ (key & m32)) ^ (key >> 32))
    u = ((x >> 9) + 0.5) / 2 ** 23  # exact in float64 (and in float32)
    return float(-np.log(-np.log(u)))


def test_uniforms_stay_inside_the_open_interval_at_the_extreme_hashes():
    """Every hash at both ends of the uint32 range gives a uniform strictly inside (0, 1), exactly
    (top 23 bits + 1/2) * 2^-23, so the noise is finite. The earlier 24-bit form rounded
    (2^24 - 1 + 1/2) * 2^-24 to 1.0 in float32: infinite noise."""
    extremes = np.array([0, 1, 511, 512, 2 ** 31, 2 ** 32 - 513, 2 ** 32 - 512, 2 ** 32 - 2, 2 ** 32 - 1], dtype=np.uint32)
    u = sampling.open_uniform(extremes.copy())
    assert u.dtype == np.float32 and bool(((u > 0) & (u < 1)).all())
    assert [float(v) for v in u] == [((int(x) >> 9) + 0.5) / 2 ** 23 for x in extremes]
    assert bool(np.isfinite(-np.log(-np.log(u))).all())


def test_kept_noise_rows_are_the_rows_made_anew_and_stay_within_their_budget():
    rows = sampling.NoiseRows(budget=3 * 300 * 4)  # three rows of 300 float32s
    keys = [(5, t) for t in range(4)]
    first = rows.rows(keys, 300)  # four made: the oldest dropped
    assert len(rows.kept) == 3 and (5, 0) not in rows.kept and rows.bytes <= rows.budget
    again = rows.rows(keys[::-1], 300)  # three kept, one made anew
    fresh = sampling.noise_rows(keys, 300)
    for a, b, c in zip(first, again[::-1], fresh):
        assert np.array_equal(a, c) and np.array_equal(b, c)
    assert np.array_equal(rows.rows([(5, 3)], 400)[0][:300], fresh[3])  # a longer row: made anew, the same start
    ids = torch.tensor([0, 7, 299])  # a draft vocabulary's columns: the full row's, indexed
    assert torch.equal(gumbel([5], [[2]], 3, ids), gumbel([5], [[2]], 300)[..., ids])


def test_the_kernels_hash_the_noise_as_the_numpy_reference_does():
    module = kernels.compiled()
    assert module is not None, "the CPU kernels did not build here (g++ is needed)"
    rng = np.random.default_rng(0)
    low, high = (rng.integers(0, 2 ** 32, size=7, dtype=np.uint64).astype(np.uint32) for _ in range(2))
    compiled = module.noise_hashes(torch.from_numpy(low.view(np.int32)), torch.from_numpy(high.view(np.int32)), 5000)
    assert np.array_equal(compiled.numpy().view(np.uint32), sampling.noise_hashes(low, high, 5000))


def test_noise_made_on_a_device_is_the_hosts_bit_for_bit():
    """A GPU makes a seeded row's noise where its logits are (`device_noise_rows`: torch's integer
    operations, and each uniform's noise read from a table the host made): run on the CPU, that path
    gives the host's numbers exactly, for 24 random (seed, position) keys at row lengths of the whole
    vocabulary and of draft vocabularies, the extreme hash among them."""
    rng = np.random.default_rng(1)
    for length in (49152, 4099, 1):
        keys = [(int(rng.integers(0, 2 ** 62)), int(rng.integers(0, 10 ** 6))) for _ in range(8)]
        keys += [EXTREME[:2]] if length > EXTREME[2] else []
        host = sampling.noise_rows(keys, length)
        made = sampling.device_noise_rows(keys, length, torch.device("cpu")).numpy()
        assert np.array_equal(made.view(np.uint32), host.view(np.uint32))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_gumbel_on_a_cuda_device_is_the_hosts():
    ids = torch.tensor([3, 17, 4095, 2])
    for columns in (None, ids):
        host = gumbel([5, 9], [[10, 11], [12, 13]], 4096, columns)
        assert torch.equal(gumbel([5, 9], [[10, 11], [12, 13]], 4096, columns, "cuda").cpu(), host)


# (seed 1, position 265, token 2431) hashes to x with x >> 8 = 2^24 - 1, the value whose 24-bit uniform
# rounded to 1.0 (found by searching the hash over seeds and positions)
EXTREME = (1, 265, 2431)


def test_the_extreme_hash_gives_finite_noise_and_a_token_outside_top_k_is_never_drawn():
    seed, position, token = EXTREME
    noise = gumbel([seed], [[position]], 4096)  # (1, 1, V)
    assert bool(torch.isfinite(noise).all())
    logits = torch.randn(1, 1, 4096, generator=torch.Generator().manual_seed(0))
    logits[0, 0, token] = logits.min() - 1  # far from the top: top_k = 1 gives it probability 0
    drawn = sampling.perturbed(logits, [SamplingConfig(temperature=1.0, top_k=1, seed=seed)], [[position]])
    assert int(drawn.argmax(-1)) == int(logits.argmax(-1))


def test_seeded_tokens_lie_inside_top_k_and_top_p_over_many_seeds():
    """4 seeds x 512 positions x 4,096 tokens (8.4M noise values, the extreme hash among them): every
    seeded token is one the processed distribution allows."""
    seeds, positions, vocab = list(range(4)), [list(range(512))] * 4, 4096
    logits = torch.randn(4, 512, vocab, generator=torch.Generator().manual_seed(1))
    for config in (SamplingConfig(temperature=1.0, top_k=2), SamplingConfig(temperature=0.7, top_p=0.5)):
        configs = [replace(config, seed=s) for s in seeds]
        allowed = sampling.row_probabilities(logits, configs) > 0                 # (4, 512, V)
        tokens = sampling.perturbed(logits, configs, positions).argmax(-1)       # (4, 512)
        assert bool(allowed.gather(-1, tokens[..., None]).all())


def test_masked_columns_draw_what_the_dense_noise_draws_and_a_single_token_column_needs_none(monkeypatch):
    """Logits masked by a grammar (-inf outside it): the columns with more than one token get the
    dense computation's values exactly; a column with one token keeps it, without noise."""
    logits = torch.randn(3, 6, 300, generator=torch.Generator().manual_seed(2))
    logits[0, 1] = logits[2, 4] = float("-inf")
    logits[0, 1, 17] = logits[2, 4, 250] = 0.3   # one token allowed
    logits[1, 2, 40:] = float("-inf")             # 40 allowed
    configs = [SamplingConfig(temperature=1.0, seed=1), SamplingConfig(temperature=0.7, top_k=5, seed=2),
               SamplingConfig(temperature=1.3, top_p=0.9, seed=3)]
    positions = [[10 + i for i in range(6)], [3 + i for i in range(6)], [7] * 6]
    dense = sampling.row_probabilities(logits, configs).log() + gumbel([1, 2, 3], positions, 300)
    free = torch.ones(3, 6, dtype=torch.bool)
    free[0, 1] = free[2, 4] = False
    noised = []
    monkeypatch.setattr(sampling, "gumbel", lambda seeds, *rest: noised.append(len(seeds)) or gumbel(seeds, *rest))
    got = sampling.perturbed(logits, configs, positions)
    assert torch.equal(got[free], dense[free]) and torch.equal(got.argmax(-1), dense.argmax(-1))
    assert noised == [16]  # the 18 columns but the two with one token


def test_seeded_rows_draw_their_perturbed_argmax_without_a_draft_distribution():
    """A drafter's draw (proposers/base.draw) over seeded rows: each draft is the argmax of the row's
    log-probabilities plus the noise of its position, and no draft distribution is made (verification
    of a seeded row reads none); a row sampled without a seed beside them gets one, and the seeded
    rows' drafts stay the same."""
    from specdec.proposers.base import draw
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(4)) * 3
    seeded = [SamplingConfig(temperature=1.0, seed=5), SamplingConfig(temperature=0.6, seed=6),
              SamplingConfig(temperature=0.0)]
    positions = [11, 3, 8]
    depth = 2
    p, tokens, scores = draw(logits, seeded, sampling.Draws(None, positions), depth, None, 300)
    assert p is None
    noise = gumbel([5, 6], [[11 + depth], [3 + depth]], 300)[:, 0]
    want = (sampling.row_probabilities(logits[:2], seeded[:2]).log() + noise).argmax(-1)
    assert tokens[:2].tolist() == want.tolist() and int(tokens[2]) == int(logits[2].argmax())
    assert torch.equal(scores[:2].argmax(-1), want)
    mixed = [*seeded[:2], SamplingConfig(temperature=1.0)]
    p, again, _ = draw(logits, mixed, sampling.Draws(torch.Generator().manual_seed(0), positions), depth, None, 300)
    assert p is not None and torch.allclose(p.sum(-1), torch.ones(3)) and again[:2].tolist() == want.tolist()


def test_noise_is_the_hash_of_seed_position_and_token():
    seeds, positions = [0, 7, 2 ** 63 - 1], [[0, 5], [1023, 3], [2, 2]]
    noise = gumbel(seeds, positions, 300)  # (3, 2, 300)
    for r, seed in enumerate(seeds):
        for i, t in enumerate(positions[r]):
            for v in (0, 1, 299):
                assert noise[r, i, v].item() == pytest.approx(python_gumbel(seed, t, v), rel=1e-6)
    assert torch.equal(noise[2, 0], noise[2, 1])  # same seed and position: same noise
    big = gumbel(list(range(200)), [[t] for t in range(200)], 5000).flatten().double()
    # standard Gumbel: mean = Euler's gamma, variance pi^2/6 (1e6 draws: standard errors 1e-3 and 2e-3)
    assert big.mean().item() == pytest.approx(0.5772, abs=6e-3)
    assert big.var().item() == pytest.approx(math.pi ** 2 / 6, abs=2e-2)


def seeded_counts(setting: str, proposer, k: int) -> tuple[torch.Tensor, object]:
    """N requests of PROMPT, request i seeded i, through one engine batch: counts of their first
    three tokens (V^3,)."""
    rule = StopRule(max_new_tokens=max(3, k + 1))
    engine = Engine(admit(TARGET), proposer, k, N, len(PROMPT) + rule.max_new_tokens)
    generator = torch.Generator().manual_seed(1)  # the draft model's draws (the target's are the noise)
    requests = [Request(PROMPT, rule, replace(SETTINGS[setting], seed=i), generator) for i in range(N)]
    for request in requests:
        engine.submit(request)
    while engine.busy:
        engine.step()
    first3 = torch.tensor([r.row.tokens[:3] for r in requests])
    index = first3[:, 0] * V * V + first3[:, 1] * V + first3[:, 2]
    return torch.bincount(index, minlength=V ** 3).double(), engine.metrics


CONFIGS = [("draft-model", "T=1", 3), ("ngram", "T=0.7,top-k=8,top-p=0.9", 1)]
PROPOSERS = {"draft-model": lambda: DraftModelProposer(model=DRAFT), "ngram": lambda: NgramProposer()}


@pytest.mark.parametrize("proposer_name,setting,k", CONFIGS)
def test_seeded_sampling_matches_the_target_distribution(proposer_name, setting, k):
    counts, metrics = seeded_counts(setting, PROPOSERS[proposer_name](), k)
    result = distribution_test(counts, exact_joint(SETTINGS[setting]))
    print(f"\nseeded {proposer_name} {setting} k={k}: p={result[0]:.3g} TV={result[1]:.4f} (bound {result[2]:.4f}) "
          f"alpha={metrics.acceptance_rate:.3f}")
    assert passes(result), result
    assert metrics.accepted > 0.01 * N


def test_the_distribution_test_fails_for_noise_that_forgets_the_position(monkeypatch):
    keys = sampling.noise_keys
    monkeypatch.setattr(sampling, "NOISE", sampling.NoiseRows())  # no row kept from before the change
    monkeypatch.setattr(sampling, "noise_keys", lambda seeds, positions: keys(seeds, [[0] * len(p) for p in positions]))
    counts, _ = seeded_counts("T=1", PROPOSERS["draft-model"](), 3)
    result = distribution_test(counts, exact_joint(SETTINGS["T=1"]))
    print(f"\nnoise without position: p={result[0]:.3g} TV={result[1]:.4f} (bound {result[2]:.4f})")
    assert not passes(result), result


# ---- one seed, the same tokens whatever drafts them ----

BIG = tiny_llama(3, vocab=48, layers=2, hidden=32, context=96, std=0.3)
BIG_DRAFT = noisy_copy(BIG, 0.05, seed=9)
ALONE = [1, 5, 9, 5, 9]
OTHERS = [[3, 4], [7, 7, 7, 2], [1, 5, 9], [11, 2, 3, 4, 5], [6], [2, 2, 2], [9, 8, 7, 6]]
CONFIG = SamplingConfig(temperature=0.9, top_p=0.95, seed=42)


def engine_tokens(proposer_name: str | None, k, widths=None, batch: bool = False) -> list[int]:
    rule = StopRule(max_new_tokens=40)
    proposer = (None if proposer_name is None else DraftModelProposer(model=BIG_DRAFT)
                if proposer_name == "draft-model" else NgramProposer(max_n=2, min_n=1))
    engine = Engine(admit(BIG), proposer or NgramProposer(), k, 8, 96, widths=widths)
    g = torch.Generator().manual_seed(0)
    mine = Request(ALONE, rule, CONFIG, g)
    others = [Request(p, StopRule(max_new_tokens=10 + 3 * i), SamplingConfig(1.0, seed=i) if i % 3 else
                      SamplingConfig(0.7) if i % 2 else SamplingConfig(), g) for i, p in enumerate(OTHERS)]
    for request in (others[:4] + [mine] + others[4:]) if batch else [mine]:
        engine.submit(request)
    while engine.busy:
        engine.step()
    return mine.row.tokens


def test_one_seed_gives_the_same_tokens_with_any_draft_k_tree_and_batch():
    want = reference_generate(BIG, ALONE, StopRule(max_new_tokens=40), CONFIG).tokens
    plain, _ = plain_generate(BIG, [ALONE], StopRule(max_new_tokens=40), CONFIG, torch.Generator().manual_seed(5))
    assert plain[0].tokens == want
    runs = {}
    for proposer_name in ("draft-model", "ngram"):
        for k, widths in ((0, None), (1, None), (4, None), ("auto", None), (3, (2, 2, 1)), ("auto", (2, 2, 1))):
            for batch in (False, True):
                runs[(proposer_name, k, widths, batch)] = engine_tokens(proposer_name, k, widths, batch)
    wrong = {config: tokens for config, tokens in runs.items() if tokens != want}
    assert not wrong, (want, wrong)


# ---- coupled drafts: a seeded row drafts with its verifier's noise ----

SAMPLING_DRAFTERS = ("draft-model", "parallel", "mtp", "eagle", "block", "self", "hybrid",
                     "eagle-hybrid")  # those that draw from a distribution
TOY_PROMPTS = ["def add(a, b):\n", "import os\nfor path in", "class Stack:\n    def", "x = [i for i in",
               "def main():\n    args ="]


@pytest.fixture(scope="module")
def toy():
    from specdec.api import TOY_TARGET, encode_prompts, load
    target = load(TOY_TARGET)
    prompts = encode_prompts(target, TOY_PROMPTS, 32)
    plain = {seed: [r.tokens for r in plain_generate(target.model, prompts, StopRule(32),
                                                     SamplingConfig(1.0, seed=seed), torch.Generator())[0]]
             for seed in (0, 1, 2)}
    return target, prompts, plain


def toy_run(target, proposer, prompts, seed, k, widths=None):
    rows, metrics = speculative_generate(target.model, proposer, prompts, StopRule(32), SamplingConfig(1.0, seed=seed),
                                         k, torch.Generator().manual_seed(1), widths=widths)
    return [r.tokens for r in rows], metrics


@pytest.mark.parametrize("name", SAMPLING_DRAFTERS)
def test_a_seeded_row_drafts_with_its_verifiers_noise(toy, name):
    """Every sampling drafter of the toy target at T=1, k=3, 5 prompts x 32 tokens: pooled over three
    seeds, seeded α stays within 0.12 of unseeded α (drafts drawn as argmax(log draft_probs + the
    noise of the position they are verified at) agree with the target's Gumbel-max draws about as
    often as rejection sampling accepts: at least (1 - TV) / (1 + TV) where rejection sampling gets
    1 - TV). Drafts drawn from an unrelated random stream agree with probability sum target_probs *
    draft_probs: 0.05-0.06 here against 0.3-0.7 unseeded. The seeded tokens stay those of plain
    seeded decoding, chains and a tree."""
    from specdec.api import load_drafter
    target, prompts, plain = toy
    proposer = load_drafter(target, name)
    _, unseeded = toy_run(target, proposer, prompts, None, 3)
    accepted = proposed = 0
    for seed in (0, 1, 2):
        tokens, metrics = toy_run(target, proposer, prompts, seed, 3)
        accepted, proposed = accepted + metrics.accepted, proposed + metrics.proposed
        assert tokens == plain[seed]
    coupled = accepted / proposed
    print(f"\n{name}: α unseeded {unseeded.acceptance_rate:.3f}, seeded {coupled:.3f} ({accepted}/{proposed})")
    assert coupled > unseeded.acceptance_rate - 0.12
    if getattr(proposer, "trees", False):
        assert toy_run(target, proposer, prompts, 0, 3, (2, 2, 1))[0] == plain[0]
