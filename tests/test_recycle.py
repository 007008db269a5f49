"""Recycled drafts (`recycle.py`): trees grown from the target's own past predictions.

- the successor table: what a row records, the pair key and its fallback, the
  pair capacity, and trees grown best first within their node and depth
  budgets, under an n-gram proposal's first path;
- greedy generation with recycled trees equals `model.generate` for every
  architecture (alone, after n-grams, with layers, auto, fixed and cost
  policies), and recycled nodes really were verified and kept;
- the table carries over between greedy calls (drafts from the first round);
  sampling starts afresh, so a seed reproduces its sample;
- the cost policy sizes recycled trees: none where a wide pass costs its
  width in plain steps, and it scales the recorded probabilities by what
  recycled nodes earned;
- plan checks (recycle needs a tree) and the stats' recycled counts.

The law of sampled tokens with recycled trees is checked in test_sampling.py.
"""

from __future__ import annotations

import pytest
import torch

import selfspec
import selfspec.recycle
from plan_strategies import assert_same
from selfspec.costs import PassCosts, RuntimeCosts
from selfspec.draft import Draft
from selfspec.policy import CostPolicy, RecycleLedger
from selfspec.recycle import SuccessorTable, chain_contexts, tree_contexts
from selfspec.testing import TINY_CONFIGS, has_window, random_prompt, tiny_model
from selfspec.tree import TokenTree

ARCHS = sorted(TINY_CONFIGS)


def scores_for(rows: list[dict[int, float]], vocab: int = 32) -> torch.Tensor:
    """`[rows, vocab]` log-probabilities: each row's listed tokens at their probabilities, the rest spread evenly."""
    probs = torch.zeros(len(rows), vocab)
    for r, row in enumerate(rows):
        probs[r] = (1.0 - sum(row.values())) / (vocab - len(row))
        for token, p in row.items():
            probs[r, token] = p
    return probs.log()


def test_a_row_records_its_top_tokens_under_its_pair_and_its_token():
    table = SuccessorTable()
    table.record([(None, 5), (5, 7)], scores_for([{1: 0.6, 2: 0.3}, {3: 0.9}]))
    tokens, probs = table.successors(None, 5)
    assert tokens[:2] == (1, 2) and probs[0] == pytest.approx(0.6, abs=1e-3) and len(tokens) == selfspec.recycle.TOP
    assert table.successors(5, 7)[0][0] == 3
    # the pair is more specific than the token: a later row of token 7 after another token does not replace it
    table.record([(9, 7)], scores_for([{4: 0.8}]))
    assert table.successors(5, 7)[0][0] == 3 and table.successors(9, 7)[0][0] == 4
    assert table.successors(11, 7)[0][0] == 4  # an unseen pair falls back to the token's latest row
    assert table.successors(11, 12) is None


