"""Feature-head training (`training/feature_distill.py`): the unrolled steps are the engine's draft steps, and it learns."""

from __future__ import annotations

import pytest
import torch

from selfspec.draft import Drafter
from selfspec.feature_head import FeatureHead
from selfspec.passes import TargetPasses
from selfspec.plan import DraftPlan
from selfspec.registry import model_parts
from selfspec.runner import LayerRunner
from selfspec.testing import random_prompt, tiny_model
from selfspec.training.feature_distill import (agreement, answer_start, state_scale, target_states, train_features,
                                              unroll_mask, unrolled_states)


def test_unroll_mask_is_a_draft_chains_view():
    mask = unroll_mask(5, 2, None)  # step 2: query t sees step 0 up to t - 2, step 1 at t - 1, step 2 at t
    assert mask.shape == (5, 15)
    assert mask[4, :5].tolist() == [True, True, True, False, False]
    assert mask[4, 5:10].tolist() == [False, False, False, True, False]
    assert mask[4, 10:].tolist() == [False, False, False, False, True]
    assert unroll_mask(5, 0, 2)[4].tolist() == [False, False, False, True, True]


@pytest.mark.parametrize("arch, layout", [("llama", "joined"), ("gemma3_text", "joined"), ("gpt2", "joined"),
                                          ("qwen3", "joined"), ("llama", "eagle3"), ("qwen3", "eagle3")])
def test_unrolled_steps_equal_the_engines_draft_steps(arch, layout):
    """Step j at position s + j is what the engine's draft computes at step j of a round starting at s, the
    drafted tokens being the sequence's own."""
    model = tiny_model(arch)
    parts = model_parts(model)
    head = FeatureHead.from_model(parts, layout=layout)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.1 * torch.randn_like(p))
    tokens = random_prompt(16, seed=2)[0].tolist()
    steps, s = 3, 9
    data = target_states(parts, tokens, head.reads)
    with torch.no_grad():
        unrolled = unrolled_states(head, parts, LayerRunner(parts, capacity=16, head=head), data, steps)
        runner = LayerRunner(parts, capacity=16, head=head)
        TargetPasses(parts.num_layers, exact_prefix=0, head=head).prefill(runner, tokens[:s])
        drafter = Drafter(DraftPlan(head="h.json", draft_length=steps), parts.num_layers, head=head)
        for j in range(steps):
            drafter.step(runner, tokens[s + j], s + j)
            torch.testing.assert_close(runner.draft_feature[0, 0], unrolled[j][0, s + j], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("layout", ["joined", "eagle3"])
def test_training_lowers_the_loss_and_reports_agreement_per_position(layout):
    model = tiny_model("llama", torch.float32)
    parts = model_parts(model)
    head = FeatureHead.from_model(parts, layout=layout).requires_grad_(True).train()
    data = [target_states(parts, random_prompt(24, seed=i)[0].tolist(), head.reads) for i in range(6)]
    log = train_features(head, parts, data[1:], data[:1], steps=3, epochs=6, minutes=5, lr=3e-3, positions=16,
                         eval_every=10)
    first, last = sum(log.losses[:5]) / 5, sum(log.losses[-5:]) / 5
    assert last < first, log.losses
    per_position, chain = agreement(head, parts, data[:1], 3)
    assert len(per_position) == 3 and all(0 <= a <= 1 for a in per_position) and 0 <= chain <= 3
    assert log.eval_agreement[-1] == pytest.approx(per_position)


def test_training_over_a_draft_vocabulary_drafts_only_its_tokens():
    """With `ids`, p and q are over those tokens: the head learns to pick among them, and agreement counts a
    target token outside them as a miss."""
    model = tiny_model("llama", torch.float32)
    parts = model_parts(model)
    head = FeatureHead.from_model(parts).requires_grad_(True).train()
    data = [target_states(parts, random_prompt(24, seed=i)[0].tolist(), head.reads) for i in range(6)]
    ids = torch.arange(0, parts.lm_head.weight.shape[0], 2)  # [K]: the even tokens
    log = train_features(head, parts, data[1:], data[:1], steps=2, epochs=6, minutes=5, lr=3e-3, positions=16,
                         eval_every=10, ids=ids)
    assert sum(log.losses[-5:]) < sum(log.losses[:5]), log.losses
    head.eval()
    target = parts.lm_head(data[0].final_normed).argmax(-1)  # [T]
    odd = (target % 2 == 1).float().mean().item()  # positions no even-token draft can match
    per_position, _ = agreement(head, parts, data[:1], 2, ids)
    assert per_position[0] <= 1 - odd + 1e-6
    never = next(t for t in range(parts.lm_head.weight.shape[0]) if t not in set(target.tolist()))
    none = agreement(head, parts, data[:1], 2, torch.tensor([never]))[0]  # [K=1]: a token the target never picks
    assert none == [0.0, 0.0]


def test_a_new_head_is_scaled_to_the_read_states():
    """`state_scale` is the highest read's median RMS; a head built with it joins f at that size and a tenth of
    the token's embedding."""
    model = tiny_model("llama", torch.float32)
    parts = model_parts(model)
    reads = FeatureHead.from_model(parts).reads
    data = [target_states(parts, random_prompt(12, seed=i)[0].tolist(), reads) for i in range(3)]
    hidden = parts.embed.weight.shape[1]
    rms = torch.cat([d.reads[:, -hidden:] for d in data]).pow(2).mean(-1).sqrt()  # [positions]
    scale = state_scale(data)
    assert scale == pytest.approx(float(rms.median()))
    head = FeatureHead.from_model(parts, reads=reads, scale=scale)
    eye = torch.eye(hidden)
    assert torch.allclose(head.join.weight, scale * torch.cat([0.1 * eye, eye], dim=1))


def test_agreement_is_measured_on_the_answer_positions():
    assert answer_start([1, 2, 3, 4, 5], [4, 5]) == 3
    assert answer_start([1, 2, 3, 4], [3, 4, 9, 9]) == 2  # the sequence was cut short inside the answer
    assert answer_start([1, 2, 3], [1, 2, 3]) == 0  # a piece of a text file: all of it counts
    assert answer_start([1, 2, 3], [7]) == 0  # not there: every position counts
    assert answer_start([1, 2, 3], []) == 3  # an empty answer: none does
    model = tiny_model("llama", torch.float32)
    parts = model_parts(model)
    head = FeatureHead.from_model(parts)
    tokens = random_prompt(20, seed=3)[0].tolist()
    whole = target_states(parts, tokens, head.reads)
    per_position, _ = agreement(head, parts, [whole], 3)
    last_chain = target_states(parts, tokens, head.reads, answer_start=17)  # one chain of 3: from 17
    _, chain = agreement(head, parts, [last_chain], 3)
    assert chain in (0.0, 1.0, 2.0, 3.0)
    none = target_states(parts, tokens, head.reads, answer_start=20)
    assert agreement(head, parts, [none], 3) == ([0.0, 0.0, 0.0], 0.0)
    assert agreement(head, parts, [target_states(parts, tokens, head.reads, answer_start=0)], 3)[0] == per_position
