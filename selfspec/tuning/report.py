"""What `tune` found, for people and files: the result, its tables, the Pareto front, JSON and a PNG.

It formats and saves numbers the other steps measured; it measures nothing.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..plan import DraftPlan
from .candidate import Candidate, layer_ranges
from .confirm import Confirmation
from .cost import CostModel
from .proxy_check import ProxyCheck
from .replay import Policy


def pareto_front(candidates: Sequence[Candidate]) -> list[Candidate]:
    """Candidates no other beats on both agreement (higher) and draft cost (lower), cheapest first."""
    front: list[Candidate] = []
    for c in sorted(candidates, key=lambda c: (c.draft_cost, -c.alpha)):
        if not front or c.alpha > front[-1].alpha:
            front.append(c)
    return front


@dataclass
class TuneResult:
    """What `tune` found: the best plan, every candidate, the front, the timed confirmations."""

    best_plan: DraftPlan
    best: Confirmation | None
    candidates: list[Candidate]  # every layer set the search scored (search proxy), best first
    ranked: list[Candidate]  # the best of them re-scored by the exact proxy, best first
    front: list[Candidate]
    confirmations: list[Confirmation]
    proxy_check: ProxyCheck | None
    cost_model: CostModel
    settings: dict[str, Any]
    timings: dict[str, float]
    calibration_tokens: int = 0
    plain_tokens_per_second: float = 0.0

    def table(self, *, top: int = 10) -> str:
        """Markdown: the timed plans, then the best plans by proxy, then the Pareto front."""
        lines = [
            "| plan | layers kept | policy | proxy alpha | proxy acceptance | real acceptance | "
            "tokens/pass (proxy / real) | tok/s | speedup (proxy / real) | identical |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for c in self.confirmations:
            kept = "-" if not c.plan.drafts else f"{len(c.plan.draft_layers(self.cost_model.num_layers))}"
            policy = "-" if not c.plan.drafts else Policy.from_plan(c.plan).describe()
            if c.proxy is None:
                proxy = ("-", "-", "-", "-")
            else:
                proxy = (
                    f"{c.proxy_alpha:.3f}",
                    f"{c.proxy.acceptance_rate:.3f}",
                    f"{c.proxy.tokens_per_pass:.2f}",
                    f"{c.proxy.speedup:.2f}x",
                )
            lines.append(
                f"| {c.label}: {_plan_words(c.plan, self.cost_model.num_layers)} | {kept} | {policy} | {proxy[0]} | "
                f"{proxy[1]} | {c.stats.acceptance_rate:.3f} | {proxy[2]} / {c.stats.tokens_per_pass:.2f} | "
                f"{c.stats.tokens_per_second:.2f} | {proxy[3]} / {c.speedup:.2f}x | {c.identical}/{c.prompts} |"
            )
        out = ["### Timed on held-out prompts (greedy; speedup over the engine's plain path)", "", *lines, ""]
        out += [
            f"### Best {min(top, len(self.ranked))} of {len(self.candidates)} layer sets by the exact proxy",
            "",
            "| # | layers | kept | policy | alpha | proxy acceptance | tokens/pass | draft cost | proxy speedup | "
            "i.i.d. speedup (k) | found by |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for rank, c in enumerate(self.ranked[:top], 1):
            out.append(
                f"| {rank} | {c.describe_layers()} | {len(c.layers)} | {c.policy.describe()} | {c.alpha:.3f} | "
                f"{c.simulation.acceptance_rate:.3f} | {c.simulation.tokens_per_pass:.2f} | {c.draft_cost:.3f} | "
                f"{c.speedup:.3f}x | {c.iid_speedup:.3f}x ({c.iid_k}) | {c.source} |"
            )
        out += ["", "### Pareto front: agreement against draft cost", ""]
        out += ["| draft cost | alpha | kept | layers | proxy speedup |", "|---|---|---|---|---|"]
        for c in self.front:
            out.append(
                f"| {c.draft_cost:.3f} | {c.alpha:.3f} | {len(c.layers)} | {c.describe_layers()} | {c.speedup:.3f}x |"
            )
        return "\n".join(out)

    def to_dict(self) -> dict[str, Any]:
        return {
            "best_plan": self.best_plan.to_dict(),
            "best": None if self.best is None else self.best.to_dict(),
            "settings": self.settings,
            "timings_seconds": self.timings,
            "calibration_tokens": self.calibration_tokens,
            "plain_tokens_per_second": self.plain_tokens_per_second,
            "cost_model": self.cost_model.to_dict(),
            "confirmations": [c.to_dict() for c in self.confirmations],
            "proxy_check": None if self.proxy_check is None else self.proxy_check.to_dict(),
            "front": [c.to_dict() for c in self.front],
            "ranked": [c.to_dict() for c in self.ranked],
            "candidates": [c.to_dict() for c in self.candidates],
        }

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n", encoding="utf-8")

    def plot(self, path: str | os.PathLike, *, title: str = "") -> bool:
        """The acceptance-versus-draft-cost plot as a PNG; False when matplotlib is not installed."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return False
        fig, ax = plt.subplots(figsize=(7, 5), dpi=120)
        sources = sorted({c.source for c in self.candidates})
        for source in sources:
            group = [c for c in self.candidates if c.source == source]
            ax.scatter([c.draft_cost for c in group], [c.alpha for c in group], s=12, alpha=0.6, label=source)
        ax.plot(
            [c.draft_cost for c in self.front],
            [c.alpha for c in self.front],
            "k-",
            lw=1,
            drawstyle="steps-post",
            label="Pareto front",
        )
        # Above this line a one-token draft pays for itself: (1 + alpha) / (c + verify(1)) > 1.
        costs = [min(c.draft_cost for c in self.candidates), max(c.draft_cost for c in self.candidates)]
        ax.plot(costs, [c + self.cost_model.verify(1) - 1 for c in costs], "r--", lw=1, label="break-even at k=1")
        for c in self.confirmations:
            if c.candidate is not None:
                ax.annotate(
                    f"{c.label}: {c.speedup:.2f}x",
                    (c.candidate.draft_cost, c.candidate.alpha),
                    xytext=(6, -10),
                    textcoords="offset points",
                    fontsize=8,
                )
                ax.scatter([c.candidate.draft_cost], [c.candidate.alpha], s=40, facecolors="none", edgecolors="red")
        ax.set_xlabel("draft cost per token (fraction of a plain step)")
        ax.set_ylabel("agreement with the target (proxy alpha)")
        ax.set_title(title or "selfspec tune: acceptance against draft cost")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
        return True


def _plan_words(plan: DraftPlan, num_layers: int) -> str:
    if not plan.drafts:
        return "plain"
    if plan.exit_layer is not None:
        return f"exit after layer {plan.exit_layer - 1}"
    skipped = [i for i in range(num_layers) if i not in plan.draft_layers(num_layers)]
    return f"skip {layer_ranges(skipped)}"
