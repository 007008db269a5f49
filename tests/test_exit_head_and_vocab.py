"""Exit heads and draft vocabularies keep the output lossless, and their files round-trip.

- Greedy equality with `model.generate` for every architecture, with a head
  (perturbed copies of a layer), a draft vocabulary subset, both, and with
  n-gram proposals mixed in.
- A head that is an exact copy of the last layer, at exit N-1, is the target
  itself: every drafted token must be accepted. That only holds if the head's
  cache slot holds the right entries for every verified token (prefill,
  accepted drafts, bonus tokens, n-gram rounds), so it tests the invariant.
- Files: saved and loaded tensors are equal; a file made for another model, of
  another kind, or a head whose exit does not match the plan is refused.

The sampling tests for heads and vocabularies are in `test_sampling.py`.
"""

from __future__ import annotations

import json

import pytest
import torch

import selfspec
from plan_strategies import assert_same
from selfspec.registry import adapter_for
from selfspec.artifacts import load_artifact
from selfspec.head import load_head
from selfspec.vocab import load_vocab
from selfspec.testing import TINY_CONFIGS, make_head, make_vocab, random_prompt, tiny_model

ARCHS = sorted(TINY_CONFIGS)


def reference(model, prompt, max_new_tokens):
    return model.generate(prompt, do_sample=False, max_new_tokens=max_new_tokens)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("arch", ARCHS)
def test_head_and_vocab_greedy_match_generate(arch, dtype, tmp_path):
    model = tiny_model(arch, dtype)
    head = make_head(model, tmp_path / "head", exit_layer=2, noise=0.05)
    vocab = make_vocab(model, tmp_path / "vocab")
    plans = [
        selfspec.DraftPlan(exit_layer=2, head=str(head), draft_length=3, policy="fixed"),
        selfspec.DraftPlan(exit_layer=2, head=str(head), draft_length=6, adaptive=True, threshold=0.3, policy="fixed"),
        selfspec.DraftPlan(exit_layer=2, head=str(head), draft_length=4, ngram=2, policy="fixed"),
        selfspec.DraftPlan(exit_layer=2, head=str(head), draft_vocab=str(vocab), draft_vocab_size=20, draft_length=4, policy="fixed"),
        selfspec.DraftPlan(layers=[0, 2, 5], draft_vocab=str(vocab), draft_vocab_size=5, draft_length=5, policy="fixed"),
        selfspec.DraftPlan(exit_layer=4, draft_vocab=str(vocab), draft_length=2, ngram=3, policy="fixed"),
    ]
    for seed, plan in enumerate(plans):
        prompt = random_prompt(7 + 3 * seed, seed=seed)
        for max_new in (1, 29):
            out = selfspec.wrap(model, plan=plan).generate(prompt, max_new_tokens=max_new)
            assert_same(out, reference(model, prompt, max_new), plan)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("ngram", [0, 2])
def test_head_equal_to_last_layer_accepts_everything(arch, ngram, tmp_path):
    """Exit at N-1 plus an exact copy of layer N-1 is the target: acceptance 1 needs a correct head cache."""
    model = tiny_model(arch)
    n = model.config.get_text_config().num_hidden_layers
    head = make_head(model, tmp_path / "head", exit_layer=n - 1, source_layer=n - 1)
    plan = selfspec.DraftPlan(exit_layer=n - 1, head=str(head), draft_length=4, ngram=ngram, policy="fixed")
    spec = selfspec.wrap(model, plan=plan)
    prompt = random_prompt(11, seed=3)
    out = spec.generate(prompt, max_new_tokens=40)
    assert_same(out, reference(model, prompt, 40), plan)
    stats = spec.last_stats
    layer_drafted = stats.drafted - stats.ngram_drafted
    layer_accepted = stats.accepted - stats.ngram_accepted
    assert layer_drafted > 0 and layer_accepted == layer_drafted, str(stats)
    if not ngram:
        assert stats.tokens_per_pass == pytest.approx(40 / 9)  # prefill + 7 rounds of 5 + a last round of 4


def test_vocab_subset_scores_only_its_tokens(tmp_path):
    model = tiny_model("llama")
    parts = adapter_for(model).bind(model)
    vocab = load_vocab(make_vocab(model, tmp_path / "v"), 10, model=model, parts=parts)
    normed = torch.randn(1, 3, parts.embed.weight.shape[1], dtype=torch.float64)
    logits = vocab.logits(normed, None)  # [3, V]
    full = parts.lm_head(normed)[0].float()
    inside = torch.zeros(logits.shape[1], dtype=torch.bool)
    inside[vocab.ids] = True
    assert torch.isneginf(logits[:, ~inside]).all()
    assert torch.allclose(logits[:, inside], full[:, inside])
    assert vocab.size == 10 and "10/97" in vocab.describe()


def test_vocab_file_orders_by_count(tmp_path):
    model = tiny_model("llama")
    artifact = load_artifact(make_vocab(model, tmp_path / "v"), kind="draft_vocab")
    counts, ids = artifact.tensors["counts"], artifact.tensors["ids_by_count"]
    assert sorted(ids.tolist()) == list(range(97))
    assert (counts[:-1] >= counts[1:]).all()
    assert artifact.manifest["tokens_counted"] == 8 * 64


