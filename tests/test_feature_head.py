"""Feature heads (`feature_head.py`): drafts from the target's own states, lossless on every family and path.

A random head drafts poorly, which is what these tests want: every rejected
draft exercises the roll back and the rewrite of the head's entries. The
head's cache after a generation must equal what the head computes from the
target's states of the whole output in one pass (the same inputs training
uses), so no entry the draft wrote from a predicted state survives.
"""

from __future__ import annotations

import json

import pytest
import torch

import selfspec
from plan_strategies import assert_same
from selfspec.feature_head import FeatureHead, default_reads, load_feature_head
from selfspec.registry import model_parts
from selfspec.runner import LayerRunner
from selfspec.testing import TINY_CONFIGS, make_feature_head, make_vocab, random_prompt, tiny_model

ARCHS = sorted(TINY_CONFIGS)


def plans(head: str, vocab: str) -> list[selfspec.DraftPlan]:
    return [
        selfspec.DraftPlan(head=head, draft_length=4, policy="fixed"),
        selfspec.DraftPlan(head=head, draft_length=3, ngram=2, policy="fixed"),
        selfspec.DraftPlan(head=head, draft_vocab=vocab, draft_vocab_size=20, draft_length=4, policy="fixed"),
        selfspec.DraftPlan(head=head, tree=8, draft_length=4, policy="fixed"),
        selfspec.DraftPlan(head=head, draft_length=5),  # the cost policy
    ]


@pytest.mark.parametrize("arch", ARCHS)
def test_feature_head_greedy_matches_generate(arch, tmp_path):
    model = tiny_model(arch)
    head = str(make_feature_head(model, tmp_path / "head"))
    vocab = str(make_vocab(model, tmp_path / "vocab"))
    drafted = 0
    for seed, plan in enumerate(plans(head, vocab)):
        prompt = random_prompt(6 + 3 * seed, seed=seed)
        spec = selfspec.wrap(model, plan=plan, costs="flat")
        for max_new in (1, 27):
            out = spec.generate(prompt, max_new_tokens=max_new)
            assert_same(out, model.generate(prompt, do_sample=False, max_new_tokens=max_new), plan)
            drafted += spec.last_stats.layer_drafted
    assert drafted > 0


@pytest.mark.parametrize("step", ["eager", "static"])
@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "gpt2"])
def test_the_heads_cache_holds_what_the_targets_states_give(arch, step, tmp_path):
    """Every head entry equals the head run over (f at p - 1, token p) of the final sequence in one pass."""
    model = tiny_model(arch)
    path = make_feature_head(model, tmp_path / "head", noise=0.2)
    plan = selfspec.DraftPlan(head=str(path), draft_length=4, policy="fixed")
    spec = selfspec.wrap(model, plan=plan, step=step)
    runners = []
    make = spec.runner_for
    spec.runner_for = lambda capacity, keep=True: runners.append(make(capacity, keep=keep)) or runners[-1]
    prompt = random_prompt(9, seed=4)
    out = spec.generate(prompt, max_new_tokens=30)
    assert spec.last_stats.layer_drafted > spec.last_stats.layer_accepted  # rejected drafts were rolled back
    runner, head = runners[-1], spec.head
    length = runner.cache.lengths[head.slot]
    assert length == out.shape[1] - 1  # every token but the last emitted one

    parts = model_parts(model)
    fresh = LayerRunner(parts, capacity=length, head=head)
    tokens = out[0, :length].tolist()
    _, features = spec.passes.run_reading(fresh, fresh.embed(tokens, 0), 0)
    before = torch.cat([torch.zeros_like(features[:, :1]), features[:, :-1]], dim=1)
    fresh.run(head.inputs(fresh.embed(tokens, 0), before), [head.slot], 0)
    keys, _ = runner.cache.entries(head.slot)
    expected, _ = fresh.cache.entries(head.slot)
    torch.testing.assert_close(keys[..., :length, :], expected[..., :length, :], rtol=1e-4, atol=1e-5)


def test_a_saved_head_loads_back_and_refuses_bad_input(tmp_path):
    model = tiny_model("llama")
    n = model.config.num_hidden_layers
    path = make_feature_head(model, tmp_path / "head", reads=(1, 4))
    head = load_feature_head(path, model=model, parts=model_parts(model))
    assert isinstance(head, FeatureHead) and head.reads == (1, 4) and head.slot == n
    with pytest.raises(ValueError, match="drafts without the target's layers: drop exit_layer"):
        selfspec.wrap(model, plan=selfspec.DraftPlan(exit_layer=2, head=str(path)))
    with pytest.raises(ValueError, match="a feature head takes neither"):
        selfspec.DraftPlan(layers=[0, 1], head=str(path))
    other = tiny_model("qwen2")
    with pytest.raises(ValueError, match="another model|made for|model"):
        selfspec.wrap(other, plan=selfspec.DraftPlan(head=str(path)))
    manifest = json.loads(path.read_text())
    unnormed = {k: v for k, v in manifest.items() if k != "inputs"}  # a head from before inputs were normalised
    path.write_text(json.dumps(unnormed))
    with pytest.raises(ValueError, match="trained by an older selfspec.*train it again"):
        selfspec.wrap(model, plan=selfspec.DraftPlan(head=str(path)))
    manifest["reads"] = [1, n + 3]
    path.write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"reads=\[1, 9\] out of range"):
        selfspec.wrap(model, plan=selfspec.DraftPlan(head=str(path)))
    with pytest.raises(ValueError, match="must be increasing layer indices"):
        FeatureHead.from_model(model_parts(model), reads=(3, 1))


def test_default_reads_are_a_low_a_middle_and_a_high_layer():
    assert default_reads(30) == (2, 15, 27)
    assert default_reads(18) == (2, 9, 15)
    assert default_reads(2) == (0, 1)
