"""The cost model and the cost policy: decisions checked against known answers on injected profiles.

- `choose_length` on the kinds of machine we know: a linear verify (AVX2 in
  bfloat16: q tokens cost about q steps) makes every draft lose, so k = 0; a
  flat verify (GPU, AVX-512 BF16) makes long drafts pay when they are
  accepted; the AVX2 table measured in issue 11 pays only for well-accepted
  n-gram proposals, and only for a few tokens.
- `CostPolicy` on injected tables: it never drafts on a linear profile, cuts
  n-gram proposals to what pays, stops a layer draft after an unconfident
  token, and learns acceptance per source from what the target kept.
- `RuntimeCosts` follows what rounds measure; `measure_pass_costs` and the
  disk cache give a table of the right shape on a real (tiny) model.
- End to end: with a linear profile injected the engine runs exactly its
  plain path (no round drafts), and no slower than it.
"""

from __future__ import annotations

import inspect
import time
import typing

import pytest
import torch

import selfspec
from selfspec.costs import PassCosts, RuntimeCosts, cpu_capability, machine_description
from selfspec.draft import Draft
from selfspec.policy import (AcceptanceEstimates, AdaptivePolicy, CostPolicy, DraftPolicy, LayerChoosingPolicy,
                             choose_length, policy_for)
from selfspec.testing import random_prompt, tiny_model

# Issue 11, AVX2 host, bfloat16, 2 threads: a pass over q tokens in plain steps (q = 1, 2, 4, 9, 16).
AVX2_BF16 = {1: 1.00, 2: 1.42, 4: 2.08, 9: 3.81, 16: 6.05}


def avx2_table() -> PassCosts:
    points = sorted(AVX2_BF16.items())
    verify = []
    for q in range(1, 17):
        lo = max(p for p in points if p[0] <= q)
        hi = min(p for p in points if p[0] >= q)
        verify.append(lo[1] if hi == lo else lo[1] + (hi[1] - lo[1]) * (q - lo[0]) / (hi[0] - lo[0]))
    return PassCosts(tuple(verify), 0.3, 30, source="avx2-bf16")


def best(rate: float, table: PassCosts, budget: int, draft: float) -> int:
    return choose_length(accepted_so_far=1.0, expected_so_far=1.0, drafted=0, future=[rate] * budget, spent=0.0,
                         draft_seconds=draft, verify_seconds=table.verify_seconds)


@pytest.mark.parametrize("rate", [0.3, 0.7, 0.9, 0.99])
@pytest.mark.parametrize("draft", [0.0, 0.1, 0.5])
def test_linear_verify_never_drafts(rate, draft):
    assert best(rate, PassCosts.profile("linear", max_width=17), 16, draft) == 0


def test_flat_verify_drafts_long_when_accepted_and_not_when_rejected():
    flat = PassCosts.profile("flat", max_width=9)
    assert best(0.8, flat, 8, draft=0.05) == 8  # each token is nearly free and usually kept
    assert best(0.9, flat, 8, draft=0.0) == 8  # an n-gram proposal on a GPU: take all of it
    assert best(0.3, flat, 8, draft=0.5) == 0  # half a step per token for 30% acceptance: plain is faster
    assert 1 <= best(0.6, flat, 8, draft=0.2) < 8  # in between: a few tokens


def test_measured_avx2_table_pays_only_for_well_accepted_copies():
    table = avx2_table()
    assert best(0.3, table, 8, draft=0.0) == 0  # little to copy: plain decoding
    assert best(0.5, table, 8, draft=0.0) <= 1
    assert 3 <= best(0.9, table, 8, draft=0.0) <= 6  # a good n-gram match: a few tokens, not all 8
    assert best(0.6, table, 8, draft=0.3) == 0  # a layer draft at 0.3 steps per token needs more than 60%


def test_stopping_counts_what_is_already_spent():
    flat = PassCosts.profile("flat", max_width=9)
    # Two tokens drafted, the second with a low chance: going on cannot recover the round's rate.
    k = choose_length(accepted_so_far=0.05, expected_so_far=1.9, drafted=2, future=[0.9] * 6, spent=0.4,
                      draft_seconds=0.2, verify_seconds=flat.verify_seconds)
    assert k == 2
    k = choose_length(accepted_so_far=0.9, expected_so_far=2.7, drafted=2, future=[0.9] * 6, spent=0.1,
                      draft_seconds=0.05, verify_seconds=flat.verify_seconds)
    assert k == 8


