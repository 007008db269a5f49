"""Plan search: which layers the draft runs and how many tokens it drafts, tuned for measured speed.

    from selfspec.tuning import builtin_prompts, encode_prompts, tune
    prompts = encode_prompts(tokenizer, builtin_prompts())
    result = tune(model, prompts=prompts[:10], heldout=prompts[10:15], budget=200)
    result.best_plan.save("plan.json")       # wrap(model, plan="plan.json")
    print(result.table())

The steps, each a function of this module:

1. **Calibration** (`make_calibration`): the target's own greedy continuations
   of a prompt set, generated once with the engine's plain path. These are the
   tokens a draft must predict.
2. **Cost model** (`measure_cost_model`): on this machine and in the model's
   dtype, the time of one layer and of the LM head on q = 1..k+1 tokens, as
   fractions of one plain decoding step (medians of interleaved repeats).
3. **Proxy** (`ProxyEvaluator`): the draft's greedy agreement with the
   target, measured without decoding. The target's hidden states after every
   layer and its keys and values are captured once per calibration sequence.
   A round is then started at every generated position at once: the draft's
   layers past its exact prefix run on all those positions in one batch, each
   query attending to the target's entries before its round and to the
   draft's own entries for its round's earlier tokens, exactly what the
   engine's draft sees. Depth d is scored only for rounds whose tokens
   0..d-1 were all accepted, so the cost is about one partial forward pass
   per accepted-length step. The result equals real greedy acceptance (tests
   check it token for token in float64; in bfloat16 it tracks it within about
   0.01). A one-pass proxy that scores round starts only (exact for k = 1)
   does the wide search, the exact one re-scores the best; the cruder
   teacher-forced proxy is kept for comparison. The engine's rounds are then
   replayed on the agreements, for every draft-length policy of a grid (fixed
   k, a fixed confidence threshold, Draft & Verify's moving threshold) with
   the engine's own `AdaptivePolicy`, each round costed by the cost model.
   The proxy speedup is emitted tokens over cost in plain steps (Leviathan et
   al.'s tokens per round over cost per round, on the measured agreement
   pattern rather than an i.i.d. rate; the i.i.d. figure is reported too).
4. **Search** (`search`): early exits 1..L-1, then a greedy walk that drops,
   one at a time, the layer whose removal costs the least agreement (tracing
   the acceptance-versus-cost front), then random local moves around the best
   sets. `optimizer="random"` is plain random search; `optimizer="optuna"`
   runs TPE over per-layer keep/skip choices (or NSGA-II for the front).
5. **Confirmation** (`confirm_plans`): timed greedy generation on held-out
   prompts, the plain path and the candidates interleaved in one process, with
   a check that every output equals the plain path's. The best measured plan
   wins.

What it does not know: sampling (the proxy scores greedy agreement; a plan good
for greedy is usually good for sampling, but the acceptance rule differs);
logits processors (ignored by the proxy; the confirmation runs plain greedy);
batch sizes above 1; anything about the machine beyond what it measures here.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from .adapter import adapter_for, text_config
from .draft import AdaptivePolicy
from .engine import wrap
from .plan import DraftPlan
from .runner import LayerRunner

__all__ = [
    "BUILTIN_PROMPTS",
    "CalibrationSequence",
    "Candidate",
    "Confirmation",
    "CostModel",
    "Policy",
    "ProxyEvaluator",
    "TuneResult",
    "builtin_prompts",
    "confirm_plans",
    "encode_prompts",
    "expected_tokens_per_round",
    "iid_speedup",
    "make_calibration",
    "measure_cost_model",
    "pareto_front",
    "policy_grid",
    "read_prompts",
    "search",
    "simulate",
    "tune",
]

OPTUNA_MISSING = "optimizer='optuna' needs optuna: pip install 'selfspec[tune]' (or pip install optuna)"

# --------------------------------------------------------------------------- prompts

BUILTIN_PROMPTS: tuple[str, ...] = (
    "Write a short poem about the ocean at night.",
    "Explain how a refrigerator keeps food cold, in simple terms.",
    "What are three tips for staying focused while studying?",
    "Write a Python function that checks whether a string is a palindrome.",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "Translate into French: 'The weather is lovely today, let's go for a walk.'",
    "A train travels at 60 miles per hour for 2.5 hours. How far does it go? Show your reasoning.",
    "Give me a recipe for a simple vegetable soup.",
    "What is the difference between a virus and a bacterium?",
    "Write a polite email asking a colleague to review my report by Friday.",
    "List five countries in South America and their capitals.",
    "Why do leaves change color in autumn?",
    "Describe the rules of chess for a beginner.",
    "What is photosynthesis?",
    "Write a haiku about coffee.",
    "Explain what a linked list is and when to use one.",
    "Give three arguments for and against working from home.",
    "How do I convert Celsius to Fahrenheit? Give an example.",
    "Tell me a short story about a robot who learns to paint.",
    "What causes the seasons on Earth?",
)


def builtin_prompts(*, seed: int = 0) -> list[str]:
    """The built-in chat prompts (varied tasks), in a seeded order."""
    prompts = list(BUILTIN_PROMPTS)
    random.Random(seed).shuffle(prompts)
    return prompts


def read_prompts(path: str | os.PathLike, *, seed: int = 0) -> list[str]:
    """Prompts from a file, in a seeded order that interleaves categories.

    `.jsonl`: one object a line, the prompt in `turns[0]` (Spec-Bench) or in
    `prompt`, `text`, `question` or `instruction`; rows with a `category` are
    taken round-robin over the categories, so any prefix of the list is varied.
    `.json`: a list of strings. Anything else: one prompt per non-empty line.
    """
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    rows: list[tuple[str, str]] = []  # (category, prompt)
    if path.suffix == ".jsonl":
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            row = json.loads(line)
            prompt = (row.get("turns") or [None])[0]
            for key in ("prompt", "text", "question", "instruction"):
                prompt = prompt or row.get(key)
            if not isinstance(prompt, str):
                raise ValueError(f"{path}:{number}: no prompt in turns[0], prompt, text, question or instruction")
            rows.append((str(row.get("category", "")), prompt))
    elif path.suffix == ".json":
        rows = [("", str(p)) for p in json.loads(text)]
    else:
        rows = [("", line.strip()) for line in text.splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"no prompts in {path}")
    rng = random.Random(seed)
    groups: dict[str, list[str]] = {}
    for category, prompt in rows:
        groups.setdefault(category, []).append(prompt)
    for prompts in groups.values():
        rng.shuffle(prompts)
    ordered: list[str] = []
    queues = [groups[c] for c in sorted(groups)]
    while any(queues):
        for queue in queues:
            if queue:
                ordered.append(queue.pop(0))
    return ordered


def encode_prompts(tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each prompt, through the chat template when the tokenizer has one."""
    encoded = []
    for text in texts:
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=True
            )["input_ids"]
        else:
            ids = tokenizer(text)["input_ids"]
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        if ids and isinstance(ids[0], list):
            ids = ids[0]
        encoded.append([int(i) for i in ids])
    return encoded


