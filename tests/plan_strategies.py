"""What the greedy-equality tests share: random plans (hypothesis) and the equality assertion."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

import selfspec


@st.composite
def plans(draw, num_layers: int, max_draft_length: int = 10):
    """Random plans: early exits or layer subsets, draft lengths 1..max, fixed or adaptive, with or without n-grams."""
    draft_length = draw(st.integers(1, max_draft_length))
    adaptive = draw(st.booleans())
    threshold = draw(st.floats(0.05, 0.95))
    ngram = draw(st.sampled_from([0, 0, 1, 3]))
    if ngram and draw(st.booleans()):
        return selfspec.DraftPlan(draft_length=draft_length, adaptive=adaptive, threshold=threshold, ngram=ngram)
    if draw(st.booleans()):
        where = dict(exit_layer=draw(st.integers(1, num_layers)))
    else:
        subset = draw(st.sets(st.integers(0, num_layers - 1), min_size=1, max_size=num_layers))
        where = dict(layers=sorted(subset))
    return selfspec.DraftPlan(draft_length=draft_length, adaptive=adaptive, threshold=threshold, ngram=ngram, **where)


def assert_same(out: torch.Tensor, ref: torch.Tensor, plan) -> None:
    assert out.shape == ref.shape and torch.equal(out, ref), (
        f"plan {plan}: selfspec {out[0].tolist()} != generate {ref[0].tolist()}"
    )