def policy(profile: str, *, draft_fraction: float = 0.2, draft_length: int = 8, prior: float = 0.8) -> CostPolicy:
    plan = selfspec.DraftPlan(layers=[0, 1], draft_length=draft_length, ngram=3, target_acceptance=prior)
    table = PassCosts.profile(profile, max_width=draft_length + 1, draft_fraction=draft_fraction, num_layers=6)
    return CostPolicy(plan, RuntimeCosts(table, learn=False))


def test_cost_policy_on_a_linear_profile_drafts_nothing():
    p = policy("linear", draft_fraction=0.01, prior=0.99)
    p.begin_round(8)
    assert p.ngram_length(3, 8) == 0
    assert not p.draft_next(0, None)


def test_cost_policy_on_a_flat_profile_drafts_and_stops_after_an_unconfident_token():
    p = policy("flat")
    p.begin_round(8)
    assert p.ngram_length(3, 8) == 8
    assert p.draft_next(0, None)
    # Teach it that unconfident tokens are rejected and confident ones kept.
    for _ in range(20):
        p.acceptance.observe(Draft([1, 2], None, [], confidences=[0.95, 0.95]), accepted=2)
        p.acceptance.observe(Draft([1, 2], None, [], confidences=[0.95, 0.05]), accepted=1)
    p.begin_round(8)
    assert p.draft_next(1, 0.95)  # a confident first token: go on
    assert not p.draft_next(2, 0.05)  # after an unconfident one: stop


def test_a_draft_pass_over_a_tree_level_is_priced_by_its_width():
    """A layer tree's level runs its nodes in one draft pass: priced as the full pass's measured curve grows with
    the width (the same kernels over fewer layers), counted so when its time is observed, and weighed by the
    policy before it drafts the next level."""
    table = PassCosts((1.0, 1.5, 2.0), 0.2, 6)
    costs = RuntimeCosts(table)
    assert costs.draft(1) == costs.draft() == pytest.approx(0.2)
    assert costs.draft(3) == pytest.approx(0.4)  # a pass over 3 costs 2 passes over 1
    assert costs.draft_steps([1, 3, 3]) == pytest.approx(5.0)
    for _ in range(5):
        costs.observe_draft(costs.draft_steps([1, 3, 3]), 1.0)  # exactly what the table says: no correction
    assert costs.draft() == pytest.approx(0.2)
    flat = RuntimeCosts(PassCosts.profile("flat", max_width=9, draft_fraction=0.2))
    assert flat.draft(3) == flat.draft(1)  # where a wider pass costs nothing more, nor does a wider level
    # The same odds: one more chain token pays, one more level over three nodes (three times the price) does not.
    plan = selfspec.DraftPlan(layers=[0, 1], draft_length=8, target_acceptance=0.9)
    p = CostPolicy(plan, RuntimeCosts(PassCosts((1.0, 1.0) + (2.0,) * 7, 0.2, 6), learn=False))
    p.begin_round(8)
    assert p.draft_next(0, None) and p.draft_next(1, 0.9, width=1)
    p.begin_round(8)
    assert p.draft_next(0, None) and not p.draft_next(1, 0.9, width=3)


def test_cost_policy_cuts_ngram_proposals_by_what_their_match_length_earned():
    p = CostPolicy(selfspec.DraftPlan(ngram=3, draft_length=8), RuntimeCosts(avx2_table(), learn=False))
    for _ in range(30):
        p.acceptance.observe(Draft([5, 6, 7], None, [], source="ngram", match_length=1), accepted=0)
        p.acceptance.observe(Draft([5, 6, 7], None, [], source="ngram", match_length=3), accepted=3)
    p.begin_round(8)
    assert p.ngram_length(1, 8) == 0  # 1-token matches were never right: verifying them costs a step each
    assert p.ngram_length(3, 8) == 8  # 3-token matches always were: all of it pays, even there


def test_a_copy_written_off_is_verified_again_once_what_was_emitted_agrees_with_it():
    """A match length whose first tokens were rejected gets its proposals cut to nothing, so no verify pass judges
    it again; what the plain steps then emit does, and copies that come true are soon verified again, where the
    fading of old evidence alone would take a hundred rounds."""

    def written_off() -> CostPolicy:
        p = CostPolicy(selfspec.DraftPlan(ngram=3, draft_length=8), RuntimeCosts(avx2_table(), learn=False))
        for _ in range(10):
            p.acceptance.observe(Draft([5, 6, 7], None, [], source="ngram", match_length=3), accepted=0)
            p.acceptance.decay()
        p.begin_round(8)
        assert p.ngram_length(3, 8) == 0
        return p

    def rounds_until_verified(p: CostPolicy, told: bool) -> int:
        rounds = 0
        while not p.ngram_length(3, 8) and rounds < 1000:
            p.acceptance.decay()
            if told:  # this round's plain step emitted the token the (unverified) copy proposed next
                p.observe_unverified(3, 1, [True])
            rounds += 1
        return rounds

    told = written_off()
    assert rounds_until_verified(told, told=True) <= 8
    assert told.acceptance.ngram_cells[(3, 0)].accepted > 0  # position 1's cell (bucket 0) learned it
    assert rounds_until_verified(written_off(), told=False) >= 50


