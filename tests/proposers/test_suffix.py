"""proposers/suffix.py: the suffix-tree proposer's trees from tables of intent (longest match,
frequencies, threshold, factor, widths, limits), batch against rows one by one, observe, the shared
trie across generations and its node budget; greedy speculation through the engine equals plain
decoding, and multi-draft sampling with its trees keeps the target's exact joint distribution."""
from __future__ import annotations

import pytest
import torch

from specdec.decoding.engine import speculative_generate
from specdec.decoding.protocol import Outcome
from specdec.decoding.reference import reference_generate
from specdec.decoding.sampling import Draws, SamplingConfig
from specdec.decoding.stopping import StopRule
from specdec.errors import SpecdecError
from specdec.proposers import DRAFTERS, SuffixProposer

from ..decoding import test_tree
from ..spec_helpers import NEAR_TIE, assert_greedy_rows_equal_reference, greedy_divergence, tiny_llama
from ..decoding.test_engine_sampling import PROMPT, SETTINGS, distribution_test, exact_joint, passes

CHAIN = (1, 1, 1, 1)
# "2" went on with 4 twice, then 1 and 6 once each; "2 4 2" with 1, then 6
BRANCHY = [2, 4, 2, 1, 2, 4, 2, 6, 2]

# history, proposer settings, limit, widths -> tokens, parents (None: a chain)
CASES = {
    "longest match wins: 1 2 3 -> 9, not 2 3 -> 7": ([1, 2, 3, 9, 5, 2, 3, 7, 1, 2, 3], {}, 3, CHAIN,
                                                     [9, 5, 2], None),
    "max_match shortens the pattern: 2 3 -> 7 (9 and 7 tie, 7 seen latest)": (
        [1, 2, 3, 9, 5, 2, 3, 7, 1, 2, 3], {"max_match": 2}, 1, CHAIN, [7], None),
    "frequencies rank branches: 7 -> 1 (3 of 4), 2 (1 of 4)": ([7, 1, 7, 2, 7, 1, 7, 1, 9, 7], {}, 1, (2,),
                                                              [1, 2], [-1, -1]),
    "a tie goes to the continuation first seen latest": ([7, 1, 7, 2, 9, 7], {}, 1, (2,), [2, 1], [-1, -1]),
    "threshold: five continuations of 0.2 each are below 0.25": (
        [7, 1, 7, 2, 7, 3, 7, 4, 7, 5, 9, 7], {"min_score": 0.25}, 1, (3,), [], None),
    "threshold: ... and at 0.2 the widths decide": ([7, 1, 7, 2, 7, 3, 7, 4, 7, 5, 9, 7], {"min_score": 0.2}, 1,
                                                    (3,), [5, 4, 3], [-1, -1, -1]),
    "threshold: the path score falls below it (1/2 then 1/4)": (BRANCHY, {"factor": 3, "min_score": 0.3}, 3,
                                                                (2, 2, 2), [4, 2], [-1, 0]),
    "factor 1: a 1-token match drafts 1 level": ([1, 2, 3, 4, 5, 6, 1], {}, 4, CHAIN, [2], None),
    "factor 2.5: 2 levels": ([1, 2, 3, 4, 5, 6, 1], {"factor": 2.5}, 4, CHAIN, [2, 3], None),
    "factor 3: 3 levels": ([1, 2, 3, 4, 5, 6, 1], {"factor": 3}, 4, CHAIN, [2, 3, 4], None),
    "a tree, best first per depth, siblings by score": (BRANCHY, {"factor": 3}, 3, (2, 2, 2),
                                                        [4, 6, 2, 2, 6, 1], [-1, -1, 0, 1, 2, 2]),
    "all widths 1: the best chain": (BRANCHY, {"factor": 3}, 3, (1, 1, 1), [4, 2, 6], None),
    "a full depth drops the subtrees of its losers": (BRANCHY, {"factor": 3}, 3, (3, 1, 1),
                                                      [4, 6, 1, 2, 6], [-1, -1, -1, 0, 3]),
    "limit cuts the depth": (BRANCHY, {"factor": 3}, 1, (2, 2, 2), [4, 6], [-1, -1]),
    "trie_depth bounds match + continuation": ([1, 2, 3, 4, 5, 1, 2], {"trie_depth": 3, "max_match": 2,
                                                                       "factor": 3}, 4, CHAIN, [3], None),
    "the continuation ends with the text": ([7, 8, 7], {"factor": 4}, 4, CHAIN, [8, 7], None),
    "min_match 3: a match of 2 (2 3 -> 7) drafts nothing": ([1, 2, 3, 9, 5, 2, 3, 7, 8, 2, 3], {"min_match": 3}, 3,
                                                            CHAIN, [], None),
    "min_match 3: ... a match of 3 (1 2 3 -> 9) drafts": ([1, 2, 3, 9, 5, 2, 3, 7, 1, 2, 3], {"min_match": 3}, 3,
                                                          CHAIN, [9, 5, 2], None),
    "no repeat: nothing": ([1, 2, 3], {}, 4, CHAIN, [], None),
    "limit 0: nothing": ([1, 2, 1], {}, 0, CHAIN, [], None),
}


