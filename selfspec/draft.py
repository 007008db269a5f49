"""The draft phase: propose tokens with a cheap path through the target's own layers.

`Drafter.propose` runs the plan's layers one token at a time on the shared
cache, writing entries only for those layers. It saves the hidden states after
the plan's exact prefix (layers 0..s-1, which compute what the target
computes), so the verify pass can resume at layer s instead of starting over.

`AdaptiveThreshold` is the runtime state of an adaptive draft-length policy;
the plan holds only its starting values.

This module does not verify, accept or roll back; see `engine.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .plan import DraftPlan
from .runner import LayerRunner
from .scoring import Scorer


@dataclass
class Draft:
    tokens: list[int]  # the drafted tokens d_1..d_k
    probs: torch.Tensor | None  # q: [k, vocab] draft distributions (sampling only)
    boundary: list[torch.Tensor]  # k x [1, 1, hidden]: states after the exact prefix for inputs x, d_1..d_{k-1}


class Drafter:
    def __init__(self, plan: DraftPlan, num_layers: int) -> None:
        layers = plan.draft_layers(num_layers)
        self.exact_prefix = plan.exact_prefix(num_layers)  # s
        self.prefix_layers = range(self.exact_prefix)
        self.other_layers = layers[self.exact_prefix :]

    def propose(
        self, runner: LayerRunner, scorer: Scorer, tokens: list[int], budget: int, threshold: float | None
    ) -> Draft:
        """Draft up to `budget` tokens after `tokens`; the last of `tokens` is not in the cache yet."""
        start = len(tokens) - 1
        drafted: list[int] = []
        probs: list[torch.Tensor] = []
        boundary: list[torch.Tensor] = []
        token = tokens[-1]
        for i in range(budget):
            hidden = runner.run(runner.embed([token]), self.prefix_layers, start + i)  # [1, 1, hidden]
            boundary.append(hidden)
            hidden = runner.run(hidden, self.other_layers, start + i)
            scores = scorer.scores(runner.logits(hidden), tokens + drafted, len(tokens) + i)  # [1, vocab]
            token, confidence, q = scorer.draft_choice(scores, with_confidence=threshold is not None)
            drafted.append(token)
            if q is not None:
                probs.append(q)
            if confidence is not None and threshold is not None and confidence < threshold:
                break  # keep this token (already paid for), draft no further
        return Draft(drafted, torch.stack(probs) if probs else None, boundary)


class AdaptiveThreshold:
    """Draft & Verify's rule: raise the confidence bar when acceptance falls short, lower it otherwise."""

    def __init__(self, plan: DraftPlan) -> None:
        self.enabled = plan.adaptive
        self.value = plan.threshold
        self.target = plan.target_acceptance
        self.step = plan.threshold_step
        self.smoothed = plan.target_acceptance  # exponential moving average of the acceptance rate

    @property
    def threshold(self) -> float | None:
        return self.value if self.enabled else None

    def update(self, *, drafted: int, accepted: int) -> None:
        if not self.enabled or drafted == 0:
            return
        self.smoothed = 0.8 * self.smoothed + 0.2 * (accepted / drafted)
        delta = self.step if self.smoothed < self.target else -self.step
        self.value = min(1.0, max(0.0, self.value + delta))