@pytest.mark.parametrize("n", [7, 300, 49_152, 262_144 + 5])
def test_block_top_k_finds_what_topk_finds(n):
    generator = torch.Generator().manual_seed(n)
    values = torch.randn(5, n, generator=generator)
    values[1, -3:] = torch.tensor([50.0, 52.0, 51.0])  # the best in the last, padded block
    values[2] = 0.0
    values[2, :: max(1, n // 11)] = torch.arange(len(values[2, :: max(1, n // 11)])).float()  # spread out
    top, where = selfspec.recycle.top_k(values, 8)
    expected = values.topk(min(8, n))
    assert torch.equal(top, expected.values)
    assert torch.equal(values.gather(1, where), top)  # the indices hold those values
    assert torch.equal(where[[0, 1, 3, 4]], expected.indices[[0, 1, 3, 4]])  # no ties in these rows: the same ids


def test_the_pair_table_drops_its_oldest_key_at_capacity(monkeypatch):
    monkeypatch.setattr(selfspec.recycle, "PAIR_CAPACITY", 2)
    table = SuccessorTable()
    table.record([(1, 2), (2, 3), (3, 4)], scores_for([{5: 0.9}, {6: 0.9}, {7: 0.9}]))
    assert list(table.by_pair) == [(2, 3), (3, 4)] and len(table) == 3


def test_a_tree_grows_best_first_within_its_budgets():
    table = SuccessorTable()
    # after 1: 2 (0.7) or 3 (0.2); after 2: 4 (0.9); after 4: 5 (0.9); after 3: 6 (0.5)
    table.record([(0, 1), (1, 2), (2, 4), (1, 3)],
                 scores_for([{2: 0.7, 3: 0.2}, {4: 0.9}, {5: 0.9}, {6: 0.5}]))
    tree, values = table.grow(0, 1, None, [], max_nodes=4, max_depth=8)
    assert tree.tokens == (2, 4, 5, 3) and tree.parents == (-1, 0, 1, -1)
    assert values == pytest.approx([0.7, 0.63, 0.567, 0.2], abs=1e-3)
    assert values == sorted(values, reverse=True)
    shallow, _ = table.grow(0, 1, None, [], max_nodes=8, max_depth=2)
    assert max(shallow.depths()) == 2 and len(set(zip(shallow.parents, shallow.tokens))) == len(shallow)
    assert len(table.grow(0, 1, None, [], max_nodes=3, max_depth=8)[0]) == 3


def test_recycled_nodes_hang_under_an_ngram_proposal_and_never_repeat_its_tokens():
    table = SuccessorTable()
    table.record([(0, 1), (1, 2), (2, 4)], scores_for([{2: 0.7, 3: 0.2}, {4: 0.9}, {5: 0.9}]))
    base = TokenTree((2, 9), (-1, 0))  # an n-gram chain 2, 9 after the root 1
    tree, values = table.grow(0, 1, base, [0.5, 0.25], max_nodes=5, max_depth=8)
    assert tree.tokens[:2] == (2, 9) and tree.parents[:2] == (-1, 0)
    assert (-1, 2) not in set(zip(tree.parents[2:], tree.tokens[2:]))  # the root's child 2 is the proposal's
    assert (0, 4) in set(zip(tree.parents, tree.tokens))  # under the proposal's first token, at 0.5 x 0.9
    assert len(values) == len(tree) - 2


def test_contexts_name_each_rows_token_and_the_one_before():
    assert chain_contexts([4, 5], [6, 7]) == [(4, 5), (5, 6), (6, 7)]
    assert chain_contexts([5], []) == [(None, 5)]
    tree = TokenTree((6, 7, 8), (-1, 0, -1))
    assert tree_contexts([4, 5], tree) == [(4, 5), (5, 6), (6, 7), (5, 8)]


RECYCLE_PLANS = [
    selfspec.DraftPlan(recycle=True, tree=10, draft_length=5),
    selfspec.DraftPlan(recycle=True, tree=8, draft_length=4, policy="fixed"),
    selfspec.DraftPlan(recycle=True, ngram=2, tree=12, draft_length=5),
    selfspec.DraftPlan(recycle=True, ngram=2, tree=12, layers=[0, 2], draft_length=4),
    selfspec.DraftPlan(auto=True, recycle=True, ngram=3, tree=16, draft_length=8),
]


def test_recycled_trees_equal_generate_on_every_architecture():
    """float64, flat costs (trees pay): twice per plan and prompt, the second call drafting from the first's table."""
    drafted = kept = 0
    for arch in ARCHS:
        model = tiny_model(arch, torch.float64, window=4 if has_window(arch) else None)
        for seed in (1, 2):
            prompt = random_prompt(20, seed=seed)
            ref = model.generate(prompt, do_sample=False, max_new_tokens=48)
            for plan in RECYCLE_PLANS:
                spec = selfspec.wrap(model, plan=plan, costs="flat")
                for _ in range(2):
                    assert_same(spec.generate(prompt, max_new_tokens=48), ref, f"{arch}: {plan}")
                    drafted += spec.last_stats.recycled_drafted
                    kept += spec.last_stats.recycled_accepted
    assert drafted > 1000 and kept > 100, (drafted, kept)


def test_the_static_step_drafts_recycled_trees_and_equals_generate():
    """The static step grows the same trees on the host; each round's rows' top tokens come back with its one
    read. Twice per plan, the second call drafting from the first's table."""
    drafted = kept = 0
    for arch in ARCHS:
        model = tiny_model(arch, torch.float64, window=4 if has_window(arch) else None)
        prompt = random_prompt(20, seed=3)
        ref = model.generate(prompt, do_sample=False, max_new_tokens=40)
        for plan in RECYCLE_PLANS:
            spec = selfspec.wrap(model, plan=plan, costs="flat", step="static")
            for _ in range(2):
                assert_same(spec.generate(prompt, max_new_tokens=40), ref, f"{arch}, static: {plan}")
                drafted += spec.last_stats.recycled_drafted
                kept += spec.last_stats.recycled_accepted
    assert drafted > 500 and kept > 50, (drafted, kept)


def test_the_table_carries_over_between_greedy_calls_and_sampling_starts_afresh():
    """With `reproducible=False`; a reproducible wrapper starts every call afresh (`test_reproducible.py`)."""
    model = tiny_model("llama", torch.float64)
    prompt = random_prompt(20, seed=1)
    spec = selfspec.wrap(model, plan=RECYCLE_PLANS[1], costs="flat", reproducible=False)
    first_rounds = []
    original = spec.drafter.recycled_draft

    def recording(tokens, *args, **kwargs):
        draft = original(tokens, *args, **kwargs)
        if len(tokens) == prompt.shape[1] + 1:  # the first round after the prefill
            first_rounds.append(draft is not None)
        return draft

    spec.drafter.recycled_draft = recording
    spec.generate(prompt, max_new_tokens=32)
    spec.generate(prompt, max_new_tokens=32)
    # the first call's first round had only the prompt's last row; the second's has the first call's rows
    assert first_rounds == [False, True]
    learned = len(spec.successors)
    runs = []
    for _ in range(2):
        out = spec.generate(prompt, max_new_tokens=24, do_sample=True, generator=torch.Generator().manual_seed(0))
        runs.append(out.tolist())
        assert spec.last_stats.recycled_drafted > 0
    assert runs[0] == runs[1]
    assert first_rounds[2:] == [False, False]  # sampling starts from an empty table ...
    assert len(spec.successors) == learned  # ... and leaves the greedy one alone


def test_the_cost_policy_sizes_recycled_trees():
    plan = selfspec.DraftPlan(recycle=True, tree=16, draft_length=8)
    flat = CostPolicy(plan, RuntimeCosts(PassCosts(verify=(1.0,) * 17, draft_step=0.5, num_layers=4), learn=False))
    flat.begin_round(8)
    values, depths = [0.9, 0.5, 0.2, 0.1], [1, 1, 2, 1]
    assert flat.recycled_nodes(values, depths, base_nodes=0, base_expected=1.0, layers=False) == 4  # free: all pay
    linear = CostPolicy(plan, RuntimeCosts(PassCosts(verify=tuple(range(1, 18)), draft_step=0.5, num_layers=4),
                                           learn=False))
    linear.begin_round(8)
    assert linear.recycled_nodes(values, depths, base_nodes=0, base_expected=1.0, layers=False) == 0
    # A wide pass costing 10% more per 4 rows: the first nodes pay, the unlikely ones do not.
    sloped = CostPolicy(plan, RuntimeCosts(PassCosts(verify=tuple(1 + 0.025 * q for q in range(17)), draft_step=0.5,
                                                     num_layers=4), learn=False))
    sloped.begin_round(8)
    assert sloped.recycled_nodes([0.9, 0.1, 0.01], [1, 1, 1], base_nodes=0, base_expected=1.0, layers=False) == 2
    # Recycled nodes that never get kept are written down: their predictions scaled toward a quarter.
    for _ in range(40):
        sloped.observe_recycled(depths=[1, 1], values=[0.9, 0.6], kept=[False, False])
    assert sloped.recycled.ratio(1) == pytest.approx(0.25)
    assert sloped.recycled_nodes([0.9, 0.1, 0.01], [1, 1, 1], base_nodes=0, base_expected=1.0, layers=False) == 1


def half_step_rows() -> CostPolicy:
    """A cost policy on a CPU where a wide pass is dear: each extra row costs half a plain step."""
    plan = selfspec.DraftPlan(recycle=True, tree=16, draft_length=8)
    policy = CostPolicy(plan, RuntimeCosts(PassCosts(verify=tuple(1 + 0.5 * q for q in range(17)), draft_step=0.5,
                                                     num_layers=4), learn=False))
    policy.begin_round(8)
    return policy


def test_recycled_nodes_are_calibrated_per_depth():
    """Chains of recorded probabilities near 1 whose first node is often rejected: the deep nodes are written
    down by what deep nodes earned, the first by what first nodes earned (one ratio for all let them through)."""
    policy = half_step_rows()
    chain, depths = [0.99] * 8, list(range(1, 9))
    assert policy.recycled_nodes(chain, depths, base_nodes=0, base_expected=1.0, layers=False) == 8  # believed
    for round_ in range(60):  # the first node kept 3 rounds in 5; nothing deeper ever
        first = round_ % 5 < 3
        policy.observe_recycled(depths=depths, values=chain, kept=[first] + [False] * 7)
    assert policy.recycled.ratio(1) == pytest.approx(0.6 / 0.99, rel=0.1)
    assert policy.recycled.ratio(4) == pytest.approx(0.25)  # the floor
    policy.begin_round(8)
    assert policy.recycled_nodes(chain, depths, base_nodes=0, base_expected=1.0, layers=False) == 1


def test_a_depth_with_no_evidence_is_expected_to_earn_what_the_depth_above_earns():
    """Only first nodes were ever verified, and 3 in 10 kept: a deep chain is priced at their ratio, not at 1
    (a prior of 1 per depth let 8-deep chains of recorded values near 0.99 through, and none was kept)."""
    policy = half_step_rows()
    for i in range(20):
        policy.observe_recycled(depths=[1], values=[0.9], kept=[i % 10 < 3])
    first = policy.recycled.ratio(1)
    assert first == pytest.approx((6 + 4) / (18 + 4))  # kept + prior over predicted + prior
    assert [policy.recycled.ratio(d) for d in (2, 3, 4, 9)] == pytest.approx([first] * 4)
    chain, depths = [0.99] * 8, list(range(1, 9))
    assert policy.recycled_nodes(chain, depths, base_nodes=0, base_expected=1.0, layers=False) == 0
    # Evidence at a depth still counts: deep nodes that were kept more than their parents' ratio earn more.
    for _ in range(20):
        policy.observe_recycled(depths=[2], values=[0.5], kept=[True])
    assert policy.recycled.ratio(2) > first


def test_written_off_recycling_fades_back_slowly_in_rounds_without_recycled_nodes():
    """The calibration fades by `IDLE_DECAY`, not `DECAY`, in a round that verified no recycled node: a written-off
    source is tried again, but not every few dozen rounds."""
    policy = half_step_rows()
    one = {"values": [0.99], "depths": [1], "base_nodes": 0, "base_expected": 1.0, "layers": False}
    assert policy.recycled_nodes(**one) == 1  # at the prior
    for _ in range(30):
        policy.observe_recycled(depths=[1], values=[0.95], kept=[False])
        policy.observe(Draft([0], None, [], source="recycled", recycled=(0.95,)), 0, draft_seconds=0.0,
                       verify_seconds=1.0, width=2)
    assert policy.recycled_nodes(**one) == 0
    idle = Draft([], None, [])  # a plain step: no draft
    retried = None
    for rounds in range(1, 400):
        policy.observe(idle, 0, draft_seconds=0.0, verify_seconds=1.0, width=1)
        policy.begin_round(8)
        if policy.recycled_nodes(**one):
            retried = rounds
            break
    # At DECAY a round the evidence would have halved within 35 rounds and the node been tried at about 85.
    assert retried is not None and 150 < retried < 200


def test_a_linear_cost_profile_drafts_no_recycled_tree():
    model = tiny_model("llama", torch.float64)
    spec = selfspec.wrap(model, plan=RECYCLE_PLANS[0], costs="linear")
    prompt = random_prompt(20, seed=1)
    out = spec.generate(prompt, max_new_tokens=32)
    assert_same(out, model.generate(prompt, do_sample=False, max_new_tokens=32), RECYCLE_PLANS[0])
    assert spec.last_stats.recycled_drafted == 0 and spec.last_stats.tree_rounds == 0


def test_plan_checks_description_and_stats():
    with pytest.raises(ValueError, match="recycle=True drafts token trees .* give tree=N"):
        selfspec.DraftPlan(recycle=True, ngram=2)
    with pytest.raises(ValueError, match="recycle must be true or false"):
        selfspec.DraftPlan(recycle=1, tree=8)
    plan = selfspec.DraftPlan(recycle=True, ngram=3, tree=12)
    assert selfspec.DraftPlan.from_dict(plan.to_dict()) == plan
    assert plan.describe(6).startswith("n-gram lookup (n<=3, as a tree), then recycled predictions")
    model = tiny_model("llama", torch.float64)
    spec = selfspec.wrap(model, plan=RECYCLE_PLANS[2], costs="flat")
    spec.generate(random_prompt(20, seed=2), max_new_tokens=48)
    stats = spec.last_stats
    assert stats.recycled_drafted > 0 and "recycled: drafted" in str(stats)
    assert stats.layer_drafted == stats.drafted - stats.ngram_drafted - stats.recycled_drafted


class Recorder:
    """Stands in for a `SuccessorTable`: only the seconds it has spent recording."""

    seconds = 0.0


def ledger_rounds(policy: CostPolicy, recorder: Recorder, rounds: int, *, nodes: int, kept: int,
                  record_seconds: float = 0.0) -> list[bool]:
    """`rounds` rounds of an n-gram tree of 4 nodes plus `nodes` recycled ones (`kept` of them kept); per round,
    whether recycling was on."""
    on = []
    for _ in range(rounds):
        policy.begin_round(8, context=64)
        on.append(policy.recycling)
        recycled = (0.5,) * nodes if on[-1] else ()
        if recycled:  # what `recycled_nodes` leaves: without them, the n-gram tree's own pass
            policy.ledger.alternative = (None, policy.costs.verify(5))
            policy.observe_recycled(depths=[1] * nodes, values=recycled, kept=[i < kept for i in range(nodes)])
        recorder.seconds += record_seconds if on[-1] else 0.0
        width = 5 + len(recycled)
        draft = Draft([1, 2, 3, 4], None, [], source="ngram", match_length=2,
                      tree=TokenTree(tuple(range(width - 1)), tuple(range(-1, width - 2))), recycled=recycled)
        policy.observe(draft, 2, draft_seconds=0.0, verify_seconds=1.0, width=width, emitted=3 + (kept if on[-1] else 0))
    return on


def sloped_policy(timed: bool = False) -> tuple[CostPolicy, Recorder]:
    """A cost policy where each extra row costs 5% of a plain step, judging recycling by a stand-in recorder."""
    plan = selfspec.DraftPlan(recycle=True, ngram=2, tree=16, draft_length=8)
    costs = RuntimeCosts(PassCosts(verify=tuple(1 + 0.05 * q for q in range(17)), draft_step=0.5, num_layers=4),
                         learn=False)
    policy = CostPolicy(plan, costs)
    policy.ledger.timed = timed
    recorder = Recorder()
    policy.count_recording(recorder)
    return policy, recorder


def test_recycling_that_does_not_pay_pauses_with_a_doubling_backoff():
    """8 recycled nodes a round (0.4 steps of width) and none kept: after a trial of 32 rounds recycling pauses
    for 16, then 32, then 64 rounds."""
    policy, recorder = sloped_policy()
    trial = RecycleLedger.TRIAL
    on = ledger_rounds(policy, recorder, trial + 16 + trial + 32 + trial + 64 + 1, nodes=8, kept=0)
    runs, current = [], None
    for state in on:  # lengths of alternating on / off runs
        if state != current:
            runs.append(0)
            current = state
        runs[-1] += 1
    assert runs == [trial, 16, trial, 32, trial, 64, 1]
    assert policy.ledger.pauses == 3
    assert "recycling on (3 pauses so far" in policy.describe()


def test_recycling_that_pays_stays_on_and_a_paying_trial_resets_the_backoff():
    """8 nodes a round at 0.4 steps, 2 of them kept: a kept token is worth about a third of a step (the round's
    1.6 steps over its 5 tokens), 0.64 steps for the two, so they pay. One bad stretch pauses recycling; a paying trial then resets the
    backoff, so the next pause is short again."""
    policy, recorder = sloped_policy()
    assert all(ledger_rounds(policy, recorder, 200, nodes=8, kept=2))
    bad = 0
    while policy.recycling:
        ledger_rounds(policy, recorder, 1, nodes=8, kept=0)
        bad += 1
    assert 1 < bad < 60 and policy.ledger.pauses == 1  # the good rounds' credit ran out first
    while not policy.recycling:
        ledger_rounds(policy, recorder, 1, nodes=8, kept=0)
    assert policy.ledger.backoff == 2 * RecycleLedger.FIRST_PAUSE
    assert all(ledger_rounds(policy, recorder, 40, nodes=8, kept=3))
    assert policy.ledger.backoff == RecycleLedger.FIRST_PAUSE


def test_recycled_nodes_are_judged_against_what_the_round_would_have_drafted_without_them():
    """Under an n-gram proposal: the proposal's own pass (its tokens: the round's less the recycled kept). A
    recycled tree alone: a plain step, or the layer draft it beat, whose drafting time it saves; there a round
    that emits no more than the layer draft was expected to still pays when it took much less time."""
    policy, recorder = sloped_policy()
    costs = policy.costs
    policy.recycled_nodes([0.9, 0.5], [1, 2], base_nodes=3, base_expected=2.5, layers=True)
    assert policy.ledger.alternative == (None, costs.verify(4))
    policy.recycled_nodes([0.9, 0.5], [1, 2], base_nodes=0, base_expected=1.0, layers=False)
    assert policy.ledger.alternative == (1.0, costs.verify(1))
    # A deep layer draft: a drafted token costs half a step, and the layers are expected to be accepted 90%.
    deep = CostPolicy(selfspec.DraftPlan(recycle=True, layers=[0, 1, 2], tree=16, draft_length=8,
                                         target_acceptance=0.9),
                      RuntimeCosts(PassCosts(verify=tuple(1 + 0.05 * q for q in range(17)), draft_step=0.5,
                                             num_layers=4), learn=False))
    deep.count_recording(Recorder())
    deep.begin_round(8, context=64)
    layer_tokens, layer_seconds = deep.layer_draft_outcome()
    assert layer_tokens > 1.5 and layer_seconds > 2.0
    assert deep.recycled_nodes([0.95, 0.9, 0.85], [1, 2, 3], base_nodes=0, base_expected=1.0, layers=True) == 3
    assert deep.ledger.alternative == (layer_tokens, layer_seconds)
    deep.observe_recycled(depths=[1, 2, 3], values=[0.95, 0.9, 0.85], kept=[True, False, False])
    tree = Draft([7], None, [], source="recycled", tree=TokenTree((7, 8, 9), (-1, 0, 1)),
                 recycled=(0.95, 0.9, 0.85))
    deep.observe(tree, 0, draft_seconds=0.0, verify_seconds=1.0, width=4, emitted=2)
    # 2 tokens against the layers' expected 3.4, in 1.15 steps against their 2.65
    worth = deep.costs.verify(4) / 2
    assert deep.ledger.balance == pytest.approx((2 - layer_tokens) * worth + layer_seconds - deep.costs.verify(4))
    assert deep.ledger.balance > 0


def test_the_time_spent_recording_counts_when_greedy_and_not_when_sampling():
    """No recycled node is ever drafted. Greedy (timed) pays the recording's seconds for nothing and pauses; a
    sampling ledger (untimed: a seed's draws must not depend on timing) sees no cost and stays on."""
    for timed in (True, False):
        policy, recorder = sloped_policy(timed=timed)
        on = ledger_rounds(policy, recorder, 40, nodes=0, kept=0, record_seconds=0.01)
        assert all(on) is not timed, timed


@pytest.mark.parametrize("step", ["eager", "static"])
def test_a_paused_ledger_records_and_drafts_no_recycled_nodes_and_the_output_is_unchanged(step):
    """Greedy (`reproducible=False`) keeps its ledger between calls: paused for 12 rounds, the next call drafts
    and records nothing recycled for those rounds, reports them, then resumes; the text is `model.generate`'s
    throughout."""
    model = tiny_model("llama", torch.float64)
    prompt = random_prompt(20, seed=1)
    ref = model.generate(prompt, do_sample=False, max_new_tokens=40)
    spec = selfspec.wrap(model, plan=RECYCLE_PLANS[0], costs="flat", step=step, reproducible=False)
    assert_same(spec.generate(prompt, max_new_tokens=40), ref, step)
    assert spec.last_stats.recycling_paused == 0 and spec.last_stats.recycled_drafted > 0
    ledger = spec.recycle_ledger
    ledger.paused = 12
    recorded = []
    original = spec.successors.record_top  # what each round records through, on either step
    spec.successors.record_top = lambda *args: (recorded.append(True), original(*args))
    assert_same(spec.generate(prompt, max_new_tokens=40), ref, step)
    stats = spec.last_stats
    assert stats.recycling_paused == 12 and ledger.paused == 0
    assert len(recorded) == stats.rounds - 12
    assert stats.recycled_drafted > 0 and "paused 12 rounds" in str(stats)
