"""The search over layer sets: early exits, then greedy / local moves, random sets, or optuna.

Every optimizer spends a budget of distinct layer sets scored by a
`ProxyEvaluator`; it knows nothing about how they are scored, and times
nothing. The greedy walk drops, one layer at a time, the layer whose removal
costs the least agreement (tracing the acceptance-versus-cost front), then
tries random local moves around the best sets. `optimizer="random"` is plain
random search; `optimizer="optuna"` runs TPE over per-layer keep/skip choices
(or NSGA-II for the front). (Named `layer_search`, not `search`, so that the
module's name differs from its `search` function.)
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Sequence

from tqdm.auto import tqdm

from .candidate import Candidate
from .proxy import ProxyEvaluator

OPTUNA_MISSING = "optimizer='optuna' needs optuna: pip install 'selfspec[tune]' (or pip install optuna)"


class _Budget:
    """Counts new evaluations; a progress bar shows them."""

    def __init__(self, evaluator: ProxyEvaluator, budget: int, progress: bool) -> None:
        self.evaluator = evaluator
        self.left = budget
        self.bar = tqdm(total=budget, desc="plan search (proxy)", disable=not progress, leave=False)

    def __call__(self, layers: Sequence[int], source: str) -> Candidate | None:
        layers = self.evaluator.check_layers(layers)
        if layers in self.evaluator.results:
            return self.evaluator.results[layers]
        if self.left <= 0:
            return None
        candidate = self.evaluator.evaluate(layers, source=source)
        self.left -= 1
        self.bar.update(1)
        best = self.evaluator.evaluated[0]
        self.bar.set_postfix_str(f"best {best.speedup:.2f}x ({best.describe_layers()}, {best.policy.describe()})")
        return candidate

    def close(self) -> None:
        self.bar.close()


OPTIMIZERS = ("greedy", "random", "optuna")
OPTUNA_SAMPLERS = ("tpe", "nsga2")


def search(
    evaluator: ProxyEvaluator,
    *,
    optimizer: str = "greedy",
    budget: int = 200,
    seed: int = 0,
    keep_ends: bool = True,
    optuna_sampler: str = "tpe",
    progress: bool = True,
) -> list[Candidate]:
    """Search layer sets; returns every candidate scored, best proxy speedup first.

    Every optimizer first scores the early exits 1..L-1 (cheap: no layer runs).
    Layer-skip sets keep the first and the last layer when `keep_ends`.
    `budget` counts distinct layer sets scored, early exits included.
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r} is not known (valid: {', '.join(OPTIMIZERS)})")
    if budget < 1:
        raise ValueError(f"budget={budget} out of range (valid: >= 1)")
    optuna = _import_optuna() if optimizer == "optuna" else None
    rng = random.Random(seed)
    spend = _Budget(evaluator, budget, progress)
    try:
        L = evaluator.num_layers
        for exit_layer in range(L - 1, 0, -1):
            spend(range(exit_layer), "early exit")
        if optimizer == "greedy":
            _greedy(spend, L, keep_ends)
            _local(spend, evaluator, rng, L, keep_ends)
        elif optimizer == "random":
            _random(spend, rng, L, keep_ends)
        else:
            _optuna(spend, optuna, L, keep_ends, seed, optuna_sampler)
    finally:
        spend.close()
    return evaluator.evaluated


def _droppable(layers: Sequence[int], L: int, keep_ends: bool) -> list[int]:
    return [i for i in layers if not (keep_ends and i in (0, L - 1))] if len(layers) > 1 else []


def _greedy(spend: _Budget, L: int, keep_ends: bool, patience: int = 4) -> None:
    """From all layers, repeatedly drop the layer whose removal keeps the most agreement."""
    current = tuple(range(L))
    best_speedup, since_best = 0.0, 0
    while spend.left > 0:
        trials = [spend(tuple(i for i in current if i != drop), "greedy") for drop in _droppable(current, L, keep_ends)]
        trials = [t for t in trials if t is not None]
        if not trials:
            return
        step = max(trials, key=lambda c: (c.alpha, c.speedup))
        current = step.layers
        if step.speedup > best_speedup:
            best_speedup, since_best = step.speedup, 0
        else:
            since_best += 1
            if since_best >= patience:  # past the front's useful part: agreement falls faster than cost
                return


