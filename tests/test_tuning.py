"""The plan search (selfspec.tuning) on a tiny random Llama: proxy, cost formulas, search, plan files.

Nothing here asserts speed: the timed parts run, but only their bookkeeping is checked.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tomllib

import pytest
import torch
from selfspec.testing import random_prompt, tiny_model

import selfspec
from selfspec import DraftPlan
from selfspec.costs import PassCosts
from selfspec.plan import ignored_fields
from selfspec.registry import adapter_for
from selfspec.cli.tune import add_arguments as add_tune_arguments
from selfspec.cli.tune import format_command, tune_config
from selfspec.tuning import CostModel, adapter_entry, tune
from selfspec.tuning.calibration import make_calibration
from selfspec.tuning.candidate import Candidate
from selfspec.tuning.cost import expected_tokens_per_round, iid_speedup, measure_cost_model
from selfspec.tuning.layer_search import search
from selfspec.tuning.proxy import ProxyEvaluator
from selfspec.tuning.replay import Agreement, Policy, Simulation, policy_grid, simulate
from selfspec.tuning.report import pareto_front

LAYERS = 6  # selfspec.testing.COMMON
# A made-up cost table (no timing, so the tests are deterministic), in seconds: a pass over q tokens costs
# 1 + 0.08 (q - 1); a drafted token through n layers 0.4 + 0.1 n.
COSTS = CostModel(
    PassCosts(verify=tuple(1.0 + 0.08 * q for q in range(9)), draft_step=0.0, num_layers=LAYERS, source="test"),
    draft_first=0.5,
    draft_all=1.0,
)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def prompts():
    return [random_prompt(6 + i, seed=10 + i)[0].tolist() for i in range(4)]


@pytest.fixture(scope="module")
def calibration(model, prompts):
    sequences, _ = make_calibration(model, prompts, max_new_tokens=20, progress=False)
    return sequences


@pytest.fixture(scope="module")
def evaluator(model, calibration):
    return ProxyEvaluator(model, calibration, COSTS)


# --------------------------------------------------------------------------- formulas


def test_expected_tokens_per_round_formula():
    assert expected_tokens_per_round(0.5, 3) == pytest.approx(1.875)  # 1 + .5 + .25 + .125
    assert expected_tokens_per_round(1.0, 4) == 5
    assert expected_tokens_per_round(0.0, 4) == 1
    assert iid_speedup(0.5, 3, draft_step=0.2, verify=1.1) == pytest.approx(1.875 / 1.7)


def test_cost_model_prices_with_the_runtime_table():
    """The tuner's prices are the runtime's `PassCosts`: a layer set's table is the passes with its draft step."""
    assert COSTS.draft_step(1) == pytest.approx(0.5) and COSTS.draft_step(LAYERS) == pytest.approx(1.0)
    assert COSTS.draft_step(3) == pytest.approx(0.4 + 3 * 0.1)  # linear in the layers between the two measured
    assert COSTS.verify(0) == pytest.approx(1.0)  # a plain step
    table = COSTS.table(3)
    assert table.draft_step == pytest.approx(0.7) and table.verify == COSTS.passes.verify
    # Two drafted tokens, exact prefix of 2 layers: priced as the runtime prices that verify pass.
    assert COSTS.verify(2, exact_prefix=2) == pytest.approx(table.verify_seconds(3, 2) / table.step)
    assert COSTS.round_cost(2, 3, 2) == pytest.approx(2 * COSTS.draft_step(3) + COSTS.verify(2, 2))
    assert CostModel.from_dict(json.loads(json.dumps(COSTS.to_dict()))) == COSTS
    assert COSTS.max_draft_length == 8 and COSTS.num_layers == LAYERS


def test_measured_cost_model_is_the_runtimes_table(model):
    """`measure_cost_model` reads the tables a generation decides with (`SelfSpecModel.measure_costs`)."""
    measured = measure_cost_model(model, max_draft_length=3, repeats=1)
    runtime = selfspec.wrap(model, plan=DraftPlan(exit_layer=1, draft_length=3)).measure_costs(repeats=1)
    assert dataclasses.replace(measured.passes, source="cached") == runtime.passes_only()  # the same table
    assert measured.draft_first == runtime.draft_step
    assert measured.max_draft_length == 3 and measured.draft_all >= measured.draft_first > 0


