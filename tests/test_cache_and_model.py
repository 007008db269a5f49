"""The one cache holds exactly the target's entries, and the model is never modified."""

from __future__ import annotations

import pytest
import torch

import selfspec
import selfspec.engine as engine
from selfspec import output
from selfspec.testing import TINY_CONFIGS, random_prompt, tiny_model

ARCHS = sorted(TINY_CONFIGS)
PLANS = [
    selfspec.DraftPlan(exit_layer=3, draft_length=5, policy="fixed"),
    selfspec.DraftPlan(layers=[0, 1, 4], draft_length=4, policy="fixed"),
    selfspec.DraftPlan(layers=[2, 3, 5], draft_length=3, policy="fixed"),  # skips layer 0: no exact prefix
    selfspec.DraftPlan(layers=[0, 2, 3, 5], adaptive=True, draft_length=6, policy="fixed"),
]


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.describe(6))
@pytest.mark.parametrize("arch", ARCHS)
def test_cache_after_every_round_equals_plain_decoding(arch, plan, monkeypatch):
    """After each round: every layer holds one entry per token but the last, equal to the target's."""
    model = tiny_model(arch)
    runners, snapshots = [], []

    class RecordingRunner(engine.LayerRunner):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            runners.append(self)

    original_emit = output.Output.emit

    def emit_and_snapshot(self, chunk):
        original_emit(self, chunk)
        cache = runners[-1].cache
        snapshots.append(
            (len(self.tokens), list(cache.lengths), [tuple(t.clone() for t in cache.entries(i)) for i in range(len(cache.lengths))])
        )

    monkeypatch.setattr(engine, "LayerRunner", RecordingRunner)
    monkeypatch.setattr(output.Output, "emit", emit_and_snapshot)
    prompt = random_prompt(7, seed=11)
    out = selfspec.wrap(model, plan=plan).generate(prompt, max_new_tokens=30)

    # The target's own cache for the whole output, from one plain forward pass.
    reference = model(out, use_cache=True).cache
    rounds = snapshots[1:]  # the first snapshot is the prefill
    assert len(rounds) > 3
    # Eager attention takes its softmax in float32 even in a float64 model: plain decoding itself differs by ~1e-6.
    tol = 1e-9 if model.config._attn_implementation == "sdpa" else 1e-5
    for n_tokens, lengths, entries in rounds:
        if n_tokens == out.shape[1]:
            continue  # the last round may stop on max_new_tokens with drafted entries still in place
        assert lengths == [n_tokens - 1] * len(lengths), "every layer holds all tokens but the last"
        for layer, (keys, values) in enumerate(entries):
            ref_keys = reference.layers[layer].keys[:, :, : n_tokens - 1]
            ref_values = reference.layers[layer].values[:, :, : n_tokens - 1]
            torch.testing.assert_close(keys, ref_keys, rtol=tol, atol=tol)
            torch.testing.assert_close(values, ref_values, rtol=tol, atol=tol)


def model_fingerprint(model):
    hooks = sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules()
    )
    forwards = [type(m).forward for m in model.modules()] + [m.__dict__.get("forward") for m in model.modules()]
    return (
        {k: v.clone() for k, v in model.state_dict().items()},
        model.config.to_json_string(),
        model.generation_config.to_json_string(),
        hooks,
        forwards,
        model.training,
        [p.requires_grad for p in model.parameters()],
    )


def assert_unchanged(model, before):
    after = model_fingerprint(model)
    assert before[0].keys() == after[0].keys()
    for name in before[0]:
        assert torch.equal(before[0][name], after[0][name]), f"parameter {name} changed"
    assert before[1:] == after[1:]


class Boom(Exception):
    pass


@pytest.mark.parametrize("arch", ARCHS)
def test_model_unchanged_by_wrap_generate_and_failures(arch):
    model = tiny_model(arch)
    before = model_fingerprint(model)
    prompt = random_prompt(6)
    spec = selfspec.wrap(model, plan=selfspec.DraftPlan(layers=[0, 1, 3], draft_length=4))
    assert_unchanged(model, before)
    spec.generate(prompt, max_new_tokens=20)
    spec.generate(prompt, max_new_tokens=20, do_sample=True, temperature=0.8)
    assert_unchanged(model, before)

    class ThrowingStreamer:
        calls = 0

        def put(self, value):
            self.calls += 1
            if self.calls == 3:
                raise Boom()

        def end(self):
            pass

    with pytest.raises(Boom):
        spec.generate(prompt, max_new_tokens=20, streamer=ThrowingStreamer())

    def interrupt(input_ids, scores, **kwargs):
        if input_ids.shape[1] > 10:
            raise KeyboardInterrupt
        return torch.zeros(1, dtype=torch.bool)

    with pytest.raises(KeyboardInterrupt):
        spec.generate(prompt, max_new_tokens=20, stopping_criteria=[interrupt])
    assert_unchanged(model, before)
    # And the wrapper still works after the failures.
    ref = model.generate(prompt, max_new_tokens=15, do_sample=False)
    assert torch.equal(spec.generate(prompt, max_new_tokens=15), ref)
