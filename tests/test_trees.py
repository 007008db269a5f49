"""Token trees (`tree.py`): a verify pass over a tree equals a chain pass over each of its paths.

- the tree itself: trie merging, depths, what each row sees, paths;
- float64, every architecture: each row's logits from one tree pass equal
  those of a chain pass over that row's path, and after keeping a path that
  is not the first, the compacted cache equals the cache a chain pass over
  that path writes;
- greedy generation with n-gram trees equals `model.generate`, and a kept
  path does leave the first branch somewhere (so compaction really moves
  entries);
- the static step verifies trees too (acceptance on the device, one read
  back), and equals `model.generate`;
- a tree is refused without n-grams; sampling drafts chains.
"""

from __future__ import annotations

import pytest
import torch

import selfspec
import selfspec.passes
from plan_strategies import assert_same
from selfspec.costs import PassCosts
from selfspec.passes import TargetPasses
from selfspec.runner import LayerRunner
from selfspec.testing import TINY_CONFIGS, has_window, random_prompt, tiny_model
from selfspec.tree import TokenTree, accept_tree_greedy, accept_tree_greedy_on_device, compact

ARCHS = sorted(TINY_CONFIGS)
# float64 models, but Gemma 2's attention takes its softmax in float32: sums over more (masked) keys round
# differently there, at ~1e-7. A wrong mask or a misplaced entry differs at ~1e-1.
TOLERANCE = 1e-6


def model_for(arch: str):
    return tiny_model(arch, torch.float64, window=4 if has_window(arch) else None)


def test_tree_from_paths_merges_prefixes_and_cuts_at_the_budget():
    tree = TokenTree.from_paths([[5, 6, 7], [5, 8], [9, 6]], max_nodes=10)
    assert tree.tokens == (5, 6, 7, 8, 9, 6) and tree.parents == (-1, 0, 1, 0, -1, 4)
    assert tree.depths() == [0, 1, 2, 3, 2, 1, 2] and not tree.is_chain
    assert tree.path_to(2) == [0, 1, 2] and tree.path_to(5) == [4, 5] and tree.path_to(-1) == []
    seen = tree.visibility()
    assert seen[3].tolist() == [True, True, True, True, False, False, False]  # node 2 (row 3): root, 0, 1, itself
    assert seen[6].tolist() == [True, False, False, False, False, True, True]  # node 5: root, node 4, itself
    assert TokenTree.from_paths([[5, 6, 7], [5, 8]], max_nodes=3).tokens == (5, 6, 7)
    assert TokenTree.from_paths([[1, 2, 3]], max_nodes=9).is_chain
    with pytest.raises(ValueError, match="parents come before their children"):
        TokenTree((1, 2), (-1, 1))


def test_accept_tree_greedy_follows_the_targets_choices():
    tree = TokenTree.from_paths([[5, 6, 7], [5, 8, 2]], max_nodes=10)  # nodes: 5, 6, 7, 8, 2
    scores = torch.full((6, 10), -1.0)
    for row, choice in {0: 5, 1: 8, 4: 2, 5: 3}.items():  # the target: 5, then 8 (second branch), 2, then 3
        scores[row, choice] = 1.0
    path, nxt = accept_tree_greedy(tree, scores)
    assert path == [0, 3, 4] and tree.path_tokens(path) == [5, 8, 2] and nxt == 3
    scores[0] = -1.0
    scores[0, 9] = 1.0
    assert accept_tree_greedy(tree, scores) == ([], 9)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_tree_pass_equals_a_chain_pass_per_path_and_compaction_equals_the_chain_cache(arch):
    model = model_for(arch)
    spec = selfspec.wrap(model, plan=selfspec.DraftPlan.plain())
    layers = spec.parts.num_layers
    passes = TargetPasses(layers, exact_prefix=0)
    prompt = random_prompt(11, seed=7)[0].tolist()
    start = len(prompt)
    tree = TokenTree.from_paths([[3, 4, 5], [3, 6, 7, 8], [9, 10]], max_nodes=12)

    def prefilled() -> LayerRunner:
        runner = LayerRunner(spec.parts, capacity=40)
        runner.run(runner.embed(prompt, 0), range(layers), 0)
        return runner

    last = 2  # the last emitted token (the root)
    runner = prefilled()
    logits = passes.verify_tree(runner, torch.tensor([[last, *tree.tokens]]), tree, start).logits  # [n+1, vocab]
    for node in range(len(tree)):
        path = tree.path_to(node)
        chain = prefilled()
        expected = passes.verify(chain, torch.tensor([[last, *tree.path_tokens(path)]]), [], start).logits
        assert torch.allclose(logits[node + 1], expected[-1], atol=TOLERANCE), f"{arch}: node {node}"
    assert torch.allclose(logits[0], expected[0], atol=TOLERANCE)

    keep_path = tree.path_to(5)  # 3, 6, 7, 8: the second branch, whose slots are not its positions
    compact(runner.cache, start=start, path=keep_path, layers=range(layers))
    chain = prefilled()
    passes.verify(chain, torch.tensor([[last, *tree.path_tokens(keep_path)]]), [], start)
    for i in range(layers):
        assert runner.cache.lengths[i] == chain.cache.lengths[i] == start + 1 + len(keep_path)
        for ours, theirs in zip(runner.cache.entries(i), chain.cache.entries(i)):
            assert torch.allclose(ours, theirs, atol=TOLERANCE), f"{arch}: layer {i} after compaction"


