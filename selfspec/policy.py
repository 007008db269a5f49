"""How many tokens a round drafts: chosen per round by expected tokens per second, or fixed by the plan.

`CostPolicy` (a plan's `policy="cost"`, the default) drafts the length k, 0
allowed, that maximises the round's expected emitted tokens over its
expected time, from the measured cost table (`costs.RuntimeCosts`) and
acceptance learned online per draft source (its docstring says how).
`AdaptivePolicy` (`policy="fixed"`) drafts what the plan says: k tokens, or
with `adaptive=True` Draft & Verify's confidence threshold with an off
switch. It is the baseline the cost policy is compared with.

Both satisfy `DraftPolicy`, the one contract the rounds use (`draft.py`,
`rounds.py`, the tuner's replay); `policy_for` builds
the one a plan names. `LayerChoosingPolicy` adds what an auto plan's layer
choice asks (`auto_layers.py`); only the cost policy has it.

This module does not run layers or read the cache: it sees counts, confidences and times.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from .costs import RuntimeCosts, moving_average
from .draft import Draft
from .plan import DraftPlan

if TYPE_CHECKING:
    from .recycle import SuccessorTable



@runtime_checkable
class DraftPolicy(Protocol):
    """What a round asks of its draft-length policy: every member the rounds read, and no other.

    `round_budget`: the tokens this round may draft (set by `begin_round`);
    `wants_confidence`: whether drafting reads the draft's top probability;
    `recycling`: whether this round records successors and may draft
    recycled nodes; `threshold`: the confidence threshold in force (None:
    none); `costs`: the cost table it prices rounds with (None: it prices
    nothing), which the engine saves and reports.
    """

    round_budget: int
    wants_confidence: bool
    recycling: bool
    threshold: float | None
    costs: RuntimeCosts | None

    def begin_round(self, budget: int, *, context: int | None = None) -> None: ...

    def draft_next(self, drafted: int, confidence: float | None, *, width: int = 1) -> bool: ...

    def planned_length(self) -> int: ...

    def ngram_length(self, match_length: int, available: int) -> int: ...

    def ngram_reach(self, match_length: int, length: int) -> list[float]: ...

    def tree_nodes(self, chain: int, max_nodes: int, *, exact_prefix: int = 0) -> int: ...

    def recycled_nodes(self, values: Sequence[float], depths: Sequence[int], *, base_nodes: int,
                       base_expected: float, layers: bool) -> int: ...

    def observe(self, draft: Draft, accepted: int, *, draft_seconds: float, verify_seconds: float, width: int,
                emitted: int | None = None) -> None: ...

    def observe_unverified(self, match_length: int, first: int, outcomes: Sequence[bool]) -> None: ...

    def observe_recycled(self, *, depths: Sequence[int], values: Sequence[float], kept: Sequence[bool]) -> None: ...

    def count_recording(self, successors: SuccessorTable | None) -> None: ...

    def describe(self) -> str: ...


@runtime_checkable
class LayerChoosingPolicy(DraftPolicy, Protocol):
    """A `DraftPolicy` that also prices layer sets, for an auto plan's per-context choice (`auto_layers.py`)."""

    def plain_rate(self) -> float: ...

    def layer_rate(self, key: object, *, exact_prefix: int, draft_scale: float) -> float: ...

    def layer_set_tried(self, key: object) -> bool: ...

    def use_layers(self, key: object, *, exact_prefix: int, draft_scale: float) -> None: ...


def policy_for(plan: DraftPlan, costs: RuntimeCosts | None = None, *, exact_prefix: int = 0,
               off_switch: bool = True) -> DraftPolicy:
    """The policy that runs `plan`: `AdaptivePolicy` for `policy="fixed"` (and plain decoding), else a
    `CostPolicy` pricing rounds with `costs`; `exact_prefix`: the layers a verify pass resumes after;
    `off_switch`: the fixed policy's timed pause (off when sampling)."""
    if plan.policy == "fixed" or not plan.drafts:
        return AdaptivePolicy(plan, off_switch=off_switch)
    if costs is None:
        raise ValueError("a plan with policy='cost' prices its rounds: give the cost table (`RuntimeCosts`) to decide by")
    return CostPolicy(plan, costs, exact_prefix=exact_prefix)


CONFIDENCE_BINS = 10
POSITION_BUCKETS = 4  # draft positions 1, 2, 3, 4+
DECAY = 0.98  # per round: old evidence fades, so a source written off is tried again later
IDLE_DECAY = 0.99  # ... the layer (recycled-node) estimates, in a round that drafted no layer token (recycled node)
PRIOR_WEIGHT = 2.0  # pseudo-observations behind the prior acceptance
TREE_SLACK = 0.05  # a tree may widen the verify pass while it costs at most this much more than the chain's
SHRINK = 2.0  # pseudo-observations pulling a (position, confidence) cell toward its position's rate
MIN_EVIDENCE = 1.0  # judged tokens (decayed) before a layer set's estimate counts as tried


