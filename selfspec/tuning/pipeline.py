"""The whole search, in order; `TuneConfig` says how hard to look.

1. Calibration (`calibration`): the target's own greedy continuations of the
   prompts, from the engine's plain path.
2. Costs (`cost`): the runtime's measured pass costs on this machine.
3. Search (`layer_search`), scored by the acceptance proxy (`proxy`), whose
   rounds are replayed with the runtime's cost policy (`replay`).
4. Re-scoring: the best layer sets and the Pareto front, by the exact proxy.
5. Proxy check (`proxy_check`): a few plans run for real.
6. Confirmation (`confirm`): the best few timed against the plain path on
   held-out prompts; the fastest measured plan wins, written with the
   default (cost) policy.

`tune` runs the other modules' steps and holds none of their logic. What it
does not know: sampling, logits processors, batch sizes above 1, anything
about the machine beyond what it measures here.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from ..plan import MAX_DRAFT_LENGTH
from ..registry import adapter_for
from .calibration import CalibrationSequence, make_calibration
from .candidate import Candidate
from .confirm import Confirmation, confirm_plans
from .cost import CostModel, measure_cost_model
from .layer_search import OPTIMIZERS, OPTUNA_SAMPLERS, search
from .proxy import ProxyEvaluator
from .proxy_check import check_proxy
from .replay import Policy
from .report import TuneResult, pareto_front

SEARCH_PROXIES = ("target", "rounds")  # ProxyEvaluator contexts the search can use


@dataclass(frozen=True)
class TuneConfig:
    """How `tune` searches: every option of the search, validated, and serialisable (`to_dict`).

    `budget`: layer sets the search scores with the `search_proxy` ("target":
    round starts only, one pass per set; "rounds": exact, slower); the best
    `rescore` of them and the Pareto front are then re-scored with the exact
    proxy, which ranks them. `confirm`: how many of the best (by proxy) to
    time, against the plain path and (with `include_default`) the adapter's
    current plan. `proxy_check`: how many plans to also run for real on
    `proxy_check_prompts` calibration prompts, to measure the proxy's error
    (0 to skip). `name`: the name the chosen plan gets.
    """

    max_new_tokens: int = 48
    budget: int = 200
    optimizer: str = "greedy"
    optuna_sampler: str = "tpe"
    search_proxy: str = "target"
    rescore: int = 24
    confirm: int = 3
    confirm_repeats: int = 1
    proxy_check: int = 6
    proxy_check_prompts: int = 4
    max_draft_length: int = 8
    keep_ends: bool = True
    seed: int = 0
    name: str = "tuned"
    include_default: bool = True
    cost_repeats: int = 3  # the runtime's `SelfSpecModel.measure_costs(repeats=)`
    trees: tuple[int, ...] = ()  # node budgets: the best plan is also timed with n-gram lookup as trees of this size
    recycle: bool = False  # ... and each tree budget also with recycled trees (`recycle=True`)

    TREE_NGRAM = 3  # the n-gram lookup a tree variant adds

    def __post_init__(self) -> None:
        minimum = dict(max_new_tokens=2, budget=1, rescore=0, confirm=0, confirm_repeats=1, proxy_check=0,
                       proxy_check_prompts=1, max_draft_length=1, cost_repeats=1, seed=0)
        for key, low in minimum.items():
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{key} must be an integer, got {value!r}")
            if value < low:
                raise ValueError(f"{key}={value} out of range (valid: >= {low})")
        if not isinstance(self.trees, (tuple, list)) or any(isinstance(t, bool) or not isinstance(t, int)
                                                             or not 0 <= t <= MAX_DRAFT_LENGTH for t in self.trees):
            raise ValueError(f"trees must be node budgets 0..{MAX_DRAFT_LENGTH} (0: n-gram chains), got {self.trees!r}")
        object.__setattr__(self, "trees", tuple(self.trees))
        if not isinstance(self.recycle, bool):
            raise ValueError(f"recycle must be True or False, got {self.recycle!r}")
        if self.recycle and not any(self.trees):
            raise ValueError(f"recycle=True times recycled trees: it needs a tree budget > 0 in trees, got {self.trees!r}")
        for key, valid in (("optimizer", OPTIMIZERS), ("optuna_sampler", OPTUNA_SAMPLERS),
                           ("search_proxy", SEARCH_PROXIES)):
            if getattr(self, key) not in valid:
                raise ValueError(f"{key}={getattr(self, key)!r} is not known (valid: {', '.join(valid)})")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def tune(
    model,
    *,
    prompts: Sequence[Sequence[int]],
    heldout: Sequence[Sequence[int]] | None = None,
    config: TuneConfig | None = None,
    cost_model: CostModel | None = None,
    progress: bool = True,
    **options,
) -> TuneResult:
    """Search a plan for `model` on `prompts` (token ids) and confirm the best few by timed runs.

    `heldout`: prompts for the timed confirmation (default: `prompts`; held-out
    prompts keep the choice honest). `config`: the search's options
    (`TuneConfig`); `options` replace single fields of it, so
    `tune(model, prompts=p, budget=50)` works too. `cost_model`: a measured
    cost model to reuse instead of measuring one.
    """
    config = dataclasses.replace(config or TuneConfig(), **options)
    if not prompts:
        raise ValueError("tune needs at least one prompt")
    say, laps = _sayer(progress), _Laps()

    calibration, plain_speed = make_calibration(model, prompts, max_new_tokens=config.max_new_tokens,
                                                progress=progress)
    tokens = sum(s.generated for s in calibration)
    say(f"calibration: {len(calibration)} prompts, {tokens} target tokens, plain path {plain_speed:.2f} tok/s")
    laps.lap("calibration")

    if cost_model is None:
        cost_model = measure_cost_model(model, max_draft_length=config.max_draft_length,
                                        repeats=config.cost_repeats)
    say(f"cost model: {cost_model.summary()}")
    laps.lap("cost_model")

    evaluator = ProxyEvaluator(model, calibration, cost_model, context=config.search_proxy)
    candidates = search(evaluator, optimizer=config.optimizer, budget=config.budget, seed=config.seed,
                        keep_ends=config.keep_ends, optuna_sampler=config.optuna_sampler, progress=progress)
    laps.lap("search")

    exact, ranked = rescore(model, calibration, cost_model, evaluator, candidates, config, progress)
    if exact is not evaluator:
        laps.lap("rescore")
    best = ranked[0]
    say(f"search: {len(candidates)} layer sets ({config.search_proxy} proxy), {len(ranked)} re-scored; best: "
        f"{best.describe_layers()} ({len(best.layers)} layers), {best.policy.describe()}, proxy {best.speedup:.2f}x")

    check = None
    if config.proxy_check > 0:
        check = check_proxy(model, exact, ranked, plans=config.proxy_check, sequences=config.proxy_check_prompts,
                            progress=progress)
        say(check.summary())
        laps.lap("proxy_check")

    confirmations: list[Confirmation] = []
    chosen: Confirmation | None = None
    chosen_plan = best.plan(name=config.name)
    if config.confirm > 0:
        confirmations = confirm_ranked(model, exact, ranked, heldout or prompts, config, progress)
        chosen = choose(confirmations, cost_model.dtype, say)
        chosen_plan = dataclasses.replace(chosen.plan, name=config.name)
        laps.lap("confirmation")

    settings = {**config.to_dict(), "prompts": len(prompts), "heldout": len(heldout or []),
                "threads": torch.get_num_threads(), "dtype": cost_model.dtype}
    if config.optimizer != "optuna":
        settings["optuna_sampler"] = None
    return TuneResult(
        best_plan=chosen_plan,
        best=chosen,
        candidates=candidates,
        ranked=ranked,
        front=pareto_front(candidates),
        confirmations=confirmations,
        proxy_check=check,
        cost_model=cost_model,
        settings=settings,
        timings=laps.timings,
        calibration_tokens=tokens,
        plain_tokens_per_second=plain_speed,
    )


def rescore(model, calibration: Sequence[CalibrationSequence], cost_model: CostModel, evaluator: ProxyEvaluator,
            candidates: list[Candidate], config: TuneConfig,
            progress: bool) -> tuple[ProxyEvaluator, list[Candidate]]:
    """(the exact evaluator, its candidates best first): the search's best and its front, scored exactly.

    With `search_proxy="rounds"` the search already scored exactly, and its
    evaluator and candidates are returned as they are.
    """
    if config.search_proxy == "rounds":
        return evaluator, candidates
    exact = ProxyEvaluator(model, calibration, cost_model, context="rounds")
    pool = {c.layers: c for c in [*candidates[: config.rescore], *pareto_front(candidates)]}
    for c in tqdm(pool.values(), desc="re-scoring (exact proxy)", disable=not progress, leave=False):
        exact.evaluate(c.layers, source=c.source)
    return exact, exact.evaluated


def confirm_ranked(model, exact: ProxyEvaluator, ranked: list[Candidate], prompts: Sequence[Sequence[int]],
                   config: TuneConfig, progress: bool) -> list[Confirmation]:
    """Time the `config.confirm` best plans (and the adapter's default) against the plain path on `prompts`."""
    entries = [(f"#{r}", c.plan(name=f"{config.name}-{r}")) for r, c in enumerate(ranked[: config.confirm], 1)]
    tuned = {label: c for (label, _), c in zip(entries, ranked)}
    if ranked and config.trees:  # the best plan with n-gram lookup first, as chains (0) or trees of each budget
        best = entries[0][1] if entries else ranked[0].plan(name=f"{config.name}-1")
        for nodes in config.trees:
            for recycle in (False, True) if nodes and config.recycle else (False,):
                label = "#1+ngram" + (f"+tree{nodes}" if nodes else "") + ("+recycle" if recycle else "")
                entries.append((label, dataclasses.replace(best, ngram=config.TREE_NGRAM, tree=nodes, recycle=recycle,
                                                           name=f"{best.name}-{label[3:]}")))
                tuned[label] = ranked[0]
    if config.include_default:
        entries.append(("default", adapter_for(model).plan_for(model.config)))
    confirmations = confirm_plans(model, entries, prompts, max_new_tokens=config.max_new_tokens,
                                  repeats=config.confirm_repeats, progress=progress)
    for c in confirmations:
        c.candidate = tuned.get(c.label, c.candidate)
        if c.plan.drafts:
            layers = c.plan.draft_layers(exact.num_layers)
            c.proxy = exact.simulate(layers, Policy.from_plan(c.plan))
            c.proxy_alpha = exact.agreement(layers).alpha
    return confirmations


def choose(confirmations: list[Confirmation], dtype: str, say: Callable[[str], None]) -> Confirmation:
    """The fastest tuned plan, measured.

    In float32/float64 an output that differs from the plain path's is a bug,
    and the plan is passed over. In bfloat16/float16 a verify pass over k+1
    tokens may round differently from a one-token step and flip a near-tie,
    so there a difference is reported but does not disqualify.
    """
    tuned = [c for c in confirmations if c.candidate is not None]
    exact_arithmetic = dtype in ("float32", "float64")
    eligible = ([c for c in tuned if c.lossless] if exact_arithmetic else tuned) or tuned
    chosen = max(eligible, key=lambda c: c.stats.tokens_per_second)
    if not all(c.lossless for c in confirmations):
        why = "" if exact_arithmetic else f" ({dtype}: near-ties can round differently in multi-token verify passes)"
        say(f"warning: some outputs differ from the plain path's{why}; see the 'identical' column")
    if chosen.speedup < 1.0:
        say(f"warning: no tuned plan beat the plain path here (best {chosen.speedup:.2f}x)")
    return chosen


class _Laps:
    """Seconds spent in each named step."""

    def __init__(self) -> None:
        self.timings: dict[str, float] = {}
        self._clock = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.timings[name] = now - self._clock
        self._clock = now


def _sayer(progress: bool) -> Callable[[str], None]:
    def say(message: str) -> None:
        if progress:
            tqdm.write(f"selfspec tune: {message}", file=sys.stderr)

    return say
