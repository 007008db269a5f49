"""The whole search, in order: calibration, cost model, search, exact re-scoring, proxy check, confirmation.

`tune` runs the steps of the other modules and picks the fastest confirmed
plan; it holds none of their logic itself.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable, Sequence

import torch
from tqdm.auto import tqdm

from ..registry import adapter_for
from .calibration import make_calibration
from .confirm import Confirmation, confirm_plans
from .cost import CostModel, measure_cost_model
from .layer_search import search
from .proxy import ProxyEvaluator
from .proxy_check import check_proxy
from .replay import Policy
from .report import TuneResult, _policy_fields, pareto_front


def tune(
    model,
    *,
    prompts: Sequence[Sequence[int]],
    heldout: Sequence[Sequence[int]] | None = None,
    max_new_tokens: int = 48,
    budget: int = 200,
    optimizer: str = "greedy",
    optuna_sampler: str = "tpe",
    search_proxy: str = "target",
    rescore: int = 24,
    confirm: int = 3,
    confirm_repeats: int = 1,
    proxy_check: int = 6,
    proxy_check_prompts: int = 4,
    max_draft_length: int = 8,
    keep_ends: bool = True,
    seed: int = 0,
    name: str = "tuned",
    include_default: bool = True,
    cost_model: CostModel | None = None,
    cost_repeats: int = 15,
    progress: bool = True,
) -> TuneResult:
    """Search a plan for `model` on `prompts` (token ids) and confirm the best few by timed runs.

    `heldout`: prompts for the timed confirmation (default: `prompts`; held-out
    prompts keep the choice honest). `budget`: layer sets the search scores
    with the `search_proxy` ("target": round starts only, one pass per set;
    "rounds": exact, slower); the best `rescore` of them and the Pareto front
    are then re-scored with the exact proxy, which ranks them.
    `confirm`: how many of the best (by proxy) to time, against the plain path
    and (with `include_default`) the adapter's current plan. `proxy_check`: how
    many plans to also run for real on `proxy_check_prompts` calibration
    prompts, to measure the proxy's error (0 to skip).
    """
    if not prompts:
        raise ValueError("tune needs at least one prompt")
    if max_new_tokens < 2:
        raise ValueError(f"max_new_tokens={max_new_tokens} out of range (valid: >= 2)")
    timings: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(name_: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        timings[name_] = now - clock
        clock = now

    say = _sayer(progress)
    calibration, plain_speed = make_calibration(model, prompts, max_new_tokens=max_new_tokens, progress=progress)
    tokens = sum(s.generated for s in calibration)
    say(f"calibration: {len(calibration)} prompts, {tokens} target tokens, plain path {plain_speed:.2f} tok/s")
    lap("calibration")
    if cost_model is None:
        cost_model = measure_cost_model(
            model, max_draft_length=max_draft_length, repeats=cost_repeats, progress=progress
        )
    say(f"cost model: {cost_model.summary()}")
    lap("cost_model")
    evaluator = ProxyEvaluator(model, calibration, cost_model, context=search_proxy)
    candidates = search(
        evaluator,
        optimizer=optimizer,
        budget=budget,
        seed=seed,
        keep_ends=keep_ends,
        optuna_sampler=optuna_sampler,
        progress=progress,
    )
    lap("search")
    if search_proxy == "rounds":
        exact, ranked = evaluator, candidates
    else:
        # The search proxy ranks layer sets; the exact one re-scores the best few (and the front)
        # and picks each one's draft-length policy.
        exact = ProxyEvaluator(model, calibration, cost_model, context="rounds")
        pool = {c.layers: c for c in [*candidates[:rescore], *pareto_front(candidates)]}
        for c in tqdm(pool.values(), desc="re-scoring (exact proxy)", disable=not progress, leave=False):
            exact.evaluate(c.layers, source=c.source)
        ranked = exact.evaluated
        lap("rescore")
    best = ranked[0]
    say(
        f"search: {len(candidates)} layer sets ({search_proxy} proxy), {len(ranked)} re-scored; best: "
        f"{best.describe_layers()} ({len(best.layers)} layers), {best.policy.describe()}, proxy {best.speedup:.2f}x"
    )
    check = None
    if proxy_check > 0:
        check = check_proxy(
            model, exact, ranked, plans=proxy_check, sequences=proxy_check_prompts, progress=progress
        )
        say(check.summary())
        lap("proxy_check")
    confirmations: list[Confirmation] = []
    chosen_plan = best.plan(name=name)
    chosen: Confirmation | None = None
    if confirm > 0:
        entries = [(f"#{r}", c.plan(name=f"{name}-{r}")) for r, c in enumerate(ranked[:confirm], 1)]
        if include_default:
            entries.append(("default", adapter_for(model).plan_for(model.config)))
        confirmations = confirm_plans(
            model,
            entries,
            heldout if heldout else prompts,
            max_new_tokens=max_new_tokens,
            repeats=confirm_repeats,
            progress=progress,
        )
        for c in confirmations:
            if c.label.startswith("#"):
                c.candidate = ranked[int(c.label[1:]) - 1]
            if c.plan.drafts:
                layers = c.plan.draft_layers(exact.num_layers)
                c.proxy = exact.simulate(layers, Policy(**_policy_fields(c.plan)))
                c.proxy_alpha = exact.agreement(layers).alpha
        chosen = _choose(confirmations, cost_model.dtype, say)
        chosen_plan = dataclasses.replace(chosen.plan, name=name)
        lap("confirmation")
    settings = dict(
        max_new_tokens=max_new_tokens,
        prompts=len(prompts),
        heldout=len(heldout or []),
        budget=budget,
        optimizer=optimizer,
        optuna_sampler=optuna_sampler if optimizer == "optuna" else None,
        search_proxy=search_proxy,
        rescore=rescore,
        confirm=confirm,
        proxy_check=proxy_check,
        max_draft_length=max_draft_length,
        keep_ends=keep_ends,
        seed=seed,
        threads=torch.get_num_threads(),
        dtype=cost_model.dtype,
    )
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
        timings=timings,
        calibration_tokens=tokens,
        plain_tokens_per_second=plain_speed,
    )


def _choose(confirmations: list[Confirmation], dtype: str, say: Callable[[str], None]) -> Confirmation:
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


def _sayer(progress: bool) -> Callable[[str], None]:
    def say(message: str) -> None:
        if progress:
            tqdm.write(f"selfspec tune: {message}", file=sys.stderr)

    return say
