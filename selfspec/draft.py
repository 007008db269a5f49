"""The draft phase: propose tokens with a cheap path through the target's own layers.

`Drafter.propose` runs the plan's layers one token at a time on the shared
cache, writing entries only for those layers. It saves the hidden states after
the plan's exact prefix (layers 0..s-1, which compute what the target
computes), so the verify pass can resume at layer s instead of starting over.

`AdaptiveThreshold` is the runtime state of an adaptive draft-length policy;
the plan holds only its starting values.

`Drafter.verify_pass` runs the target over the last token and the draft,
reusing what the draft computed exactly; it returns logits and decides
nothing. Acceptance (`verify.py`) and the final rollback (`engine.py`) are
elsewhere.

With a trained exit head (`head.py`) the draft is layers 0..E-1, then the head;
the head's cache slot must hold entries for every verified token, so the
prefill and the verify pass keep the states after layer E-1 and
`Drafter.fill_head` runs the head on the verified ones the draft did not
already cover. With a draft vocabulary (`vocab.py`) the draft scores only its
tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .head import ExitHead
from .ngram import lookup
from .plan import DraftPlan
from .runner import LayerRunner
from .scoring import Scorer
from .vocab import DraftVocab


@dataclass
class Draft:
    tokens: list[int]  # the drafted tokens d_1..d_k
    probs: torch.Tensor | None  # q: [k, vocab] draft distributions (sampling only)
    boundary: list[torch.Tensor]  # k x [1, 1, hidden]: states after the exact prefix for inputs x, d_1..d_{k-1}
    source: str = "layers"  # "layers", or "ngram" (copied from an earlier match; no boundary states)


@dataclass
class Checked:
    """What a verify pass computed."""

    logits: torch.Tensor  # [k+1, vocab] target logits
    exit_states: torch.Tensor | None  # [1, k+1, hidden] states after layer E-1 (only with a head)


class Drafter:
    def __init__(
        self, plan: DraftPlan, num_layers: int, *, head: ExitHead | None = None, vocab: DraftVocab | None = None
    ) -> None:
        layers = plan.draft_layers(num_layers)
        self.num_layers = num_layers
        self.ngram = plan.ngram
        self.has_layers = bool(layers)
        self.exact_prefix = plan.exact_prefix(num_layers)  # s
        self.prefix_layers = range(self.exact_prefix)
        self.other_layers = layers[self.exact_prefix :]
        self.head = head
        self.vocab = vocab
        if head is not None:
            if plan.exit_layer != head.exit_layer:
                raise ValueError(
                    f"the head {plan.head} was trained for exit_layer={head.exit_layer}, "
                    f"the plan has exit_layer={plan.exit_layer}"
                )
            self.other_layers = (head.slot,)  # layers 0..E-1 are the exact prefix; then the head

    def prefill(self, runner: LayerRunner, prompt: list[int]) -> torch.Tensor:
        """Run the prompt through the target (and the head, to fill its cache); `[1, vocab]` logits of its last row."""
        hidden = runner.embed(prompt, 0)  # [1, prompt, hidden]
        rest = range(self.num_layers)
        if self.head is not None:
            hidden = runner.run(hidden, range(self.head.exit_layer), 0)
            runner.run(hidden, [self.head.slot], 0)
            rest = range(self.head.exit_layer, self.num_layers)
        return runner.logits(runner.run(hidden, rest, 0)[:, -1:])

    def fill_head(self, runner: LayerRunner, checked: Checked, start: int, keep: int) -> None:
        """After the roll back to `keep` positions: give the head entries for the verified tokens it lacks."""
        if self.head is None or checked.exit_states is None:
            return
        slot = self.head.slot
        have = runner.cache.lengths[slot]  # start..keep: the draft's entries are exact (E is the exact prefix)
        if have < keep:
            runner.run(checked.exit_states[:, have - start : keep - start], [slot], have)

    def propose(
        self,
        runner: LayerRunner,
        scorer: Scorer,
        tokens: list[int],
        budget: int,
        threshold: float | None,
        *,
        use_layers: bool = True,
    ) -> Draft:
        """Draft up to `budget` tokens after `tokens`; the last of `tokens` is not in the cache yet.

        An n-gram match, when the plan looks for one, comes first: it is free.
        """
        copied = lookup(tokens, max_ngram=self.ngram, budget=budget) if self.ngram else []
        if copied:
            probs = None
            if scorer.do_sample:  # a deterministic proposal: q is one-hot
                vocab = runner.parts.lm_head.weight.shape[0]
                probs = torch.zeros(len(copied), vocab, device=runner.positions.device)  # [k, vocab]
                probs[torch.arange(len(copied)), torch.tensor(copied)] = 1.0
            return Draft(copied, probs, [], source="ngram")
        if not (use_layers and self.has_layers):
            budget = 0
        start = len(tokens) - 1
        drafted: list[int] = []
        probs: list[torch.Tensor] = []
        boundary: list[torch.Tensor] = []
        token = tokens[-1]
        for i in range(budget):
            hidden = runner.run(runner.embed([token], start + i), self.prefix_layers, start + i)  # [1, 1, hidden]
            boundary.append(hidden)
            hidden = runner.run(hidden, self.other_layers, start + i)
            logits = runner.logits(hidden, self.vocab)  # [1, vocab]
            scores = scorer.scores(logits, tokens + drafted, len(tokens) + i)  # [1, vocab]
            token, confidence, q = scorer.draft_choice(scores, with_confidence=threshold is not None)
            drafted.append(token)
            if q is not None:
                probs.append(q)
            if confidence is not None and threshold is not None and confidence < threshold:
                break  # keep this token (already paid for), draft no further
        return Draft(drafted, torch.stack(probs) if probs else None, boundary)


    def verify_pass(self, runner: LayerRunner, last_token: int, draft: Draft, start: int) -> Checked:
        """Target logits `[k+1, vocab]` for the last emitted token (at `start`) and the k drafted tokens."""
        num_layers = self.num_layers
        k = len(draft.tokens)
        s = self.exact_prefix if k and draft.boundary else 0
        if s:
            # The exact prefix already ran for x, d_1..d_{k-1}; only d_k still needs it.
            tail = runner.run(runner.embed(draft.tokens[-1:], start + k), range(s), start + k)  # [1, 1, hidden]
            hidden = torch.cat([*draft.boundary, tail], dim=1)  # [1, k+1, hidden]
        else:
            hidden = runner.embed([last_token] + draft.tokens, start)  # [1, k+1, hidden]
        runner.cache.crop(start, layers=range(s, num_layers))  # drop the draft's inexact entries
        exit_states = None
        if self.head is not None:  # keep the states after layer E-1 for the head's cache
            exit_layer = self.head.exit_layer
            hidden = exit_states = runner.run(hidden, range(s, exit_layer), start)  # [1, k+1, hidden]
            s = exit_layer
        return Checked(runner.logits(runner.run(hidden, range(s, num_layers), start)), exit_states)


class AdaptivePolicy:
    """Runtime state of an adaptive draft-length policy (the plan holds only its starting values).

    - Draft & Verify's threshold rule: raise the confidence bar when the
      smoothed acceptance rate falls short of the target, lower it otherwise.
    - A measured off switch: when a drafted token costs more time than the
      accepted tokens it brings back (acceptance x the time of a verify pass),
      drafting pauses for a few rounds, then probes again, backing off
      exponentially. A poor plan so degrades toward plain speed.

    A plan with `adaptive=False` drafts its fixed k every round.
    """

    SMOOTHING = 0.8  # weight of the past in the moving averages
    MAX_PAUSE = 64  # rounds

    def __init__(self, plan: DraftPlan) -> None:
        self.enabled = plan.adaptive
        self.draft_length = plan.draft_length
        self.value = plan.threshold
        self.target = plan.target_acceptance
        self.step = plan.threshold_step
        self.acceptance = plan.target_acceptance  # smoothed acceptance rate, optimistic start
        self.draft_cost: float | None = None  # smoothed seconds per drafted token
        self.verify_cost: float | None = None  # smoothed seconds per verify pass
        self.paused = 0  # rounds left without drafting
        self.backoff = 4

    @property
    def threshold(self) -> float | None:
        return self.value if self.enabled else None

    def budget(self) -> int:
        """How many tokens this round may draft."""
        return 0 if self.paused else self.draft_length

    def update(self, *, drafted: int, accepted: int, draft_seconds: float, verify_seconds: float) -> None:
        if not self.enabled:
            return
        self.verify_cost = _smooth(self.verify_cost, verify_seconds, self.SMOOTHING)
        if drafted == 0:
            self.paused = max(0, self.paused - 1)
            return
        self.acceptance = _smooth(self.acceptance, accepted / drafted, self.SMOOTHING)
        self.draft_cost = _smooth(self.draft_cost, draft_seconds / drafted, self.SMOOTHING)
        delta = self.step if self.acceptance < self.target else -self.step
        self.value = min(1.0, max(0.0, self.value + delta))
        if self.acceptance * self.verify_cost < self.draft_cost:
            self.paused, self.backoff = self.backoff, min(2 * self.backoff, self.MAX_PAUSE)
        else:
            self.backoff = 4


def _smooth(average: float | None, value: float, weight: float) -> float:
    return value if average is None else weight * average + (1 - weight) * value
