"""Layer drafts in a batch (`batch_draft.LayerRows`): every row drafts through the plan's layers, one pass a token.

- A 2-row left-padded batch with a fixed plan of three layers drafts layer
  tokens, and each row equals `model.generate` on its prompt alone.
- Every architecture, float64: layer sets, exit heads, draft vocabularies,
  n-gram copies with layers behind them, fixed and cost policies.
- An exit head that is an exact copy of the last layer, at exit N-1, is the
  target: in a batch every layer token must be accepted. That holds only if
  the head's cache row holds the target's entries for every kept token.
- Rows that join and leave mid-session keep drafting and stay exact.
- The measured batch table prices a draft step over the rows.
Sampling over batches with layer drafts and heads is tested in `test_sampling.py`.
"""

from __future__ import annotations

import pytest
import torch

import selfspec
from selfspec.batch_generate import batch_costs
from selfspec.testing import TINY_CONFIGS, make_feature_head, make_head, make_vocab, tiny_model
from test_batch import alone, assert_rows_alone, repetitive

ARCHS = sorted(TINY_CONFIGS)
THREE_LAYERS = selfspec.DraftPlan(layers=(0, 1, 2), draft_length=4, policy="fixed")


def layer_tokens(stats) -> tuple[int, int]:
    """(drafted, accepted) layer tokens over a batch's rows."""
    drafted = sum(s.drafted - s.ngram_drafted - s.recycled_drafted for s in stats.row_stats)
    accepted = sum(s.accepted - s.ngram_accepted - s.recycled_accepted for s in stats.row_stats)
    return drafted, accepted


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_two_rows_with_three_layers_draft_layer_tokens(dtype):
    model = tiny_model("llama", dtype)
    spec = selfspec.wrap(model, plan=THREE_LAYERS)
    assert_rows_alone(model, spec, [repetitive(11, seed=1), repetitive(5, seed=2)], max_new_tokens=24)
    stats = spec.last_stats
    drafted, accepted = layer_tokens(stats)
    assert drafted > 0 and stats.draft_passes > 0, stats
    assert stats.passes < sum(s.verify_passes for s in stats.row_stats)  # the rows verified together


def plans(head, vocab, features) -> list[selfspec.DraftPlan]:
    return [
        selfspec.DraftPlan(head=str(features), draft_length=4, policy="fixed"),
        selfspec.DraftPlan(head=str(features), draft_vocab=str(vocab), draft_vocab_size=20, ngram=2, draft_length=3),
        THREE_LAYERS,
        selfspec.DraftPlan(layers=(0, 2, 5), draft_length=3, adaptive=True, threshold=0.3, policy="fixed"),
        selfspec.DraftPlan(exit_layer=2, head=str(head), draft_length=4, policy="fixed"),
        selfspec.DraftPlan(exit_layer=2, head=str(head), draft_vocab=str(vocab), draft_vocab_size=20,
                           draft_length=3, ngram=2, policy="fixed"),
        selfspec.DraftPlan(layers=(0, 3), draft_vocab=str(vocab), draft_vocab_size=8, draft_length=5),
        selfspec.DraftPlan(ngram=2, layers=(1,), draft_length=4),
    ]


@pytest.mark.parametrize("arch", ARCHS)
def test_layer_drafts_in_a_batch_equal_each_prompt_alone(arch, tmp_path):
    model = tiny_model(arch, torch.float64)
    head = make_head(model, tmp_path / "head", exit_layer=2, noise=0.05)
    vocab = make_vocab(model, tmp_path / "vocab")
    features = make_feature_head(model, tmp_path / "features")
    prompts = [repetitive(14, seed=3), repetitive(6, seed=4), repetitive(3, seed=5)]
    for i, plan in enumerate(plans(head, vocab, features)):
        spec = selfspec.wrap(model, plan=plan, costs="flat" if plan.policy == "cost" else None)
        assert_rows_alone(model, spec, prompts, max_new_tokens=(1, 17, 26)[i % 3])
        if i % 3:
            assert spec.last_stats.drafted > 0, (plan, spec.last_stats.row_stats)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "gpt2"])
def test_a_head_equal_to_the_last_layer_is_always_accepted_in_a_batch(arch, tmp_path):
    model = tiny_model(arch)
    n = model.config.get_text_config().num_hidden_layers
    head = make_head(model, tmp_path / "head", exit_layer=n - 1, source_layer=n - 1)
    plan = selfspec.DraftPlan(exit_layer=n - 1, head=str(head), draft_length=4, policy="fixed")
    spec = selfspec.wrap(model, plan=plan)
    assert_rows_alone(model, spec, [repetitive(9, seed=6), repetitive(13, seed=7)], max_new_tokens=30)
    drafted, accepted = layer_tokens(spec.last_stats)
    assert drafted > 0 and accepted == drafted, spec.last_stats.row_stats


@pytest.mark.parametrize("kind", ["exit", "feature"])
def test_rows_that_join_and_leave_keep_drafting_through_layers(kind, tmp_path):
    model = tiny_model("qwen3", torch.float64)
    if kind == "exit":
        head = make_head(model, tmp_path / "head", exit_layer=3, noise=0.02)
        plan = selfspec.DraftPlan(exit_layer=3, head=str(head), draft_length=3, ngram=2, policy="fixed")
    else:
        head = make_feature_head(model, tmp_path / "head", noise=0.02)
        plan = selfspec.DraftPlan(head=str(head), draft_length=3, ngram=2, policy="fixed")
    spec = selfspec.wrap(model, plan=plan)
    session = spec.batch_session()
    prompts = [repetitive(10, seed=s) for s in range(5)]
    lengths = [12, 5, 20, 9, 15]
    rows, finished = [], []
    for prompt, new in zip(prompts[:2], lengths):
        rows.append(session.add(prompt, max_new_tokens=new, do_sample=False))
    waiting = list(zip(prompts[2:], lengths[2:]))
    while len(session) or waiting:
        finished += session.step()
        if waiting and len(finished) >= len(rows) - 1:  # a row joins as one leaves
            prompt, new = waiting.pop(0)
            rows.append(session.add(prompt, max_new_tokens=new, do_sample=False))
    for row, prompt, new in zip(rows, prompts, lengths):
        assert row.new_tokens == alone(model, prompt, max_new_tokens=new)
    assert session.stats.draft_passes > 0


def test_the_measured_batch_table_prices_a_draft_step(tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_COSTS_CACHE", str(tmp_path))
    spec = selfspec.wrap(tiny_model("llama", torch.float32), plan=THREE_LAYERS)
    table = batch_costs(spec, 2, True).table
    assert 0 < table.draft_step < table.verify[-1] and table.draft_long >= 0
    plain = selfspec.wrap(tiny_model("llama", torch.float32), plan=selfspec.DraftPlan(ngram=2, draft_length=4))
    assert batch_costs(plain, 2, True).table.draft_step == 0.0  # an n-gram plan drafts no layers