def repetitive_prompt(seed: int) -> torch.Tensor:
    """A prompt whose last tokens occurred twice before, with different continuations."""
    base = random_prompt(6, seed=seed)[0].tolist()
    return torch.tensor([base + [base[0], base[1], 7] + base + [base[0], base[1], 9, 3] + base[:3]])


TREE_PLANS = [
    selfspec.DraftPlan(ngram=2, tree=10, draft_length=5, policy="fixed"),
    selfspec.DraftPlan(ngram=1, tree=12, exit_layer=2, draft_length=4, policy="fixed"),
    selfspec.DraftPlan(ngram=3, tree=8, layers=[0, 2], draft_length=6),
]


def test_tree_generation_equals_generate_and_leaves_the_first_branch(monkeypatch):
    off_branch = []
    original = selfspec.passes.compact

    def recording(cache, *, start, path, layers):
        off_branch.append(any(node != i for i, node in enumerate(path)))
        return original(cache, start=start, path=path, layers=layers)

    monkeypatch.setattr(selfspec.passes, "compact", recording)
    trees = 0
    for arch in ARCHS:
        model = model_for(arch)
        for seed in (3, 4):
            prompt = repetitive_prompt(seed)
            ref = model.generate(prompt, do_sample=False, max_new_tokens=40)
            for plan in TREE_PLANS:
                spec = selfspec.wrap(model, plan=plan, costs="flat")
                assert_same(spec.generate(prompt, max_new_tokens=40), ref, f"{arch}: {plan}")
                trees += spec.last_stats.tree_rounds
    assert trees > 50 and any(off_branch), (trees, sum(off_branch))


def test_tree_stats_and_description():
    model = model_for("gpt2")
    spec = selfspec.wrap(model, plan=TREE_PLANS[0], costs="flat")
    spec.generate(repetitive_prompt(3), max_new_tokens=40)
    stats = spec.last_stats
    assert stats.tree_rounds > 0 and stats.tree_nodes >= 2 * stats.tree_rounds
    assert "token trees:" in str(stats) and "trees of up to 10 nodes" in spec.describe_plan()


LAYER_TREE_PLANS = [
    selfspec.DraftPlan(layers=[0, 2, 5], tree=10, draft_length=4, policy="fixed"),
    selfspec.DraftPlan(exit_layer=3, tree=8, draft_length=3, policy="fixed"),
    selfspec.DraftPlan(auto=True, tree=10, draft_length=4),
]


def test_layer_drafts_branch_where_unsure_and_equal_generate():
    """A layer draft's runners-up become branches (likeliest paths first); the kept path is the target's."""
    layer_trees = 0
    for arch in ARCHS:
        model = model_for(arch)
        prompt = random_prompt(20, seed=3)
        ref = model.generate(prompt, do_sample=False, max_new_tokens=40)
        for plan in LAYER_TREE_PLANS:
            spec = selfspec.wrap(model, plan=plan, costs="flat")
            assert_same(spec.generate(prompt, max_new_tokens=40), ref, f"{arch}: {plan}")
            layer_trees += spec.last_stats.layer_tree_rounds
    assert layer_trees > 100 and "(branching where unsure)" in LAYER_TREE_PLANS[0].describe(6)
    with pytest.raises(ValueError, match=r"tree=-1 out of range \(valid: 0..64\)"):
        selfspec.DraftPlan(ngram=2, tree=-1)


