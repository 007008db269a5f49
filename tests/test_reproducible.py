"""Reproducible greedy output (issue 44, item 3): the same input gives the same drafts and text on every call.

- By default (`wrap(reproducible=True)`) a greedy call decides its drafts
  from its tokens and a cost table fixed for the wrapper: rounds timed at
  random change nothing, repeated calls draft the same lengths round by
  round in bfloat16, and a second wrapper (another process) reading the
  cached table decides alike. `reproducible=False` refines the table from
  the timings and learns across calls, so the same calls draft otherwise.
- A reproducible generation leaves the cached tables as measured; a
  refining one writes its refinement beside them; `measure_costs(cached=False)`
  replaces them.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

import selfspec
from selfspec import cost_tables, output
from selfspec.rounds import RoundClock
from selfspec.costs import PassCosts
from selfspec.stats import GenerationStats
from selfspec.testing import random_prompt, tiny_model

PLANS = [
    selfspec.DraftPlan(ngram=2, layers=[0, 2, 4], draft_length=6),
    selfspec.DraftPlan(ngram=3, layers=[0, 1, 5], draft_length=4, tree=8, recycle=True),
    selfspec.DraftPlan(ngram=1, exit_layer=3, draft_length=6, adaptive=True, policy="fixed"),
]
PLAN_IDS = ["cost", "recycle", "fixed-adaptive"]


def fake_measurement(runner_for, draft_step, *, num_layers, max_width, draft_only=False, **_) -> PassCosts:
    """A measurement that gives the same table every time: a nearly flat verify, a cheap draft step."""
    if draft_only:
        return PassCosts((1e-3,), 2e-4, num_layers)
    return PassCosts(tuple(1e-3 * (1 + 0.05 * (q - 1)) for q in range(1, max_width + 1)), 0.0, num_layers)


@pytest.fixture
def jittered(monkeypatch, tmp_path):
    """Cost tables measured (deterministically) into an empty cache; every round timed at random; and each
    round's (drafted, accepted, source) recorded in `rounds`."""
    monkeypatch.setenv("SELFSPEC_COSTS_CACHE", str(tmp_path))
    monkeypatch.setattr(cost_tables, "measure_pass_costs", fake_measurement)
    jitter = random.Random(0)
    monkeypatch.setattr(output.Clock, "lap", lambda self: jitter.choice([1e-5, 1e-4, 1e-3, 1e-2, 1e-1]))  # batches
    monkeypatch.setattr(RoundClock, "seconds", lambda self, begin, end: jitter.choice([1e-5, 1e-4, 1e-3, 1e-2, 1e-1]))
    rounds: list[tuple] = []
    record = GenerationStats.record_round

    def recording(self, **kwargs):
        rounds.append((kwargs["drafted"], kwargs["accepted"], kwargs.get("source", "layers")))
        return record(self, **kwargs)

    monkeypatch.setattr(GenerationStats, "record_round", recording)
    return rounds


def calls(spec, prompt, rounds: list[tuple], n: int = 4) -> list[tuple]:
    """`n` greedy calls: each one's tokens, its rounds, and its stats without the times."""
    out = []
    for _ in range(n):
        rounds.clear()
        tokens = spec.generate(prompt, max_new_tokens=48)[0].tolist()
        stats = {k: v for k, v in dataclasses.asdict(spec.last_stats).items() if not k.endswith("seconds")}
        stats["costs"] = stats["costs"].split("[")[0]  # the table's values, not whether it was measured or read
        out.append((tokens, list(rounds), stats))
    return out


def prompt_for(seed: int) -> torch.Tensor:
    return random_prompt(10, seed=seed).repeat(1, 3)  # repeats: n-gram proposals, some right, some wrong