def test_acceptance_counts_only_what_the_target_saw():
    est = AcceptanceEstimates(prior=0.5)
    est.observe(Draft([1, 2, 3, 4], None, [], confidences=[0.9, 0.9, 0.9, 0.9]), accepted=1)
    assert est.positions[0].accepted == 1 and est.positions[0].rejected == 0
    assert est.positions[1].rejected == 1  # token 2 was rejected
    assert est.positions[2].seen == 0 and est.positions[3].seen == 0  # tokens 3, 4 were never judged
    est.decay(0.5)
    assert est.positions[0].accepted == 0.5
    est.observe(Draft([5, 6], None, [], source="ngram", match_length=2), accepted=2)
    est.decay(0.5, layers_drafted=False)  # a round that drafted no layer token: layer evidence fades slower
    assert est.positions[0].accepted == pytest.approx(0.5 * selfspec.policy.IDLE_DECAY)
    assert est.ngram[2].accepted == pytest.approx(1.0)


def test_runtime_costs_follow_what_rounds_measure():
    table = PassCosts((1.0, 1.0, 1.2), 0.2, 6)
    costs = RuntimeCosts(table)
    for _ in range(40):
        costs.observe_verify(2, 0, 2.0)  # this width runs twice as slow as the table says
        costs.observe_draft(2, 0.8)  # 0.4 s per drafted token
    assert costs.verify(2) == pytest.approx(2.0, rel=0.01)
    assert costs.verify(3) == pytest.approx(2.4, rel=0.01)  # an unseen width follows the overall ratio
    assert costs.draft() == pytest.approx(0.4, rel=0.01)
    for _ in range(3):
        costs.observe_verify(2, 0, 20.0)  # a burst of other load hits three rounds
    assert costs.verify(2) == pytest.approx(2.0, rel=0.01)  # the median ignores it
    frozen = RuntimeCosts(table, learn=False)
    frozen.observe_verify(2, 0, 2.0)
    assert frozen.verify(2) == 1.0


def test_one_widths_correction_stays_near_its_bands():
    """A burst of load on the rounds of one width cannot price it out for good (nor carry that to the next run)."""
    table = PassCosts((1.0, 1.0, 1.0, 1.0), 0.2, 6)
    costs = RuntimeCosts(table)
    for _ in range(9):
        costs.observe_verify(1, 0, 1.0)
        costs.observe_verify(2, 0, 1.1)
    for _ in range(5):
        costs.observe_verify(3, 0, 4.0)  # width 3's rounds all ran under other load
    general = 1.1  # the band's median over every width's rounds
    assert costs.verify(3) == pytest.approx(general * selfspec.costs.SHAPE_SLACK)
    assert costs.verify(4) == pytest.approx(costs.verify(3))  # unseen, and no dearer in the table: width 3's cost
    assert costs.verify(2) == pytest.approx(1.1)  # a correction within the slack is kept as measured
    refined = costs.refined()
    assert refined.verify[2] == pytest.approx(general * selfspec.costs.SHAPE_SLACK) and refined.verify[2] < 2.0


def test_corrected_costs_stay_a_cost_curve():
    """Rounds of one width that ran fast cannot make it as cheap as a narrower width: widening keeps its price."""
    table = PassCosts((1.0, 1.1, 1.2, 1.3), 0.2, 6)
    costs = RuntimeCosts(table)
    for _ in range(9):
        costs.observe_verify(1, 0, 1.0)
        costs.observe_verify(2, 0, 1.1 * 1.3)  # width 2's rounds ran slow
        costs.observe_verify(3, 0, 1.2 * 0.9)  # width 3's ran fast
        costs.observe_verify(4, 0, 1.3)
    general = costs.ratio(1, None)
    assert general == pytest.approx(1.0)
    assert costs.verify(2) == pytest.approx(1.1 * selfspec.costs.SHAPE_SLACK)  # dearer, within the slack
    step = selfspec.costs.STEP_FLOOR * 0.1
    assert costs.verify(3) == pytest.approx(costs.verify(2) + step)  # not cheaper: width 2's + part of the table's step
    assert costs.verify(4) == pytest.approx(costs.verify(3) + step)
    widths = [costs.verify(q) for q in range(1, 5)]
    assert widths == sorted(widths)
    refined = costs.refined()
    assert list(refined.verify) == pytest.approx(widths)