def test_head_file_round_trips(tmp_path):
    model = tiny_model("qwen3")
    parts = adapter_for(model).bind(model)
    path = make_head(model, tmp_path / "h", exit_layer=3, source_layer=4, noise=0.1)
    manifest = json.loads(path.read_text())
    assert manifest["kind"] == "exit_head" and manifest["exit_layer"] == 3 and manifest["source_layer"] == 4
    assert manifest["model"]["num_layers"] == 6 and manifest["shape"]["parameters"] > 0
    head = load_head(path, model=model, parts=parts)
    saved = load_artifact(path, kind="exit_head").tensors
    for name, value in head.layer.state_dict().items():
        assert torch.equal(value, saved[name].to(value.dtype)), name
    assert head.slot == 6 and head.layer.self_attn.layer_idx == 6
    assert parts.layers[4].self_attn.layer_idx == 4  # the model's own layer is untouched


def test_head_for_another_model_is_refused(tmp_path):
    path = make_head(tiny_model("llama"), tmp_path / "h", exit_layer=2)
    other = tiny_model("llama", seed=1)
    with pytest.raises(ValueError, match="made for another model"):
        selfspec.wrap(other, plan=selfspec.DraftPlan(exit_layer=2, head=str(path)))
    vocab = make_vocab(tiny_model("llama"), tmp_path / "v")
    with pytest.raises(ValueError, match="made for another model"):
        selfspec.wrap(other, plan=selfspec.DraftPlan(exit_layer=2, draft_vocab=str(vocab)))


def test_bad_head_and_vocab_settings_are_refused(tmp_path):
    model = tiny_model("llama")
    head = make_head(model, tmp_path / "h", exit_layer=2)
    vocab = make_vocab(model, tmp_path / "v")
    with pytest.raises(ValueError, match="trained for exit_layer=2"):
        selfspec.wrap(model, plan=selfspec.DraftPlan(exit_layer=3, head=str(head)))
    with pytest.raises(ValueError, match="needs exit_layer"):
        selfspec.DraftPlan(layers=[0, 1], head=str(head))
    with pytest.raises(ValueError, match="not a exit_head file"):
        selfspec.wrap(model, plan=selfspec.DraftPlan(exit_layer=2, head=str(vocab)))
    with pytest.raises(ValueError, match=r"draft_vocab_size=500 out of range .*valid: 1\.\.97"):
        selfspec.wrap(model, plan=selfspec.DraftPlan(exit_layer=2, draft_vocab=str(vocab), draft_vocab_size=500))
    with pytest.raises(FileNotFoundError, match="manifest not found"):
        selfspec.wrap(model, plan=selfspec.DraftPlan(exit_layer=2, head=str(tmp_path / "missing.json")))


def test_plan_file_resolves_artifacts_beside_it(tmp_path):
    model = tiny_model("llama")
    make_head(model, tmp_path / "h", exit_layer=2)
    make_vocab(model, tmp_path / "v")
    (tmp_path / "plan.json").write_text(json.dumps(
        {"exit_layer": 2, "head": "h.json", "draft_vocab": "v.json", "draft_vocab_size": 30, "draft_length": 3}
    ))
    spec = selfspec.wrap(model, plan=tmp_path / "plan.json")
    assert spec.head is not None and spec.vocab.size == 30
    prompt = random_prompt(5)
    assert_same(spec.generate(prompt, max_new_tokens=12), reference(model, prompt, 12), spec.plan)


def test_a_profiles_draft_step_costs_what_a_drafted_token_reads(tmp_path):
    """Under a cost profile (where a pass costs what it reads) a drafted token costs its layers, an exit head's
    layer and the LM head rows it reads, as the runner counts them; n-gram and recycled drafts cost nothing."""
    from selfspec.runner import LayerRunner

    model = tiny_model("llama")
    head = make_head(model, tmp_path / "head", exit_layer=2)
    vocab = make_vocab(model, tmp_path / "vocab")
    plans = [
        selfspec.DraftPlan(layers=[0, 2, 5]),
        selfspec.DraftPlan(exit_layer=2, head=str(head)),
        selfspec.DraftPlan(exit_layer=4, draft_vocab=str(vocab), draft_vocab_size=20),
        selfspec.DraftPlan(exit_layer=4),
    ]
    fractions = []
    for plan in plans:
        spec = selfspec.wrap(model, plan=plan, costs="flat")
        runner = LayerRunner(spec.parts, capacity=4, head=spec.head)
        spec.drafter.step(runner, 1, 0)
        plain = sum(runner.layer_bytes[: spec.parts.num_layers]) + runner.head_bytes
        fractions.append(runner.weights_read / plain)
        assert spec.costs.draft_step == pytest.approx(fractions[-1]), plan
        if spec.vocab is None:  # the whole LM head is read, so more than the layers' share of a step
            assert spec.costs.draft_step > len(spec.drafter.draft_layers) / spec.parts.num_layers
    assert fractions[2] < fractions[3]  # 20 vocabulary rows read less than the whole head
    assert selfspec.wrap(model, plan=selfspec.DraftPlan(ngram=3, tree=8, recycle=True), costs="flat").costs.draft_step == 0
