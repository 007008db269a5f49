"""`plan="auto"`: the draft's layers, chosen per context while generating, with no offline search.

Two signals. The target's own passes (the prefill, then every `PROBE_EVERY`-th
verify pass while some layer set would draft) report per layer 1 - cos(input,
output) as a moving average (`LayerInfluence`, ShortGPT's block influence); a
budget of L layers drafts with the L that turn the state most, the first and
the last always among them. The cost policy keeps acceptance estimates per
budget (about 1/2, 2/3, 5/6 of the layers and all but one) and every
`CHOOSE_EVERY` rounds drafts with the budget it predicts fastest; untried
budgets go first, the largest first. docs/how-it-works.md has the whole
mechanism.

Changing the set between rounds is free: every verify pass writes every
layer's entries. The choice uses only the past, so output stays the target's.

This module chooses layers; it does not run them (`runner.py`), verify or
accept.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .draft import Drafter
from .memory import parameter_bytes
from .passes import TargetPasses
from .plan import auto_reference_layers

if TYPE_CHECKING:
    from .policy import LayerChoosingPolicy

BUDGET_FRACTIONS = (0.5, 0.67, 0.83)  # candidate layer budgets, as fractions of the layer count (and N - 1)
PROBE_EVERY = 4  # rounds between verify passes that report layer changes
CHOOSE_EVERY = 4  # rounds between choices of the layer set
CHOOSE_EVERY_IDLE = 16  # ... while the last choice found no set that would draft (their estimates fade slowly)
INFLUENCE_DECAY = 0.8  # weight of the past in the per-layer moving average
HOLD_ELEMENTS = 1 << 18  # layer reports held for one batched reduction, at most (values of their inputs)
PROBE_ROWS = 64  # a pass's last rows that report (a long prompt's prefill: the rows nearest what comes next)


class LayerInfluence:
    """Per layer, a moving average of 1 - cos(input, output) over the rows of the target's passes (their last
    `PROBE_ROWS`).

    A pass's reports are held (references, no copies) and reduced together
    when its last layer reports: a handful of batched ops per pass rather
    than several per layer (measured alone, AVX512 CPU, 2 cores, 30 layers of
    576: 0.13-0.25 ms per pass of 1-9 rows, where one reduction per layer
    took 0.84-0.94 ms). Reports are folded in sooner once they hold
    `HOLD_ELEMENTS` values, so a long prompt's prefill is reduced a few
    layers at a time, as it runs. Only a pass's last `PROBE_ROWS` rows
    report: on SmolLM2's Spec-Bench prompts (bfloat16, 2-core AVX512 CPU)
    the probes of whole prefills took 0.4% of the generation time.
    """

    def __init__(self, num_layers: int, device: torch.device) -> None:
        self.num_layers = num_layers
        self._change = torch.zeros(num_layers, device=device)  # [layers]
        self._seen = torch.zeros(num_layers, dtype=torch.bool, device=device)  # [layers]
        self.pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (before, after), this pass
        self.held = 0  # values in `pending`'s `before` tensors
        self.ranked: list[int] | None = None  # the last ranking, until a pass reports again

    def __call__(self, layer: int, before: torch.Tensor, after: torch.Tensor) -> None:
        """Record a layer's effect on its rows: `before`, `after` `[1, q, hidden]` (on the device, no sync)."""
        before, after = before[:, -PROBE_ROWS:], after[:, -PROBE_ROWS:]  # [1, min(q, PROBE_ROWS), hidden] views
        if layer in self.pending:  # a second report before the pass ended: the first one counts first
            self.flush()
        self.pending[layer] = (before, after)
        self.held += before.numel()
        self.ranked = None
        if layer == self.num_layers - 1 or self.held >= HOLD_ELEMENTS:  # every target pass ends with the last layer
            self.flush()

    def flush(self) -> None:
        """Fold the held reports into the averages: one reduction per row count (the exact prefix may run 1 row)."""
        if not self.pending:
            return
        by_rows: dict[tuple, list[int]] = {}
        for layer, (before, _) in self.pending.items():
            by_rows.setdefault(tuple(before.shape), []).append(layer)
        layers, changes = [], []
        for group in by_rows.values():
            before = torch.stack([self.pending[i][0] for i in group]).float()  # [n, 1, q, hidden]
            after = torch.stack([self.pending[i][1] for i in group]).float()  # [n, 1, q, hidden]
            # cos by hand: F.cosine_similarity over [30, 1, 9, 576] took 0.6 ms on 2 cores, this 0.05 ms
            cos = (before * after).sum(-1) / (before.norm(dim=-1) * after.norm(dim=-1)).clamp_min(1e-8)  # [n, 1, q]
            changes.append(1.0 - cos.mean(dim=(1, 2)))  # [n]
            layers += group
        self.pending.clear()
        self.held = 0
        index = torch.tensor(layers, device=self._change.device)  # [m]
        change = torch.cat(changes)  # [m]
        past = self._change[index]
        self._change[index] = torch.where(self._seen[index], past.lerp(change, 1.0 - INFLUENCE_DECAY), change)
        self._seen[index] = True

    @property
    def change(self) -> torch.Tensor:
        """`[layers]` the moving averages, with every report so far folded in."""
        self.flush()
        return self._change

    @change.setter
    def change(self, values: torch.Tensor) -> None:
        self.pending.clear()
        self.held = 0
        self._change = values
        self.ranked = None

    @property
    def seen(self) -> list[bool]:
        """Per layer, whether any pass has reported it."""
        self.flush()
        return self._seen.tolist()

    def ranking(self) -> list[int]:
        """Layers, the ones that change the hidden state most first (one read back, when passes reported since)."""
        if self.ranked is None:
            change = self.change.tolist()
            self.ranked = sorted(range(len(change)), key=lambda i: (-change[i], i))
        return self.ranked