def test_the_refined_table_carries_what_the_rounds_learned_in_the_bands_between_its_contexts():
    """Rounds at 300 entries only (band 2): width 2 ran at 1.5 steps where the table said 1.72. The refined
    table takes that band's corrections, per width, for both of its contexts (48 and 1,024 entries: bands 0 and
    4, where no round ran), not the median over every width."""
    table = PassCosts((1.0, 1.72, 2.2), 0.2, 6, verify_long=(1.0, 1.72, 2.2), context=48, long_context=1024)
    costs = RuntimeCosts(table)
    costs.context = 300
    for _ in range(RuntimeCosts.WINDOW):
        for width, seconds in ((1, 1.0), (2, 1.5), (3, 2.2)):
            costs.observe_verify(width, 0, seconds)
    refined = costs.refined()
    assert refined.verify[1] == pytest.approx(1.5) and refined.verify_long[1] == pytest.approx(1.5)
    assert refined.verify[0] == pytest.approx(1.0) and refined.verify[2] == pytest.approx(2.2)
    costs.context = 48  # once rounds ran in the table's own band, that band's corrections are its own
    for _ in range(RuntimeCosts.WINDOW):
        for width in (1, 2, 3):
            costs.observe_verify(width, 0, 2 * table.verify[width - 1])
    assert list(costs.refined().verify) == pytest.approx([2 * t for t in table.verify])
    assert costs.refined().verify_long[1] == pytest.approx(1.5)


def test_a_step_the_table_overstated_is_learned_from_the_rounds():
    """The table timed 2 tokens at 1.72 plain steps; the rounds run them at 1.5. After a window of rounds
    width 2 is priced as they ran, and the refined table carries that on, not the table's step."""
    table = PassCosts((1.0, 1.72, 2.2, 2.7), 0.2, 6)
    costs = RuntimeCosts(table)
    for _ in range(RuntimeCosts.WINDOW):
        costs.observe_verify(1, 0, 1.05)
        costs.observe_verify(2, 0, 1.5)
    assert costs.verify(2) == pytest.approx(1.5)
    assert costs.refined().verify[1] == pytest.approx(1.5)
    assert costs.verify(2) - costs.verify(1) >= selfspec.costs.STEP_FLOOR * 0.72  # widening is still not free


def test_cost_table_rejects_nonsense_and_round_trips():
    with pytest.raises(ValueError, match="positive"):
        PassCosts((1.0, 0.0), 0.1, 4)
    with pytest.raises(ValueError, match="unknown cost profile 'steep'"):
        PassCosts.profile("steep")
    table = PassCosts((0.01, 0.012), 0.003, 4, machine="m")
    assert PassCosts.from_dict(table.to_dict()) == table
    with pytest.raises(ValueError, match="costs must be None"):
        selfspec.wrap(tiny_model("llama", torch.float32), costs=3)


def test_measured_costs_have_the_plan_shape_and_are_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_COSTS_CACHE", str(tmp_path))
    model = tiny_model("llama", torch.float32)
    plan = selfspec.DraftPlan(layers=[0, 1, 4], draft_length=5)
    costs = selfspec.wrap(model, plan=plan).costs
    assert costs.max_width == 6 and costs.draft_step > 0 and costs.source == "measured"
    assert all(b >= a for a, b in zip(costs.verify, costs.verify[1:]))  # never decreasing in the width
    assert "threads" in costs.machine and len(list(tmp_path.glob("*.json"))) == 2  # the passes; the plan's draft
    again = selfspec.wrap(model, plan=plan).costs
    assert again.source == "cached" and again.verify == costs.verify
    assert again.draft_step == pytest.approx(costs.draft_step)
    spec = selfspec.wrap(model, plan=plan, reproducible=False)
    spec.generate(random_prompt(6), max_new_tokens=6)
    assert "plain step" in spec.last_stats.costs and "cost" in spec.last_stats.policy
    assert "costs: plain step" in str(spec.last_stats)
    # What the rounds measured is kept beside the measured tables, for the next refining process to start from.
    assert selfspec.wrap(model, plan=plan, reproducible=False).costs.source == "cached"
    texts = [path.read_text() for path in tmp_path.glob("*.json")]
    assert len(texts) == 4 and sum('"source": "refined"' in text for text in texts) == 2


