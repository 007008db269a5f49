"""The engine's rounds replayed on measured agreements, with the policy the runtime runs.

A `Policy` is the plan fields that say how many tokens a round drafts;
`policy_grid` is the set the tuner tries: the cost policy (the runtime's
default) at each most draft length. An `Agreement` says where a draft chose
the target's next token; `simulate` replays the decode loop on it through
the policy contract (`policy.DraftPolicy`, built by `policy_for` as the
engine builds it), priced and decided by the plan's cost table
(`costs.PassCosts`), and totals the rounds' cost. It runs no model. A
simulation's speedup is emitted tokens over cost in plain steps, on the
measured agreement pattern rather than an i.i.d. rate (`cost.iid_speedup`
is reported beside it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..costs import PassCosts, RuntimeCosts
from ..draft import Draft
from ..plan import DraftPlan, ignored_fields
from ..policy import policy_for


@dataclass(frozen=True)
class Policy:
    """A draft-length policy: the plan fields that say how many tokens a round drafts (`plan.DraftPlan`)."""

    draft_length: int
    policy: str = "cost"
    adaptive: bool = False
    threshold: float = 0.5
    target_acceptance: float = 0.8
    threshold_step: float = 0.05

    def __post_init__(self) -> None:
        self.plan()  # a policy that sets a field it ignores is refused, as a plan is

    @classmethod
    def from_plan(cls, plan: DraftPlan) -> "Policy":
        """The draft-length policy of `plan`, as a layer draft runs it (a field only an n-gram or recycled draft
        reads is left at its default)."""
        fields = {f.name: getattr(plan, f.name) for f in dataclasses.fields(cls)}
        layers_only = DraftPlan(exit_layer=1, draft_length=max(1, plan.draft_length), policy=plan.policy,
                                adaptive=plan.adaptive)
        defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.name in ignored_fields(layers_only)}
        return cls(**{**fields, **defaults})

    def plan(self, **fields: Any) -> DraftPlan:
        """A plan with this policy and `fields` (the draft's layers: an exit after layer 0 unless given)."""
        if "layers" not in fields and "exit_layer" not in fields:
            fields["exit_layer"] = 1
        return DraftPlan(**fields, **dataclasses.asdict(self))

    def plan_fields(self) -> dict[str, Any]:
        """The fields this policy reads (those it ignores hold their defaults, and are left out)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in ignored_fields(self.plan())}

    def describe(self) -> str:
        if self.policy == "cost":
            prior = f", prior {self.target_acceptance:g}" if self.target_acceptance != 0.8 else ""
            return f"k<={self.draft_length} by cost{prior}"
        if not self.adaptive:
            return f"k={self.draft_length}"
        if self.threshold_step == 0:
            return f"k<={self.draft_length}, stop below p={self.threshold:g}"
        return f"k<={self.draft_length}, adaptive (to acceptance {self.target_acceptance:g})"


def policy_grid(max_draft_length: int = 8) -> list[Policy]:
    """The cost policy (the runtime's default) with most draft lengths 1..max.

    Shorter first, so on a tie the shorter one is kept.
    """
    return [Policy(k) for k in range(1, max_draft_length + 1)]


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
    costs: PassCosts,
    exact_prefix: int = 0,
    prompt_lengths: Sequence[int] | None = None,
    carry: bool = False,
) -> Simulation:
    """Replay the engine's greedy decode loop for `policy` on measured agreements.

    `limits[i]`: max_new_tokens of sequence i (its generated length is
    len(matches[i]) + 1; fewer than the limit means EOS came first).
    `costs`: the plan's cost table (seconds; its draft step is the layer
    set's), which prices every round and which the cost policy decides
    with, as a generation wrapped with `costs=` that table does;
    `exact_prefix`: the layers a verify pass resumes after;
    `prompt_lengths[i]`: sequence i's prompt (the context a pass is priced at).
    The policy is the engine's (`policy_for`), through the contract the
    rounds use; like the engine's greedy calls (`wrap`'s default
    `reproducible=True`), each sequence starts afresh. `carry`: a cost policy
    carries what it learned from one sequence to the next, as greedy calls of
    a wrapper with `reproducible=False` do.
    """
    rounds = drafted_total = accepted_total = emitted_total = sequences = 0
    cost = 0.0
    plan = policy.plan()
    runtime = RuntimeCosts(costs, learn=False)
    carried = carry and plan.policy == "cost"
    shared = policy_for(plan, runtime, exact_prefix=exact_prefix) if carried else None
    for index, limit in enumerate(limits):
        generated = len(agreement.matches[index]) + 1
        runs = agreement.accepted_runs(index)
        state = shared or policy_for(plan, runtime, exact_prefix=exact_prefix)
        emitted = 1  # the prefill's token
        while emitted < generated:
            first = emitted - 1  # the round's first drafted token comes from generated input `first`
            context = (prompt_lengths[index] if prompt_lengths is not None else 0) + first
            state.begin_round(min(plan.draft_length, limit - emitted - 1), context=context)
            confidences: list[float] = []
            confidence = None
            while state.draft_next(len(confidences), confidence):
                confidence = agreement.confidence(index, first, len(confidences))
                confidence = 0.0 if confidence is None else confidence  # past the data (EOS came): unsure
                confidences.append(confidence)
            n = len(confidences)
            accepted = min(runs[first] if first < len(runs) else 0, n)
            draft_seconds = n * costs.draft_seconds(context)
            verify_seconds = costs.verify_seconds(n + 1, exact_prefix, context)
            cost += (draft_seconds + verify_seconds) / costs.step
            rounds += 1
            drafted_total += n
            accepted_total += accepted
            emitted = min(emitted + accepted + 1, generated)
            draft = Draft([0] * n, None, [], confidences=confidences)  # the tokens themselves do not matter here
            state.observe(draft, accepted, draft_seconds=draft_seconds, verify_seconds=verify_seconds, width=n + 1)
        emitted_total += generated
        sequences += 1
    return Simulation(rounds, drafted_total, accepted_total, emitted_total, sequences, cost)