def start(proposer, histories):
    state = proposer.start(64, 8, len(histories))
    proposer.join(state, histories, torch.zeros(len(histories), 0, 1), [SamplingConfig()] * len(histories))
    return state


def drafted(proposal, b: int) -> tuple[list[int], list[int] | None]:
    n = int(proposal.lengths[b])
    parents = None if proposal.parents is None or n == 0 else proposal.parents[b, :n].tolist()
    return proposal.tokens[b, :n].tolist(), parents


def propose_one(history, settings, limit, widths):
    proposer = SuffixProposer(**settings)
    proposal = proposer.propose(start(proposer, [history]), torch.tensor([limit]), widths, Draws())
    assert proposal.draft_probs is None
    return drafted(proposal, 0)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_suffix_table(case):
    *args, tokens, parents = case
    assert propose_one(*args) == (tokens, parents)


def test_batch_equals_rows_one_by_one():
    cases = [c for c in CASES.values() if c[1] == {"factor": 3}] + [CASES["frequencies rank branches: 7 -> 1 "
                                                                          "(3 of 4), 2 (1 of 4)"]]
    proposer = SuffixProposer(factor=3)
    widths, limits = (2, 2, 2), torch.tensor([3, 0, 2, 1, 3, 1])[:len(cases)]
    proposal = proposer.propose(start(proposer, [c[0] for c in cases]), limits, widths, Draws())
    for b, (case, limit) in enumerate(zip(cases, limits.tolist())):
        assert drafted(proposal, b) == propose_one(case[0], {"factor": 3}, limit, widths)


def test_observe_extends_the_rows_tries_by_what_each_row_committed():
    """After committing counts[b] of the same tokens, each row drafts as if its history had
    been that long from the start."""
    histories = [[1, 2, 3, 4, 1], [5, 6, 5], [8, 9, 8, 9]]
    committed = torch.tensor([[2, 5, 1, 0], [7, 5, 6, 0], [9, 8, 7, 0]])
    counts = torch.tensor([3, 2, 0])
    proposer = SuffixProposer(factor=4, shared_nodes=0)
    state = start(proposer, histories)
    proposer.observe(state, Outcome(counts.tolist(), committed.tolist(), counts.tolist(), torch.zeros(3, 4, 1)))
    proposal = proposer.propose(state, torch.tensor([4, 4, 4]), CHAIN, Draws())
    for b, (history, tokens, n) in enumerate(zip(histories, committed.tolist(), counts.tolist())):
        assert drafted(proposal, b) == propose_one(history + tokens[:n], {"factor": 4, "shared_nodes": 0}, 4,
                                                   CHAIN)
    # learnt from what they committed: "1 2" went on with 5 the last time, "5" with 7
    assert [drafted(proposal, b)[0] for b in range(3)] == [[2, 5, 1], [7, 5], [8, 9]]


def generate_by_hand(proposer, prompt, tokens):
    """A generation that commits `tokens` one step at a time."""
    state = start(proposer, [prompt])
    for token in tokens:
        proposer.observe(state, Outcome([0], [[token]], [1], torch.zeros(1, 1, 1)))
    return state