def test_a_layer_tree_grows_from_the_drafts_own_choices_after_each_path():
    """Each level of a layer tree is one pass over several nodes (tree rows): every node must be one of the
    draft's 3 likeliest tokens after its path, with the path probability a chain draft of that path computes
    (so each row saw its ancestors and nothing else); the likeliest path goes first and is as deep as the
    policy allowed; the rows the draft wrote are dropped after."""
    from types import SimpleNamespace

    from selfspec.draft import LAYER_BRANCHES
    from selfspec.scoring import Scorer

    class ThreeLevels:  # the policy: three levels, the plan's node budget
        def draft_next(self, depth, coverage, *, width=1):
            return depth < 3

        def tree_nodes(self, chain, max_nodes, *, exact_prefix=0):
            return max_nodes

    scorer = Scorer(SimpleNamespace(processors=None, do_sample=False), None)
    for arch in ("llama", "gemma3_text", "gpt2"):
        model = model_for(arch)
        spec = selfspec.wrap(model, plan=selfspec.DraftPlan(layers=[0, 2, 5], tree=10, draft_length=4))
        parts, drafter = spec.parts, spec.drafter
        prompt = random_prompt(12, seed=5)[0].tolist()

        def prefilled() -> LayerRunner:
            runner = LayerRunner(parts, capacity=64)
            TargetPasses(parts.num_layers, exact_prefix=0).prefill(runner, prompt[:-1])
            return runner

        runner = prefilled()
        with torch.no_grad():
            draft = drafter.propose(runner, scorer, prompt, ThreeLevels())
        tree = draft.tree
        assert len(tree) == 10 and draft.tokens == tree.path_tokens([0, 1, 2]) and len(draft.confidences) == 3
        assert set(runner.cache.lengths) == {len(prompt) - 1, len(prompt)}  # the last token's draft entry at most
        deepest = [node for node, depth in enumerate(tree.depths()[1:]) if depth == 3]
        assert draft.path_probs[2] == max(draft.path_probs[node] for node in deepest)  # the likeliest path first
        for node in range(len(tree)):
            path = tree.path_tokens(tree.path_to(node))
            chain, probability = prefilled(), 1.0
            for i, token in enumerate([prompt[-1], *path[:-1]]):
                with torch.no_grad():
                    p = torch.softmax(drafter.step(chain, token, len(prompt) - 1 + i)[0], dim=-1)  # [vocab]
                probability *= float(p[path[i]])
            assert path[-1] in p.topk(LAYER_BRANCHES).indices.tolist(), (arch, node, path)
            assert abs(draft.path_probs[node] - probability) < 1e-9, (arch, node, draft.path_probs[node], probability)


def test_costly_wide_passes_keep_trees_off():
    """Where q tokens cost q steps, a tree never verifies within 5% of its chain: chains only."""
    model = model_for("gpt2")
    spec = selfspec.wrap(model, plan=selfspec.DraftPlan(ngram=2, tree=10, draft_length=5), costs="linear")
    spec.generate(repetitive_prompt(3), max_new_tokens=40)
    assert spec.last_stats.tree_rounds == 0
    # Each row costs a fifth of a step more, a drafted token a hundredth: chains pay (this model's drafts are
    # mostly accepted), a branch never verifies within 5% of its chain's cost.
    steep = PassCosts(verify=tuple(1.0 + 0.2 * (q - 1) for q in range(1, 12)), draft_step=0.01, num_layers=6)
    spec = selfspec.wrap(model_for("gemma3_text"), plan=selfspec.DraftPlan(layers=[0, 2, 5], tree=10, draft_length=4),
                         costs=steep)
    spec.generate(random_prompt(20, seed=3), max_new_tokens=40)
    assert spec.last_stats.tree_rounds == 0 and spec.last_stats.drafted > 0


def test_sampling_verifies_trees_and_a_seed_reproduces():
    """Sampling verifies trees too (recursive rejection; its law is tested in test_sampling.py)."""
    model = model_for("gpt2")
    spec = selfspec.wrap(model, plan=TREE_PLANS[0], costs="flat")
    runs = []
    for _ in range(2):
        out = spec.generate(repetitive_prompt(3), max_new_tokens=30, do_sample=True,
                            generator=torch.Generator().manual_seed(0))
        runs.append(out.tolist())
    assert spec.last_stats.tree_rounds > 0 and spec.last_stats.ngram_drafted > 0
    assert runs[0] == runs[1]


def test_static_step_verifies_trees_and_equals_generate():
    rounds = 0
    for arch in ARCHS:
        model = model_for(arch)
        prompt = repetitive_prompt(4)
        ref = model.generate(prompt, do_sample=False, max_new_tokens=40)
        for plan in TREE_PLANS[:2]:
            spec = selfspec.wrap(model, plan=plan, costs="flat", step="static")
            assert_same(spec.generate(prompt, max_new_tokens=40), ref, f"{arch}, static: {plan}")
            rounds += spec.last_stats.tree_rounds
    assert rounds > 20


def test_device_acceptance_equals_the_host_rule():
    tree = TokenTree.from_paths([[5, 6, 7], [5, 8, 2], [3, 1], [5, 6, 4]], max_nodes=20)
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        scores = torch.randn(len(tree) + 1, 10, generator=generator)
        for row in range(len(tree) + 1):  # bias rows toward the tree's tokens so that paths get kept
            if torch.rand(1, generator=generator) < 0.7:
                scores[row, tree.tokens[int(torch.randint(len(tree), (1,), generator=generator))]] += 5
        path, nxt = accept_tree_greedy(tree, scores)
        kept, next_token = accept_tree_greedy_on_device(tree, scores)
        assert [i for i, k in enumerate(kept.tolist()) if k] == path and int(next_token) == nxt
