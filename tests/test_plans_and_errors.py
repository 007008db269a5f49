"""Plans are frozen, serialisable data; bad input gets a clear ValueError naming value and range."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re

import pytest
import torch
import transformers

import selfspec
from selfspec.generic import GENERIC
from selfspec.plan import ignored_fields
from selfspec.registry import all_adapters
from selfspec.testing import random_prompt, tiny_model


def test_plan_round_trips_through_json(tmp_path):
    plans = [
        selfspec.DraftPlan(exit_layer=8),
        selfspec.DraftPlan(layers=[0, 1, 2, 5, 9, 29], draft_length=7, adaptive=True, threshold=0.3, name="x",
                           policy="fixed"),
        selfspec.DraftPlan(layers=[0, 3], draft_length=5, target_acceptance=0.6, ngram=2),  # cost: fields left out
        selfspec.DraftPlan.plain(),
    ]
    for i, plan in enumerate(plans):
        path = tmp_path / f"plan{i}.json"
        plan.save(path)
        assert selfspec.DraftPlan.load(path) == plan
        assert selfspec.DraftPlan.from_json(plan.to_json()) == plan
    assert hash(plans[0]) == hash(selfspec.DraftPlan(exit_layer=8))
    with pytest.raises(dataclasses.FrozenInstanceError):
        plans[0].exit_layer = 3


def test_wrap_takes_a_saved_plan(tmp_path):
    model = tiny_model("llama")
    plan = selfspec.DraftPlan(layers=[0, 2, 4], draft_length=3)
    plan.save(tmp_path / "plan.json")
    spec = selfspec.wrap(model, plan=str(tmp_path / "plan.json"))
    assert spec.plan == plan
    assert selfspec.wrap(model, plan=plan.to_dict()).plan == plan


def test_default_plan_comes_from_the_adapter():
    model = tiny_model("llama")
    spec = selfspec.wrap(model)
    assert spec.plan.drafts
    assert spec.plan.draft_layers(6)  # a valid, non-empty plan for this model


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(layers=[]), "empty plan"),
        (dict(), "empty plan"),
        (dict(layers=[0, 2, 2]), "duplicate layers"),
        (dict(layers=[3, 1]), "increasing order"),
        (dict(layers=[-1, 2]), "out of range"),
        (dict(exit_layer=0), r"exit_layer=0 out of range \(valid: >= 1\)"),
        (dict(exit_layer=2, layers=[0, 1]), "not both"),
        (dict(exit_layer=2, draft_length=-1), r"draft_length=-1 out of range \(valid: 0..64\)"),
        (dict(exit_layer=2, threshold=1.5), r"threshold=1.5 out of range \(valid: 0.0..1.0\)"),
    ],
)
def test_bad_plans(kwargs, message):
    with pytest.raises(ValueError, match=message):
        selfspec.DraftPlan(**kwargs)


@pytest.mark.parametrize(
    "kwargs, field, policy",
    [
        (dict(exit_layer=2, adaptive=True), "adaptive=True", "policy='cost'"),
        (dict(exit_layer=2, threshold=0.4), "threshold=0.4", "policy='cost'"),
        (dict(layers=[0, 2], threshold_step=0.0), "threshold_step=0.0", "policy='cost'"),
        (dict(exit_layer=2, policy="fixed", threshold=0.7), "threshold=0.7", "policy='fixed' with adaptive=False"),
        (dict(exit_layer=2, policy="fixed", target_acceptance=0.6), "target_acceptance=0.6",
         "policy='fixed' with adaptive=False"),
    ],
)
def test_a_field_the_policy_ignores_is_refused(kwargs, field, policy, tmp_path):
    """One clear error naming the field, the policy that ignores it and what to do; from files too."""
    message = f"{field} does nothing under {policy}: .* Drop "
    with pytest.raises(ValueError, match=message):
        selfspec.DraftPlan(**kwargs)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"format": "selfspec.plan/1", **kwargs}))
    with pytest.raises(ValueError, match=f"plan file {re.escape(str(path))}: {message}"):
        selfspec.DraftPlan.load(path)


def test_ignored_fields_at_their_defaults_load_and_are_left_out():
    """Plans saved before the check wrote every field at its default: they still load, and save without them."""
    old = {"format": "selfspec.plan/1", "exit_layer": 2, "adaptive": False, "threshold": 0.5,
           "threshold_step": 0.05, "target_acceptance": 0.8, "policy": "cost"}
    plan = selfspec.DraftPlan.from_dict(old)
    assert plan == selfspec.DraftPlan(exit_layer=2)
    assert not {"adaptive", "threshold", "threshold_step"} & set(plan.to_dict())
    assert ignored_fields(plan) == ("adaptive", "threshold", "threshold_step")
    fixed = selfspec.DraftPlan(exit_layer=2, policy="fixed", adaptive=True, threshold=0.3)
    assert ignored_fields(fixed) == () and fixed.to_dict()["threshold"] == 0.3
    assert ignored_fields(selfspec.DraftPlan(ngram=2, tree=8, recycle=True, policy="fixed")) == (
        "threshold", "threshold_step")  # fixed k still prices an n-gram proposal's recycled nodes by it
    assert ignored_fields(selfspec.DraftPlan.plain()) == ()  # plain decoding runs no policy


def test_every_adapter_plan_loads_under_its_policy_with_no_ignored_field():
    """The adapters' default (rule) and tuned plans, the generic adapter's and the shipped plan files."""
    model = tiny_model("llama")
    for adapter in [*all_adapters(), GENERIC]:
        assert not set(adapter.default_plan) & {"adaptive", "threshold", "threshold_step", "target_acceptance"}
        rule = adapter.rule_plan(model.config)
        assert rule.drafts and not _set_ignored(dict(adapter.default_plan), rule)
        for tuned in adapter.tuned_plans:
            fields = {k: v for k, v in tuned.items() if k not in ("match", "command")}
            assert not _set_ignored(fields, selfspec.DraftPlan.from_dict(fields)), (adapter.name, fields)
    root = pathlib.Path(__file__).resolve().parents[1]
    files = [*root.glob("examples/plans/*.json"), *root.glob("examples/heads/*.plan.json"),
             *root.glob("benchmarks/plans/*.json")]
    assert len(files) >= 20
    for path in files:
        fields = json.loads(path.read_text())
        assert not _set_ignored(fields, selfspec.DraftPlan.load(path)), path.name


def _set_ignored(fields: dict, plan: selfspec.DraftPlan) -> set[str]:
    """The fields `fields` names that the policy running `plan` ignores."""
    return set(fields) & set(ignored_fields(plan))


def test_plan_checked_against_the_model():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=r"layer index 6 out of range: this model has 6 layers \(valid: 0..5\)"):
        selfspec.wrap(model, plan=selfspec.DraftPlan(layers=[0, 6]))
    with pytest.raises(ValueError, match=r"exit_layer=7 out of range: this model has 6 layers \(valid: 1..6\)"):
        selfspec.wrap(model, plan=selfspec.DraftPlan(exit_layer=7))
    with pytest.raises(ValueError, match="unknown plan field"):
        selfspec.wrap(model, plan={"layers": [0], "speed": "fast"})


def test_bad_generate_arguments():
    model = tiny_model("llama")
    spec = selfspec.wrap(model, plan=selfspec.DraftPlan(exit_layer=2))
    prompt = random_prompt(5)
    with pytest.raises(ValueError, match=r"max_new_tokens=0 out of range \(valid: >= 1\)"):
        spec.generate(prompt, max_new_tokens=0)
    with pytest.raises(ValueError, match=r"attention_mask row 1 has padding that is not all on the left"):
        spec.generate(prompt.repeat(2, 1), attention_mask=torch.tensor([[1] * 5, [1, 1, 1, 1, 0]]), max_new_tokens=5)
    long_prompt = random_prompt(300)  # the tiny model's context is 256
    with pytest.raises(ValueError, match=r"prompt of 300 tokens is longer than the model's context .*valid prompt length: 1..255"):
        spec.generate(long_prompt, max_new_tokens=5)
    with pytest.raises(ValueError, match=r"valid max_new_tokens: 1..6"):
        spec.generate(random_prompt(250), max_new_tokens=10)
    with pytest.raises(ValueError, match="num_beams=2 is not supported"):
        spec.generate(prompt, max_new_tokens=5, num_beams=2)
    with pytest.raises(ValueError, match="padding"):
        spec.generate(prompt, attention_mask=torch.tensor([[1, 1, 0, 1, 1]]), max_new_tokens=5)


def test_unsupported_architecture_lists_supported_ones_and_how_to_add():
    config = transformers.OPTConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=2, ffn_dim=32, num_attention_heads=2, word_embed_proj_dim=16
    )
    model = transformers.OPTForCausalLM(config)
    with pytest.raises(ValueError) as info:
        selfspec.wrap(model)
    message = str(info.value)
    assert "model_type='opt'" in message
    for adapter in all_adapters():
        for model_type in adapter.model_types:
            assert model_type in message
    assert "adapters/" in message
