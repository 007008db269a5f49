"""Timed confirmation: greedy generation of each plan against the plain path, on held-out prompts.

The plain path and the plans run interleaved in one process, and every output
is checked against the plain path's. It measures what it runs and nothing
else: it does not know the proxy (a confirmation only carries the proxy's
numbers for the report) and does not choose a plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from ..engine import wrap
from ..plan import DraftPlan
from ..stats import GenerationStats
from .candidate import Candidate
from ..prompts import as_ids
from .replay import Simulation


@dataclass
class Confirmation:
    """Timed greedy generation of one plan on the confirmation prompts."""

    label: str
    plan: DraftPlan
    # Summed over every timed generation: tokens, drafted, accepted, verify passes and times
    # (total_seconds), with the derived rates (tokens_per_second, acceptance_rate, tokens_per_pass).
    stats: GenerationStats = field(default_factory=GenerationStats)
    identical: int = 0  # prompts whose output equals the plain path's
    prompts: int = 0
    speedup: float = 0.0  # tokens/s over the plain path's, same prompts, same process
    candidate: Candidate | None = None  # the searched layer set it came from, if any
    proxy: Simulation | None = None  # the exact proxy's replay of this plan on the calibration prompts
    proxy_alpha: float | None = None

    @property
    def lossless(self) -> bool:
        return self.identical == self.prompts

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "plan": self.plan.to_dict(),
            "new_tokens": self.stats.new_tokens,
            "seconds": self.stats.total_seconds,
            "tokens_per_second": self.stats.tokens_per_second,
            "acceptance_rate": self.stats.acceptance_rate,
            "tokens_per_pass": self.stats.tokens_per_pass,
            "draft_seconds": self.stats.draft_seconds,
            "verify_seconds": self.stats.verify_seconds,
            "identical": f"{self.identical}/{self.prompts}",
            "speedup": self.speedup,
            "candidate": None if self.candidate is None else self.candidate.to_dict(),
            "proxy_alpha": self.proxy_alpha,
            "proxy_acceptance": None if self.proxy is None else self.proxy.acceptance_rate,
            "proxy_tokens_per_pass": None if self.proxy is None else self.proxy.tokens_per_pass,
            "proxy_speedup": None if self.proxy is None else self.proxy.speedup,
        }


def confirm_plans(
    model,
    plans: Sequence[tuple[str, DraftPlan]],
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int = 48,
    repeats: int = 1,
    progress: bool = True,
) -> list[Confirmation]:
    """Time greedy generation of each plan against the plain path, interleaved, on the same prompts.

    The plain path runs first on every prompt (its output is the reference);
    the other plans follow in an order that rotates from prompt to prompt, so
    a burst of load on a shared machine does not always hit the same plan.
    """
    entries = [("plain", DraftPlan.plain())] + [p for p in plans if p[1].drafts]
    wrapped = [wrap(model, plan=plan) for _, plan in entries]
    results = [Confirmation(label, plan) for label, plan in entries]
    warm = torch.tensor([as_ids(prompts[0])[:8]])
    for spec in wrapped:  # warmup: first calls allocate
        spec.generate(warm, max_new_tokens=4, do_sample=False)
    total = repeats * len(prompts) * len(entries)
    with tqdm(total=total, desc="confirmation (timed)", disable=not progress, leave=False) as bar:
        for repeat in range(repeats):
            for p, prompt in enumerate(prompts):
                ids = torch.tensor([as_ids(prompt)])
                reference = None
                others = list(range(1, len(entries)))
                shift = (p + repeat) % max(1, len(others))
                for index in [0] + others[shift:] + others[:shift]:
                    spec, result = wrapped[index], results[index]
                    out = spec.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
                    stats, total = spec.last_stats, result.stats
                    if index == 0:
                        reference = out
                    total.new_tokens += stats.new_tokens
                    total.total_seconds += stats.total_seconds
                    total.drafted += stats.drafted
                    total.accepted += stats.accepted
                    total.verify_passes += stats.verify_passes
                    total.draft_seconds += stats.draft_seconds
                    total.verify_seconds += stats.verify_seconds
                    result.identical += bool(torch.equal(out, reference))
                    result.prompts += 1
                    bar.update(1)
    plain_speed = results[0].stats.tokens_per_second
    for result in results:
        result.speedup = result.stats.tokens_per_second / plain_speed if plain_speed else 0.0
    return results
