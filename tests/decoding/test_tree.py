"""Draft trees (tree.py, verify.py, engine.py): a degenerate tree verifies like a chain, greedy tree
speculation equals plain decoding, multi-draft sampling keeps the target's exact joint
distribution (and the test fails for a wrong sibling residual), and a compacted cache equals one
that saw only the accepted path."""
from __future__ import annotations

import functools

import pytest
import torch

from specdec.decoding.engine import speculative_generate
from specdec.decoding.sampling import Draws, SamplingConfig
from specdec.decoding.stopping import StopRule
from specdec.decoding.tree import caterpillar_layout, chain_parents, chain_positions, chain_runs, window_layout
from specdec.decoding.verify import greedy_accept, rejection_sample, tree_rejection_sample
from specdec.errors import SpecdecError
from specdec.lm.interface import next_positions
from specdec.lm.kv_cache import cache_for
from specdec.proposers import DraftModelProposer, MTPProposer, NgramProposer
from specdec.heads.mtp import build_mtp
from specdec.proposers.ngram import trie

from ..spec_helpers import assert_greedy_rows_equal_reference, noisy_copy, tiny_llama
from .test_engine_sampling import DRAFT, PROMPT, SETTINGS, TARGET, N, distribution_test, exact_joint, passes


def logits_with_argmax(argmax: list[list[int]], vocab: int = 10) -> torch.Tensor:
    out = torch.zeros(len(argmax), len(argmax[0]), vocab)
    for b, row in enumerate(argmax):
        for i, t in enumerate(row):
            out[b, i, t] = 1.0
    return out


# ---- the tree's shape ----

def test_window_layout_positions_by_depth_and_mask_by_ancestry():
    parents = torch.tensor([[-1, -1, 0, 2]])  # root -> {0, 1}, 0 -> 2 -> 3
    positions, mask = window_layout(parents, [4], [10], context=64)
    assert positions.tolist() == [[10, 11, 11, 12, 13]]
    expected = [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 1, 0, 1, 1]]
    assert mask[0].int().tolist() == expected


@pytest.mark.parametrize("held", [[10, 3], [60, 58], [63, 40]], ids=["far from the end", "padding past it", "at it"])
def test_a_chains_positions_are_the_default_until_the_context_ends_then_clamped(held):
    """The engine lays out a chain's window (a plain step's too) from its host lengths, as the
    proposers do from their caches (lm.interface.next_positions): the model's default positions (None)
    while every row fits, else each row's own clamped at the context's last position."""
    cache = cache_for(1, 1, 4, 2, 64, torch.float32, "cpu")
    cache.rollback(held)
    for width in (1, 4):
        expected = next_positions(cache, width, 64)
        got = chain_positions(held, width, 64)
        assert (got is None) == (expected is None)
        if got is not None:
            assert got.tolist() == expected.tolist() and got.dtype == expected.dtype


@pytest.mark.parametrize("parents", [[[0, -1]], [[-1, 1]], [[-1, -2]]], ids=["child first", "self", "bad id"])
def test_a_malformed_tree_is_refused(parents):
    with pytest.raises(SpecdecError, match="malformed draft tree"):
        window_layout(torch.tensor(parents), [2], [0], context=64)


def test_a_tree_deeper_than_the_context_is_refused():
    with pytest.raises(SpecdecError, match="beyond the target's context"):
        window_layout(chain_parents(1, 4), [4], [60], context=64)


def test_caterpillar_layout_and_trie():
    assert caterpillar_layout((3, 1, 2)) == ([-1, -1, -1, 0, 3, 3], [0, 3, 4])
    # main chain 1 2 3; 1 2 4 shares two nodes; 5 6 branches at the root; width 2 at depth 1 drops 7
    tokens, parents = trie([[1, 2, 3], [1, 2, 4], [5, 6], [7, 8]], (2, 2, 2))
    assert tokens == [1, 5, 2, 6, 3, 4]
    assert parents == [-1, -1, 0, 1, 2, 2]


