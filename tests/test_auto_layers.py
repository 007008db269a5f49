"""`plan="auto"`: layers chosen per context while generating (`selfspec/auto_layers.py`).

What is tested: the pieces (budgets, which layers a budget keeps, the ranking
by how much a layer changes its rows, the policy's per-set estimates and
predicted rates); that a generation changes its layer set and stays equal to
`model.generate` in float64 for every architecture, on the eager and the
static step, with the layer sets' cache entries in step; that the choice is
made afresh per generation and reproduced by a seed when sampling; the plan
field, its JSON form and its bad inputs. The sampling law with an auto plan is
tested in `test_sampling.py`.
"""

from __future__ import annotations

import pytest
import torch

import selfspec
from plan_strategies import assert_same
from selfspec.auto_layers import (CHOOSE_EVERY_IDLE, HOLD_ELEMENTS, INFLUENCE_DECAY, PROBE_ROWS, AutoLayers,
                                  LayerInfluence, candidate_budgets, exact_prefix, layers_for)
from selfspec.costs import PassCosts, RuntimeCosts
from selfspec.draft import Draft, Drafter
from selfspec.passes import TargetPasses
from selfspec.policy import CostPolicy
from selfspec.testing import TINY_CONFIGS, random_prompt, tiny_model

ARCHS = sorted(TINY_CONFIGS)
AUTO = selfspec.DraftPlan(auto=True, ngram=3, tree=8, draft_length=5)


def repetitive_prompt(seed: int) -> torch.Tensor:
    """A random prompt repeated: n-gram rounds and layer rounds both happen."""
    return torch.cat([random_prompt(10, seed=seed)] * 3, dim=1)


def test_candidate_budgets():
    assert candidate_budgets(30) == [15, 20, 25, 29]
    assert candidate_budgets(6) == [3, 4, 5]
    assert candidate_budgets(2) == [1]
    assert candidate_budgets(1) == [1]


def test_a_budget_keeps_the_first_and_last_layers_and_then_the_most_changing():
    ranking = [3, 7, 0, 9, 5, 1, 2, 4, 6, 8]
    assert layers_for(4, ranking, 10) == (0, 3, 7, 9)
    assert layers_for(2, ranking, 10) == (0, 9)
    assert layers_for(1, ranking, 10) == (0,)
    assert layers_for(10, ranking, 10) == tuple(range(10))
    assert exact_prefix((0, 1, 2, 5, 9)) == 3 and exact_prefix((1, 2)) == 0 and exact_prefix(()) == 0


def test_influence_ranks_a_layer_that_changes_nothing_last():
    influence = LayerInfluence(3, torch.device("cpu"))
    x = torch.randn(1, 4, 8, generator=torch.Generator().manual_seed(0))
    influence(0, x, x + torch.randn(1, 4, 8) * 0.5)  # a small turn
    influence(1, x, x)  # identity: cos = 1, change 0
    influence(2, x, -x)  # reverses the state: change 2
    assert influence.ranking() == [2, 0, 1]
    influence(1, x, -x)  # a moving average: one report moves layer 1 up, not to the top
    change = influence.change.tolist()
    assert 0 < change[1] < change[2] and influence.ranking()[0] == 2