def test_simulate_replays_the_decode_loop_by_hand():
    # 8 generated tokens; the draft matches at generated inputs 0, 1, 3, 4, 5.
    agreement = Agreement([[True, True, False, True, True, True, False]], [[0.9] * 7])
    costs = PassCosts(verify=(1.0,) * 9, draft_step=0.5, num_layers=LAYERS)  # a drafted token 0.5, a pass 1.0
    sim = simulate(agreement, Policy(2, policy="fixed"), limits=[8], costs=costs)
    # Rounds: draft 2, accept 2 (emitted 1 -> 4); draft 2, accept 2 (-> 7); budget 0, plain step (-> 8).
    assert sim == Simulation(rounds=3, drafted=4, accepted=4, emitted=8, sequences=1, cost=5.0)
    assert sim.speedup == pytest.approx(7 / 5)
    assert sim.tokens_per_pass == pytest.approx(8 / 4)


def test_simulate_stops_drafting_below_the_confidence_threshold():
    agreement = Agreement([[True, True, True, True, True]], [[0.9, 0.2, 0.9, 0.9, 0.9]])
    policy = Policy(4, policy="fixed", adaptive=True, threshold=0.5, threshold_step=0.0)
    sim = simulate(agreement, policy, limits=[6], costs=PassCosts(verify=(1.0,) * 9, draft_step=0.0, num_layers=1))
    # Round 1 drafts 2 (the second is under 0.5) and keeps both (-> 4); round 2: budget 1, drafts 1 (-> 6).
    assert (sim.rounds, sim.drafted, sim.accepted, sim.emitted) == (2, 3, 3, 6)


def test_policy_grid_is_valid_plans():
    for policy in policy_grid(8):
        plan = DraftPlan(exit_layer=1, **policy.plan_fields())
        assert plan.policy == "cost" and plan == policy.plan()  # the runtime's default policy, nothing inert
    assert policy_grid(8)[0] == Policy(1)  # the simplest first: it wins ties
    with pytest.raises(ValueError, match="threshold=0.3 does nothing under policy='cost'"):
        Policy(4, threshold=0.3)


def test_simulate_runs_the_cost_policy_through_the_contract():
    """A cost replay decides as the runtime's `CostPolicy` does: it stops drafting where a pass costs too much."""
    agreement = Agreement([[True] * 11], [[0.95] * 11])
    cheap = PassCosts(verify=(1.0,) * 9, draft_step=0.05, num_layers=LAYERS)  # wide passes free, drafts cheap
    dear = PassCosts(verify=tuple(float(q) for q in range(1, 10)), draft_step=0.9, num_layers=LAYERS)
    fast = simulate(agreement, Policy(4), limits=[12], costs=cheap)
    slow = simulate(agreement, Policy(4), limits=[12], costs=dear)
    assert fast.drafted >= 4 and fast.speedup > 1.5
    assert slow.drafted == 0 and slow.rounds == 11 and slow.speedup == pytest.approx(1.0)  # plain steps pay best


# --------------------------------------------------------------------------- the proxy


@pytest.mark.parametrize("context", ["rounds", "target", "draft"])
def test_proxy_of_the_full_depth_plan_agrees_everywhere(model, calibration, context):
    evaluator = ProxyEvaluator(model, calibration, COSTS, context=context)
    agreement = evaluator.agreement(range(LAYERS))
    assert agreement.alpha == 1.0
    assert all(0.0 < c <= 1.0 for row in agreement.confidences for c in row)


@pytest.mark.parametrize("layers", [(0, 1, 2), (0, 2, 5), (0, 1, 3, 4, 5), (0, 3), (0,)])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_rounds_proxy_equals_real_greedy_acceptance(model, evaluator, layers, k):
    """The default proxy replays the engine's rounds, draft entries and all: exact in float64."""
    proxy = evaluator.simulate(layers, Policy(k, policy="fixed"))
    spec = selfspec.wrap(model, plan=DraftPlan(layers=layers, draft_length=k, policy="fixed"))
    drafted = accepted = rounds = 0
    for seq in evaluator.calibration:
        spec.generate(torch.tensor([seq.tokens[: seq.prompt_length]]), max_new_tokens=seq.max_new_tokens)
        drafted, accepted = drafted + spec.last_stats.drafted, accepted + spec.last_stats.accepted
        rounds += spec.last_stats.rounds
    assert (proxy.drafted, proxy.accepted, proxy.rounds) == (drafted, accepted, rounds)


# Wide passes free and drafts cheap: the cost policy drafts on even at the tiny model's low acceptance.
CHEAP = CostModel(PassCosts(verify=(1.0,) * 9, draft_step=0.0, num_layers=LAYERS), draft_first=0.01, draft_all=0.05)


@pytest.fixture(scope="module")
def cheap_evaluator(model, calibration):
    return ProxyEvaluator(model, calibration, CHEAP)