def candidate_budgets(num_layers: int) -> list[int]:
    """Layer counts an auto plan's draft may run: fractions of the layers, and all but one; at least 1."""
    budgets = {round(f * num_layers) for f in BUDGET_FRACTIONS} | {num_layers - 1}
    return sorted(b for b in budgets if 1 <= b < num_layers) or [1]


def layers_for(budget: int, ranking: list[int], num_layers: int) -> tuple[int, ...]:
    """The `budget` layers that change the hidden state most, the first and the last always among them."""
    chosen = [i for i in (0, num_layers - 1)][:budget]
    chosen += [i for i in ranking if i not in chosen][: budget - len(chosen)]
    return tuple(sorted(set(chosen)))


def exact_prefix(layers: tuple[int, ...]) -> int:
    """Leading layers 0..s-1 the set runs as the target does."""
    s = 0
    while s < len(layers) and layers[s] == s:
        s += 1
    return s


class AutoLayers:
    """The layer choice of one auto-plan generation; the decode loops call `before_round` and `after_round`."""

    def __init__(self, drafter: Drafter, passes: TargetPasses, *, layer_weights: list[float], head_weight: float,
                 device: torch.device, probe_verify: bool = True) -> None:
        self.drafter = drafter
        self.passes = passes
        self.num_layers = len(layer_weights)
        self.layer_weights = layer_weights
        self.head_weight = head_weight
        self.reference = self.weight(auto_reference_layers(self.num_layers))
        self.budgets = candidate_budgets(self.num_layers)
        self.influence = LayerInfluence(self.num_layers, device)
        self.probe_verify = probe_verify  # False on CUDA graphs: their verify passes replay, unobserved
        self.rounds = 0
        self.drafting = True  # whether the last choice found a set that would draft (then verify passes report)
        self.history: list[tuple[int, tuple[int, ...]]] = []  # (round, layers) each time the set changed
        passes.probe = self.influence  # the prefill reports every layer

    def weight(self, layers: tuple[int, ...]) -> float:
        return sum(self.layer_weights[i] for i in layers) + self.head_weight

    def before_round(self, policy: LayerChoosingPolicy) -> None:
        """At the top of a round: every few rounds re-pick the set, and say whether this round's verify pass
        reports layer changes (only while some set would draft: otherwise the ranking would go unused)."""
        if self.rounds % (CHOOSE_EVERY if self.drafting else CHOOSE_EVERY_IDLE) == 0:
            self.choose(policy)
        probe = self.probe_verify and self.drafting and self.rounds % PROBE_EVERY == 0
        self.passes.probe = self.influence if probe else None
        self.rounds += 1

    def choose(self, policy: LayerChoosingPolicy) -> None:
        ranking = self.influence.ranking()
        best, best_rate, explore = None, -1.0, None
        plain = policy.plain_rate()
        for budget in self.budgets:  # smallest first
            layers = layers_for(budget, ranking, self.num_layers)
            rate = policy.layer_rate(budget, exact_prefix=exact_prefix(layers), draft_scale=self.scale(layers))
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = layers, rate
            if not policy.layer_set_tried(budget) and rate > plain * (1 + 1e-9):
                explore = layers  # the largest untried budget that would pay at its prior: what it shows caps the rest
        self.drafting = explore is not None or best_rate > plain * (1 + 1e-9)
        best = explore or best
        if best != self.drafter.draft_layers or not self.history:
            self.use(best, policy)

    def scale(self, layers: tuple[int, ...]) -> float:
        """A drafted token's cost with `layers`, relative to the reference set the cost table timed."""
        return self.weight(layers) / self.reference

    def use(self, layers: tuple[int, ...], policy: LayerChoosingPolicy) -> None:
        self.drafter.set_layers(layers)
        self.passes.exact_prefix = self.drafter.exact_prefix
        policy.use_layers(len(layers), exact_prefix=self.drafter.exact_prefix, draft_scale=self.scale(layers))
        self.history.append((self.rounds, layers))

    def describe(self) -> str:
        """The sets chosen over the generation, with the round each began at."""
        return "; ".join(f"round {r}: {len(layers)}/{self.num_layers} {list(layers)}" for r, layers in self.history)


def layer_weights(parts) -> tuple[list[float], float]:
    """Bytes each layer's weights take (quantized ones as stored), and the LM head's with the final norm:
    what a drafted token reads."""
    return ([float(parameter_bytes([layer])) for layer in parts.layers],
            float(parameter_bytes([parts.lm_head, parts.norm])))
