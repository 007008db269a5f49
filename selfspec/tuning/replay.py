"""The engine's rounds replayed on measured agreements: draft-length policies and their simulation.

A `Policy` is the plan fields that say how many tokens a round drafts;
`policy_grid` is the set the tuner tries. An `Agreement` says where a draft
chose the target's next token; `simulate` replays the engine's decode loop
(with the engine's own `AdaptivePolicy`) on it and totals the cost of the
rounds. It runs no model: the agreements come from the proxy, the round costs
from the cost model.

The policies of the grid: fixed k, a fixed confidence threshold, and Draft &
Verify's moving threshold. A simulation's speedup is emitted tokens over cost
in plain steps: Leviathan et al.'s tokens per round over cost per round, on the
measured agreement pattern rather than an i.i.d. rate (the i.i.d. figure,
`cost.iid_speedup`, is reported beside it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..policy import AdaptivePolicy
from ..plan import DraftPlan


@dataclass(frozen=True)
class Policy:
    """A draft-length policy: the plan fields that say how many tokens a round drafts."""

    draft_length: int
    adaptive: bool = False
    threshold: float = 0.5
    target_acceptance: float = 0.8
    threshold_step: float = 0.05

    @classmethod
    def from_plan(cls, plan: DraftPlan) -> "Policy":
        """The draft-length policy of `plan`."""
        return cls(**{f.name: getattr(plan, f.name) for f in dataclasses.fields(cls)})

    def plan_fields(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        if not self.adaptive:
            return f"k={self.draft_length}"
        if self.threshold_step == 0:
            return f"k<={self.draft_length}, stop below p={self.threshold:g}"
        return f"k<={self.draft_length}, adaptive (to acceptance {self.target_acceptance:g})"


def policy_grid(max_draft_length: int = 8) -> list[Policy]:
    """Fixed k = 1..max; a fixed confidence threshold; Draft & Verify's moving threshold.

    Simpler policies come first, so on a tie the simpler one is kept.
    """
    grid = [Policy(k) for k in range(1, max_draft_length + 1)]
    longs = sorted({max(2, max_draft_length // 2), max_draft_length})
    for k in longs:
        grid += [Policy(k, adaptive=True, threshold=t / 10, threshold_step=0.0) for t in range(1, 10)]
    for k in longs:
        grid += [Policy(k, adaptive=True, threshold=0.5, target_acceptance=a) for a in (0.6, 0.7, 0.8, 0.9)]
    return grid


@dataclass
class Agreement:
    """Where the draft chose the target's next token, per calibration sequence and generated input j.

    `matches[j]`, `confidences[j]`: the draft's agreement and top probability
    when input j starts a round. `runs[j]`: how many drafted tokens a round
    that starts at input j gets accepted (up to the deepest draft scored), and
    `run_confidences[j]` the draft's top probability at each depth of that
    round, as far as it was scored. Without `runs`, a round's depth-i token is
    assumed to agree as the round-start token at j + i does.
    """

    matches: list[list[bool]]
    confidences: list[list[float]]
    runs: list[list[int]] | None = None
    run_confidences: list[list[list[float]]] | None = None

    @property
    def alpha(self) -> float:
        """Round-start agreement over all generated inputs."""
        total = sum(len(m) for m in self.matches)
        return sum(sum(m) for m in self.matches) / total if total else 0.0

    def subset(self, indices: Sequence[int]) -> "Agreement":
        def pick(rows):
            return None if rows is None else [rows[i] for i in indices]

        return Agreement(pick(self.matches), pick(self.confidences), pick(self.runs), pick(self.run_confidences))

    def accepted_runs(self, sequence: int) -> list[int]:
        if self.runs is not None:
            return self.runs[sequence] + [0]
        matches = self.matches[sequence]
        runs = [0] * (len(matches) + 1)  # runs[j]: consecutive matches from j on
        for j in range(len(matches) - 1, -1, -1):
            runs[j] = runs[j + 1] + 1 if matches[j] else 0
        return runs

    def confidence(self, sequence: int, start: int, depth: int) -> float | None:
        """The draft's top probability at `depth` of a round starting at `start` (None past the data)."""
        if self.run_confidences is not None:
            scored = self.run_confidences[sequence][start] if start < len(self.run_confidences[sequence]) else []
            if depth < len(scored):
                return scored[depth]
        # Past the first rejection the draft goes on from its own token, which the proxy does not
        # follow; the round-start confidence at that position stands in (it only changes the cost).
        row = self.confidences[sequence]
        return row[start + depth] if start + depth < len(row) else None


@dataclass(frozen=True)
class Simulation:
    """The engine's rounds replayed on the calibration sequences."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0  # including each sequence's first (prefill) token
    sequences: int = 0
    cost: float = 0.0  # plain steps, prefill excluded

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_pass(self) -> float:
        passes = self.rounds + self.sequences
        return self.emitted / passes if passes else 0.0

    @property
    def speedup(self) -> float:
        """Plain steps the same tokens would take, over the simulated cost."""
        return (self.emitted - self.sequences) / self.cost if self.cost else 1.0


def simulate(
    agreement: Agreement,
    policy: Policy,
    *,
    limits: Sequence[int],
    round_cost: Callable[[int], tuple[float, float]],
) -> Simulation:
    """Replay the engine's decode loop for `policy` on measured agreements.

    `limits[i]`: max_new_tokens of sequence i (its generated length is
    len(matches[i]) + 1; fewer than the limit means EOS came first).
    `round_cost(n)`: (draft cost, verify cost) of a round that drafts n tokens.
    The draft-length rule is the engine's own `AdaptivePolicy`, fed with costs.
    """
    rounds = drafted_total = accepted_total = emitted_total = sequences = 0
    cost = 0.0
    plan_like = DraftPlan(exit_layer=1, **policy.plan_fields())
    for index, limit in enumerate(limits):
        generated = len(agreement.matches[index]) + 1
        runs = agreement.accepted_runs(index)
        state = AdaptivePolicy(plan_like)
        emitted = 1  # the prefill's token
        while emitted < generated:
            budget = min(state.budget(), limit - emitted - 1)
            first = emitted - 1  # the round's first drafted token comes from generated input `first`
            n = budget
            threshold = state.threshold
            if threshold is not None:
                for i in range(budget):
                    confidence = agreement.confidence(index, first, i)
                    if confidence is None or confidence < threshold:
                        n = i + 1
                        break
            accepted = min(runs[first] if first < len(runs) else 0, n)
            draft_cost, verify_cost = round_cost(n)
            cost += draft_cost + verify_cost
            rounds += 1
            drafted_total += n
            accepted_total += accepted
            emitted = min(emitted + accepted + 1, generated)
            state.update(drafted=n, accepted=accepted, draft_seconds=draft_cost, verify_seconds=verify_cost)
        emitted_total += generated
        sequences += 1
    return Simulation(rounds, drafted_total, accepted_total, emitted_total, sequences, cost)