def test_every_plan_prices_the_same_verify_passes_and_its_own_draft(tmp_path, monkeypatch):
    """The verify passes are the model's and the machine's: timed once, shared by every plan (two tables
    timed apart differ by noise, and one plan would be priced wider passes than another). Each plan's draft
    step is its own, kept as a share of the plain step it was timed beside."""
    monkeypatch.setenv("SELFSPEC_COSTS_CACHE", str(tmp_path))
    model = tiny_model("llama", torch.float32)
    few, many = (selfspec.DraftPlan(layers=layers, draft_length=5) for layers in ([0], [0, 1, 2, 3, 4]))
    first = selfspec.wrap(model, plan=few).costs
    second = selfspec.wrap(model, plan=many).costs
    assert second.verify == first.verify and second.verify_long == first.verify_long
    assert second.draft_step != first.draft_step  # each timed its own layers
    ngram = selfspec.wrap(model, plan=selfspec.DraftPlan(ngram=3, draft_length=5)).costs
    assert ngram.verify == first.verify and ngram.draft_step == 0.0
    assert len(list(tmp_path.glob("*.json"))) == 3  # one table of passes, two drafts (an n-gram plan has none)
    # A draft timed while the machine ran at half speed keeps its share of a step.
    passes = PassCosts((0.01, 0.012), 0.0, 4, verify_long=(0.02, 0.03), context=48, long_context=1024)
    slow = PassCosts((0.02,), 0.01, 4, verify_long=(0.04,), draft_long=0.016, context=48, long_context=1024)
    joined = passes.with_draft(slow)
    assert joined.verify == passes.verify and joined.draft_step == pytest.approx(0.005)
    assert joined.draft_long == pytest.approx(0.008)
    assert joined.passes_only() == passes and joined.draft_only().verify == (0.01,)
    # The rounds' refinement of one plan's passes is where the next refining plan starts from.
    spec = selfspec.wrap(model, plan=few, reproducible=False)
    runtime = spec._runtime_costs()
    for _ in range(RuntimeCosts.MIN_SEEN):
        runtime.observe_verify(1, 0, first.step * 3)
    spec.cost_tables.save_refined(runtime)
    assert selfspec.wrap(model, plan=many, reproducible=False).costs.step == pytest.approx(first.step * 3)
    assert selfspec.wrap(model, plan=many).costs.step == first.step  # a reproducible one reads it as measured


def test_plans_of_other_widths_share_the_passes_timed_for_the_widest(tmp_path, monkeypatch):
    """A plan that verifies fewer tokens reads the widest table so far; a wider one times the passes again
    (and its table serves both); a narrower plan's refined passes keep the wider widths when written back."""
    monkeypatch.setenv("SELFSPEC_COSTS_CACHE", str(tmp_path))
    model = tiny_model("llama", torch.float32)
    narrow = selfspec.DraftPlan(ngram=3, draft_length=3)  # passes of up to 4 tokens
    wide = selfspec.DraftPlan(ngram=3, draft_length=3, tree=8)  # up to 9
    first = selfspec.wrap(model, plan=narrow).costs
    assert first.max_width == 4 and first.source == "measured"
    timed = selfspec.wrap(model, plan=wide).costs
    assert timed.max_width == 9 and timed.source == "measured"  # the cached table was too narrow
    again = selfspec.wrap(model, plan=narrow).costs
    assert again.source == "cached" and again.verify == timed.verify[:4]
    assert again.verify == first.verify  # timing the wider passes kept the narrower ones as they were
    assert len(list(tmp_path.glob("*.json"))) == 1
    spec = selfspec.wrap(model, plan=narrow, reproducible=False)
    runtime = spec._runtime_costs()
    for _ in range(RuntimeCosts.MIN_SEEN):  # this machine runs every pass at twice the table's time
        for width in (1, 2, 3, 4):
            runtime.observe_verify(width, 0, runtime.table.verify[width - 1] * 2)
    spec.cost_tables.save_refined(runtime)
    after = selfspec.wrap(model, plan=wide, reproducible=False).costs
    assert after.source == "cached" and after.max_width == 9
    assert list(after.verify) == pytest.approx([2 * t for t in timed.verify])  # the wider widths: same shape
    table = PassCosts((1.0, 1.5), 0.0, 2)
    assert table.merged_into(PassCosts((2.0, 2.2, 2.1, 3.0), 0.0, 2)).verify == pytest.approx((1.0, 1.5, 1.5, 2.045),
                                                                                               abs=1e-3)