def _valid(layers: Sequence[int], L: int, keep_ends: bool) -> bool:
    if not layers:
        return False
    if tuple(layers) == tuple(range(len(layers))):  # an early exit
        return True
    return not keep_ends or (0 in layers and L - 1 in layers)


def _local(spend: _Budget, evaluator: ProxyEvaluator, rng: random.Random, L: int, keep_ends: bool) -> None:
    """Random single-layer moves (drop, add, swap) around the current best few sets."""
    misses = 0
    while spend.left > 0 and misses < 200:
        pool = evaluator.evaluated[:5]
        layers = set(rng.choice(pool).layers)
        move = rng.choice(("drop", "add", "swap"))
        kept = [i for i in layers if not (keep_ends and i in (0, L - 1))]
        skipped = [i for i in range(L) if i not in layers]
        if move in ("drop", "swap") and kept and len(layers) > 1:
            layers.discard(rng.choice(kept))
        if move in ("add", "swap") and skipped:
            layers.add(rng.choice(skipped))
        if keep_ends and not _valid(sorted(layers), L, keep_ends):
            layers |= {0, L - 1}
        candidate = tuple(sorted(layers))
        if not _valid(candidate, L, keep_ends) or candidate in evaluator.results or len(candidate) == L:
            misses += 1
            continue
        misses = 0
        spend(candidate, "local")


def _random(spend: _Budget, rng: random.Random, L: int, keep_ends: bool) -> None:
    """Uniformly random layer sets of uniformly random size."""
    ends = [0, L - 1] if keep_ends and L > 1 else []
    middle = [i for i in range(L) if i not in ends]
    misses = 0
    while spend.left > 0 and misses < 200:
        size = rng.randint(0, max(0, len(middle) - 1))
        candidate = tuple(sorted(ends + rng.sample(middle, size)))
        if not candidate or candidate in spend.evaluator.results:
            misses += 1
            continue
        misses = 0
        spend(candidate, "random")


def _import_optuna():
    try:
        import optuna
    except ImportError:
        raise ModuleNotFoundError(OPTUNA_MISSING) from None
    return optuna


def _optuna(spend: _Budget, optuna, L: int, keep_ends: bool, seed: int, sampler_name: str) -> None:
    """TPE over per-layer keep/skip (maximising proxy speedup), or NSGA-II for (agreement, draft cost)."""
    if sampler_name not in OPTUNA_SAMPLERS:
        raise ValueError(f"optuna_sampler={sampler_name!r} is not known (valid: {', '.join(OPTUNA_SAMPLERS)})")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    ends = [0, L - 1] if keep_ends and L > 1 else []
    middle = [i for i in range(L) if i not in ends]
    if sampler_name == "tpe":
        sampler = optuna.samplers.TPESampler(seed=seed, multivariate=True)
        study = optuna.create_study(direction="maximize", sampler=sampler)
    else:
        sampler = optuna.samplers.NSGAIISampler(seed=seed)
        study = optuna.create_study(directions=["maximize", "minimize"], sampler=sampler)
    # Start from the greedy walk's first steps: everything, then the back half skipped.
    study.enqueue_trial({f"keep_{i}": True for i in middle})
    study.enqueue_trial({f"keep_{i}": i < L // 2 for i in middle})

    def objective(trial):
        layers = ends + [i for i in middle if trial.suggest_categorical(f"keep_{i}", [True, False])]
        if not layers:
            raise optuna.TrialPruned()
        candidate = spend(layers, f"optuna-{sampler_name}")
        if candidate is None:
            trial.study.stop()
            raise optuna.TrialPruned()
        if sampler_name == "tpe":
            return candidate.speedup
        return candidate.alpha, candidate.draft_cost

    while spend.left > 0:
        before = spend.left
        study.optimize(objective, n_trials=spend.left)
        if spend.left == before:  # only repeats of scored sets: the sampler has converged
            return