@pytest.mark.parametrize("layers", [(0, 1, 2), (0, 2, 5), (0, 1, 3, 4, 5)])
@pytest.mark.parametrize("k", [2, 6])
@pytest.mark.parametrize("costs", ["cheap", "dear"])
def test_cost_policy_replay_equals_the_real_cost_policy(model, evaluator, cheap_evaluator, layers, k, costs):
    """The replay runs the policy the runtime runs: wrapped with the same table, the real rounds accept the same.

    Drafted counts agree exactly up to k = 2; past a rejected token the proxy does not follow the draft's own
    tokens (the round-start confidence stands in), so a longer draft's tail may be decided a little differently.
    """
    evaluator = cheap_evaluator if costs == "cheap" else evaluator
    table = evaluator.cost_model.table(len(layers))
    proxy = evaluator.simulate(layers, Policy(k))
    if costs == "cheap":
        assert proxy.drafted > proxy.rounds  # it drafts, more than one token a round on average
    spec = selfspec.wrap(model, plan=Policy(k).plan(layers=layers), costs=table)
    drafted = accepted = rounds = 0
    for seq in evaluator.calibration:
        spec.generate(torch.tensor([seq.tokens[: seq.prompt_length]]), max_new_tokens=seq.max_new_tokens)
        drafted, accepted = drafted + spec.last_stats.drafted, accepted + spec.last_stats.accepted
        rounds += spec.last_stats.rounds
    assert (proxy.accepted, proxy.rounds) == (accepted, rounds)
    assert proxy.drafted == drafted if k <= 2 else proxy.drafted == pytest.approx(drafted, rel=0.05)


@pytest.mark.parametrize("layers", [(0, 2, 5), (0, 1, 3, 4, 5)])
def test_round_start_proxy_is_exact_for_one_drafted_token(model, calibration, layers):
    evaluator = ProxyEvaluator(model, calibration, COSTS, context="target")
    rounds_proxy = ProxyEvaluator(model, calibration, COSTS)
    fixed = Policy(1, policy="fixed")
    assert evaluator.simulate(layers, fixed) == rounds_proxy.simulate(layers, fixed)
    assert evaluator.agreement(layers).matches == rounds_proxy.agreement(layers).matches


def test_bad_layer_sets_are_refused(evaluator):
    with pytest.raises(ValueError, match="out of range"):
        evaluator.evaluate([0, LAYERS])
    with pytest.raises(ValueError, match="out of range"):
        evaluator.evaluate([])
    with pytest.raises(ValueError, match="optimizer"):
        search(evaluator, optimizer="annealing", progress=False)


# --------------------------------------------------------------------------- search and plans


def test_greedy_search_gives_a_lossless_plan_that_round_trips(model, evaluator, prompts):
    candidates = search(evaluator, optimizer="greedy", budget=14, progress=False)
    assert 0 < len(candidates) <= len(evaluator.results) and len(evaluator.results) <= 14 + 1
    assert [c.speedup for c in candidates] == sorted((c.speedup for c in candidates), reverse=True)
    early_exits = [c for c in candidates if c.source == "early exit"]
    assert sorted(len(c.layers) for c in early_exits) == list(range(1, LAYERS))
    for candidate in (candidates[0], *[c for c in candidates if not c.is_early_exit][:1]):
        plan = candidate.plan(name="tuned")
        again = DraftPlan.from_json(plan.to_json())
        assert again == plan
        spec = selfspec.wrap(model, plan=again)
        for prompt in prompts[:2]:
            ids = torch.tensor([prompt])
            expected = model.generate(ids, max_new_tokens=20, do_sample=False)
            assert torch.equal(spec.generate(ids, max_new_tokens=20, do_sample=False), expected)


def test_random_search_keeps_the_first_and_last_layer(evaluator):
    candidates = search(evaluator, optimizer="random", budget=20, seed=1, progress=False)
    for c in candidates:
        assert c.is_early_exit or (c.layers[0] == 0 and c.layers[-1] == LAYERS - 1)


@pytest.mark.parametrize("sampler", ["tpe", "nsga2"])
def test_optuna_search(model, calibration, sampler):
    pytest.importorskip("optuna")
    evaluator = ProxyEvaluator(model, calibration, COSTS)
    candidates = search(evaluator, optimizer="optuna", optuna_sampler=sampler, budget=10, progress=False)
    assert len(evaluator.results) <= 10
    assert any(c.source == f"optuna-{sampler}" for c in candidates)