def test_greedy_calls_go_on_from_what_earlier_ones_learned_and_sampling_does_not():
    """With `reproducible=False`; a reproducible wrapper starts every call afresh (`test_reproducible.py`)."""
    model = tiny_model("llama", torch.float32)
    spec = selfspec.wrap(model, plan=selfspec.DraftPlan(ngram=3, layers=[0, 1], draft_length=4), costs="flat",
                         reproducible=False)
    prompt = random_prompt(12, seed=5).repeat(1, 3)  # repeats: the n-gram lookup finds matches
    spec.generate(prompt, max_new_tokens=30)
    acceptance, calibration, ledger = spec.learned
    judged = sum(rate.seen for rate in acceptance.ngram.values()) + sum(rate.seen for rate in acceptance.positions)
    assert judged > 0
    spec.generate(prompt, max_new_tokens=30, do_sample=True, generator=torch.Generator().manual_seed(1))
    assert spec.learned[0] is acceptance  # a sampled call learned apart (a seed reproduces its sample) ...
    after = sum(rate.seen for rate in acceptance.ngram.values()) + sum(rate.seen for rate in acceptance.positions)
    assert after == judged  # ... and left the greedy calls' estimates as they were
    spec.generate(prompt, max_new_tokens=30)
    assert spec.learned == (acceptance, calibration, ledger)  # the next greedy call learned into the same estimates
    assert sum(rate.seen for rate in acceptance.positions) + sum(r.seen for r in acceptance.ngram.values()) != judged


def test_linear_profile_runs_the_plain_path_and_no_slower(monkeypatch):
    """A machine where verifying q tokens costs q steps: every round is a plain step, and it costs what one does."""
    model = tiny_model("llama", torch.float32)
    prompt = random_prompt(10, seed=3)
    plain = selfspec.wrap(model, plan=selfspec.DraftPlan.plain())
    spec = selfspec.wrap(model, plan=selfspec.DraftPlan(ngram=3, layers=[0, 1, 2], draft_length=8), costs="linear")
    reference = plain.generate(prompt, max_new_tokens=60)
    assert torch.equal(spec.generate(prompt, max_new_tokens=60), reference)
    stats = spec.last_stats
    assert stats.drafted == 0 and stats.rounds_without_draft == stats.rounds == 59
    times = {"plain": [], "linear": []}
    for _ in range(7):  # interleaved; the fastest of each (other load only ever adds time)
        for name, wrapped in (("plain", plain), ("linear", spec)):
            began = time.perf_counter()
            wrapped.generate(prompt, max_new_tokens=60)
            times[name].append(time.perf_counter() - began)
    ratio = min(times["linear"]) / min(times["plain"])
    assert ratio < 1.3, f"the cost policy's bookkeeping made plain steps {ratio:.2f}x slower"


def test_flat_profile_drafts_and_stays_lossless():
    model = tiny_model("qwen2", torch.float64)
    prompt = random_prompt(10, seed=5)
    reference = model.generate(prompt, do_sample=False, max_new_tokens=40)
    spec = selfspec.wrap(model, plan=selfspec.DraftPlan(ngram=2, exit_layer=5, draft_length=6), costs="flat")
    assert torch.equal(spec.generate(prompt, max_new_tokens=40), reference)
    assert spec.last_stats.drafted > 0


def test_ngram_acceptance_is_counted_by_position_in_the_proposal():
    """A copy that starts right goes on right: the first copied token and the later ones are counted apart."""
    est = AcceptanceEstimates(prior=0.5)
    for i in range(50):
        accepted = 4 if i % 10 < 3 else 0  # 30% of copies are right from the start, and then all the way
        est.observe(Draft([1, 2, 3, 4], None, [], source="ngram", match_length=2), accepted=accepted)
    assert est.ngram_token(2, 1) == pytest.approx(0.3, abs=0.05)
    assert est.ngram_token(2, 2) > 0.9 and est.ngram_token(2, 4) > 0.85
    # Where 9 tokens cost 1.9 steps (float32 on an AVX-512 CPU), such copies are worth verifying long...
    fp32 = PassCosts((1.0, 1.10, 1.30, 1.50, 1.59, 1.69, 1.78, 1.88, 1.90), 0.9, 30)
    p = CostPolicy(selfspec.DraftPlan(ngram=3, draft_length=8), RuntimeCosts(fp32, learn=False))
    p.acceptance = est
    assert p.ngram_length(2, 8) >= 6
    # ... and on the AVX2 table not at all: a third of first tokens right does not pay for the wide pass there.
    p = CostPolicy(selfspec.DraftPlan(ngram=3, draft_length=8), RuntimeCosts(avx2_table(), learn=False))
    p.acceptance = est
    assert p.ngram_length(2, 8) == 0


