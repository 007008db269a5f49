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
- A row alone in a batch makes one sequence's rounds under a fixed plan (layer
  chains and trees, exit and feature heads): the same outcomes, the same text.
- A verify pass resumed after a layer chain's exact prefix gives a full pass's
  logits and cache entries; rounds resume where every row drafted layers.
- Layer trees (layers, exit and feature heads): a row's tree drafted in the
  batch's passes is the one its sequence drafts alone, and every architecture
  stays exact.
Sampling over batches with layer drafts and heads is tested in `test_sampling.py`.
"""

from __future__ import annotations

import pytest
import torch

import selfspec
from selfspec.batch_generate import batch_costs
from selfspec.testing import TINY_CONFIGS, make_feature_head, make_head, make_vocab, random_prompt, tiny_model
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


TREE_PLANS = {
    "layers": lambda paths: selfspec.DraftPlan(layers=(0, 2, 5), tree=10, draft_length=3, policy="fixed"),
    "exit head": lambda paths: selfspec.DraftPlan(exit_layer=2, head=str(paths["head"]), tree=8, draft_length=3,
                                                  policy="fixed"),
    "feature head": lambda paths: selfspec.DraftPlan(head=str(paths["features"]), tree=10, draft_length=3,
                                                     policy="fixed"),
}


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "gpt2", "qwen3"])
def test_a_batch_rows_layer_tree_is_the_one_its_sequence_drafts_alone(arch, tmp_path):
    """Each row of a batch grows its layer tree in passes over every row's level (`LayerRows.trees`): its nodes,
    their parents and path probabilities must be those `Drafter.layer_tree` drafts for that sequence alone (so
    each level's rows sat at their depths and saw their ancestors and nothing else, a feature head's node read
    its own parent's output), its first path the likeliest deepest one."""
    class Levels:  # one sequence's policy: as many levels as the batch drafts, the plan's node budget
        def __init__(self, depth):
            self.depth = depth

        def draft_next(self, depth, coverage, *, width=1):
            return depth < self.depth

        def tree_nodes(self, chain, max_nodes, *, exact_prefix=0):
            return max_nodes

    model = tiny_model(arch, torch.float64)
    paths = {"head": make_head(model, tmp_path / "head", exit_layer=2, noise=0.05),
             "features": make_feature_head(model, tmp_path / "features", noise=0.05)}
    prompts = [repetitive(14, seed=3), repetitive(6, seed=4)]
    for name, plan in TREE_PLANS.items():
        spec = selfspec.wrap(model, plan=plan(paths))
        session = spec.batch_session()
        rows = [session.add(prompt, max_new_tokens=10, do_sample=False) for prompt in prompts]
        batch = session._round()
        with torch.no_grad():
            session.layers.propose(batch)
        assert batch.layer_steps == 3
        for row, draft in zip(rows, batch.drafts):
            tokens = row.out.tokens
            runner = spec.runner_for(len(tokens) + 16, keep=False)
            with torch.no_grad():
                spec.passes.prefill(runner, tokens[:-1])
                alone = spec.drafter.layer_tree(runner, row.scorer, tokens, Levels(3))
            where = f"{arch}, {name}"
            assert draft.grown == alone.tree and draft.tokens == alone.tokens, where
            probs = [p for p, _ in zip(alone.path_probs[len(draft.tokens):], draft.values)]
            assert max(abs(a - b) for a, b in zip(probs, draft.values)) < 1e-9, where
            assert len(draft.values) == len(draft.grown) - 3 and len(draft.odds) == 3, where


@pytest.mark.parametrize("arch", ARCHS)
def test_layer_trees_in_a_batch_equal_each_prompt_alone(arch, tmp_path):
    """Rows draft layer trees together (layers, an exit head, a feature head; fixed plans and the cost policy on
    a flat profile, where a wider pass costs what a narrow one does), verify them in one pass, and each row
    equals `model.generate` on its prompt alone."""
    model = tiny_model(arch, torch.float64)
    paths = {"head": make_head(model, tmp_path / "head", exit_layer=2, noise=0.05),
             "features": make_feature_head(model, tmp_path / "features", noise=0.05)}
    prompts = [repetitive(14, seed=3), repetitive(6, seed=4), repetitive(3, seed=5)]
    plans = [plan(paths) for plan in TREE_PLANS.values()]
    plans.append(selfspec.DraftPlan(layers=(0, 2, 5), ngram=2, tree=10, draft_length=4))
    layer_trees = 0
    for i, plan in enumerate(plans):
        spec = selfspec.wrap(model, plan=plan, costs="flat" if plan.policy == "cost" else None)
        assert_rows_alone(model, spec, prompts, max_new_tokens=(17, 26)[i % 2])
        layer_trees += sum(stats.layer_tree_rounds for stats in spec.last_stats.row_stats)
    assert layer_trees > 20, layer_trees


@pytest.mark.parametrize("arch", ARCHS)
def test_a_batch_verify_resumes_after_the_exact_prefix(arch, tmp_path, monkeypatch):
    """Where every row drafted a layer chain (or nothing), the verify pass resumes after the draft's exact prefix:
    the prefix's entries and the states after it are the draft steps' own (for the last drafted token, a pass
    of the prefix alone). Rows stay exact; rounds with an n-gram row run every layer."""
    from selfspec.batch_runner import BatchRunner

    passes = []  # (width, the layers the pass resumed after) of every verify pass
    forward_rows = BatchRunner.forward_rows

    def spy(self, ids, *args, **kwargs):
        if "exact_prefix" in kwargs:  # a round's verify pass (not a prefill, nor a timed pass of the cost table)
            passes.append((ids.shape[1], kwargs["exact_prefix"]))
        return forward_rows(self, ids, *args, **kwargs)

    monkeypatch.setattr(BatchRunner, "forward_rows", spy)
    model = tiny_model(arch, torch.float64)
    head = make_head(model, tmp_path / "head", exit_layer=2, noise=0.05)
    prompts = [random_prompt(n, seed=n)[0].tolist() for n in (14, 6, 3)]
    copies = [repetitive(n, seed=n) for n in (14, 6, 3)]  # some row always has an n-gram copy
    cases = [(2, selfspec.DraftPlan(exit_layer=2, head=str(head), draft_length=4, policy="fixed"), prompts),
             (3, selfspec.DraftPlan(layers=(0, 1, 2, 4), draft_length=3, policy="fixed"), prompts),
             (4, selfspec.DraftPlan(layers=(0, 1, 2, 3), draft_length=3, policy="fixed"), prompts),  # an early exit
             (1, selfspec.DraftPlan(layers=(0, 2, 5), draft_length=3), prompts),  # the cost policy, priced so
             (None, selfspec.DraftPlan(layers=(0, 2, 5), ngram=2, draft_length=3, policy="fixed"), copies)]
    for i, (prefix, plan, rows) in enumerate(cases):
        passes.clear()
        spec = selfspec.wrap(model, plan=plan, costs="flat" if plan.policy == "cost" else None)
        assert_rows_alone(model, spec, rows, max_new_tokens=(17, 26)[i % 2])
        wide = [resumed for width, resumed in passes if width > 1]
        if prefix is None:  # rounds with a copy run every layer; those without resume after layer 0
            assert 0 in wide and set(wide) <= {0, 1}, (plan, passes)
        else:
            assert set(wide) == {prefix}, (plan, passes)
        assert spec.last_stats.resumed_passes == sum(r > 0 for r in wide), (plan, passes)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "gpt2", "phi3"])
