"""How well the proxy predicts real acceptance: the same plans, real greedy generation, the same prompts.

It runs a few plans spread over the agreement range for real on calibration
prompts and compares them with the proxy's simulation of the same policy
(and, for comparison, with the cruder proxies). It times nothing and plays no
part in choosing a plan.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from ..engine import wrap
from .candidate import Candidate
from .proxy import ProxyEvaluator
from .replay import Policy


@dataclass
class ProxyCheck:
    """How well the proxy predicts real acceptance: the same plans, the same prompts, real generation."""

    draft_length: int
    sequences: int
    rows: list[dict[str, Any]] = field(default_factory=list)

    def correlation(self, proxy_key: str, real_key: str = "real_acceptance") -> float | None:
        xs = [r[proxy_key] for r in self.rows if r.get(proxy_key) is not None]
        ys = [r[real_key] for r in self.rows if r.get(proxy_key) is not None]
        if len(xs) < 3 or len(set(xs)) < 2 or len(set(ys)) < 2:
            return None
        return statistics.correlation(xs, ys)

    def mean_abs_error(self, proxy_key: str, real_key: str = "real_acceptance") -> float | None:
        pairs = [(r[proxy_key], r[real_key]) for r in self.rows if r.get(proxy_key) is not None]
        return sum(abs(a - b) for a, b in pairs) / len(pairs) if pairs else None

    PROXIES = {
        "proxy_acceptance": "rounds (the search's proxy)",
        "round_start_acceptance": "round starts only",
        "teacher_acceptance": "teacher-forced",
    }

    def to_dict(self) -> dict[str, Any]:
        summary = {}
        for key in self.PROXIES:
            summary[key] = {"pearson_r": self.correlation(key), "mean_abs_error": self.mean_abs_error(key)}
        summary["proxy_tokens_per_pass"] = {
            "pearson_r": self.correlation("proxy_tokens_per_pass", "real_tokens_per_pass"),
            "mean_abs_error": self.mean_abs_error("proxy_tokens_per_pass", "real_tokens_per_pass"),
        }
        return {"draft_length": self.draft_length, "sequences": self.sequences, "rows": self.rows, "summary": summary}

    def summary(self) -> str:
        def fmt(value):
            return "n/a" if value is None else f"{value:.3f}"

        parts = [
            f"{words}: r={fmt(self.correlation(key))}, MAE={fmt(self.mean_abs_error(key))}"
            for key, words in self.PROXIES.items()
        ]
        tau = "proxy_tokens_per_pass", "real_tokens_per_pass"
        return (
            f"proxy check ({len(self.rows)} plans, k={self.draft_length}, {self.sequences} calibration prompts), "
            f"acceptance against real: {'; '.join(parts)}; tokens/pass: r={fmt(self.correlation(*tau))}, "
            f"MAE={fmt(self.mean_abs_error(*tau))}"
        )


def check_proxy(
    model,
    evaluator: ProxyEvaluator,
    candidates: Sequence[Candidate],
    *,
    plans: int = 6,
    sequences: int = 4,
    draft_length: int = 4,
    alternatives: bool = True,
    progress: bool = True,
) -> ProxyCheck:
    """Real greedy generation on calibration prompts for `plans` layer sets spread over the agreement range.

    Every plan runs the cost policy with the same most draft length, deciding
    with the cost table the proxy prices it with (injected, so the real run
    decides as the replay does), and the proxy simulates that same policy on
    the same prompts, so the difference is the proxy's alone.
    With `alternatives`, the cruder proxies (round starts only, teacher
    forcing) are scored on the same plans for comparison.
    """
    chosen = _spread(candidates, plans)
    indices = list(range(min(sequences, len(evaluator.calibration))))
    policy = Policy(draft_length)
    others = {}
    if alternatives:
        subset = [evaluator.calibration[i] for i in indices]
        for key, context in (("round_start_acceptance", "target"), ("teacher_acceptance", "draft")):
            others[key] = ProxyEvaluator(model, subset, evaluator.cost_model, context=context, policies=[policy])
    check = ProxyCheck(draft_length, len(indices))
    runs = len(chosen) * len(indices)
    with tqdm(total=runs, desc="proxy check (real runs)", disable=not progress, leave=False) as bar:
        for candidate in chosen:
            spec = wrap(model, plan=candidate.plan(policy=policy),
                        costs=evaluator.cost_model.table(len(candidate.layers)))
            drafted = accepted = new_tokens = passes = same = 0
            for i in indices:
                seq = evaluator.calibration[i]
                ids = torch.tensor([list(seq.tokens[: seq.prompt_length])])
                out = spec.generate(ids, max_new_tokens=seq.max_new_tokens, do_sample=False)
                stats = spec.last_stats
                drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
                new_tokens, passes = new_tokens + stats.new_tokens, passes + stats.verify_passes
                same += out[0].tolist() == list(seq.tokens)
                bar.update(1)
            sim = evaluator.simulate(candidate.layers, policy, sequences=indices)
            row = {
                "layers": list(candidate.layers),
                "describe": candidate.describe_layers(),
                "alpha": candidate.alpha,
                "proxy_acceptance": sim.acceptance_rate,
                "proxy_tokens_per_pass": sim.tokens_per_pass,
                "real_acceptance": accepted / drafted if drafted else 0.0,
                "real_tokens_per_pass": new_tokens / passes if passes else 0.0,
                "identical": f"{same}/{len(indices)}",
            }
            for key, other in others.items():
                row[key] = other.simulate(candidate.layers, policy).acceptance_rate
            check.rows.append(row)
    return check


def _spread(candidates: Sequence[Candidate], count: int) -> list[Candidate]:
    """Up to `count` candidates spread evenly over the agreement range, the best one included."""
    if count <= 0 or not candidates:
        return []
    by_alpha = sorted({c.layers: c for c in candidates}.values(), key=lambda c: c.alpha)
    chosen = {candidates[0].layers: candidates[0]}
    for j in range(count):
        if len(chosen) >= count:
            break
        c = by_alpha[round(j * (len(by_alpha) - 1) / max(1, count - 1))]
        chosen.setdefault(c.layers, c)
    return sorted(chosen.values(), key=lambda c: c.alpha)