def test_ngram_acceptance_is_counted_by_how_far_back_the_match_agrees():
    """A copy whose context agrees over 16+ tokens and one that agrees over exactly 3 are counted apart (lengths
    5-7, 8-15 and 16+ each share a count), so the short ones are verified short and the long ones long."""
    est = AcceptanceEstimates(prior=0.5)
    for i in range(60):
        est.observe(Draft([1, 2, 3, 4, 5, 6, 7, 8], None, [], source="ngram", match_length=3), accepted=0)
        est.observe(Draft([1, 2, 3, 4, 5, 6, 7, 8], None, [], source="ngram", match_length=16 + i % 9), accepted=8)
    assert est.ngram_token(3, 1) < 0.1 and est.ngram_token(24, 1) > 0.9 and est.ngram_token(16, 5) > 0.9
    assert est.ngram_token(32, 1) > 0.9  # never seen at 32 exactly: it shares the count of 16+
    assert est.ngram_token(15, 1) == est.ngram_token(8, 1) == pytest.approx(0.5)  # 8-15: nothing seen, the prior
    table = PassCosts((1.0, 1.48, 1.85, 2.21, 2.26, 2.31, 2.36, 2.41, 2.45), 0.9, 30)  # as measured, bf16, AVX512
    p = CostPolicy(selfspec.DraftPlan(ngram=3, draft_length=8), RuntimeCosts(table, learn=False))
    p.acceptance = est
    assert p.ngram_length(3, 8) == 0 and p.ngram_length(20, 8) == 8


@pytest.mark.parametrize("plan", [
    selfspec.DraftPlan(ngram=1, exit_layer=3, draft_length=8, adaptive=True, policy="fixed"),
    selfspec.DraftPlan(ngram=2, layers=[0, 2, 4], draft_length=6),
], ids=["fixed-adaptive", "cost"])
def test_a_seed_reproduces_its_sample_whatever_the_timings(plan, monkeypatch):
    """Rounds timed at random (a machine under bursts of load): a seeded sample is the same every time."""
    import random

    from selfspec import rounds

    jitter = random.Random(0)
    monkeypatch.setattr(rounds.RoundClock, "seconds", lambda self, begin, end: jitter.choice([1e-4, 1e-3, 1e-2, 1.0]))
    model = tiny_model("llama")
    prompt = random_prompt(8, seed=5).repeat(1, 3)
    spec = selfspec.wrap(model, plan=plan)
    runs = [spec.generate(prompt, max_new_tokens=30, do_sample=True, generator=torch.Generator().manual_seed(1))
            for _ in range(4)]
    assert all(torch.equal(runs[0], run) for run in runs[1:])


# --------------------------------------------------------------------------- costs by context

def long_table() -> PassCosts:
    """At 48 entries a wide pass is nearly free; at 1,024 a pass over 3 tokens costs three times one."""
    return PassCosts((1.0, 1.1, 1.2), 0.3, 4, context=48, verify_long=(1.2, 2.4, 3.6), draft_long=0.6,
                     long_context=1024)


def test_a_pass_costs_what_its_context_says():
    table = long_table()
    assert table.verify_seconds(3) == 1.2 and table.verify_seconds(3, context=10) == 1.2  # at or below 48: as timed
    assert table.verify_seconds(3, context=536) == pytest.approx((1.2 + 3.6) / 2)  # linear between
    assert table.verify_seconds(3, context=2000) == pytest.approx(1.2 + 2.4 * (2000 - 48) / 976)  # and beyond
    assert table.draft_seconds(536) == pytest.approx(0.45) and table.draft_seconds() == 0.3
    # Layers that already ran see one token: their share is priced at one token's cost at that context.
    assert table.verify_seconds(3, exact_prefix=2, context=1024) == pytest.approx(3.6 - 0.5 * (3.6 - 1.2))
    assert PassCosts.from_dict(table.to_dict()) == table
    assert "at 1024 entries" in table.summary()
    flat = PassCosts.profile("flat")
    assert flat.verify_seconds(3, context=100_000) == flat.verify_seconds(3)  # a profile has no context
    with pytest.raises(ValueError, match="verify_long must be positive seconds for the same 3 widths"):
        PassCosts((1.0, 1.1, 1.2), 0.3, 4, verify_long=(1.0, 2.0), long_context=1024)
    with pytest.raises(ValueError, match="long_context > context"):
        PassCosts((1.0, 1.1, 1.2), 0.3, 4, verify_long=(1.0, 2.0, 3.0), long_context=48)
    with pytest.raises(ValueError, match="not a cost table"):
        PassCosts.from_dict({**table.to_dict(), "format": "selfspec.costs/1"})  # older tables are measured anew


