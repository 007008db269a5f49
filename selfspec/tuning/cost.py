"""The tuner's prices: the runtime's own measured pass costs, for any layer set.

`measure_cost_model` asks the engine (`SelfSpecModel.measure_costs`, the
table a generation decides with, cached alike) for the verify passes and for
two draft steps: an exit after layer 0 and one after the last layer. A draft
of n layers is priced between the two, linear in n (each layer reads the
same weights). `CostModel.table` is then the `PassCosts` table a plan of that
many layers runs with, which the replay prices and decides with. The i.i.d.
formulas (Leviathan et al.) turn an agreement rate into an expected speedup,
for comparison. This module knows nothing about which layers a draft runs or
how well they agree with the target.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from ..costs import PassCosts
from ..engine import wrap
from ..plan import DraftPlan


@dataclass(frozen=True)
class CostModel:
    """The runtime's pass costs (`passes`, seconds by verify width), and the draft step through 1 and through
    every layer (`draft_first`, `draft_all`, seconds at `passes.context`, each with the final norm and LM head).

    `draft_step(n)` and `verify(drafted)` are in plain steps (one token through the full model).
    """

    passes: PassCosts
    draft_first: float
    draft_all: float
    dtype: str = ""
    threads: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.draft_first <= self.draft_all:
            raise ValueError(f"draft steps must satisfy 0 <= draft_first <= draft_all, got {self.draft_first} and "
                             f"{self.draft_all}")

    @property
    def num_layers(self) -> int:
        return self.passes.num_layers

    @property
    def max_draft_length(self) -> int:
        return self.passes.max_width - 1

    @property
    def plain_step_seconds(self) -> float:
        return self.passes.step

    def draft_seconds(self, num_draft_layers: int) -> float:
        """One drafted token through `num_draft_layers` layers and the LM head, in seconds."""
        if self.num_layers <= 1:
            return self.draft_all
        share = (num_draft_layers - 1) / (self.num_layers - 1)
        return self.draft_first + share * (self.draft_all - self.draft_first)

    def table(self, num_draft_layers: int) -> PassCosts:
        """The cost table a plan whose draft runs `num_draft_layers` layers decides with (`costs.PassCosts`)."""
        draft = self.draft_seconds(num_draft_layers)
        long = draft * self.passes.verify_long[0] / self.passes.step if self.passes.verify_long else 0.0
        return dataclasses.replace(self.passes, draft_step=draft, draft_long=long)

    def draft_step(self, num_draft_layers: int) -> float:
        """One drafted token through `num_draft_layers` layers and the LM head, in plain steps."""
        return self.draft_seconds(num_draft_layers) / self.passes.step

    def verify(self, drafted: int, exact_prefix: int = 0) -> float:
        """One verify pass over the last token and `drafted` tokens, resuming after the plan's exact prefix, in
        plain steps."""
        return self.passes.verify_seconds(drafted + 1, exact_prefix if drafted else 0) / self.passes.step

    def round_cost(self, drafted: int, num_draft_layers: int, exact_prefix: int) -> float:
        return drafted * self.draft_step(num_draft_layers) + self.verify(drafted, exact_prefix)

    def to_dict(self) -> dict[str, Any]:
        return {"passes": self.passes.to_dict(), "draft_first": self.draft_first, "draft_all": self.draft_all,
                "dtype": self.dtype, "threads": self.threads,
                "verify_full": [self.verify(k) for k in range(self.max_draft_length + 1)]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CostModel":
        return cls(PassCosts.from_dict(data["passes"]), float(data["draft_first"]), float(data["draft_all"]),
                   dtype=data.get("dtype", ""), threads=int(data.get("threads", 0)))

    def summary(self) -> str:
        verify = ", ".join(f"{k}: {self.verify(k):.2f}" for k in range(1, self.max_draft_length + 1))
        return (
            f"plain step {self.passes.step * 1e3:.2f} ms ({self.dtype}, {self.threads} threads); in plain steps: "
            f"a draft step through 1 layer {self.draft_step(1):.3f}, through all {self.num_layers} "
            f"{self.draft_step(self.num_layers):.3f}; verify(k) {verify} [{self.passes.source}; {self.passes.machine}]"
        )


def measure_cost_model(model, *, max_draft_length: int = 8, repeats: int = 3, cached: bool = True) -> CostModel:
    """The runtime's cost tables for `model` on this machine, in its dtype (`SelfSpecModel.measure_costs`).

    `cached`: read (and keep) the tables a generation uses, as the engine does; False measures afresh
    (and replaces the cached tables, `SelfSpecModel.measure_costs`).
    """

    def measured(exit_layer: int) -> PassCosts:
        plan = DraftPlan(exit_layer=exit_layer, draft_length=max_draft_length, name=f"tune-exit-{exit_layer}")
        return wrap(model, plan=plan).measure_costs(cached=cached, repeats=repeats)

    spec_first = measured(1)
    num_layers = spec_first.num_layers
    passes = spec_first.passes_only()
    last = passes.with_draft(measured(num_layers).draft_only())  # the full draft, as a share of these passes' step
    dtype = next(model.parameters()).dtype
    return CostModel(passes, spec_first.draft_step, max(spec_first.draft_step, last.draft_step),
                     dtype=str(dtype).removeprefix("torch."), threads=torch.get_num_threads())


def expected_tokens_per_round(alpha: float, k: int) -> float:
    """Tokens emitted per round with k drafted tokens, each accepted i.i.d. with probability alpha."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def iid_speedup(alpha: float, k: int, *, draft_step: float, verify: float) -> float:
    """Leviathan et al.'s expected speedup: tokens per round over the round's cost in plain steps."""
    return expected_tokens_per_round(alpha, k) / (k * draft_step + verify)