def test_the_shared_trie_lets_a_second_generation_draft_from_the_first_ones_text():
    for shared_nodes, expected in ((500_000, [7, 8, 9]), (0, [])):
        proposer = SuffixProposer(factor=2, shared_nodes=shared_nodes)
        generate_by_hand(proposer, [1, 2, 3], [5, 6, 7, 8, 9])
        # the prompt ends with "5 6", which only the first generation's output holds
        second = proposer.propose(start(proposer, [[4, 5, 6]]), torch.tensor([3]), (1, 1, 1), Draws())
        assert drafted(second, 0) == (expected, None)


def test_of_the_two_tries_the_tree_with_more_expected_accepted_drafts_wins():
    """Row trie: "6" went on with 9 5 (a 1-token match: 2 levels at factor 2, expected 2); shared
    trie: "5 6" went on with 7 8 9 (a 2-token match: 3 levels, expected 3). At limit 2 both expect
    2 drafts, and the row's own tree wins the tie."""
    proposer = SuffixProposer(factor=2)
    generate_by_hand(proposer, [1, 2, 3], [5, 6, 7, 8, 9])
    state = start(proposer, [[4, 6, 9, 5, 6]] * 2)
    proposal = proposer.propose(state, torch.tensor([3, 2]), (1, 1, 1), Draws())
    assert [drafted(proposal, b)[0] for b in range(2)] == [[7, 8, 9], [9, 5]]