def test_the_cost_policy_prices_drafts_at_the_rounds_context():
    """The same well-accepted n-gram proposal pays at a short context and not at a long one."""
    plan = selfspec.DraftPlan(ngram=3, draft_length=2)
    policy = CostPolicy(plan, RuntimeCosts(long_table(), learn=False))
    policy.begin_round(2, context=60)
    assert policy.ngram_length(3, 2) == 2
    policy.begin_round(2, context=3000)
    assert policy.ngram_length(3, 2) == 0


def test_runtime_corrections_stay_in_their_context_band():
    costs = RuntimeCosts(long_table())
    costs.context = 100
    for _ in range(3):
        costs.observe_verify(2, 0, 0.5 * long_table().verify_seconds(2, context=100))  # short: half the table's
    costs.context = 1500
    assert costs.verify(2) == pytest.approx(long_table().verify_seconds(2, context=1500) * 0.5)  # nothing seen here
    for _ in range(3):
        costs.observe_verify(1, 0, 2.0 * long_table().verify_seconds(1, context=1500))  # long: twice the table's
    assert costs.verify(2) == pytest.approx(long_table().verify_seconds(2, context=1500) * 2.0)  # the band's own
    costs.context = 100
    assert costs.verify(2) == pytest.approx(0.5 * long_table().verify_seconds(2, context=100))  # the short band's
    refined = costs.refined()
    assert refined.verify[1] == pytest.approx(0.55) and refined.verify_long[0] == pytest.approx(2.0 * 1.2)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_measured_tables_time_a_long_context_within_the_models_positions(kind, tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_COSTS_CACHE", str(tmp_path))
    model = tiny_model(kind, torch.float32)
    plan = selfspec.DraftPlan(layers=[0, 2], draft_length=4)
    table = selfspec.wrap(model, plan=plan).costs
    positions = getattr(model.config, "n_positions", None)
    expected = 1024 if positions is None else positions - 5 - 1  # GPT-2's learned positions end sooner
    assert table.long_context == expected and len(table.verify_long) == 5 and table.draft_long > 0


def test_a_capped_cpu_capability_is_named_in_figures_and_in_the_cost_tables_key(monkeypatch):
    """`ATEN_CPU_CAPABILITY=avx2` on an AVX-512 host times an AVX2-only machine: every header and the cost
    tables' machine must say the kernels were capped, so such a figure is never read as the host's own."""
    for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA"):
        monkeypatch.delenv(name, raising=False)
    uncapped = cpu_capability()
    assert uncapped == torch.backends.cpu.get_cpu_capability()
    cpu = torch.device("cpu")
    plain_machine = machine_description(cpu)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert cpu_capability() == f"{uncapped} (capped: ONEDNN_MAX_CPU_ISA=AVX2)"
    assert machine_description(cpu) != plain_machine  # a capped run's cost tables are kept apart


def _protocol_members(protocol) -> set[str]:
    own = {name for klass in protocol.__mro__ if klass not in (object, typing.Protocol, typing.Generic)
           for name in [*vars(klass), *getattr(klass, "__annotations__", {})] if not name.startswith("_")}
    return own


def test_both_policies_satisfy_the_one_contract():
    """`policy_for` builds what a plan names; both policies have every `DraftPolicy` member, with its signature."""
    costs = RuntimeCosts(PassCosts.profile("linear", num_layers=6), learn=False)
    fixed = policy_for(selfspec.DraftPlan(exit_layer=2, policy="fixed", adaptive=True))
    cost = policy_for(selfspec.DraftPlan(exit_layer=2), costs, exact_prefix=2)
    assert type(fixed) is AdaptivePolicy and type(cost) is CostPolicy and cost.exact_prefix == 2
    assert type(policy_for(selfspec.DraftPlan.plain(), costs)) is AdaptivePolicy  # plain decoding drafts nothing
    with pytest.raises(ValueError, match="cost table"):
        policy_for(selfspec.DraftPlan(exit_layer=2))
    for policy in (fixed, cost):
        assert isinstance(policy, DraftPolicy)
        for name in _protocol_members(DraftPolicy):
            assert hasattr(policy, name), (type(policy).__name__, name)
            declared = getattr(DraftPolicy, name, None)
            if callable(declared):
                assert inspect.signature(getattr(policy, name)) == inspect.signature(declared.__get__(policy)), name
    assert isinstance(cost, LayerChoosingPolicy) and not isinstance(fixed, LayerChoosingPolicy)
    assert (fixed.costs, cost.costs) == (None, costs) and (fixed.threshold, cost.threshold) == (0.5, None)
    members = _protocol_members(DraftPolicy)
    assert len(members) == 17 and {"begin_round", "draft_next", "observe", "round_budget", "costs"} <= members