def tree_room(costs: RuntimeCosts, chain: int, max_nodes: int, *, exact_prefix: int = 0) -> int:
    """Nodes a tree around a chain of `chain` tokens may hold (one sequence's or a batch's rows'): as many as
    verify within `TREE_SLACK` of the chain's cost. `exact_prefix`: a layer chain's verify pass would resume
    after it; a tree's runs every layer."""
    base = costs.verify(chain + 1, exact_prefix)
    nodes = chain
    while nodes < max_nodes and costs.verify(nodes + 2) <= base * (1 + TREE_SLACK):
        nodes += 1
    return nodes


def choose_length(
    *,
    accepted_so_far: float,
    expected_so_far: float,
    drafted: int,
    future: Sequence[float],
    spent: float,
    draft_seconds: float,
    verify_seconds: Callable[[int], float],
) -> int:
    """The total draft length k >= `drafted` that maximises expected tokens per second for this round.

    `drafted` tokens are drafted already; all of them are accepted with
    probability `accepted_so_far`, and the round emits `expected_so_far`
    tokens in expectation if it stops now (1 + the sum over drafted tokens of
    the chance that they and all before them are accepted). `future[j]` is the
    chance that the next token j+1 is accepted given all before it were;
    `spent` the seconds already spent drafting, `draft_seconds` those of one
    more drafted token, `verify_seconds(q)` those of a verify pass over q
    tokens. Ties go to the shorter draft.
    """
    best_k, best_rate = drafted, expected_so_far / (spent + verify_seconds(drafted + 1))
    reach, expected, cost = accepted_so_far, expected_so_far, spent
    for j, rate in enumerate(future):
        k = drafted + j + 1
        reach *= rate
        expected += reach
        cost += draft_seconds
        tokens_per_second = expected / (cost + verify_seconds(k + 1))
        if tokens_per_second > best_rate * (1 + 1e-9):
            best_k, best_rate = k, tokens_per_second
    return best_k


@dataclass
class Rate:
    """Decayed counts of accepted and rejected tokens."""

    accepted: float = 0.0
    rejected: float = 0.0

    @property
    def seen(self) -> float:
        return self.accepted + self.rejected

    def estimate(self, prior: float, weight: float) -> float:
        return (self.accepted + weight * prior) / (self.seen + weight)

    def add(self, accepted: bool) -> None:
        if accepted:
            self.accepted += 1
        else:
            self.rejected += 1

    def decay(self, factor: float) -> None:
        self.accepted *= factor
        self.rejected *= factor


@dataclass
class Calibration:
    """Of the tokens the chosen drafts were predicted to add, the share they did add (decayed sums).

    A cost policy drafts where its predictions look best, so the rounds it
    chooses are those whose estimates ran high: their predicted gains
    overstate what comes even when every estimate is unbiased on average
    (the winner's curse; on Spec-Bench chat traffic in a batch of 8, the
    chosen drafts realized about 0.9 of the tokens predicted). Scaling a
    prediction by `ratio` corrects that from outcomes alone. Decays like the
    acceptance estimates, so it follows the traffic.
    """

    predicted: float = 0.0
    realized: float = 0.0
    PRIOR = 4.0  # pseudo-tokens at a ratio of 1

    @property
    def ratio(self) -> float:
        return self.estimate(1.0)

    def estimate(self, prior: float) -> float:
        """The ratio, with `PRIOR` pseudo-tokens at `prior` behind the evidence."""
        return min(2.0, max(0.25, (self.realized + self.PRIOR * prior) / (self.predicted + self.PRIOR)))

    def observe(self, *, predicted: float, realized: float) -> None:
        self.predicted += predicted
        self.realized += realized

    def decay(self, factor: float = DECAY) -> None:
        self.predicted *= factor
        self.realized *= factor


