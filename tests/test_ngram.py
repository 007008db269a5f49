"""N-gram proposals: the lookup itself, and plans that use it stay lossless and say where tokens came from."""

from __future__ import annotations

import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import selfspec
from plan_strategies import assert_same
from selfspec.ngram import MATCH_CAP, NgramIndex, continuations, longest_match, lookup, matched_length
from selfspec.testing import random_prompt, tiny_model


def test_lookup_copies_what_followed_the_latest_longest_match():
    tokens = [5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7]
    assert lookup(tokens, max_ngram=2, budget=3) == [9, 2, 6]  # latest earlier "6 7" is followed by 9 2 6
    assert lookup(tokens, max_ngram=3, budget=1) == [9]  # no earlier "2 6 7": falls back to n=2
    assert lookup([1, 2, 3], max_ngram=2, budget=4) == []  # no earlier match
    assert lookup([4, 4], max_ngram=2, budget=5) == [4]  # n=1 match at the start
    assert lookup([1, 2, 1], max_ngram=1, budget=0) == []


def test_a_match_that_agrees_further_back_is_copied_first_and_says_how_far():
    """At n = max_ngram the occurrence whose context agrees furthest back is copied (the latest among equals),
    and the match length returned is how far back it agrees; below max_ngram nothing changes."""
    # (1, 2, 3) occurred twice: at 6, after 9, and at 1, after 5, as the end is: that one agrees over 4 tokens.
    tokens = [5, 1, 2, 3, 8, 9, 1, 2, 3, 6, 7, 5, 1, 2, 3]
    assert longest_match(tokens, max_ngram=3, budget=3) == ([8, 9, 1], 4)
    assert matched_length(tokens, 6, 3) == 3 and matched_length(tokens, 1, 3) == 4
    assert continuations(tokens, max_ngram=3, budget=2, branches=2) == ([[8, 9], [6, 7]], 4)
    assert longest_match(tokens, max_ngram=4, budget=3) == ([8, 9, 1], 4)  # (5, 1, 2, 3) matched outright
    # Both occurrences agree over exactly 3 tokens: the latest first, as below max_ngram.
    tokens = [1, 2, 3, 8, 0, 1, 2, 3, 9, 4, 1, 2, 3]
    assert longest_match(tokens, max_ngram=3, budget=3) == ([9, 4, 1], 3)
    # Below max_ngram: no earlier (4, 2, 3) or (5, 2, 3), so every (2, 3) agrees over 2 tokens; the latest first.
    assert longest_match([4, 2, 3, 8, 6, 2, 3, 9, 5, 2, 3], max_ngram=3, budget=1) == ([9], 2)
    # A long repeat is measured up to MATCH_CAP.
    run = list(range(100, 100 + MATCH_CAP + 10))
    assert longest_match(run + [7] + run, max_ngram=3, budget=1) == ([7], MATCH_CAP)


@pytest.mark.parametrize(
    "plan",
    [
        selfspec.DraftPlan(ngram=3, draft_length=6),  # n-gram only: a round without a match is a plain step
        selfspec.DraftPlan(ngram=2, layers=[0, 1, 4], draft_length=4, policy="fixed"),
        selfspec.DraftPlan(ngram=1, exit_layer=3, draft_length=8, adaptive=True, policy="fixed"),
    ],
    ids=lambda p: p.describe(6),
)
def test_ngram_plans_are_lossless_and_counted(plan):
    model = tiny_model("llama")
    # A prompt that repeats itself, so lookups find matches.
    prompt = random_prompt(8, seed=5).repeat(1, 3)
    # The cost policy drafts what pays on this machine, which may be nothing: decide here as where verifying is flat.
    spec = selfspec.wrap(model, plan=plan, costs="flat" if plan.policy == "cost" else None)
    ref = model.generate(prompt, max_new_tokens=40, do_sample=False)
    assert_same(spec.generate(prompt, max_new_tokens=40), ref, plan)
    stats = spec.last_stats
    assert stats.ngram_drafted > 0 and 0 <= stats.ngram_accepted <= stats.ngram_drafted
    assert stats.ngram_drafted <= stats.drafted and stats.ngram_accepted <= stats.accepted
    if not plan.draft_layers(6):
        assert stats.ngram_drafted == stats.drafted
    # Sampling with one-hot n-gram proposals runs and is reproducible.
    a = spec.generate(prompt, max_new_tokens=30, do_sample=True, generator=torch.Generator().manual_seed(1))
    b = spec.generate(prompt, max_new_tokens=30, do_sample=True, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b)


def test_ngram_plan_round_trips_and_validates(tmp_path):
    plan = selfspec.DraftPlan(ngram=3, draft_length=5)
    plan.save(tmp_path / "p.json")
    assert selfspec.DraftPlan.load(tmp_path / "p.json") == plan
    with pytest.raises(ValueError, match=r"ngram=17 out of range \(valid: 0..16\)"):
        selfspec.DraftPlan(ngram=17, exit_layer=2)


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 4), min_size=1, max_size=60), max_ngram=st.integers(1, 4),
       budget=st.integers(0, 6), stride=st.integers(1, 7))
def test_ngram_index_equals_longest_match_as_a_sequence_grows(tokens, max_ngram, budget, stride):
    """The incremental index (batches) answers exactly what the scan answers, at every length it is asked at."""
    index = NgramIndex(max_ngram)
    for length in [*range(1, len(tokens), stride), len(tokens)]:
        assert index.match(tokens[:length], budget=budget) == longest_match(tokens[:length], max_ngram=max_ngram,
                                                                           budget=budget)


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=60), max_ngram=st.integers(1, 4),
       budget=st.integers(0, 6), branches=st.integers(1, 4), stride=st.integers(1, 7))
