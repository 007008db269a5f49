"""Plans are frozen, serialisable data; bad input gets a clear ValueError naming value and range."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

import selfspec
from selfspec.registry import all_adapters
from selfspec.testing import random_prompt, tiny_model


def test_plan_round_trips_through_json(tmp_path):
    plans = [
        selfspec.DraftPlan(exit_layer=8),
        selfspec.DraftPlan(layers=[0, 1, 2, 5, 9, 29], draft_length=7, adaptive=True, threshold=0.3, name="x"),
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