@dataclass
class DepthCalibration:
    """Recycled nodes' `Calibration`, kept apart by the node's depth in the tree (1, 2, 3, 4+).

    A recycled node's value is the product of probabilities the target
    recorded in other contexts along its path. Whether a deep node is kept
    hangs on every node above it being kept, which that product overstates
    most: measured on SmolLM2 (bfloat16, kernels capped at AVX2, where each
    extra row costs about half a step), chains of recorded probabilities
    near 0.99 were drafted 5 to 8 deep and had their first node rejected
    (7 rounds that predicted 40 tokens kept 2), while trees of two nodes kept 0.64
    of what they predicted. One ratio over all depths let the deep chains
    through; a ratio per depth learns how fast the recorded values lose
    their meaning down a path.

    A depth's prior is the ratio of the depth above it (depth 1's: 1), not
    1: a node is kept only when its parent is, so a depth with little
    evidence is expected to earn no more than its parent's. Deep nodes are
    verified rarely, and with a prior of 1 their ratio drifted back from
    the evidence within a few dozen rounds and another 8-deep chain was
    tried (three such rounds in six prompts under the AVX2 kernels, none
    kept a token).
    """

    depths: list[Calibration] = field(default_factory=lambda: [Calibration() for _ in range(POSITION_BUCKETS)])

    def ratio(self, depth: int) -> float:
        """The share of a node's value expected to be earned at tree `depth` (1: a child of the root)."""
        return self.ratios()[_bucket(depth)]

    def ratios(self) -> list[float]:
        """`ratio` per depth bucket (1, 2, 3, 4+), each the prior of the next."""
        ratios, prior = [], 1.0
        for calibration in self.depths:
            prior = calibration.estimate(prior)
            ratios.append(prior)
        return ratios

    def gains(self, depths: Sequence[int], values: Sequence[float]) -> list[float]:
        """The tokens nodes at tree `depths` with `values` are expected to add: each value times its depth's ratio."""
        ratios = self.ratios()
        return [ratios[_bucket(depth)] * value for depth, value in zip(depths, values)]

    def observe(self, *, depths: Sequence[int], values: Sequence[float], kept: Sequence[bool]) -> None:
        """Verified recycled nodes at `depths` with `values`; `kept[i]`: node i lies on the kept path."""
        for depth, value, on_path in zip(depths, values, kept, strict=True):
            self.depths[_bucket(depth)].observe(predicted=value, realized=float(on_path))

    def decay(self, factor: float = DECAY) -> None:
        for calibration in self.depths:
            calibration.decay(factor)


@dataclass
class RecycleLedger:
    """Whether recycled nodes pay on this model and machine, judged in seconds from what rounds with them did.

    The cost policy adds a recycled node when its calibrated value buys a
    wider pass (`CostPolicy.recycled_nodes`); that is a prediction, and it
    errs on models whose recorded successors rarely hold in a new context.
    The ledger checks outcomes against what each round would have done
    without its recycled nodes (`alternative`, left by the policy when it
    sized them):

    - under an n-gram proposal, the proposal alone: it would have emitted
      the round's tokens less the recycled ones kept (exactly), in the time
      of its own narrower pass;
    - a tree of recycled nodes alone: a layer draft (its expected tokens, in
      its drafting and verifying time: a deep layer draft costs most of a
      step per token, which a recycled tree saves) or a plain step.

    A round gains the tokens it emitted beyond the alternative's, each worth
    the plan's recent seconds per emitted token (a token more ends the
    generation that much sooner), and costs its priced time beyond the
    alternative's (the cost table's: deterministic). Every round while
    recycling is on also costs the time the successor table took to record
    its rows (greedy only: a sampled seed's draws must not depend on timing
    noise). The decayed balance decides: after `TRIAL` rounds on, when it is
    below zero, recycling pauses, recording included, for `backoff` rounds,
    which doubles up to `MAX_PAUSE` each time a trial fails and resets when
    one pays. A pause only changes what is drafted, never what is kept.
    """

    TRIAL = 32  # rounds on before a verdict
    FIRST_PAUSE = 16  # rounds
    MAX_PAUSE = 256  # rounds
    SMOOTHING = 0.9  # weight of the past in the seconds per emitted token

    timed: bool = True  # the recording time counts (greedy runs)
    balance: float = 0.0  # decayed seconds recycling saved, less what it cost
    rounds_on: int = 0  # rounds since recycling last resumed
    paused: int = 0  # rounds left without recycling
    backoff: int = FIRST_PAUSE
    pauses: int = 0  # trials that failed
    round_seconds: float | None = None  # smoothed priced seconds of a round
    round_tokens: float | None = None  # smoothed tokens a round emitted
    pending: tuple[int, int] = (0, 0)  # this round's recycled nodes: (verified, kept)
    # Without this round's recycled nodes: (expected emitted tokens, or None: the round's less the recycled kept;
    # priced seconds)
    alternative: tuple[float | None, float] = (None, 0.0)
    recorder: SuccessorTable | None = field(default=None, compare=False, repr=False)  # the table it charges
    recorded: float = 0.0  # the recorder's seconds when last read

    def count_recording(self, successors: SuccessorTable | None) -> None:
        """Charge the time `successors` (None: no table) spends recording from now on."""
        self.recorder, self.recorded = successors, successors.seconds if successors is not None else 0.0

    @property
    def active(self) -> bool:
        """Whether this round may record successors and draft recycled nodes."""
        return self.paused == 0

    def observe(self, *, round_seconds: float, emitted: int) -> None:
        """A round ended: priced at `round_seconds`, it emitted `emitted` tokens."""
        record_seconds, self.recorded = self.recorder.seconds - self.recorded, self.recorder.seconds
        self.round_seconds = _smooth(self.round_seconds, round_seconds, self.SMOOTHING)
        self.round_tokens = _smooth(self.round_tokens, float(emitted), self.SMOOTHING)
        (nodes, kept), self.pending = self.pending, (0, 0)
        if self.paused:
            self.paused -= 1
            return
        net = -record_seconds if self.timed else 0.0
        if nodes:
            tokens, seconds = self.alternative
            tokens = emitted - kept if tokens is None else tokens
            net += (emitted - tokens) * self.round_seconds / self.round_tokens - (round_seconds - seconds)
        self.balance = DECAY * self.balance + net
        self.rounds_on += 1
        if self.rounds_on < self.TRIAL:
            return
        if self.balance < 0:  # the trial failed: pause, and judge the next one on its own rounds
            self.paused, self.backoff = self.backoff, min(2 * self.backoff, self.MAX_PAUSE)
            self.balance, self.rounds_on = 0.0, 0
            self.pauses += 1
        else:
            self.backoff = self.FIRST_PAUSE

    def describe(self) -> str:
        state = f"paused for {self.paused} more rounds" if self.paused else "on"
        return f"recycling {state} ({self.pauses} pauses so far: what it kept did not pay for it)"