# ---- verification ----

def test_greedy_tree_on_a_degenerate_tree_equals_the_chain():
    drafts = torch.tensor([[4, 5, 6], [4, 5, 6], [4, 9, 6], [1, 1, 1]])
    logits = logits_with_argmax([[4, 5, 6, 7], [4, 5, 8, 2], [4, 5, 6, 3], [2, 2, 2, 2]])
    lengths = torch.tensor([3, 3, 3, 2])
    chain = greedy_accept(drafts, logits, lengths)
    tree = greedy_accept(drafts, logits, lengths, chain_parents(4, 3))
    assert tree.accepted.tolist() == chain.accepted.tolist() == [3, 2, 1, 0]
    assert tree.next_token.tolist() == chain.next_token.tolist() == [7, 8, 5, 2]
    assert tree.paths == [[0, 1, 2], [0, 1], [0], []]


def test_greedy_tree_follows_the_branch_the_target_agrees_with():
    # root -> 0 (tok 4), 1 (tok 5); 1 -> 2 (tok 6), 3 (tok 7); target: 5 at root, 7 after 5, then 9
    drafts, parents = torch.tensor([[4, 5, 6, 7]]), torch.tensor([[-1, -1, 1, 1]])
    logits = logits_with_argmax([[5, 0, 7, 0, 9]])
    verdict = greedy_accept(drafts, logits, torch.tensor([4]), parents)
    assert verdict.paths == [[1, 3]] and verdict.next_token.tolist() == [9]


def test_tree_sampling_on_a_degenerate_tree_matches_the_chain_rule():
    """Both rules' (accepted, next token) distributions over 40,000 draws agree (chi-square on the
    pooled cells, alpha 1e-3) for a 2-draft chain with random target and draft distributions."""
    g = torch.Generator().manual_seed(0)
    B, V = 40_000, 5
    target = torch.softmax(torch.randn(1, 3, V, generator=g) * 1.5, -1).expand(B, 3, V)
    draft = torch.softmax(torch.randn(1, 2, V, generator=g) * 1.5, -1).expand(B, 2, V)
    tokens = torch.multinomial(draft[:, 0], 1, True, generator=g)
    tokens = torch.cat([tokens, torch.multinomial(draft[:, 1], 1, True, generator=g)], 1)
    outcomes = []
    for verdict in (rejection_sample(tokens, draft, target, g),
                    tree_rejection_sample(tokens, draft, target, chain_parents(B, 2), g)):
        outcomes.append(torch.bincount(verdict.accepted * V + verdict.next_token, minlength=3 * V).double())
    from scipy.stats import chi2_contingency
    table = torch.stack(outcomes)
    table = table[:, table.sum(0) > 0]
    assert chi2_contingency(table.numpy()).pvalue > 1e-3


# ---- the engine with trees ----

def test_compaction_leaves_the_cache_of_the_accepted_path_alone():
    model = tiny_llama(3)
    prefix, nodes = [5, 9, 2], [7, 8, 1, 4, 6]
    parents = torch.tensor([[-1, -1, 0, 1, 3]])  # the path 1 -> 3 -> 4: tokens 8, 4, 6
    cache = model.new_cache(1, 32)
    model(torch.tensor([prefix[:-1]]), cache=cache)
    start = int(cache.lengths[0])
    positions, mask = window_layout(parents, [5], [start], context=64)
    model(torch.tensor([[prefix[-1]] + nodes]), positions=positions, cache=cache, attention_mask=mask)
    cache.compact([start], [[1, 3, 4]])
    cache.rollback([start + 4])
    alone = model.new_cache(1, 32)
    model(torch.tensor([prefix + [8, 4, 6]]), cache=alone)
    n = start + 4
    for layer in range(model.config.num_hidden_layers):
        for kept, fed in zip(cache.gathered(layer, n), alone.gathered(layer, n)):
            torch.testing.assert_close(kept, fed, rtol=1e-5, atol=1e-6)