def test_a_resumed_verify_pass_computes_what_a_full_one_does(arch):
    """float64: two rows draft 3 tokens through layers (0, 1, 2, 4) (exact prefix 3); the verify pass over the last
    token and 2 or 3 of them, resumed after layer 2 from the draft steps' states (and, for the last input, a pass
    of the prefix alone), gives the logits and the cache entries of a pass that runs every layer."""
    import copy

    from selfspec.batch_runner import BatchRunner

    model = tiny_model(arch, torch.float64)
    parts = selfspec.wrap(model).parts
    layers = (0, 1, 2, 4)
    prompts = [random_prompt(9, seed=1)[0].tolist(), random_prompt(5, seed=2)[0].tolist()]
    for width in (3, 4):
        runner = BatchRunner(parts, capacity=32)
        with torch.no_grad():
            for prompt in prompts:
                row = runner.cache.add_row()
                runner.forward_rows(torch.tensor([prompt[:-1]]), [0], slice(row, row + 1), last=True)
            starts = [len(p) - 1 for p in prompts]
            inputs = [[p[-1]] for p in prompts]
            boundary = []
            for j in range(3):  # the draft: every row one token a step, its greedy choice
                logits = runner.draft_rows(torch.tensor([[i[-1]] for i in inputs]), [s + j for s in starts],
                                           slice(0, 2), layers)[:, 0]
                boundary.append(runner.boundary)
                for i, token in enumerate(logits.argmax(-1).tolist()):
                    inputs[i].append(token)
            ids = torch.tensor([i[:width] for i in inputs])  # [2, width]: the last token and width - 1 drafted
            full_runner = copy.deepcopy(runner)
            resumed = runner.forward_rows(ids, starts, slice(0, 2), exact_prefix=3, boundary=boundary)
            full = full_runner.forward_rows(ids, starts, slice(0, 2))
        assert torch.allclose(resumed, full, atol=1e-10), (arch, width, (resumed - full).abs().max())
        for ours, theirs in ((runner.cache.keys, full_runner.cache.keys), (runner.cache.values, full_runner.cache.values)):
            for layer, (a, b) in enumerate(zip(ours, theirs)):  # [rows, kv_heads, capacity, head_dim] each
                for row, start in enumerate(starts):
                    assert torch.allclose(a[row, :, : start + width], b[row, :, : start + width], atol=1e-10), (arch, layer)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "gpt2", "qwen2"])
def test_a_batch_of_one_drafts_the_rounds_one_sequence_drafts(arch, tmp_path):
    """Under a fixed plan a row alone in a batch session (what the server runs) makes one sequence's rounds: the
    same layer chains or trees, of the same sizes, with the same outcomes (`round_outcomes`: source, nodes
    verified, tokens kept), and the same text."""
    model = tiny_model(arch, torch.float64)
    paths = {"head": make_head(model, tmp_path / "head", exit_layer=2, noise=0.05),
             "features": make_feature_head(model, tmp_path / "features", noise=0.05)}
    plans = [plan(paths) for plan in TREE_PLANS.values()]
    plans += [selfspec.DraftPlan(layers=(0, 1, 2, 4), draft_length=3, policy="fixed"),
              selfspec.DraftPlan(head=str(paths["features"]), draft_length=3, policy="fixed")]
    prompt = random_prompt(11, seed=7)[0].tolist()
    for plan in plans:
        spec = selfspec.wrap(model, plan=plan)
        single = spec.generate(torch.tensor([prompt]), max_new_tokens=24)[0, len(prompt):].tolist()
        alone = spec.last_stats
        session = spec.batch_session()
        row = session.add(prompt, max_new_tokens=24)
        while len(session):
            session.step()
        assert row.new_tokens == single, plan
        assert row.stats.round_outcomes == alone.round_outcomes, (plan, row.stats.round_outcomes, alone.round_outcomes)
