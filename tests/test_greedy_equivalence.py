"""Greedy self-speculative output equals `model.generate(do_sample=False)`, token for token.

Property-based over plans (random layer subsets, every exit layer, draft
lengths 1..10, fixed and adaptive), prompts, `max_new_tokens` and EOS tokens
chosen so that they land inside a draft, and the step (eager or static);
for every architecture in `selfspec.testing.TINY_CONFIGS`, in float64 and
float32.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import LogitsProcessorList, NoRepeatNGramLogitsProcessor, StoppingCriteria, StoppingCriteriaList

import selfspec
from plan_strategies import assert_same, plans
from selfspec.testing import TINY_CONFIGS, random_prompt, tiny_model

ARCHS = sorted(TINY_CONFIGS)
DTYPES = [torch.float64, torch.float32]


def reference(model, prompt, **kwargs) -> torch.Tensor:
    return model.generate(prompt, do_sample=False, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("arch", ARCHS)
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_greedy_matches_generate(arch, dtype, data):
    model = tiny_model(arch, dtype)
    num_layers = model.config.get_text_config().num_hidden_layers
    plan = data.draw(plans(num_layers), label="plan")
    prompt = random_prompt(data.draw(st.integers(1, 24), label="prompt length"), seed=data.draw(st.integers(0, 999)))
    max_new = data.draw(st.integers(1, 40), label="max_new_tokens")
    step = data.draw(st.sampled_from(["eager", "static"]), label="step")  # how passes run (static.py)
    spec = selfspec.wrap(model, plan=plan, step=step)
    ref = reference(model, prompt, max_new_tokens=max_new)
    assert_same(spec.generate(prompt, max_new_tokens=max_new), ref, plan)

    # An EOS token taken from the reference output, so generation stops mid-stream (often inside a draft).
    new = ref[0, prompt.shape[1] :].tolist()
    eos = new[data.draw(st.integers(0, len(new) - 1), label="eos index")]
    ref_eos = reference(model, prompt, max_new_tokens=max_new, eos_token_id=eos)
    assert_same(spec.generate(prompt, max_new_tokens=max_new, eos_token_id=eos), ref_eos, plan)
    stats = spec.last_stats
    assert stats.new_tokens == ref_eos.shape[1] - prompt.shape[1]
    assert 1.0 <= stats.tokens_per_pass <= plan.draft_length + 1


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("exit_layer", range(1, 7))
def test_every_exit_layer(arch, exit_layer):
    model = tiny_model(arch)
    prompt = random_prompt(9, seed=exit_layer)
    for k in (1, 4, 10):
        plan = selfspec.DraftPlan(exit_layer=exit_layer, draft_length=k, policy="fixed")
        out = selfspec.wrap(model, plan=plan).generate(prompt, max_new_tokens=33)
        assert_same(out, reference(model, prompt, max_new_tokens=33), plan)


def test_full_depth_draft_accepts_everything():
    """A 'draft' that runs every layer is the target itself: every drafted token is accepted."""
    model = tiny_model("llama")
    spec = selfspec.wrap(model, plan=selfspec.DraftPlan(exit_layer=6, draft_length=5, policy="fixed"))
    out = spec.generate(random_prompt(5), max_new_tokens=31)
    assert_same(out, reference(model, random_prompt(5), max_new_tokens=31), spec.plan)
    assert spec.last_stats.acceptance_rate == 1.0
    assert spec.last_stats.tokens_per_pass == pytest.approx(31 / 6)  # prefill + 5 rounds of 6 tokens
    # ... and it reads what plain decoding reads: per round 5 draft steps, then the last one's tail, each a step
    assert spec.last_stats.steps_read == pytest.approx(31) and spec.last_stats.tokens_per_step_read == 1.0


@pytest.mark.parametrize("step", ["eager", "static"])
def test_plain_path_is_one_token_per_pass_and_reads_one_step_per_token(step):
    model = tiny_model("llama")
    spec = selfspec.wrap(model, plan=selfspec.DraftPlan.plain(), step=step)
    prompt = random_prompt(6)
    for _ in range(2):  # the count starts afresh with each generation
        assert_same(spec.generate(prompt, max_new_tokens=20), reference(model, prompt, max_new_tokens=20), spec.plan)
        stats = spec.last_stats
        assert stats.tokens_per_pass == 1.0 and stats.drafted == 0
        assert stats.steps_read == pytest.approx(20) and stats.tokens_per_step_read == pytest.approx(1.0)
        assert "20.0 plain steps, 1.00 tokens per step read" in str(stats)


def test_a_shallow_draft_reads_less_than_plain_per_token_when_it_is_accepted():
    """An early exit at half depth that the target always accepts (its later layers zeroed: they add nothing)
    reads about half a step per drafted token: more tokens per step read than plain decoding."""
    model = tiny_model("llama")
    for layer in model.model.layers[3:]:
        for linear in (layer.self_attn.o_proj, layer.mlp.down_proj):
            torch.nn.init.zeros_(linear.weight)
    spec = selfspec.wrap(model, plan=selfspec.DraftPlan(exit_layer=3, draft_length=4, policy="fixed"))
    prompt = random_prompt(6)
    assert_same(spec.generate(prompt, max_new_tokens=21), reference(model, prompt, max_new_tokens=21), spec.plan)
    stats = spec.last_stats
    assert stats.acceptance_rate == 1.0 and stats.tokens_per_pass == pytest.approx(21 / 5)
    assert 1.4 < stats.tokens_per_step_read < stats.tokens_per_pass


class StopAfterToken(StoppingCriteria):
    def __init__(self, token: int) -> None:
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


@pytest.mark.parametrize("arch", ARCHS)
def test_stopping_criterion_inside_a_draft(arch):
    model = tiny_model(arch)
    prompt = random_prompt(8, seed=3)
    new = reference(model, prompt, max_new_tokens=30)[0, 8:].tolist()
    for stop_at in (new[2], new[7], new[15]):
        criteria = StoppingCriteriaList([StopAfterToken(stop_at)])
        ref = reference(model, prompt, max_new_tokens=30, stopping_criteria=criteria)
        for plan in (selfspec.DraftPlan(exit_layer=5, draft_length=8, policy="fixed"), selfspec.DraftPlan(layers=[0, 2, 3, 5])):
            out = selfspec.wrap(model, plan=plan).generate(prompt, max_new_tokens=30, stopping_criteria=criteria)
            assert_same(out, ref, plan)


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_processor_and_repetition_penalty(arch):
    model = tiny_model(arch)
    prompt = random_prompt(10, seed=4)
    processors = LogitsProcessorList([NoRepeatNGramLogitsProcessor(2)])
    for plan in (selfspec.DraftPlan(exit_layer=4, draft_length=6), selfspec.DraftPlan(layers=[0, 1, 4, 5], adaptive=True, policy="fixed")):
        spec = selfspec.wrap(model, plan=plan)
        ref = reference(model, prompt, max_new_tokens=30, logits_processor=processors)
        assert_same(spec.generate(prompt, max_new_tokens=30, logits_processor=processors), ref, plan)
        ref = reference(model, prompt, max_new_tokens=30, repetition_penalty=1.5)
        assert_same(spec.generate(prompt, max_new_tokens=30, repetition_penalty=1.5), ref, plan)
        # min_new_tokens keeps an early EOS out (a processor built from the generation config)
        eos = reference(model, prompt, max_new_tokens=30)[0, 12].item()
        options = dict(max_new_tokens=30, min_new_tokens=20, eos_token_id=eos)
        ref = reference(model, prompt, **options)
        assert ref.shape[1] - prompt.shape[1] >= 20
        assert_same(spec.generate(prompt, **options), ref, plan)


def test_streamer_gets_prompt_then_one_put_per_accepted_chunk():
    model = tiny_model("llama")
    prompt = random_prompt(4)

    class Recorder:
        def __init__(self):
            self.puts, self.ended = [], False

        def put(self, value):
            self.puts.append(value.tolist())

        def end(self):
            self.ended = True

    rec = Recorder()
    spec = selfspec.wrap(model, plan=selfspec.DraftPlan(exit_layer=5, draft_length=4, policy="fixed"))
    out = spec.generate(prompt, max_new_tokens=25, streamer=rec)
    assert rec.puts[0] == prompt.tolist() and rec.ended
    streamed = [t for chunk in rec.puts[1:] for t in chunk]
    assert streamed == out[0, 4:].tolist()
    assert len(rec.puts) - 1 == spec.last_stats.verify_passes  # prefill + one put per round