def tiny_heads(target, kind: str, depth: int):
    heads = build_mtp(kind, target.config, depth)
    torch.manual_seed(7)
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return heads.eval()


def tree_proposers(target):
    return {
        "draft-model": (lambda: DraftModelProposer(model=noisy_copy(target, 0.05, seed=1)), (3, 2, 2)),
        "mtp sequential": (lambda: MTPProposer(heads=tiny_heads(target, "mtp-sequential", 3), target=target),
                           (2, 3, 2)),
        "mtp parallel": (lambda: MTPProposer(heads=tiny_heads(target, "mtp-parallel", 2), target=target),
                         (3, 3)),
        "ngram": (lambda: NgramProposer(), (3, 2, 2, 1)),
        "draft-model dynamic": (lambda: DraftModelProposer(model=noisy_copy(target, 0.05, seed=1),
                                                       tree="dynamic"), (3, 3, 2)),
    }


@pytest.mark.parametrize("name", ["draft-model", "mtp sequential", "mtp parallel", "ngram", "draft-model dynamic"])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_tree_speculation_equals_plain_decoding(name, batch):
    target = tiny_llama(0)
    make, widths = tree_proposers(target)[name]
    prompts = [[3, 9, 4, 3, 9], [5, 1, 2, 7, 1, 2, 7], [8], [4, 4, 4, 4]][:batch]
    rule = StopRule(max_new_tokens=24)
    rows, metrics = speculative_generate(target, make(), prompts, rule, SamplingConfig(), len(widths),
                                         widths=widths)
    assert_greedy_rows_equal_reference(target, prompts, rows, rule)
    assert metrics.accepted > 0


def test_off_chain_branches_are_accepted():
    """The alternatives beside a draft model's chain win often enough to matter: τ with a tree
    beats the chain's on the same prompts (greedy, so both emit the same text)."""
    target = tiny_llama(0)
    draft = noisy_copy(target, 0.3, seed=1)
    prompts, rule = [[3, 9, 4, 3, 9], [5, 1, 2, 7, 1]], StopRule(max_new_tokens=40)
    taus = []
    for widths in ((1, 1, 1), (4, 3, 2)):
        _, metrics = speculative_generate(target, DraftModelProposer(model=draft), prompts, rule,
                                          SamplingConfig(), 3, widths=widths)
        taus.append(metrics.mean_acceptance_length)
    assert taus[1] > taus[0]


def test_a_dynamic_tree_keeps_the_best_scored_candidates_per_depth():
    from specdec.proposers.base import grow_tree
    # root: token 5 (p .6) then 7 (p .3); after 5 the best child is 1, after 7 it is 2 (more certain)
    root = torch.log(torch.tensor([[.01, .01, .01, .01, .01, .6, .01, .3, .02, .02]]))
    after = {5: [.01, .5, .4, .01, .02, .01, .01, .01, .02, .01], 7: [.01, .01, .9, .01, .01, .01, .01, .01, .02, .0]}

    def children_logits(tokens, parents, frontier):
        return torch.log(torch.tensor([[after[tokens[0, i].item()] for i in frontier[0].tolist()]]) + 1e-9)

    proposal = grow_tree(root, children_logits, (2, 2), [2], None, [SamplingConfig()], Draws())
    # depth 2 candidates: 5->1 (.30), 5->2 (.24), 7->2 (.27): the two best are 5->1 and 7->2
    assert proposal.tokens.tolist() == [[5, 7, 1, 2]] and proposal.parents.tolist() == [[-1, -1, 0, 1]]


def test_widths_must_match_k():
    target = tiny_llama(0)
    with pytest.raises(SpecdecError, match="one width >= 1 per depth"):
        speculative_generate(target, NgramProposer(), [[1, 2]], StopRule(max_new_tokens=4),
                             SamplingConfig(), 2, widths=(2,))