def _as_ids(prompt) -> list[int]:
    if isinstance(prompt, torch.Tensor):
        prompt = prompt.reshape(-1).tolist()
    ids = [int(i) for i in prompt]
    if not ids:
        raise ValueError("empty prompt: every prompt needs at least one token")
    return ids


# --------------------------------------------------------------------------- calibration


@dataclass(frozen=True)
class CalibrationSequence:
    """A prompt and the target's greedy continuation of it (what the draft must predict)."""

    tokens: tuple[int, ...]  # prompt + generated
    prompt_length: int
    max_new_tokens: int  # the limit it was generated with (fewer tokens mean EOS came first)

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_length


def make_calibration(
    model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 48, progress: bool = True
) -> tuple[list[CalibrationSequence], float]:
    """Greedy continuations with the engine's plain path; also returns its speed (tokens/s)."""
    plain = wrap(model, plan=DraftPlan.plain())
    sequences, tokens, seconds = [], 0, 0.0
    for prompt in tqdm(prompts, desc="calibration (plain greedy)", disable=not progress, leave=False):
        ids = _as_ids(prompt)
        out = plain.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)
        sequences.append(CalibrationSequence(tuple(out[0].tolist()), len(ids), max_new_tokens))
        tokens += plain.last_stats.new_tokens
        seconds += plain.last_stats.total_seconds
    return sequences, tokens / seconds if seconds else 0.0


# --------------------------------------------------------------------------- cost model