def test_missing_optuna_says_how_to_install(evaluator, monkeypatch):
    monkeypatch.setitem(sys.modules, "optuna", None)
    with pytest.raises(ModuleNotFoundError, match="pip install"):
        search(evaluator, optimizer="optuna", budget=3, progress=False)


def _candidate(layers, alpha, cost):
    sim = Simulation()
    return Candidate(tuple(layers), LAYERS, alpha, cost, 0, Policy(1), sim, 1.0, 1)


def test_pareto_front():
    a, b = _candidate([0], 0.2, 0.3), _candidate([0, 1], 0.5, 0.4)
    c, d = _candidate([0, 5], 0.4, 0.5), _candidate([0, 1, 5], 0.7, 0.6)  # c is dominated by b
    assert pareto_front([d, c, b, a]) == [a, b, d]


# --------------------------------------------------------------------------- the whole run


def test_tune_end_to_end(model, prompts, tmp_path):
    result = tune(
        model,
        prompts=prompts[:3],
        heldout=prompts[3:],
        max_new_tokens=12,
        budget=12,
        confirm=2,
        proxy_check=3,
        proxy_check_prompts=2,
        cost_repeats=2,
        max_draft_length=4,
        trees=(0, 6),
        recycle=True,
        progress=False,
    )
    assert result.best_plan.drafts and result.best is not None
    assert result.best_plan.policy == "cost" and not set(result.best_plan.to_dict()) & set(ignored_fields(
        result.best_plan))  # written for the default policy, no inert field
    assert all(c.plan.policy == "cost" for c in result.confirmations if c.candidate is not None)
    labels = [c.label for c in result.confirmations]
    assert labels[0] == "plain" and "#1" in labels and "default" in labels
    variants = {c.label: c for c in result.confirmations if c.label.startswith("#1+")}
    assert set(variants) == {"#1+ngram", "#1+ngram+tree6", "#1+ngram+tree6+recycle"}  # tree budgets, recycling
    assert variants["#1+ngram+tree6"].plan.tree == 6 and variants["#1+ngram"].plan.ngram == 3
    assert variants["#1+ngram+tree6+recycle"].plan.recycle and not variants["#1+ngram+tree6"].plan.recycle
    assert all(v.candidate is result.confirmations[labels.index("#1")].candidate for v in variants.values())
    assert all(c.lossless for c in result.confirmations)  # float64: token-identical to the plain path
    assert result.confirmations[0].speedup == pytest.approx(1.0)
    assert len(result.proxy_check.rows) >= 2
    assert result.front and result.front[0].draft_cost <= result.front[-1].draft_cost
    table = result.table()
    assert "| plain" in table and "Pareto front" in table
    result.save(tmp_path / "report.json")
    report = json.loads((tmp_path / "report.json").read_text())
    assert DraftPlan.from_dict(report["best_plan"]) == result.best_plan
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not result.plot(tmp_path / "front.png")  # no matplotlib: no plot, no error
    else:
        assert result.plot(tmp_path / "front.png") and (tmp_path / "front.png").stat().st_size > 0


def test_adapter_entry_is_a_tuned_plan_the_adapter_reads(model):
    plan = DraftPlan(layers=(0, 2, 5), draft_length=3, name="tiny-tuned")
    entry = adapter_entry(plan, model.config, command="selfspec tune tiny --budget 12")
    tuned = tomllib.loads(entry)["tuned_plans"]
    adapter = dataclasses.replace(adapter_for(model), tuned_plans=tuple(tuned))
    assert adapter.plan_for(model.config) == plan


def test_cli_arguments_and_command():
    parser = add_tune_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["smollm2-135m-instruct", "--dtype", "bfloat16", "--budget", "300", "--skip-ends"])
    assert (args.optimizer, args.confirm, args.prompts, args.max_new_tokens) == ("greedy", 3, 10, 48)
    assert format_command(args) == "selfspec tune smollm2-135m-instruct --dtype bfloat16 --budget 300 --skip-ends"
    with_trees = parser.parse_args(["m", "--trees", "0,8,16"])
    assert with_trees.trees == (0, 8, 16) and format_command(with_trees) == "selfspec tune m --trees 0,8,16"
    for bad in ("x", "8,99", ""):
        with pytest.raises(SystemExit):
            parser.parse_args(["m", "--trees", bad])
    recycled = parser.parse_args(["m", "--trees", "0,16", "--recycle"])
    assert tune_config(recycled).recycle and format_command(recycled) == "selfspec tune m --trees 0,16 --recycle"
    with pytest.raises(ValueError, match="needs a tree budget"):
        tune_config(parser.parse_args(["m", "--recycle"]))