@dataclass
class AcceptanceEstimates:
    """Per-token acceptance learned online, per draft source (see `CostPolicy`)."""

    prior: float
    positions: list[Rate] = field(default_factory=lambda: [Rate() for _ in range(POSITION_BUCKETS)])
    cells: list[list[Rate]] = field(
        default_factory=lambda: [[Rate() for _ in range(CONFIDENCE_BINS)] for _ in range(POSITION_BUCKETS)]
    )
    ngram: dict[int, Rate] = field(default_factory=dict)  # by match length bucket (`_match_bucket`)
    ngram_cells: dict[tuple[int, int], Rate] = field(default_factory=dict)  # by (match length bucket, position bucket)
    # An auto plan (`auto_layers.py`) drafts with several layer sets: each keeps its own layer estimates,
    # swapped into `positions` / `cells` by `use_layer_set`.
    layer_sets: dict[object, tuple[list[Rate], list[list[Rate]]]] = field(default_factory=dict)
    # Per position bucket, the prior of the layer set in use (`use_layer_set`); the plan's prior otherwise.
    layer_priors: list[float] | None = None

    def use_layer_set(self, key: object) -> None:
        """Learn and predict layer drafts with the estimates of layer set `key` (fresh, at the prior, if new).

        An auto plan's sets are keyed by their layer count, and a set of fewer
        layers is expected to be accepted no more often than one of more: its
        prior, per position, is at most what every larger set tried has
        shown. So when the larger sets are rejected, the smaller ones are not
        tried at the plan's optimistic prior.
        """
        if not self.layer_sets:
            self.layer_sets[None] = (self.positions, self.cells)  # what was learned before any set was named
        if key not in self.layer_sets:
            self.layer_sets[key] = ([Rate() for _ in range(POSITION_BUCKETS)],
                                    [[Rate() for _ in range(CONFIDENCE_BINS)] for _ in range(POSITION_BUCKETS)])
        self.positions, self.cells = self.layer_sets[key]
        self.layer_priors = None
        if isinstance(key, int):
            larger = [positions for other, (positions, _) in self.layer_sets.items()
                      if isinstance(other, int) and other > key]
            self.layer_priors = [min([self.prior] + [p[j].estimate(self.prior, PRIOR_WEIGHT) for p in larger
                                                      if p[j].seen >= MIN_EVIDENCE])
                                 for j in range(POSITION_BUCKETS)]

    def layer_set_tried(self, key: object) -> bool:
        """Whether layer set `key` has drafted a judged token (its estimates have evidence)."""
        found = self.layer_sets.get(key)
        return found is not None and found[0][0].seen >= MIN_EVIDENCE

    def layer_position(self, position: int) -> float:
        """Acceptance of the token at draft `position` (1-based), given those before were accepted."""
        bucket = _bucket(position)
        prior = self.prior if self.layer_priors is None else self.layer_priors[bucket]
        return self.positions[bucket].estimate(prior, PRIOR_WEIGHT)

    def layer_token(self, position: int, confidence: float) -> float:
        """The same, for a drafted token whose confidence is known."""
        cell = self.cells[_bucket(position)][_bin(confidence)]
        return cell.estimate(self.layer_position(position), SHRINK)

    def ngram_token(self, match_length: int, position: int = 1) -> float:
        """Acceptance of the copied token at `position` (1-based) of a proposal, given those before were accepted.

        A copy that starts right tends to go on right, so the first token and
        the later ones are counted apart; and one whose context agrees further
        back is right more often, so matches are counted apart by their length.
        """
        match_length = _match_bucket(match_length)
        marginal = self.ngram.setdefault(match_length, Rate()).estimate(self.prior, PRIOR_WEIGHT)
        cell = self.ngram_cells.setdefault((match_length, _bucket(position)), Rate())
        return cell.estimate(marginal, SHRINK)

    def observe(self, draft: Draft, accepted: int) -> None:
        """Tokens 1..accepted were accepted, token accepted+1 (if drafted) rejected; later ones unseen.

        A recycled tree teaches nothing here: its nodes' recorded probabilities are calibrated apart
        (`CostPolicy.recycled`)."""
        if draft.source == "recycled":
            return
        seen = min(len(draft.tokens), accepted + 1)
        for i in range(seen):
            ok = i < accepted
            if draft.source == "ngram":
                self.observe_copied(draft.match_length, i + 1, [ok])
            else:
                self.positions[_bucket(i + 1)].add(ok)
                self.cells[_bucket(i + 1)][_bin(draft.confidences[i])].add(ok)

    def observe_copied(self, match_length: int, first: int, outcomes: Sequence[bool]) -> None:
        """Tokens at positions `first`, `first` + 1, ... of an n-gram proposal (1-based) were (True) or were
        not (False) what the target emitted there."""
        match_length = _match_bucket(match_length)
        for i, ok in enumerate(outcomes):
            self.ngram.setdefault(match_length, Rate()).add(ok)
            self.ngram_cells.setdefault((match_length, _bucket(first + i)), Rate()).add(ok)

    def decay(self, factor: float = DECAY, *, layers_drafted: bool = True) -> None:
        """Old evidence fades by `factor` a round; the layer estimates by `IDLE_DECAY` in a round that drafted
        no layer token (a layer draft written off is tried again, but not every few dozen rounds)."""
        sets = self.layer_sets.values() or [(self.positions, self.cells)]
        layer_rates = [r for positions, cells in sets for r in [*positions, *(c for row in cells for c in row)]]
        for rate in layer_rates:
            rate.decay(factor if layers_drafted else IDLE_DECAY)
        for rate in [*self.ngram.values(), *self.ngram_cells.values()]:
            rate.decay(factor)

    def summary(self) -> str:
        def pct(rate: Rate) -> str:
            return f"{rate.accepted / rate.seen:.0%}" if rate.seen >= 0.5 else "-"

        layers = " ".join(f"{i + 1}{'+' if i == POSITION_BUCKETS - 1 else ''}:{pct(r)}"
                          for i, r in enumerate(self.positions))
        ngram = " ".join(f"n={n}:{pct(r)}" for n, r in sorted(self.ngram.items()))
        return f"layers by position {layers}" + (f"; n-gram by match length {ngram}" if ngram else "")