def test_influence_folds_a_pass_at_once_as_one_report_per_layer_would():
    """Reports are held until the pass's last layer and reduced together; the averages equal the
    per-layer rule, with the exact prefix's 1-row reports and the rest's wider ones in one pass, and a
    layer reported twice before a pass ends counted in order; a long pass counts its last PROBE_ROWS rows."""
    gen = torch.Generator().manual_seed(1)
    influence, expected = LayerInfluence(4, torch.device("cpu")), [None] * 4

    def report(layer: int, rows: int, hidden: int = 8) -> None:
        before, after = torch.randn(2, 1, rows, hidden, generator=gen).to(torch.bfloat16)
        influence(layer, before, after)
        last = slice(max(0, rows - PROBE_ROWS), rows)
        change = 1.0 - torch.nn.functional.cosine_similarity(before[:, last].float(), after[:, last].float(),
                                                             dim=-1).mean().item()
        past = expected[layer]
        expected[layer] = change if past is None else past + (change - past) * (1.0 - INFLUENCE_DECAY)

    for layer in range(4):  # the prefill: 6 rows
        report(layer, 6)
    assert not influence.pending  # the last layer ended the pass
    report(0, 1), report(1, 1)  # a verify pass: the exact prefix runs the last token only...
    report(2, 4), report(2, 4)  # ...(layer 2 twice: the first report counts first)...
    report(3, 4)  # ...the rest its 4 rows
    report(1, 3)  # a report not yet folded in: reading the averages folds it
    assert influence.change.tolist() == pytest.approx(expected, abs=1e-5)
    assert influence.seen == [True] * 4 and not influence.pending
    # A long prompt's layer: its last rows only, folded in as it runs, not held to the pass's end.
    report(0, 3 * PROBE_ROWS, hidden=HOLD_ELEMENTS // PROBE_ROWS)
    assert not influence.pending and influence.change.tolist() == pytest.approx(expected, abs=1e-5)


def policy_with(costs: PassCosts) -> CostPolicy:
    return CostPolicy(selfspec.DraftPlan(auto=True, draft_length=6), RuntimeCosts(costs, learn=False))


def test_policy_keeps_estimates_per_layer_set_and_prefers_the_one_that_is_accepted():
    costs = PassCosts.profile("flat", max_width=7, step=1.0, draft_fraction=0.5, num_layers=10)
    policy = policy_with(costs)
    good, poor = (0, 1, 2, 9), (0, 9)
    untried = policy.layer_rate(good, exact_prefix=3, draft_scale=1.0)
    assert untried == policy.layer_rate(poor, exact_prefix=1, draft_scale=1.0)  # both at the prior
    for accepted, layers in [(4, good), (0, poor)] * 10:  # `good` drafts accepted, `poor` ones rejected
        policy.use_layers(layers, exact_prefix=exact_prefix(layers), draft_scale=1.0)
        policy.observe(Draft([1] * 4, None, [], confidences=[0.9] * 4), accepted, draft_seconds=0.0,
                       verify_seconds=0.0, width=5)
    rate_good = policy.layer_rate(good, exact_prefix=3, draft_scale=1.0)
    rate_poor = policy.layer_rate(poor, exact_prefix=1, draft_scale=1.0)
    assert rate_good > untried * 0.9 and rate_poor == pytest.approx(1.0)  # `poor`: plain steps (k = 0) pay best
    assert rate_good > 1.5 * rate_poor
    # A costlier draft of the same acceptance is predicted slower; the active set is left as it was.
    assert policy.layer_rate(good, exact_prefix=3, draft_scale=1.5) < rate_good
    assert policy.exact_prefix == exact_prefix(poor) and policy.draft_scale == 1.0


def test_layer_sets_fade_back_toward_the_prior():
    policy = policy_with(PassCosts.profile("flat", max_width=7, num_layers=10))
    policy.use_layers((0, 9), exact_prefix=1, draft_scale=1.0)
    for _ in range(5):
        policy.observe(Draft([1] * 3, None, [], confidences=[0.5] * 3), 0, draft_seconds=0.0, verify_seconds=0.0,
                       width=4)
    low = policy.acceptance.layer_position(1)
    policy.use_layers((0, 1, 9), exact_prefix=2, draft_scale=1.0)
    for _ in range(200):  # rounds drafted with another set: the first set's evidence fades
        policy.acceptance.decay()
    policy.use_layers((0, 9), exact_prefix=1, draft_scale=1.0)
    assert low < 0.3 < policy.acceptance.layer_position(1)


def test_a_budget_keeps_what_it_learned_when_its_set_trades_a_layer():
    """Estimates follow the budget: a rejected budget is not tried afresh because the ranking moved."""
    plan = selfspec.DraftPlan(auto=True, draft_length=6)
    drafter = Drafter(plan, 10)
    auto = AutoLayers(drafter, TargetPasses(10, exact_prefix=drafter.exact_prefix), layer_weights=[1.0] * 10,
                      head_weight=1.0, device=torch.device("cpu"))
    policy = policy_with(PassCosts.profile("flat", max_width=7, step=1.0, draft_fraction=0.5, num_layers=10))

    def rank(order: list[int]) -> None:  # the influence ranking, most changing first
        auto.influence.change = torch.tensor([float(10 - order.index(i)) for i in range(10)])
        auto.influence.ranked = None

    rank([3, 7, 5, 1, 2, 4, 6, 8, 0, 9])
    auto.choose(policy)
    first = drafter.draft_layers
    paying = [b for b in candidate_budgets(10)
              if policy.layer_rate(b, exact_prefix=0, draft_scale=(b + 1) / 6) > policy.plain_rate()]
    assert len(first) == max(paying) < 10  # untried, the largest budget that would pay at the prior goes first
    for _ in range(10):
        policy.observe(Draft([1] * 3, None, [], confidences=[0.9] * 3), 0, draft_seconds=0.0, verify_seconds=0.0,
                       width=4)
    order = [3, 7, 5, 1, 2, 4, 6, 8]  # then 0 and 9, always in a set
    last = len(first) - 3  # the last of these in the budget's set
    order[last], order[last + 1] = order[last + 1], order[last]  # it swaps places with the first left out
    rank(order + [0, 9])  # so the budget's set trades a layer
    assert layers_for(len(first), auto.influence.ranking(), 10) != first
    auto.choose(policy)
    assert len(drafter.draft_layers) != len(first)  # that budget's rejections still count
    assert set(policy.acceptance.layer_sets) <= {None, *candidate_budgets(10)}


def test_a_smaller_budget_is_expected_no_better_than_a_larger_one_tried():
    """Rejections of the larger set cap the smaller sets' prior: they are not tried at the plan's optimistic guess."""
    plan = selfspec.DraftPlan(auto=True, draft_length=6)
    policy = policy_with(PassCosts.profile("flat", max_width=7, step=1.0, draft_fraction=0.5, num_layers=10))
    untried = policy.layer_rate(5, exact_prefix=0, draft_scale=1.0)
    assert untried > policy.plain_rate()  # at the plan's prior, 5 layers would pay
    policy.use_layers(8, exact_prefix=0, draft_scale=1.0)
    for _ in range(10):
        policy.observe(Draft([1] * 3, None, [], confidences=[0.9] * 3), 0, draft_seconds=0.0, verify_seconds=0.0,
                       width=4)
    assert policy.layer_set_tried(8) and not policy.layer_set_tried(5)
    assert policy.layer_rate(5, exact_prefix=0, draft_scale=1.0) == pytest.approx(policy.plain_rate())  # capped
    assert policy.layer_rate(9, exact_prefix=0, draft_scale=1.0) == pytest.approx(untried)  # a larger one is not
    policy.use_layers(5, exact_prefix=0, draft_scale=1.0)
    capped = policy.acceptance.layer_position(1)
    assert capped < plan.target_acceptance
    policy.layer_rate(9, exact_prefix=0, draft_scale=1.0)  # pricing another set leaves the one in use as it was
    assert policy.acceptance.layer_position(1) == capped


@pytest.mark.parametrize("step", ["eager", "static"])
@pytest.mark.parametrize("arch", ARCHS)
def test_auto_plan_equals_generate_in_float64(arch, step):
    """Whether the set changes depends on what each set earns here; changing sets is tested below (llama)."""
    model = tiny_model(arch)
    for seed, costs in [(1, "flat"), (2, "linear"), (3, None)]:
        prompt = repetitive_prompt(seed)
        ref = model.generate(prompt, do_sample=False, max_new_tokens=40)
        spec = selfspec.wrap(model, plan=AUTO, costs=costs, step=step)
        assert_same(spec.generate(prompt, max_new_tokens=40), ref, f"{arch} {step} auto, costs={costs}")


def test_choice_is_made_per_generation_and_the_cache_stays_in_step():
    model = tiny_model("llama")
    spec = selfspec.wrap(model, plan=AUTO, costs="flat", reproducible=False)  # learns across calls
    prompt = repetitive_prompt(4)
    first = spec.generate(prompt, max_new_tokens=40)
    sets = spec.last_stats.layer_sets
    assert sets.count("round ") > 1  # the set changed during the generation
    fresh = selfspec.wrap(model, plan=AUTO, costs="flat")
    assert torch.equal(fresh.generate(prompt, max_new_tokens=40), first)
    assert fresh.last_stats.layer_sets == sets  # the same start, the same choices
    learned = {key for key in spec.learned[0].layer_sets if spec.learned[0].layer_set_tried(key)}
    assert learned  # what the budgets earned is kept for the next greedy call ...
    again = spec.generate(prompt, max_new_tokens=40)
    assert torch.equal(again, first)  # ... which starts from it, and keeps the target's tokens


def test_sampling_with_an_auto_plan_reproduces_with_a_seed():
    model = tiny_model("qwen2")
    spec = selfspec.wrap(model, plan=AUTO, costs="flat")
    kwargs = {"max_new_tokens": 30, "do_sample": True, "temperature": 0.8}
    a = spec.generate(repetitive_prompt(5), generator=torch.Generator().manual_seed(7), **kwargs)
    b = spec.generate(repetitive_prompt(5), generator=torch.Generator().manual_seed(7), **kwargs)
    assert torch.equal(a, b) and spec.last_stats.drafted > 0


def test_graphs_step_probes_only_the_prefill(monkeypatch):
    """Captured verify passes cannot report their layers: there the choice runs on the prefill's report."""
    model = tiny_model("llama")
    spec = selfspec.wrap(model, plan=AUTO, costs="flat", step="static")
    probed = []
    original = AutoLayers.__init__

    def without_verify_probes(self, *args, **kwargs):
        original(self, *args, **{**kwargs, "probe_verify": False})
        probed.append(self)

    monkeypatch.setattr(AutoLayers, "__init__", without_verify_probes)
    prompt = repetitive_prompt(6)
    ref = model.generate(prompt, do_sample=False, max_new_tokens=30)
    assert_same(spec.generate(prompt, max_new_tokens=30), ref, "auto, prefill probe only")
    assert all(probed[0].influence.seen)  # the prefill reported every layer


@pytest.mark.parametrize("costs, probed", [("linear", False), ("flat", True)])
def test_verify_passes_report_layer_changes_only_while_some_set_would_draft(monkeypatch, costs, probed):
    """Where a verify pass costs a step per token no layer set pays: the prefill reports, verify passes do not,
    and the choice runs every CHOOSE_EVERY_IDLE rounds. Where passes are flat the sets draft, every few verify
    passes report, and the choice runs every CHOOSE_EVERY rounds."""
    verify, choose, reported, chosen = TargetPasses.verify, AutoLayers.choose, [], []

    def noting(self, *args, **kwargs):
        reported.append(self.probe is not None)
        return verify(self, *args, **kwargs)

    def counting(self, policy):
        chosen.append(self.rounds)
        return choose(self, policy)

    monkeypatch.setattr(TargetPasses, "verify", noting)
    monkeypatch.setattr(AutoLayers, "choose", counting)
    model = tiny_model("llama")
    prompt = repetitive_prompt(8)
    spec = selfspec.wrap(model, plan=AUTO, costs=costs)
    assert_same(spec.generate(prompt, max_new_tokens=40), model.generate(prompt, do_sample=False, max_new_tokens=40),
                f"auto, costs={costs}")
    assert len(reported) > 8 and any(reported) == probed
    assert (spec.last_stats.layer_drafted > 0) == probed
    idle = [r % CHOOSE_EVERY_IDLE == 0 for r in chosen[1:]]  # after the first choice, at round 0
    assert len(chosen) > 2 and all(idle) != probed


def test_plan_field_json_and_strings():
    model = tiny_model("gpt2")
    spec = selfspec.wrap(model, plan="auto")
    assert spec.plan == selfspec.DraftPlan.auto_plan() and "chosen per context" in spec.describe_plan()
    assert selfspec.DraftPlan.from_json(spec.plan.to_json()) == spec.plan
    assert spec.plan.draft_layers(6) == (0, 1, 2)  # the reference set its cost table times


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"auto": True, "layers": [0, 1]}, "drop layers"),
        ({"auto": True, "exit_layer": 2}, "drop exit_layer"),
        ({"auto": True, "policy": "fixed"}, "needs policy='cost'"),
        ({"auto": "yes"}, "auto must be true or false"),
    ],
)
def test_bad_auto_plans(kwargs, message):
    with pytest.raises(ValueError, match=message):
        selfspec.DraftPlan(**kwargs)