@pytest.mark.parametrize("plan", PLANS, ids=PLAN_IDS)
def test_greedy_calls_repeat_their_drafts_whatever_the_timings(plan, jittered):
    model = tiny_model("llama", torch.bfloat16)
    prompt = prompt_for(3)
    spec = selfspec.wrap(model, plan=plan)
    assert spec.reproducible
    runs = calls(spec, prompt, jittered)
    assert sum(drafted for _, rounds, _ in runs for drafted, _, _ in rounds) > 0  # it drafted
    for tokens, rounds, stats in runs[1:]:
        assert tokens == runs[0][0] and rounds == runs[0][1] and stats == runs[0][2]
    # Another wrapper (as another process would) reads the cached table and decides alike.
    assert calls(selfspec.wrap(model, plan=plan), prompt, jittered, n=1)[0] == runs[0]
    # Traded back: the table refined from the (random) timings, the estimates carried across calls: the same
    # calls draft otherwise.
    learning = calls(selfspec.wrap(model, plan=plan, reproducible=False), prompt, jittered)
    assert len({repr(rounds) for _, rounds, _ in learning}) > 1


def test_a_batch_repeats_its_drafts_whatever_the_timings(jittered):
    model = tiny_model("llama", torch.bfloat16)
    spec = selfspec.wrap(model, plan=PLANS[0])
    prompts = torch.cat([prompt_for(3), prompt_for(4)])
    runs = []
    for _ in range(3):
        out = spec.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=32)
        rows = [(r.drafted, r.accepted, r.verify_passes) for r in spec.last_stats.row_stats]
        runs.append((out.tolist(), rows))
    assert runs[1] == runs[0] and runs[2] == runs[0]


def test_a_reproducible_generation_leaves_the_cached_tables_as_measured(tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_COSTS_CACHE", str(tmp_path))
    model = tiny_model("llama", torch.float32)
    plan = PLANS[0]
    measured = selfspec.wrap(model, plan=plan).costs
    files = {path.name: path.read_text() for path in tmp_path.glob("*.json")}
    assert len(files) == 2  # the passes, the plan's draft step
    monkeypatch.setattr(RoundClock, "seconds", lambda self, begin, end: 0.5)  # every round far slower than
    # the table says
    spec = selfspec.wrap(model, plan=plan)
    for _ in range(2):
        spec.generate(prompt_for(1), max_new_tokens=24)
    assert {path.name: path.read_text() for path in tmp_path.glob("*.json")} == files
    # A refining wrapper writes what its rounds measured beside the measured tables, not over them ...
    refining = selfspec.wrap(model, plan=plan, reproducible=False)
    refining.generate(prompt_for(1), max_new_tokens=24)
    now = {path.name: path.read_text() for path in tmp_path.glob("*.json")}
    assert len(now) == 4 and all(now[name] == text for name, text in files.items())
    # ... where the next refining wrapper starts, while a reproducible one reads the table as measured.
    assert selfspec.wrap(model, plan=plan, reproducible=False).costs.step > 10 * measured.step
    assert selfspec.wrap(model, plan=plan).costs.verify == measured.verify


def test_measuring_afresh_replaces_the_cached_tables(tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_COSTS_CACHE", str(tmp_path))
    model = tiny_model("llama", torch.float32)
    plan = PLANS[0]
    spec = selfspec.wrap(model, plan=plan)
    before = spec.costs
    monkeypatch.setattr(RoundClock, "seconds", lambda self, begin, end: 0.5)
    selfspec.wrap(model, plan=plan, reproducible=False).generate(prompt_for(1), max_new_tokens=12)
    assert len(list(tmp_path.glob("*.json"))) == 4  # measured and refined
    monkeypatch.setattr(cost_tables, "measure_pass_costs", fake_measurement)
    fresh = spec.measure_costs(cached=False)
    assert fresh.verify != before.verify and fresh.source == "measured"
    assert spec.costs.verify == fresh.verify  # this wrapper decides with the new table from now on ...
    assert selfspec.wrap(model, plan=plan).costs.verify == fresh.verify  # ... and so does the next process
    assert len(list(tmp_path.glob("*.json"))) == 2  # the refinements of the old table are gone
    assert selfspec.wrap(model, plan=plan, reproducible=False).costs.verify == fresh.verify


def test_reproducible_is_a_bool():
    with pytest.raises(ValueError, match="reproducible must be True or False, got 'yes'"):
        selfspec.wrap(tiny_model("llama", torch.float32), reproducible="yes")