def _bucket(position: int) -> int:
    return min(position, POSITION_BUCKETS) - 1


def _match_bucket(match_length: int) -> int:
    """The estimates' key for an n-gram match of `match_length` tokens: the length up to 4, then 5 (5-7),
    8 (8-15) or 16 (16 and more)."""
    return next((bound for bound in (16, 8, 5) if match_length >= bound), match_length)


def _bin(confidence: float) -> int:
    return min(int(confidence * CONFIDENCE_BINS), CONFIDENCE_BINS - 1)


class CostPolicy:
    """Each round drafts the length that maximises expected tokens per second.

    A plan's `policy="cost"` (the default) drafts the length k, 0
    allowed, that maximises the round's expected emitted tokens over its
    expected time:

        E[tokens | k] / (draft time(k) + verify time(k + 1))

    The times come from the measured cost table (`costs.RuntimeCosts`). Expected
    tokens come from acceptance learned online (`AcceptanceEstimates`), per
    source: for layer drafts by the token's position in the round and the
    draft's confidence in it (its top probability); for n-gram proposals by the
    length of the match that found them (how far back the copy's context
    agrees, `ngram.matched_length`: 1, 2, 3, 4, 5-7, 8-15, 16+) and the token's
    position in the proposal (a copy that starts right tends to go on right).
    A layer draft is decided one token at a time: after each drafted token its
    confidence is known, and drafting goes on only while some longer draft
    still beats stopping now. An n-gram proposal is cut to its best length,
    and when that is 0 the layers get their turn. The
    tokens the target then emits also judge the proposal's tokens no verify pass
    saw (`Drafter.judge_offer`), so a copy cut to nothing still teaches its
    estimate: greedy, a token is accepted exactly when it is the one emitted;
    sampling, the emitted token is the proposed one with the chance the proposal
    would have been accepted. Every
    choice uses only what is known before the verify pass (draft tokens and
    confidences, past rounds), so sampling keeps its exact distribution.

    Recycled nodes (`recycle.py`) are sized the same way, by their recorded
    probabilities scaled per tree depth (`DepthCalibration`), and a
    `RecycleLedger` checks from outcomes that they pay for their wider passes
    and their recording, pausing them when they do not.
    """

    wants_confidence = True
    threshold = None  # no confidence threshold: each token's confidence feeds the expected rate

    def __init__(self, plan: DraftPlan, costs: RuntimeCosts, *, exact_prefix: int = 0) -> None:
        self.max_length = plan.draft_length
        self.costs = costs
        self.exact_prefix = exact_prefix
        self.acceptance = AcceptanceEstimates(prior=plan.target_acceptance)
        self.round_budget = plan.draft_length
        self.reach = 1.0  # chance that every token drafted so far this round is accepted
        self.expected = 1.0  # expected emitted tokens if the round stopped now
        self.spent, self.pass_width = 0.0, 1  # this round's layer draft passes so far; the width of the last
        self.draft_scale = 1.0  # a drafted token's cost relative to the table's draft step (auto plans' other sets)
        self.recycled = DepthCalibration()  # of the recycled nodes' recorded path probabilities, the share kept
        self.ledger = RecycleLedger(timed=costs.learn)  # whether recycling pays (a recycled-draft plan)

    def use_layers(self, key: object, *, exact_prefix: int, draft_scale: float) -> None:
        """Draft with another layer set from the next round (auto plans): its estimates, exact prefix and cost."""
        self.acceptance.use_layer_set(key)
        self.exact_prefix, self.draft_scale = exact_prefix, draft_scale

    def layer_set_tried(self, key: object) -> bool:
        return self.acceptance.layer_set_tried(key)

    def plain_rate(self) -> float:
        """Tokens per second of plain steps at this round's context."""
        return 1.0 / self.costs.verify(1)

    def layer_rate(self, key: object, *, exact_prefix: int, draft_scale: float) -> float:
        """Expected tokens per second of a layer draft with set `key`, at its best length (auto plans' choice).

        An untried set is predicted at its prior (`AcceptanceEstimates.use_layer_set`),
        so it gets tried; the estimates of every set fade, so a set written
        off is tried again later. The set in use stays in use, its prior with it.
        """
        estimates = self.acceptance
        active = (estimates.positions, estimates.cells, estimates.layer_priors, self.exact_prefix, self.draft_scale)
        self.use_layers(key, exact_prefix=exact_prefix, draft_scale=draft_scale)
        budget = self.round_budget
        self.round_budget = self.max_length
        rate = self.layer_draft_rate() or self.plain_rate()  # no length pays: plain steps
        self.round_budget = budget
        estimates.positions, estimates.cells, estimates.layer_priors, self.exact_prefix, self.draft_scale = active
        return rate

    def layer_draft_rate(self) -> float:
        """Expected tokens per second of this round's layer draft at its best length, before drafting (0: none)."""
        outcome = self.layer_draft_outcome()
        return outcome[0] / outcome[1] if outcome else 0.0

    def layer_draft_outcome(self) -> tuple[float, float] | None:
        """This round's layer draft at its best length, before drafting: its expected emitted tokens and its
        seconds (drafting and verifying), or None when no length pays."""
        reach, expected = self.reach, self.expected
        self.reach, self.expected = 1.0, 1.0
        k = self.draft_length_from(0) if self.round_budget > 0 and self.costs.table.draft_step else 0
        self.reach, self.expected = reach, expected
        if not k:
            return None
        gained = 1.0 + sum(math.prod(self.acceptance.layer_position(j + 1) for j in range(i + 1)) for i in range(k))
        return gained, k * self.costs.draft() * self.draft_scale + self.costs.verify(k + 1, self.exact_prefix)

    def ngram_reach(self, match_length: int, length: int) -> list[float]:
        """Per token of an n-gram proposal's first `length` tokens: the estimated chance it is accepted."""
        reach, chance = [], 1.0
        for j in range(length):
            chance *= self.acceptance.ngram_token(match_length, j + 1)
            reach.append(chance)
        return reach

    def recycled_nodes(self, values: Sequence[float], depths: Sequence[int], *, base_nodes: int,
                       base_expected: float, layers: bool) -> int:
        """How many recycled nodes (`recycle.py`, best first, recorded path probabilities `values`, at tree
        `depths`) to add to a draft of `base_nodes` nodes that is expected to emit `base_expected` tokens; 0 when
        none pay.

        Predictions are scaled by what recycled nodes at the same depth earned
        so far. With no base draft, the tree must also beat a plain step and,
        when `layers` may draft, the layer draft's expected rate. What the
        round would do without recycled nodes is left with the ledger, which
        judges the round against it (`RecycleLedger.alternative`).
        """
        best_m, best_rate = 0, base_expected / self.costs.verify(base_nodes + 1)
        # Without recycled nodes: the base draft, whose tokens the round's outcome will tell (None), ...
        self.ledger.alternative = (None, self.costs.verify(base_nodes + 1))
        outcome = self.layer_draft_outcome() if not base_nodes and layers else None
        if outcome and outcome[0] / outcome[1] > best_rate:  # ... or the layer draft, whose tokens are expected
            best_rate, self.ledger.alternative = outcome[0] / outcome[1], outcome
        elif not base_nodes:  # ... or a plain step: one token
            self.ledger.alternative = (1.0, self.costs.verify(1))
        gained, ratios = base_expected, self.recycled.ratios()
        for m, (value, depth) in enumerate(zip(values, depths, strict=True), 1):
            gained += ratios[_bucket(depth)] * value
            rate = gained / self.costs.verify(base_nodes + m + 1)
            if rate > best_rate * (1 + 1e-9):
                best_m, best_rate = m, rate
        return best_m

    def observe_unverified(self, match_length: int, first: int, outcomes: Sequence[bool]) -> None:
        """What the target emitted where an n-gram proposal's tokens from position `first` on went unverified
        (`Drafter.judge_offer`): evidence no verify pass gave, so a copy judged poor is not written off for good."""
        self.acceptance.observe_copied(match_length, first, outcomes)

    def observe_recycled(self, *, depths: Sequence[int], values: Sequence[float], kept: Sequence[bool]) -> None:
        """A verified tree held recycled nodes at `depths` with `values`; `kept[i]`: node i was on the kept path."""
        self.recycled.observe(depths=depths, values=values, kept=kept)
        self.ledger.pending = (len(values), sum(kept))

    def count_recording(self, successors: SuccessorTable | None) -> None:
        """Judge recycling by `successors` (None: not a recycled-draft plan):
        the ledger charges the time it spends recording."""
        self.ledger.count_recording(successors)

    @property
    def recycling(self) -> bool:
        """Whether this round records successors and may draft recycled nodes (`RecycleLedger`)."""
        return self.ledger.active

    def begin_round(self, budget: int, *, context: int | None = None) -> None:
        """A new round that may draft `budget` tokens, with `context` entries in the cache (what passes cost)."""
        self.round_budget, self.reach, self.expected = budget, 1.0, 1.0
        self.spent, self.pass_width = 0.0, 1  # this round's layer draft passes so far; the width of the last
        self.costs.context = context

    def ngram_length(self, match_length: int, available: int) -> int:
        """How much of an n-gram proposal of `available` tokens to verify (0: none of it)."""
        future = [self.acceptance.ngram_token(match_length, j + 1) for j in range(available)]
        return choose_length(
            accepted_so_far=1.0, expected_so_far=1.0, drafted=0, future=future, spent=0.0,
            draft_seconds=0.0, verify_seconds=lambda q: self.costs.verify(q),
        )

    def draft_next(self, drafted: int, confidence: float | None, *, width: int = 1) -> bool:
        """Whether to draft one more layer token (a layer tree: one more level, over `width` nodes a pass), after
        `drafted` this round (the last with `confidence`; a tree level's: the share of probability it kept)."""
        if drafted:
            self.reach *= self.acceptance.layer_token(drafted, confidence)
            self.expected += self.reach
            self.spent += self.costs.draft(self.pass_width) * self.draft_scale  # the pass that drafted it
        self.pass_width = width
        if self.round_budget - drafted <= 0 or not self.costs.table.draft_step:
            return False
        return self.draft_length_from(drafted, width=width, spent=self.spent) > drafted

    def tree_nodes(self, chain: int, max_nodes: int, *, exact_prefix: int = 0) -> int:
        return tree_room(self.costs, chain, max_nodes, exact_prefix=exact_prefix)

    def planned_length(self) -> int:
        """The layer draft length, decided before drafting (the static step: reading a confidence would sync)."""
        if self.round_budget <= 0 or not self.costs.table.draft_step:
            return 0
        return self.draft_length_from(0)

    def draft_length_from(self, drafted: int, *, width: int = 1, spent: float = 0.0) -> int:
        """The best total layer draft length this round, after `drafted` tokens (whose odds are in `reach`, whose
        passes took `spent` seconds), each further one a pass over `width` tokens."""
        future = [self.acceptance.layer_position(drafted + j + 1) for j in range(self.round_budget - drafted)]
        return choose_length(
            accepted_so_far=self.reach, expected_so_far=self.expected, drafted=drafted, future=future,
            spent=spent, draft_seconds=self.costs.draft(width) * self.draft_scale,
            verify_seconds=lambda q: self.costs.verify(q, self.exact_prefix),
        )

    def observe(self, draft: Draft, accepted: int, *, draft_seconds: float, verify_seconds: float, width: int,
                emitted: int | None = None) -> None:
        """The round's outcome: `accepted` of the draft's tokens (a tree's: of its first path, or of the path a
        layer tree kept), a pass over `width` tokens; `emitted`: tokens the round emitted (`accepted` + 1 if None)."""
        layered = draft.source == "layers" and bool(draft.tokens)
        self.acceptance.decay(layers_drafted=layered)
        self.recycled.decay(DECAY if draft.recycled else IDLE_DECAY)  # written off, tried again only slowly
        self.acceptance.observe(draft, accepted)
        resumed = layered and draft.tree is None  # a tree's verify pass runs every layer
        prefix = self.exact_prefix if resumed else 0
        # The layer draft's passes in one-token passes (a tree's levels are wider).
        steps = self.costs.draft_steps(draft.pass_widths) if draft.pass_widths else len(draft.tokens)
        if self.ledger.recorder is not None:  # priced before this round's time moves the table
            seconds = self.costs.verify(width, prefix) + (steps * self.costs.draft() * self.draft_scale
                                                          if layered else 0.0)
            self.ledger.observe(round_seconds=seconds, emitted=accepted + 1 if emitted is None else emitted)
        self.costs.observe_verify(width, prefix, verify_seconds)
        if layered:
            self.costs.observe_draft(steps, draft_seconds / self.draft_scale)

    def describe(self) -> str:
        recycling = f"; {self.ledger.describe()}" if self.ledger.recorder is not None else ""
        return f"cost (k by expected tokens/s; acceptance {self.acceptance.summary()}{recycling})"