@dataclass(frozen=True)
class CostModel:
    """Measured costs, as fractions of one plain decoding step (one token through the full model).

    `layer[q-1]`, `head[q-1]`: one layer, and the final norm + LM head, on q
    tokens. `overhead`: the rest of a forward pass (embedding, argmax, Python),
    so that `overhead + L * layer[0] + head[0] == 1`.
    """

    num_layers: int
    layer: tuple[float, ...]
    head: tuple[float, ...]
    overhead: float
    plain_step_seconds: float = 0.0
    dtype: str = ""
    threads: int = 0

    @property
    def max_draft_length(self) -> int:
        return min(len(self.layer), len(self.head)) - 1

    def draft_step(self, num_draft_layers: int) -> float:
        """One drafted token through `num_draft_layers` layers and the LM head."""
        return self.overhead + num_draft_layers * self.layer[0] + self.head[0]

    def verify(self, drafted: int, exact_prefix: int = 0) -> float:
        """One verify pass over the last token and `drafted` tokens, resuming after the plan's exact prefix.

        The draft already ran layers 0..s-1 for all but the last drafted token,
        so those layers see one token; the other L - s layers see drafted + 1.
        """
        q = min(drafted, self.max_draft_length) + 1
        s = exact_prefix if drafted else 0
        return self.overhead + s * self.layer[0] + (self.num_layers - s) * self.layer[q - 1] + self.head[q - 1]

    def round_cost(self, drafted: int, num_draft_layers: int, exact_prefix: int) -> float:
        return drafted * self.draft_step(num_draft_layers) + self.verify(drafted, exact_prefix)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["verify_full"] = [self.verify(k) for k in range(self.max_draft_length + 1)]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CostModel":
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values["layer"], values["head"] = tuple(values["layer"]), tuple(values["head"])
        return cls(**values)

    def summary(self) -> str:
        verify = ", ".join(f"{k}: {self.verify(k):.2f}" for k in range(1, self.max_draft_length + 1))
        return (
            f"plain step {self.plain_step_seconds * 1e3:.1f} ms ({self.dtype}, {self.threads} threads); "
            f"in plain steps: one layer {self.layer[0]:.4f} (all {self.num_layers}: "
            f"{self.num_layers * self.layer[0]:.2f}), LM head {self.head[0]:.3f}, overhead {self.overhead:.3f}; "
            f"verify(k) {verify}"
        )


