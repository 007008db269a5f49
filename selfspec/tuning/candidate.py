"""A scored layer set: its agreement, draft cost, best draft-length policy and simulated speedup.

What the proxy produces and the search, the confirmation and the report pass
around; it turns into a `DraftPlan`. It does no scoring of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..plan import DraftPlan
from .replay import Policy, Simulation


@dataclass
class Candidate:
    """One layer set, scored by the proxy with its best draft-length policy."""

    layers: tuple[int, ...]
    num_layers: int
    alpha: float  # per-position agreement of the draft with the target (greedy)
    draft_cost: float  # one drafted token, in plain steps
    exact_prefix: int
    policy: Policy
    simulation: Simulation
    iid_speedup: float  # best over k of the i.i.d. formula at this alpha
    iid_k: int
    source: str = ""

    @property
    def speedup(self) -> float:
        return self.simulation.speedup

    @property
    def is_early_exit(self) -> bool:
        return self.layers == tuple(range(len(self.layers)))

    def plan(self, *, policy: Policy | None = None, name: str = "") -> DraftPlan:
        """The plan the proxy scored, with the draft-length policy its replay ran (the runtime's cost policy)."""
        chosen = policy or self.policy
        if self.is_early_exit:
            return chosen.plan(exit_layer=len(self.layers), name=name)
        return chosen.plan(layers=self.layers, name=name)

    def describe_layers(self) -> str:
        if self.is_early_exit:
            return f"exit after layer {len(self.layers) - 1}"
        skipped = [i for i in range(self.num_layers) if i not in self.layers]
        return f"skip {layer_ranges(skipped)}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "layers": list(self.layers),
            "describe": self.describe_layers(),
            "kept": len(self.layers),
            "alpha": self.alpha,
            "draft_cost": self.draft_cost,
            "exact_prefix": self.exact_prefix,
            "policy": self.policy.plan_fields(),
            "proxy_acceptance": self.simulation.acceptance_rate,
            "proxy_tokens_per_pass": self.simulation.tokens_per_pass,
            "proxy_speedup": self.speedup,
            "iid_speedup": self.iid_speedup,
            "iid_k": self.iid_k,
            "source": self.source,
        }


def layer_ranges(indices: Sequence[int]) -> str:
    """[3, 4, 5, 9] -> '3-5,9' ('none' when empty)."""
    parts, run = [], []
    for i in indices:
        if run and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [i]
    if run:
        parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(parts) or "none"