def test_trees_keep_widths_limits_depth_order_and_follow_the_history():
    """Random histories over 5 tokens: at most widths[d] nodes at depth d + 1, none deeper than
    the limit, parents before children and depths never decreasing, and every path, after the
    text's last token, occurred in the text."""
    g = torch.Generator().manual_seed(0)
    proposer = SuffixProposer(factor=4, min_score=0.05)
    for _ in range(200):
        history = torch.randint(0, 5, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
        widths = tuple(torch.randint(1, 4, (4,), generator=g).tolist())
        limit = int(torch.randint(0, 5, (1,), generator=g))
        tokens, parents = drafted(proposer.propose(start(proposer, [history]), torch.tensor([limit]), widths, Draws()),
                                  0)
        parents = parents if parents is not None else list(range(-1, len(tokens) - 1))
        depths = []
        for i, p in enumerate(parents):
            assert -1 <= p < i
            depths.append(1 if p < 0 else depths[p] + 1)
        assert depths == sorted(depths) and max(depths, default=0) <= limit
        assert all(depths.count(d + 1) <= w for d, w in enumerate(widths))
        text = " " + " ".join(map(str, history)) + " "
        for i in range(len(tokens)):
            path, node = [], i
            while node >= 0:
                path.insert(0, tokens[node])
                node = parents[node]
            assert " " + " ".join(map(str, history[-1:] + path)) + " " in text, (history, tokens, parents)


def test_the_shared_trie_keeps_its_node_budget_and_relearns_after_a_flush():
    proposer = SuffixProposer(trie_depth=4, max_match=2, factor=2, shared_nodes=12)
    generate_by_hand(proposer, [0], [1, 2, 3, 4])  # suffixes of at most 4 tokens: 1 + 2 + 3 + 4 nodes
    assert len(proposer.shared) == 10
    # 10 + 1 at "10", 13 at "11": flushed; then 12..15 learnt afresh, 1 + 2 + 3 + 4 nodes
    generate_by_hand(proposer, [0], [10, 11, 12, 13, 14, 15])
    assert len(proposer.shared) == 10 and proposer.epoch == 1

    def second(prompt):
        return drafted(proposer.propose(start(proposer, [prompt]), torch.tensor([2]), (1, 1), Draws()), 0)[0]
    assert second([9, 1]) == second([9, 10]) == []  # gone with the flush
    assert second([9, 12]) == [13, 14]


BAD = {
    "trie_depth 1": ({"trie_depth": 1}, "trie_depth must be an integer >= 2"),
    "max_match 0": ({"max_match": 0}, "max_match must be an integer from 1 to trie_depth - 1"),
    "max_match = trie_depth": ({"trie_depth": 8, "max_match": 8}, "lower it or raise trie_depth"),
    "min_score above 1": ({"min_score": 1.5}, r"min_score .* must lie in \[0, 1\]"),
    "factor 0": ({"factor": 0}, "factor .* must be > 0"),
    "negative shared_nodes": ({"shared_nodes": -1}, "shared_nodes must be an integer >= 0"),
    "min_match above max_match": ({"max_match": 4, "min_match": 5}, "min_match must be an integer from 1 to max_match"),
}


@pytest.mark.parametrize("case", BAD.values(), ids=BAD.keys())
def test_bad_settings_are_refused_with_what_to_give(case):
    settings, message = case
    with pytest.raises(SpecdecError, match=message):
        SuffixProposer(**settings)


def test_registry_builds_it_by_name():
    proposer = DRAFTERS["suffix"].load(None)  # no folder, no network: the target is not read
    assert type(proposer) is SuffixProposer and proposer.trees and proposer.vocab_size is None


# ---- through the engine ----

PROMPTS = [[3, 9, 4, 3, 9], [5, 1, 2, 7, 1, 2, 7], [8], [4, 4, 4, 4]]


@pytest.mark.parametrize("widths", [CHAIN, (3, 2, 2, 1)], ids=["chain", "tree"])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_speculation_equals_plain_decoding(widths, batch):
    target = tiny_llama(0)
    prompts, rule = PROMPTS[:batch], StopRule(max_new_tokens=24)
    rows, metrics = speculative_generate(target, SuffixProposer(factor=2), prompts, rule,
                                         SamplingConfig(), len(widths), widths=widths)
    assert_greedy_rows_equal_reference(target, prompts, rows, rule)
    assert metrics.accepted > 0


def test_a_second_run_drafts_from_the_first_ones_output():
    """Greedy, the same prompt twice through one proposer: the second run finds the first one's
    text in the shared trie and accepts more drafts (and still says exactly what the target says)."""
    target = tiny_llama(0)
    proposer, prompt, rule = SuffixProposer(), [[8]], StopRule(max_new_tokens=32)
    expected = reference_generate(target, prompt[0], rule, SamplingConfig()).tokens
    accepted = []
    for _ in range(2):
        rows, metrics = speculative_generate(target, proposer, prompt, rule, SamplingConfig(), 4, widths=(2, 2, 1, 1))
        gap = greedy_divergence(target, prompt[0], rows[0].tokens, expected)
        assert gap is None or gap < NEAR_TIE
        accepted.append(metrics.accepted)
    assert accepted[1] > accepted[0]


def test_multi_draft_sampling_with_suffix_trees_matches_the_target_distribution(monkeypatch):
    """The exact joint distribution of the first three tokens (tests/decoding/test_tree.py's machinery).
    The prompt's "2" went on with 4 twice and 9 once, "2 4" with 2 and 4: the first tree has 2
    siblings at depths 1 and 2, and the target often takes the second. N is 40,000 rows, not
    100,000: every row holds its own trie, and the test stays near 20 s."""
    monkeypatch.setattr(test_tree, "N", 40_000)
    setting = "T=0.7,top-k=8,top-p=0.9"
    prompt = PROMPT + [4, 4, 9, 0, 2, 9, 4, 0, 4, 4, 0, 7, 2]

    def make():  # paths of 6 tokens are enough here, and keep 40,000 tries small
        return SuffixProposer(trie_depth=6, max_match=3, factor=3)

    proposer = make()
    first = proposer.propose(start(proposer, [prompt]), torch.tensor([3]), (2, 2, 2), Draws())
    assert drafted(first, 0) == ([4, 9, 4, 2, 9, 4], [-1, -1, 0, 0, 2, 3])
    counts, later_siblings = test_tree.tree_counts(make, (2, 2, 2), SETTINGS[setting], prompt)
    result = distribution_test(counts, exact_joint(SETTINGS[setting], prompt))
    print(f"p={result[0]:.3g} TV={result[1]:.4f} (bound {result[2]:.4f}); {later_siblings} accepted after a "
          "rejected sibling")
    assert passes(result), result
    assert later_siblings > 0.01 * test_tree.N  # the multi-draft rule really ran
