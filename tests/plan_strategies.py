"""What the greedy-equality tests share: random plans (hypothesis) and the equality assertions."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

import selfspec


@st.composite
def plans(draw, num_layers: int, max_draft_length: int = 10):
    """Random plans: early exits, layer subsets or layers chosen per context (auto), draft lengths 1..max, fixed,
    adaptive or cost-chosen, with or without n-grams, any of them drafting token trees, trees with or without
    recycled nodes."""
    draft_length = draw(st.integers(1, max_draft_length))
    if draw(st.integers(0, 5)) == 0:  # an auto plan: n-grams or not, trees or not, k by cost
        ngram = draw(st.sampled_from([0, 3]))
        tree = draw(st.sampled_from([0, 8]))
        return selfspec.DraftPlan(auto=True, draft_length=draft_length, ngram=ngram, tree=tree,
                                  recycle=bool(tree) and draw(st.booleans()))
    policy = draw(st.sampled_from(["fixed", "fixed", "cost"]))
    adaptive = policy == "fixed" and draw(st.booleans())  # a confidence threshold: only the fixed policy reads it
    threshold = draw(st.floats(0.05, 0.95)) if adaptive else 0.5
    ngram = draw(st.sampled_from([0, 0, 1, 3]))
    tree = draw(st.sampled_from([0, 0, 6, 12]))  # n-gram continuations, or a layer draft's runners-up, as trees
    recycle = bool(tree) and draw(st.booleans())  # and nodes grown from the target's recorded predictions
    if (ngram or recycle) and draw(st.booleans()):
        return selfspec.DraftPlan(draft_length=draft_length, adaptive=adaptive, threshold=threshold, ngram=ngram,
                                  policy=policy, tree=tree, recycle=recycle)
    if draw(st.booleans()):
        where = dict(exit_layer=draw(st.integers(1, num_layers)))
    else:
        subset = draw(st.sets(st.integers(0, num_layers - 1), min_size=1, max_size=num_layers))
        where = dict(layers=sorted(subset))
    return selfspec.DraftPlan(draft_length=draft_length, adaptive=adaptive, threshold=threshold, ngram=ngram,
                              policy=policy, tree=tree, recycle=recycle, **where)


def assert_same(out: torch.Tensor, ref: torch.Tensor, plan) -> None:
    assert out.shape == ref.shape and torch.equal(out, ref), (
        f"plan {plan}: selfspec {out[0].tolist()} != generate {ref[0].tolist()}"
    )


# Gap between the target's top two logits, relative to max(1, |top logit|), below which two greedy choices are a
# rounding near-tie: a few units in the last place of the logits' dtype (bfloat16 keeps 8 significant bits, so
# two logits near 20 are never closer than 0.125 apart unless equal) -- the rule `benchmarks/report.py` applies.
NEAR_TIE = {torch.float32: 1e-3, torch.bfloat16: 2**-5, torch.float16: 2**-8}


def assert_identical_or_near_tie(model, out: torch.Tensor, ref: torch.Tensor, prompt_length: int) -> bool:
    """True when identical; else assert the first difference is a near-tie of the target and return False."""
    if torch.equal(out, ref):
        return True
    n = min(out.shape[1], ref.shape[1])
    first = next((i for i in range(prompt_length, n) if out[0, i] != ref[0, i]), n)
    assert first < n, f"one output is a prefix of the other: lengths {out.shape[1]} and {ref.shape[1]}"
    with torch.no_grad():
        logits = model(ref[:, :first]).logits[0, -1]  # the target's own logits at the first difference
    bound = NEAR_TIE.get(logits.dtype, NEAR_TIE[torch.float32])
    top2 = logits.float().topk(2)
    gap = float(top2.values[0] - top2.values[1])
    bound *= max(1.0, abs(float(top2.values[0])))
    assert gap < bound, f"outputs differ at position {first} where the target's top-2 gap is {gap:.2e}: engine error"
    assert {int(out[0, first]), int(ref[0, first])} <= set(top2.indices.tolist())
    return False