class AdaptivePolicy:
    """Runtime state of an adaptive draft-length policy (the plan holds only its starting values).

    - Draft & Verify's threshold rule: raise the confidence bar when the
      smoothed acceptance rate falls short of the target, lower it otherwise.
    - A measured off switch: when a drafted token costs more time than the
      accepted tokens it brings back (acceptance x the time of a verify pass),
      drafting pauses for a few rounds, then probes again, backing off
      exponentially. A poor plan so degrades toward plain speed. Greedy only:
      when sampling, a seed's draws must not depend on timing noise.

    A plan with `adaptive=False` drafts its fixed k every round.
    """

    SMOOTHING = 0.8  # weight of the past in the moving averages
    MAX_PAUSE = 64  # rounds

    def __init__(self, plan: DraftPlan, *, off_switch: bool = True) -> None:
        self.enabled = plan.adaptive
        self.off_switch = off_switch  # off when sampling: a seed's draws must not depend on timing noise
        self.draft_length = plan.draft_length
        self.value = plan.threshold
        self.target = plan.target_acceptance
        self.step = plan.threshold_step
        self.acceptance = plan.target_acceptance  # smoothed acceptance rate, optimistic start
        self.draft_cost: float | None = None  # smoothed seconds per drafted token
        self.verify_cost: float | None = None  # smoothed seconds per verify pass
        self.paused = 0  # rounds left without drafting
        self.backoff = 4
        self.round_budget = self.layer_budget = self.draft_length
        self.costs: RuntimeCosts | None = None  # it prices nothing: the plan says what to draft

    @property
    def threshold(self) -> float | None:
        return self.value if self.enabled else None

    def budget(self) -> int:
        """How many tokens this round may draft."""
        return 0 if self.paused else self.draft_length

    # -- the interface the decode loop uses (see `CostPolicy`) ---------------------------

    wants_confidence = property(lambda self: self.enabled)

    def begin_round(self, budget: int, *, context: int | None = None) -> None:
        self.round_budget = budget  # n-gram proposals may use it all, paused or not
        self.layer_budget = min(budget, self.budget())

    def ngram_length(self, match_length: int, available: int) -> int:
        return available  # an n-gram proposal is free: always take it whole

    def tree_nodes(self, chain: int, max_nodes: int, *, exact_prefix: int = 0) -> int:
        return max(chain, max_nodes)  # the plan's node budget, whatever it costs

    def ngram_reach(self, match_length: int, length: int) -> list[float]:
        return [self.target ** (j + 1) for j in range(length)]  # the plan's target acceptance, per token

    def recycled_nodes(self, values: Sequence[float], depths: Sequence[int], *, base_nodes: int,
                       base_expected: float, layers: bool) -> int:
        return len(values)  # a recycled tree fills the plan's node budget, whatever it costs

    def observe_unverified(self, match_length: int, first: int, outcomes: Sequence[bool]) -> None:
        pass  # the fixed policy verifies every n-gram proposal whole

    def observe_recycled(self, *, depths: Sequence[int], values: Sequence[float], kept: Sequence[bool]) -> None:
        pass  # the fixed policy does not size trees

    def count_recording(self, successors: SuccessorTable | None) -> None:
        pass  # ... and recycles every round

    recycling = True

    def planned_length(self) -> int:
        """The static step drafts the budget: the confidence threshold would need a read back per token."""
        return self.layer_budget

    def draft_next(self, drafted: int, confidence: float | None, *, width: int = 1) -> bool:
        if drafted >= self.layer_budget:
            return False
        threshold = self.threshold
        return not drafted or threshold is None or confidence is None or confidence >= threshold

    def observe(self, draft: Draft, accepted: int, *, draft_seconds: float, verify_seconds: float, width: int,
                emitted: int | None = None) -> None:
        if draft.source in ("ngram", "recycled"):  # the layer policy learns from layer drafts only
            self.update(drafted=0, accepted=0, draft_seconds=0.0, verify_seconds=verify_seconds)
        else:
            self.update(drafted=len(draft.tokens), accepted=accepted, draft_seconds=draft_seconds,
                        verify_seconds=verify_seconds)

    def describe(self) -> str:
        return "fixed k" if not self.enabled else f"confidence threshold (at the end {self.value:.2f})"

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
        if self.off_switch and self.acceptance * self.verify_cost < self.draft_cost:
            self.paused, self.backoff = self.backoff, min(2 * self.backoff, self.MAX_PAUSE)
        else:
            self.backoff = 4


def _smooth(average: float | None, value: float, weight: float) -> float:
    return value if average is None else moving_average(average, value, weight)
