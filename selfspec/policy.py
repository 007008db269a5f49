"""How many tokens a round drafts: the runtime state of a plan's draft-length policy.

The plan holds only the policy's starting values; `AdaptivePolicy` keeps what
the rounds so far taught it and answers `budget()` (how many tokens this
round may draft) and `threshold` (the confidence under which drafting stops).

This module does not run layers or read the cache: it sees counts and times.
"""

from __future__ import annotations

from .plan import DraftPlan


class AdaptivePolicy:
    """Runtime state of an adaptive draft-length policy (the plan holds only its starting values).

    - Draft & Verify's threshold rule: raise the confidence bar when the
      smoothed acceptance rate falls short of the target, lower it otherwise.
    - A measured off switch: when a drafted token costs more time than the
      accepted tokens it brings back (acceptance x the time of a verify pass),
      drafting pauses for a few rounds, then probes again, backing off
      exponentially. A poor plan so degrades toward plain speed.

    A plan with `adaptive=False` drafts its fixed k every round.
    """

    SMOOTHING = 0.8  # weight of the past in the moving averages
    MAX_PAUSE = 64  # rounds

    def __init__(self, plan: DraftPlan) -> None:
        self.enabled = plan.adaptive
        self.draft_length = plan.draft_length
        self.value = plan.threshold
        self.target = plan.target_acceptance
        self.step = plan.threshold_step
        self.acceptance = plan.target_acceptance  # smoothed acceptance rate, optimistic start
        self.draft_cost: float | None = None  # smoothed seconds per drafted token
        self.verify_cost: float | None = None  # smoothed seconds per verify pass
        self.paused = 0  # rounds left without drafting
        self.backoff = 4

    @property
    def threshold(self) -> float | None:
        return self.value if self.enabled else None

    def budget(self) -> int:
        """How many tokens this round may draft."""
        return 0 if self.paused else self.draft_length

    def update(self, *, drafted: int, accepted: int, draft_seconds: float, verify_seconds: float) -> None:
        if not self.enabled:
            return
        self.verify_cost = _smooth(self.verify_cost, verify_seconds, self.SMOOTHING)
        if drafted == 0:
            self.paused = max(0, self.paused - 1)
            return
        self.acceptance = _smooth(self.acceptance, accepted / drafted, self.SMOOTHING)
        self.draft_cost = _smooth(self.draft_cost, draft_seconds / drafted, self.SMOOTHING)
        delta = self.step if self.acceptance < self.target else -self.step
        self.value = min(1.0, max(0.0, self.value + delta))
        if self.acceptance * self.verify_cost < self.draft_cost:
            self.paused, self.backoff = self.backoff, min(2 * self.backoff, self.MAX_PAUSE)
        else:
            self.backoff = 4


def _smooth(average: float | None, value: float, weight: float) -> float:
    return value if average is None else weight * average + (1 - weight) * value