@torch.no_grad()
def measure_cost_model(
    model, *, max_draft_length: int = 8, context: int = 64, repeats: int = 15, progress: bool = True
) -> CostModel:
    """Time the layers, the LM head and a plain step on this machine, in the model's dtype.

    Every measurement is repeated `repeats` times, all kinds interleaved (so a
    burst of load on a shared machine hits them alike), after a warmup; the
    medians are used. A `context` of earlier tokens sits in the cache.
    """
    adapter = adapter_for(model)
    parts = adapter.bind(model)
    num_layers = parts.num_layers
    device = parts.lm_head.weight.device
    q_max = max_draft_length + 1
    runner = LayerRunner(parts, adapter, model.config, capacity=context + q_max + 1, device=device)
    ids = torch.randint(0, _vocab_size(model), (context + q_max,), generator=torch.Generator().manual_seed(0)).tolist()
    runner.run(runner.embed(ids[:context], 0), range(num_layers), 0)
    inputs = {q: runner.embed(ids[context : context + q], context) for q in range(1, q_max + 1)}

    def stack(q: int) -> Callable[[], None]:
        def run() -> None:
            runner.run(inputs[q], range(num_layers), context)
            runner.cache.crop(context)

        return run

    def head(q: int) -> Callable[[], None]:
        return lambda: runner.logits(inputs[q])

    def plain() -> None:
        hidden = runner.run(runner.embed(ids[context : context + 1], context), range(num_layers), context)
        int(runner.logits(hidden[:, -1:])[0].argmax())
        runner.cache.crop(context)

    tasks: dict[Any, Callable[[], None]] = {"plain": plain}
    tasks.update({("stack", q): stack(q) for q in range(1, q_max + 1)})
    tasks.update({("head", q): head(q) for q in range(1, q_max + 1)})
    times: dict[Any, list[float]] = {name: [] for name in tasks}
    for fn in tasks.values():  # warmup
        fn()
        fn()
    for _ in tqdm(range(repeats), desc="cost model", disable=not progress, leave=False):
        for name, fn in tasks.items():
            _sync(device)
            began = time.perf_counter()
            fn()
            _sync(device)
            times[name].append(time.perf_counter() - began)
    median = {name: statistics.median(values) for name, values in times.items()}
    step = median["plain"]
    layer = tuple(median[("stack", q)] / num_layers / step for q in range(1, q_max + 1))
    head_cost = tuple(median[("head", q)] / step for q in range(1, q_max + 1))
    return CostModel(
        num_layers=num_layers,
        layer=layer,
        head=head_cost,
        overhead=max(0.0, 1.0 - num_layers * layer[0] - head_cost[0]),
        plain_step_seconds=step,
        dtype=str(parts.dtype).removeprefix("torch."),
        threads=torch.get_num_threads(),
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _vocab_size(model) -> int:
    return int(text_config(model.config).vocab_size)


def expected_tokens_per_round(alpha: float, k: int) -> float:
    """Tokens emitted per round with k drafted tokens, each accepted i.i.d. with probability alpha."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def iid_speedup(alpha: float, k: int, *, draft_step: float, verify: float) -> float:
    """Leviathan et al.'s expected speedup: tokens per round over the round's cost in plain steps."""
    return expected_tokens_per_round(alpha, k) / (k * draft_step + verify)


# --------------------------------------------------------------------------- draft-length policies


@dataclass(frozen=True)
class Policy:
    """A draft-length policy: the plan fields that say how many tokens a round drafts."""

    draft_length: int
    adaptive: bool = False
    threshold: float = 0.5
    target_acceptance: float = 0.8
    threshold_step: float = 0.05

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


# --------------------------------------------------------------------------- the proxy


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
        fields = (policy or self.policy).plan_fields()
        if self.is_early_exit:
            return DraftPlan(exit_layer=len(self.layers), name=name, **fields)
        return DraftPlan(layers=self.layers, name=name, **fields)

    def describe_layers(self) -> str:
        if self.is_early_exit:
            return f"exit after layer {len(self.layers) - 1}"
        skipped = [i for i in range(self.num_layers) if i not in self.layers]
        return f"skip {_ranges(skipped)}"

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


def _ranges(indices: Sequence[int]) -> str:
    """[3, 4, 5, 9] -> '3-5,9'."""
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


class _RoundCache:
    """The keys a draft query sees: the target's entries, the draft's own from earlier depths, then its own.

    Stands in for the engine's cache in the proxy's batched rounds; which of
    these keys each query may attend to is the mask's business.
    """

    def __init__(self, target: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.target = target  # layer -> the target's (keys, values) [1, kv_heads, all positions, head_dim]
        self.draft: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # layer -> one (k, v) per depth

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = self.target[layer_idx]
        earlier = self.draft.setdefault(layer_idx, [])
        all_keys = torch.cat([keys, *(k for k, _ in earlier), key_states], dim=-2)
        all_values = torch.cat([values, *(v for _, v in earlier), value_states], dim=-2)
        earlier.append((key_states, value_states))
        return all_keys, all_values


def _as_mask(allowed: torch.Tensor, runner: LayerRunner) -> torch.Tensor:
    """`[q, kv]` allowed-pairs as the runner's attention wants it: bool (sdpa) or additive (eager)."""
    if runner.bool_masks:
        return allowed[None, None]
    additive = torch.zeros(allowed.shape, dtype=runner.dtype, device=allowed.device)
    return additive.masked_fill(~allowed, torch.finfo(runner.dtype).min)[None, None]


@dataclass
class _Trace:
    """One calibration sequence through the target: hidden states after every layer and the target's cache."""

    sequence: CalibrationSequence
    hidden: list[torch.Tensor]  # L+1 x [1, rows, hidden]: input to layer s (s = L: the final states)
    first_row: int  # position of hidden[s][:, 0]
    runner: LayerRunner  # its cache holds the target's entries for positions 0..T-2 (until flattened)
    next_tokens: torch.Tensor  # [T-1-P]: the target's token after each generated input


class ProxyEvaluator:
    """Scores layer sets by the draft's agreement with the target on calibration sequences.

    `context` says what a drafted token's queries attend to:

    - `"rounds"` (default, exact for greedy up to floating-point order): what
      the engine's draft sees. A round is started at every generated input;
      its depth-i token attends to the target's entries before the round and
      to the draft's own entries for the round's earlier tokens. Depth i is
      scored only for rounds whose tokens 0..i-1 were all accepted, so the
      cost is about the calibration tokens times the mean accepted length.
    - `"target"`: round starts only (exact for k = 1); deeper tokens are
      assumed to agree as round starts at their position do. One pass.
    - `"draft"`: teacher forcing through the draft's layers alone; the draft
      attends to its own entries for every earlier token. One pass.
    """

    CONTEXTS = ("rounds", "target", "draft")

    def __init__(
        self,
        model,
        calibration: Sequence[CalibrationSequence],
        cost_model: CostModel,
        *,
        context: str = "rounds",
        policies: Sequence[Policy] | None = None,
    ) -> None:
        if context not in self.CONTEXTS:
            raise ValueError(f"context={context!r} is not a proxy context (valid: {', '.join(self.CONTEXTS)})")
        self.model = model
        self.adapter = adapter_for(model)
        self.parts = self.adapter.bind(model)
        self.num_layers = self.parts.num_layers
        if cost_model.num_layers != self.num_layers:
            raise ValueError(
                f"the cost model is for {cost_model.num_layers} layers but the model has {self.num_layers}"
            )
        self.context = context
        self.cost_model = cost_model
        self.max_depth = cost_model.max_draft_length
        self.policies = list(policies) if policies is not None else policy_grid(cost_model.max_draft_length)
        self.device = self.parts.lm_head.weight.device
        self.calibration = [s for s in calibration if s.generated >= 2]
        if not self.calibration:
            raise ValueError("the calibration needs at least one sequence with 2 or more generated tokens")
        self.limits = [s.max_new_tokens for s in self.calibration]
        with torch.no_grad():
            self.traces = [self._trace(s) for s in self.calibration]
            if context != "draft":
                self._flatten()
        self.results: dict[tuple[int, ...], Candidate] = {}
        self._agreements: dict[tuple[int, ...], Agreement] = {}

    def _trace(self, sequence: CalibrationSequence) -> _Trace:
        tokens = list(sequence.tokens[:-1])  # the last token is never an input
        runner = LayerRunner(self.parts, self.adapter, self.model.config, capacity=len(tokens), device=self.device)
        first_row = 0 if self.context == "draft" else sequence.prompt_length
        hidden = runner.embed(tokens, 0)
        states = [hidden[:, first_row:]]
        for layer in range(self.num_layers):
            hidden = runner.run(hidden, [layer], 0)
            states.append(hidden[:, first_row:])
        next_tokens = torch.tensor(sequence.tokens[sequence.prompt_length + 1 :], device=self.device)
        return _Trace(sequence, states, first_row, runner, next_tokens)

    def check_layers(self, layers: Sequence[int]) -> tuple[int, ...]:
        layers = tuple(sorted(set(int(i) for i in layers)))
        if not layers or layers[0] < 0 or layers[-1] >= self.num_layers:
            raise ValueError(f"layer set {list(layers)} out of range (valid: non-empty, 0..{self.num_layers - 1})")
        return layers

    @torch.no_grad()
    def agreement(self, layers: Sequence[int]) -> Agreement:
        """The draft's choices against the target's tokens (memoised per layer set)."""
        layers = self.check_layers(layers)
        if layers not in self._agreements:
            s = DraftPlan(layers=layers).exact_prefix(self.num_layers)
            rest = layers[s:]
            if self.context == "draft":
                self._agreements[layers] = self._teacher_forced(s, rest)
            else:
                # Without layers past the exact prefix the draft's output does not depend on
                # where its round started, so round starts tell everything.
                depth = self.max_depth if self.context == "rounds" and rest else 1
                self._agreements[layers] = self._rounds(s, rest, depth)
        return self._agreements[layers]

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # logits() uses only the model's parts (final norm, LM head, soft cap): any trace's runner will do.
        return self.traces[0].runner.logits(hidden)  # [rows, vocab]

    def _choices(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self._logits(hidden)
        top, choice = logits.max(dim=-1)
        return choice, torch.exp(top - torch.logsumexp(logits, dim=-1))

    def _teacher_forced(self, s: int, rest: tuple[int, ...]) -> Agreement:
        finals = []
        for trace in self.traces:
            hidden = trace.hidden[s]
            if rest:
                T = len(trace.sequence.tokens)
                runner = LayerRunner(self.parts, self.adapter, self.model.config, capacity=T - 1, device=self.device)
                hidden = runner.run(hidden, rest, 0)
            finals.append(hidden[:, trace.sequence.prompt_length :])
        choice, confidence = self._choices(torch.cat(finals, dim=1))
        hits = (choice == torch.cat([t.next_tokens for t in self.traces])).tolist()
        confidence = confidence.tolist()
        matches, confidences, at = [], [], 0
        for trace in self.traces:
            size = len(trace.next_tokens)
            matches.append(hits[at : at + size])
            confidences.append(confidence[at : at + size])
            at += size
        return Agreement(matches, confidences)

    def _flatten(self) -> None:
        """All sequences' generated inputs as one batch of rows; the target's entries as one key set per layer."""
        traces = self.traces
        sizes = [len(t.next_tokens) for t in traces]
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        dev = self.device

        def per_row(values):
            return torch.cat([torch.as_tensor(v, device=dev) for v in values])

        self.flat_hidden = [torch.cat([t.hidden[s] for t in traces], dim=1) for s in range(self.num_layers + 1)]
        self.flat_next = per_row([t.next_tokens for t in traces])  # [G] the token after each input row
        prompts = [t.sequence.prompt_length for t in traces]
        self.row_pos = per_row([p + torch.arange(n, device=dev) for p, n in zip(prompts, sizes)])  # [G] its position
        self.row_seq = per_row([torch.full((n,), i, device=dev) for i, n in enumerate(sizes)])  # [G] its sequence
        self.row_end = per_row([torch.full((n,), self.offsets[i + 1], device=dev) for i, n in enumerate(sizes)])
        lengths = [t.runner.cache.lengths[0] for t in traces]
        self.key_seq = per_row([torch.full((n,), i, device=dev) for i, n in enumerate(lengths)])
        self.key_pos = per_row([torch.arange(n, device=dev) for n in lengths])
        self.target_kv = {
            layer: tuple(torch.cat(parts, dim=-2) for parts in zip(*(t.runner.cache.entries(layer) for t in traces)))
            for layer in range(self.num_layers)
        }
        # Rotary tables, windows and the layer call for any position of any sequence.
        self.tables = LayerRunner(self.parts, self.adapter, self.model.config, capacity=max(lengths), device=dev)
        for t in traces:  # the flat copies replace them
            t.hidden, t.runner = [], self.tables

    def _rounds(self, s: int, rest: tuple[int, ...], max_depth: int) -> Agreement:
        """Start a round at every generated input of every sequence; score depth after depth.

        A round's depth-d token is scored only while its tokens 0..d-1 were all
        accepted: later ones cannot change how many the round keeps.
        """
        G = len(self.flat_next)
        runs = [0] * G
        run_confidences: list[list[float]] = [[] for _ in range(G)]
        cache, depth_rows = _RoundCache(self.target_kv), []
        active = torch.arange(G, device=self.device)  # rounds (by their first input's row) all accepted so far
        for depth in range(max_depth):
            starts = active[active + depth < self.row_end[active]]  # the round's depth-th input must exist
            if len(starts) == 0:
                break
            hidden = self.flat_hidden[s][:, starts + depth]  # the exact prefix computes the target's own states
            if rest:
                hidden = self._draft_layers(cache, depth_rows, hidden, starts, depth, rest)
            choice, confidence = self._choices(hidden)
            hit = choice == self.flat_next[starts + depth]
            for start, h, c in zip(starts.tolist(), hit.tolist(), confidence.tolist()):
                run_confidences[start].append(c)
                runs[start] += h
            active = starts[hit]
        matches = [r > 0 for r in runs]  # depth 0 is scored for every row
        split = [slice(a, b) for a, b in zip(self.offsets, self.offsets[1:])]
        agreement = Agreement([matches[i] for i in split], [[c[0] for c in run_confidences[i]] for i in split])
        if max_depth > 1:
            agreement.runs = [runs[i] for i in split]
            agreement.run_confidences = [run_confidences[i] for i in split]
        return agreement

    def _draft_layers(
        self,
        cache: _RoundCache,
        depth_rows: list[torch.Tensor],
        hidden: torch.Tensor,
        starts: torch.Tensor,
        depth: int,
        rest: tuple[int, ...],
    ) -> torch.Tensor:
        """The draft's layers past the exact prefix, on the depth-th token of the rounds at rows `starts`."""
        tables = self.tables
        query_pos = self.row_pos[starts] + depth  # [B] positions of the inputs
        round_pos = self.row_pos[starts]  # [B] where each round began
        same_seq = self.key_seq[None, :] == self.row_seq[starts][:, None]
        allowed = [same_seq & (self.key_pos[None, :] < round_pos[:, None])]  # the target's entries before the round
        key_pos = [self.key_pos[None, :].expand(len(starts), -1)]
        for d, rows in enumerate(depth_rows):  # the draft's entries for the same round's earlier tokens
            allowed.append(rows[None, :] == starts[:, None])
            key_pos.append((self.row_pos[rows] + d)[None, :].expand(len(starts), -1))
        allowed.append(torch.eye(len(starts), dtype=torch.bool, device=self.device))  # its own entry
        key_pos.append(query_pos[:, None].expand(-1, len(starts)))
        depth_rows.append(starts)
        allowed_all = torch.cat(allowed, dim=1)  # [B, keys]
        masks = {}
        for window in {tables.windows[i] for i in rest}:
            mask = allowed_all
            if window is not None:
                mask = mask & (query_pos[:, None] - torch.cat(key_pos, dim=1) < window)
            masks[window] = _as_mask(mask, tables)
        rotary = {kind: tuple(t[:, query_pos] for t in table) for kind, table in tables.rotary.items()}
        for i in rest:
            hidden = tables.call(
                self.parts.layers[i],
                hidden,
                mask=masks[tables.windows[i]],
                position_embeddings=rotary.get(tables.rotary_kinds[i]),
                position_ids=query_pos[None],
                cache=cache,
            )
        return hidden

    def evaluate(self, layers: Sequence[int], *, source: str = "") -> Candidate:
        """Score a layer set (memoised): agreement, then the best policy by simulated speedup."""
        layers = self.check_layers(layers)
        if layers in self.results:
            return self.results[layers]
        agreement = self.agreement(layers)
        cost = self.cost_model
        s = DraftPlan(layers=layers).exact_prefix(self.num_layers)
        step = cost.draft_step(len(layers))

        def round_cost(n: int) -> tuple[float, float]:
            return n * step, cost.verify(n, s)

        best_policy, best = None, None
        for policy in self.policies:
            sim = simulate(agreement, policy, limits=self.limits, round_cost=round_cost)
            if best is None or sim.speedup > best.speedup + 1e-9:
                best_policy, best = policy, sim
        alpha = agreement.alpha
        iid_best, iid_k = max(
            (iid_speedup(alpha, k, draft_step=step, verify=cost.verify(k, s)), k)
            for k in range(1, cost.max_draft_length + 1)
        )
        candidate = Candidate(layers, self.num_layers, alpha, step, s, best_policy, best, iid_best, iid_k, source)
        self.results[layers] = candidate
        return candidate

    def simulate(self, layers: Sequence[int], policy: Policy, *, sequences: Sequence[int] | None = None) -> Simulation:
        """One policy's simulation for a layer set, optionally on a subset of the calibration sequences."""
        layers = self.check_layers(layers)
        agreement = self.agreement(layers)
        limits = self.limits
        if sequences is not None:
            agreement = agreement.subset(sequences)
            limits = [limits[i] for i in sequences]
        s = DraftPlan(layers=layers).exact_prefix(self.num_layers)
        step = self.cost_model.draft_step(len(layers))
        return simulate(agreement, policy, limits=limits, round_cost=lambda n: (n * step, self.cost_model.verify(n, s)))

    @property
    def evaluated(self) -> list[Candidate]:
        """All candidates scored so far, best proxy speedup first."""
        return sorted(self.results.values(), key=lambda c: (-c.speedup, -c.alpha, len(c.layers)))


# --------------------------------------------------------------------------- search


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
    if optimizer not in ("greedy", "random", "optuna"):
        raise ValueError(f"optimizer={optimizer!r} is not known (valid: greedy, random, optuna)")
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
    if sampler_name not in ("tpe", "nsga2"):
        raise ValueError(f"optuna_sampler={sampler_name!r} is not known (valid: tpe, nsga2)")
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


def pareto_front(candidates: Sequence[Candidate]) -> list[Candidate]:
    """Candidates no other beats on both agreement (higher) and draft cost (lower), cheapest first."""
    front: list[Candidate] = []
    for c in sorted(candidates, key=lambda c: (c.draft_cost, -c.alpha)):
        if not front or c.alpha > front[-1].alpha:
            front.append(c)
    return front


# --------------------------------------------------------------------------- real runs


@dataclass
class Confirmation:
    """Timed greedy generation of one plan on the confirmation prompts."""

    label: str
    plan: DraftPlan
    new_tokens: int = 0
    seconds: float = 0.0
    drafted: int = 0
    accepted: int = 0
    verify_passes: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    identical: int = 0  # prompts whose output equals the plain path's
    prompts: int = 0
    speedup: float = 0.0  # tokens/s over the plain path's, same prompts, same process
    candidate: Candidate | None = None  # the searched layer set it came from, if any
    proxy: Simulation | None = None  # the exact proxy's replay of this plan on the calibration prompts
    proxy_alpha: float | None = None

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_pass(self) -> float:
        return self.new_tokens / self.verify_passes if self.verify_passes else 0.0

    @property
    def lossless(self) -> bool:
        return self.identical == self.prompts

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "plan": self.plan.to_dict(),
            "new_tokens": self.new_tokens,
            "seconds": self.seconds,
            "tokens_per_second": self.tokens_per_second,
            "acceptance_rate": self.acceptance_rate,
            "tokens_per_pass": self.tokens_per_pass,
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
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
    warm = torch.tensor([_as_ids(prompts[0])[:8]])
    for spec in wrapped:  # warmup: first calls allocate
        spec.generate(warm, max_new_tokens=4, do_sample=False)
    total = repeats * len(prompts) * len(entries)
    with tqdm(total=total, desc="confirmation (timed)", disable=not progress, leave=False) as bar:
        for repeat in range(repeats):
            for p, prompt in enumerate(prompts):
                ids = torch.tensor([_as_ids(prompt)])
                reference = None
                others = list(range(1, len(entries)))
                shift = (p + repeat) % max(1, len(others))
                for index in [0] + others[shift:] + others[:shift]:
                    spec, result = wrapped[index], results[index]
                    out = spec.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
                    stats = spec.last_stats
                    if index == 0:
                        reference = out
                    result.new_tokens += stats.new_tokens
                    result.seconds += stats.total_seconds
                    result.drafted += stats.drafted
                    result.accepted += stats.accepted
                    result.verify_passes += stats.verify_passes
                    result.draft_seconds += stats.draft_seconds
                    result.verify_seconds += stats.verify_seconds
                    result.identical += bool(torch.equal(out, reference))
                    result.prompts += 1
                    bar.update(1)
    plain_speed = results[0].tokens_per_second
    for result in results:
        result.speedup = result.tokens_per_second / plain_speed if plain_speed else 0.0
    return results


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

    Every plan uses the same fixed draft length, and the proxy simulates that
    same policy on the same prompts, so the difference is the proxy's alone.
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
            spec = wrap(model, plan=candidate.plan(policy=policy))
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


# --------------------------------------------------------------------------- the whole search


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
            policy = "-" if not c.plan.drafts else Policy(**_policy_fields(c.plan)).describe()
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
                f"{proxy[1]} | {c.acceptance_rate:.3f} | {proxy[2]} / {c.tokens_per_pass:.2f} | "
                f"{c.tokens_per_second:.2f} | {proxy[3]} / {c.speedup:.2f}x | {c.identical}/{c.prompts} |"
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


def _policy_fields(plan: DraftPlan) -> dict[str, Any]:
    return {f.name: getattr(plan, f.name) for f in dataclasses.fields(Policy)}


def _plan_words(plan: DraftPlan, num_layers: int) -> str:
    if not plan.drafts:
        return "plain"
    if plan.exit_layer is not None:
        return f"exit after layer {plan.exit_layer - 1}"
    skipped = [i for i in range(num_layers) if i not in plan.draft_layers(num_layers)]
    return f"skip {_ranges(skipped)}"


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
    chosen = max(eligible, key=lambda c: c.tokens_per_second)
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


def adapter_entry(plan: DraftPlan, config, *, command: str) -> str:
    """A `[[tuned_plans]]` TOML entry for an adapter file, matching this model's shape."""
    keys = ("num_hidden_layers", "hidden_size", "intermediate_size", "vocab_size")
    config = text_config(config)
    match = ", ".join(f"{k} = {getattr(config, k)}" for k in keys if isinstance(getattr(config, k, None), int))
    lines = ["[[tuned_plans]]", f"match = {{ {match} }}", f"command = {json.dumps(command)}"]
    for key, value in plan.to_dict().items():
        if key == "format" or value is None:
            continue
        lines.append(f"{key} = {_toml_value(value)}")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value) if not isinstance(value, float) or math.isfinite(value) else "nan"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value))