# ---- sampling with multi-draft trees: the exact joint distribution of the first three tokens ----

TREE_CONFIGS = {  # >= 2 siblings at depth 1 and 2
    "draft-model (3,3), T=1": (lambda: DraftModelProposer(model=DRAFT), (3, 3), "T=1", PROMPT),
    "draft-model dynamic (2,3), T=1": (lambda: DraftModelProposer(model=DRAFT, tree="dynamic"), (2, 3),
                                       "T=1", PROMPT),
    # "2" is followed by 4, 1 and 6 in the prompt: n-gram lookup branches
    "ngram (2,2,2), T=0.7": (lambda: NgramProposer(), (2, 2, 2), "T=0.7,top-k=8,top-p=0.9",
                             PROMPT + [1, 2, 4, 2, 6, 2]),
}


def tree_counts(make, widths, sampling, prompt, tree_verify=tree_rejection_sample):
    """Counts of the first three tokens (V^3,) and how many accepted nodes had an earlier sibling
    (accepted after that sibling's rejection: the residual rule at work)."""
    rule = StopRule(max_new_tokens=3)
    generator = torch.Generator().manual_seed(99)
    later_siblings = 0

    def counting(tokens, draft_probs, target_probs, parents, generator, lengths):
        nonlocal later_siblings
        verdict = tree_verify(tokens, draft_probs, target_probs, parents, generator, lengths)
        for row, path in zip(parents.tolist(), verdict.paths):
            later_siblings += sum(row.index(row[c]) < c for c in path)
        return verdict

    rows, _ = speculative_generate(TARGET, make(), [prompt] * N, rule, sampling, len(widths), generator,
                                   widths=widths, tree_verify=counting)
    first3 = torch.tensor([row.tokens[:3] for row in rows])
    V = TARGET.config.vocab_size
    return torch.bincount(first3[:, 0] * V * V + first3[:, 1] * V + first3[:, 2], minlength=V ** 3).double(), \
        later_siblings


@pytest.mark.parametrize("case", TREE_CONFIGS.values(), ids=TREE_CONFIGS.keys())
def test_multi_draft_sampling_matches_the_target_distribution(case):
    make, widths, setting, prompt = case
    counts, later_siblings = tree_counts(make, widths, SETTINGS[setting], prompt)
    result = distribution_test(counts, exact_joint(SETTINGS[setting], prompt))
    print(f"p={result[0]:.3g} TV={result[1]:.4f} (bound {result[2]:.4f}); {later_siblings} accepted after a "
          "rejected sibling")
    assert passes(result), result
    assert later_siblings > 0.01 * N  # the multi-draft rule really ran


def keep_target_after_a_rejected_sibling(target_probs, draft_probs):
    """Wrong: a rejected sibling leaves the target's distribution as it was."""
    return target_probs


def test_the_distribution_test_fails_for_a_wrong_sibling_residual():
    make, widths, setting, _ = TREE_CONFIGS["draft-model (3,3), T=1"]
    wrong = functools.partial(tree_rejection_sample, residual_rule=keep_target_after_a_rejected_sibling)
    counts, _ = tree_counts(make, widths, SETTINGS[setting], PROMPT, wrong)
    assert not passes(distribution_test(counts, exact_joint(SETTINGS[setting], PROMPT)))


def test_chain_runs_count_the_accepted_path_while_it_follows_first_children():
    parents, chain = caterpillar_layout((3, 2, 1))  # nodes 0-2 at depth 1 (0 the chain's), 3-4 under 0, 5 under 3
    assert chain == [0, 3, 5]
    paths = [[0, 3, 5], [0, 4], [1], [], [0, 3]]
    assert chain_runs(torch.tensor([parents] * 5), paths) == [3, 1, 0, 0, 2]