def test_ngram_index_equals_the_continuations_scan_as_a_sequence_grows(tokens, max_ngram, budget, branches, stride):
    """What the drafter's trees draw from: the same continuations, in the same order, as the scan."""
    index = NgramIndex(max_ngram)
    for length in [*range(1, len(tokens), stride), len(tokens)]:
        assert index.continuations(tokens[:length], budget=budget, branches=branches) == continuations(
            tokens[:length], max_ngram=max_ngram, budget=budget, branches=branches)


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 2), min_size=2, max_size=80), max_ngram=st.integers(1, 4))
def test_the_copy_comes_from_the_occurrence_that_agrees_furthest_back(tokens, max_ngram):
    """Counted by brute force: the match length returned is how far back the copied occurrence agrees with the
    end (up to MATCH_CAP), and no occurrence among the latest OCCURRENCES_RANKED agrees further back."""
    from selfspec.ngram import OCCURRENCES_RANKED

    def agrees(j: int, n: int) -> int:  # how far back the occurrence of the last n tokens at j agrees
        k = 0
        while k < min(j + n, MATCH_CAP) and tokens[j + n - 1 - k] == tokens[len(tokens) - 1 - k]:
            k += 1
        return k

    copy, length = longest_match(tokens, max_ngram=max_ngram, budget=len(tokens))
    if not copy:
        return
    n = min(length, max_ngram)
    starts = [j for j in range(len(tokens) - n - 1, -1, -1) if tokens[j : j + n] == tokens[len(tokens) - n :]]
    copied_from = [j for j in starts if tokens[j + n : j + n + len(copy)] == copy and agrees(j, n) == length]
    assert copied_from, "the copy follows an occurrence that agrees over the length returned"
    ranked = starts[:OCCURRENCES_RANKED] if n == max_ngram else starts[:1]
    assert length == max(agrees(j, n) for j in ranked)


def test_the_drafter_indexes_each_sequence_apart():
    """A new token list (another generation) gets a new index: nothing of the last sequence is matched."""
    from selfspec.draft import Drafter

    class Whole:  # verifies whatever the lookup found
        round_budget = 4

        def ngram_length(self, match_length, available):
            return available

        def tree_nodes(self, chain, max_nodes, **_):
            return max_nodes

    drafter = Drafter(selfspec.DraftPlan(ngram=2, tree=8), num_layers=2)
    greedy = types.SimpleNamespace(do_sample=False)
    first = [1, 2, 3, 4, 1, 2]
    assert drafter.ngram_draft(first, Whole(), greedy, 10, "cpu").tokens == [3, 4, 1, 2]
    first += [5, 1, 2]  # grows in place: indexed on from where it was; the latest continuation first
    assert drafter.ngram_draft(first, Whole(), greedy, 10, "cpu").tree.tokens[:2] == (5, 1)
    assert drafter.ngram_draft([7, 1, 2], Whole(), greedy, 10, "cpu") is None  # no earlier (1, 2) in this one


def test_proposals_no_verify_pass_saw_are_judged_by_what_was_emitted():
    """An n-gram proposal cut short (or to nothing) still teaches its estimate: the tokens emitted after it say
    what a verify pass would have said of the tokens it did not see, up to the first that differs."""
    from selfspec.draft import Drafter

    class CutTo:  # verifies the first `keep` tokens of every proposal; notes what it is told of the rest
        round_budget = 4

        def __init__(self):
            self.keep, self.told = 0, []

        def ngram_length(self, match_length, available):
            return min(self.keep, available)

        def observe_unverified(self, match_length, first, outcomes):
            self.told.append((match_length, first, outcomes))

    drafter = Drafter(selfspec.DraftPlan(ngram=2), num_layers=2)
    policy, greedy = CutTo(), types.SimpleNamespace(do_sample=False)
    tokens = [1, 2, 3, 4, 9, 1, 2]
    assert drafter.ngram_draft(tokens, policy, greedy, 10, "cpu") is None  # (3, 4, 9, 1) offered, none verified
    tokens += [3]  # a plain step emitted the first proposed token
    policy.keep = 1
    # (4, 9, 1, 2) offered, 1 verified; its match (2, 3) agrees a token further back: (1, 2, 3), length 3
    assert drafter.ngram_draft(tokens, policy, greedy, 10, "cpu").tokens == [4]
    assert policy.told == [(2, 1, [True])]
    tokens += [4, 9]  # the verified token was accepted, and the pass's own next token was the second proposed
    policy.keep = 0
    # (1, 2, 3, 4) offered: its match (4, 9) agrees back to the sequence's start, (1, 2, 3, 4, 9): length 5
    assert drafter.ngram_draft(tokens, policy, greedy, 10, "cpu") is None
    assert policy.told[1:] == [(3, 2, [True])]  # position 1 was the verify pass's to judge; position 2 is new
    tokens += [7, 7]  # a round emitted two tokens, the first already not the proposed one
    policy.keep = 2
    assert drafter.ngram_draft(tokens, policy, greedy, 10, "cpu").tokens == [7]  # after the match (7,): (7,)
    assert policy.told[2:] == [(5, 1, [False])]  # judged up to the first that differs, not beyond
    tokens += [5, 1, 2]  # (7,) was verified whole and rejected: nothing more to tell
    assert drafter.ngram_draft(tokens, policy, greedy, 10, "cpu").tokens == [3, 4]
    tokens += [8]  # the verify pass rejected the first verified token: it learned that itself
    drafter.ngram_draft(tokens, policy, greedy, 10, "cpu")
    assert policy.told[3:] == []
