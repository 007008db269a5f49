"""What each row of a batch drafts in a round, and how far the batch verifies.

A draft source (`DraftSource`) proposes tokens for the rows it serves and
learns from what the verify pass kept. `NgramRows`: each row's prompt lookup
over its own tokens, free. `RecycledRows`: a row's recorded next tokens
grown into a tree, free. `LayerRows`: the plan's layers (a head, a
draft vocabulary) for every row at once, one `[rows, 1]` draft pass per
drafted token, or with the plan's `tree` one pass per tree level. A row
takes its n-gram proposal when it has one (recycled nodes may grow it),
else a recycled tree, else the layers'.

The batch verifies one width for every row. `DraftRound.length` picks the
common cut k that maximises the batch's expected emitted tokens per second:
each row's chance of reaching its j-th token (learned acceptance, a layer
token's by its position and confidence), over the draft time spent and to
come plus a verify pass over (rows, k + 1). Layers draft while some longer
cut beats stopping. Every choice uses what is known before the verify pass,
so sampling keeps its distribution.

This module does not verify, accept or emit (`batch.py`).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import time

import torch

from .batch_runner import BatchRunner
from .draft import LAYER_BRANCHES, Draft
from .feature_head import FeatureHead
from .head import ExitHead
from .ngram import NgramIndex, agreement
from .output import Output
from .costs import RuntimeCosts
from .plan import exact_prefix_of
from .policy import AcceptanceEstimates, DepthCalibration, tree_room
from .recycle import SuccessorTable
from .scoring import Scorer
from .stats import GenerationStats
from .tree import LayerTreeGrowth, TokenTree
from .vocab import DraftVocab


# Drafting at all must beat not drafting by this fraction of predicted tokens per second. A wrong guess widens
# every row's pass, and the acceptance estimates run optimistic early (they start at the plan's prior): a
# margin below that error turns speculation into a loss against drafting off.
BATCH_MARGIN = 0.10


@dataclass(eq=False)
class BatchRow:
    """One sequence in a batch."""

    out: Output
    scorer: Scorer
    prompt_length: int
    ngrams: NgramIndex | None = None  # its n-gram lookup, kept up to date as it grows
    feature: torch.Tensor | None = None  # a feature head's f at its last cached position `[1, 1, hidden]`
    successors: SuccessorTable | None = None  # the target's recorded next tokens on this row (`RecycledRows`)
    stats: GenerationStats = field(default_factory=GenerationStats)
    began: float = field(default_factory=time.perf_counter)

    @property
    def done(self) -> bool:
        return self.out.done

    @property
    def new_tokens(self) -> list[int]:
        return self.out.tokens[self.prompt_length :]


@dataclass
class RowDraft:
    """One row's proposal this round."""

    source: str = ""  # "ngram", "layers", or "" (nothing proposed)
    tokens: list[int] = field(default_factory=list)
    odds: list[float] = field(default_factory=list)  # per token: its chance of acceptance, those before accepted
    probs: list[torch.Tensor] = field(default_factory=list)  # q `[vocab]` per layer token (sampling)
    confidences: list[float] = field(default_factory=list)  # per layer token: the draft's top probability
    match_length: int = 0  # an n-gram proposal's match length (`ngram.matched_length`)
    proposal: list[int] = field(default_factory=list)  # an n-gram proposal uncut (its tokens no pass saw are judged)
    paths: list[list[int]] = field(default_factory=list)  # n-gram continuations, `tokens` first (branches for a tree)
    grown: TokenTree | None = None  # `tokens`, then recycled nodes best first (`RecycledRows`)
    values: list[float] = field(default_factory=list)  # per recycled node: its recorded path probability
    gains: list[float] = field(default_factory=list)  # per recycled node: the tokens it is expected to add

    def nodes(self, k: int) -> int:
        """How many nodes the row verifies when the batch cuts at k: its chain's first k, then recycled nodes."""
        return min(k, len(self.odds) + len(self.gains))

    def tree(self, k: int, nodes: int) -> TokenTree | None:
        """The row's first k tokens, then, up to `nodes` nodes (the room a batch's verify pass has beside this
        row's chain): its recycled nodes, or its other n-gram continuations (cut at depth k) as branches. None
        where that is a chain of n-gram or layer tokens."""
        if self.grown is not None:  # the chain is its first nodes: any first m nodes make a tree
            m = min(nodes, len(self.grown))
            return TokenTree(self.grown.tokens[:m], self.grown.parents[:m]) if m > k else None
        if len(self.paths) < 2 or k < 1 or nodes <= k:
            return None
        tree = TokenTree.from_paths([path[:k] for path in self.paths], max_nodes=nodes)
        return None if tree.is_chain else tree

    def q(self, k: int, vocab_size: int, device) -> torch.Tensor:
        """q `[k, vocab]` of the first k tokens: the draft's distributions, or one-hot for a copy."""
        if self.probs:
            return torch.stack(self.probs[:k])
        q = torch.zeros(k, vocab_size, device=device)
        if k:
            q[torch.arange(k), torch.tensor(self.tokens[:k])] = 1.0
        return q


@dataclass
class DraftRound:
    """A round's draft state over the batch's rows (in cache order)."""

    rows: list[BatchRow]
    starts: list[int]  # each row's position of its last token (not in the cache yet)
    budgets: list[int]  # tokens each row may still draft
    acceptance: AcceptanceEstimates
    costs_for: Callable[[], RuntimeCosts]  # what passes over these rows cost (measured on first use)
    scale: float = 1.0  # the share of predicted extra tokens the chosen drafts brought (`policy.Calibration`)
    fixed: bool = False  # the plan's `policy="fixed"`: layers draft their full length
    learned: bool = True  # whether the round decides and learns from earlier rounds' outcomes (not when sampling)
    drafts: list[RowDraft] = field(default_factory=list)
    pass_widths: list[int] = field(default_factory=list)  # per layer draft pass run this round: its nodes per row
    next_width: int = 1  # ... and what the next one would run (a layer tree's levels are wider than its root)
    costs: RuntimeCosts | None = None  # fetched by the first decision that needs them
    # Where every row drafted a layer chain or nothing: the layers the verify pass resumes after (the draft's exact
    # prefix, `LayerRows.exact_prefix`), and per draft step the rows' states after them `[rows, 1, hidden]`.
    exact_prefix: int = 0
    boundary: list[torch.Tensor] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.drafts = [RowDraft() for _ in self.rows]

    @property
    def layer_steps(self) -> int:
        """Layer draft passes run this round."""
        return len(self.pass_widths)

    def priced(self) -> RuntimeCosts:
        if self.costs is None:
            self.costs = self.costs_for()
            self.costs.context = max(self.starts)  # every row attends over the longest row's span
        return self.costs

    def length(self, futures: list[list[float]] | None = None) -> tuple[int, float]:
        """The common cut k that maximises expected emitted tokens per second, and the extra tokens it predicts.

        Row i's odds are its draft's, then `futures[i]` (layer tokens not drafted
        yet, each costing one more draft step); past its chain, each recycled
        node adds its gain. Drafting at all must beat a plain pass by
        `BATCH_MARGIN`; ties go to the shorter cut.
        """
        futures = futures or [[] for _ in self.rows]
        odds = [d.odds + f for d, f in zip(self.drafts, futures)]
        gains = [d.gains for d in self.drafts]
        longest = max((len(o) + len(g) for o, g in zip(odds, gains)), default=0)
        drafted_to = max((len(o) for o in odds), default=0)  # past it no row drafts: its nodes are drafted already
        costs = self.priced()
        step = costs.draft(self.next_width) if any(futures) else 0.0  # one more layer draft pass over the rows
        spent = costs.draft() * costs.draft_steps(self.pass_widths) if self.pass_widths else 0.0
        rows, reach, extra = len(odds), [1.0] * len(odds), 0.0
        best_k, best_extra, best_rate = 0, 0.0, rows / (spent + costs.verify(1)) * (1 + BATCH_MARGIN)
        for k in range(1, longest + 1):
            for i, row_odds in enumerate(odds):
                if k <= len(row_odds):
                    reach[i] *= row_odds[k - 1]
                    extra += reach[i]
                elif k - len(row_odds) <= len(gains[i]):
                    extra += gains[i][k - len(row_odds) - 1]
            seconds = spent + max(0, min(k, drafted_to) - self.layer_steps) * step + costs.verify(k + 1, self.exact_prefix)
            rate = (rows + self.scale * extra) / seconds
            if rate > best_rate * (1 + 1e-9):
                best_k, best_extra, best_rate = k, extra, rate
        return best_k, best_extra


class DraftSource(Protocol):
    """A way to propose tokens for a batch's rows: every source serves one row as well as many."""

    def propose(self, batch: DraftRound) -> None:
        """Fill `batch.drafts[i]` for the rows this source serves (those with nothing proposed yet)."""

    def learn(self, batch: DraftRound, i: int, verified: int, kept: list[int], path: list[int] | None) -> None:
        """Row i's pass verified its first `verified` nodes and kept `kept` (accepted ones, then the target's);
        `path`: the kept nodes, where the row verified a tree."""


class NgramRows:
    """Each row's prompt lookup (`ngram.NgramIndex`) over its own tokens: copies cost no pass. With `branches`,
    a row also keeps its other continuations (`RowDraft.paths`), which a round may verify as a tree."""

    def __init__(self, max_ngram: int, branches: int = 1) -> None:
        self.max_ngram = max_ngram
        self.branches = branches

    def index(self) -> NgramIndex:
        return NgramIndex(self.max_ngram)

    def propose(self, batch: DraftRound) -> None:
        for row, budget, draft in zip(batch.rows, batch.budgets, batch.drafts):
            if budget < 1 or draft.source:
                continue
            paths, match = row.ngrams.continuations(row.out.tokens, budget=budget, branches=self.branches)
            if paths:
                tokens = paths[0]
                draft.source, draft.tokens, draft.match_length, draft.proposal = "ngram", list(tokens), match, list(tokens)
                draft.paths = [list(path) for path in paths]
                draft.odds = [batch.acceptance.ngram_token(match, j + 1) for j in range(len(tokens))]

    def learn(self, batch: DraftRound, i: int, verified: int, kept: list[int], path: list[int] | None) -> None:
        draft = batch.drafts[i]
        if draft.source == "ngram":  # the verified tokens as judged, and the first uncut one by the pass's own token
            batch.acceptance.observe_copied(draft.match_length, 1, agreement(draft.proposal, kept))


class RecycledRows:
    """Each row's recycled tree (`recycle.py`): the target's recorded next tokens on that row, grown under its
    last token and under its n-gram chain, if any. A node's gain is its recorded path probability scaled by
    what nodes at its depth earned (`policy.DepthCalibration`). It serves rows the earlier sources left
    without a draft, and grows n-gram chains."""

    def __init__(self, max_nodes: int) -> None:
        self.max_nodes = max_nodes
        self.calibration = DepthCalibration()  # what every row's verified recycled nodes earned

    def propose(self, batch: DraftRound) -> None:
        calibration = self.calibration if batch.learned else DepthCalibration()
        for row, budget, draft in zip(batch.rows, batch.budgets, batch.drafts):
            if budget < 1 or draft.source not in ("", "ngram"):
                continue
            base = TokenTree.chain(draft.tokens) if draft.tokens else None
            reach = list(itertools.accumulate(draft.odds, operator.mul))  # each chain token's chance of being kept
            tree, values, depths = row.successors.grow_after(row.out.tokens, base, reach, max_nodes=self.max_nodes,
                                                             max_depth=budget)
            if not values:
                continue
            draft.source = draft.source or "recycled"
            draft.grown, draft.values = tree, values
            draft.gains = calibration.gains(depths, values)

    def learn(self, batch: DraftRound, i: int, verified: int, kept: list[int], path: list[int] | None) -> None:
        draft = batch.drafts[i]
        if draft.grown is None or path is None or not batch.learned:
            return
        first = len(draft.tokens)  # the recycled nodes follow the chain
        nodes = range(first, min(verified, len(draft.grown)))
        on_path = set(path)
        self.calibration.observe(depths=[draft.grown.depths()[1 + node] for node in nodes],
                                 values=[draft.values[node - first] for node in nodes],
                                 kept=[node in on_path for node in nodes])


class LayerRows:
    """The plan's draft layers (an exit head as layer N, or a feature head alone; a draft vocabulary) for every
    row: a chain, one pass a token, or with the plan's `tree` a layer tree, one pass a level (`trees`)."""

    def __init__(self, layers: tuple[int, ...], *, head: ExitHead | FeatureHead | None = None, vocab: DraftVocab | None = None,
                 threshold: float | None = None, tree: int = 0) -> None:
        self.layers = layers
        self.head = head
        self.vocab = vocab
        self.threshold = threshold  # a fixed plan's `adaptive` confidence threshold (None: draft the full length)
        self.tree = tree  # the plan's node budget for a layer tree (0: chains only)
        # Layers 0..s-1 of a chain's draft compute what the target computes: a verify pass may resume after them.
        self.exact_prefix = 0 if isinstance(head, FeatureHead) else exact_prefix_of(layers)
        self.calibration = DepthCalibration()  # what a layer tree's branch nodes earned, by depth
        self.runner: BatchRunner | None = None  # the session's, set before each round

    def propose(self, batch: DraftRound) -> None:
        serve = [i for i, (d, b) in enumerate(zip(batch.drafts, batch.budgets)) if not d.source and b >= 1]
        if not serve:
            return
        for i in serve:
            batch.drafts[i].source = "layers"
        features = self.head if isinstance(self.head, FeatureHead) else None
        before = None
        if features is not None and all(row.feature is not None for row in batch.rows):
            before = torch.cat([row.feature for row in batch.rows])  # [rows, 1, hidden]
        if self.tree and self.trees_pay(batch):
            self.trees(batch, serve, features, before)
        else:
            self.chains(batch, serve, features, before)

    def trees_pay(self, batch: DraftRound) -> bool:
        """Whether to draft trees this round: a fixed plan always (as one sequence's), else where the rows' pass
        has room for a branch beside a chain's first token (`policy.tree_room`, as one sequence's)."""
        return batch.fixed or tree_room(batch.priced(), 1, self.tree, exact_prefix=self.exact_prefix) > 1

    def chains(self, batch: DraftRound, serve: list[int], features: FeatureHead | None,
               before: torch.Tensor | None) -> None:
        """Every row one token a pass, while `go_on` says. Where no row took another source, the verify pass
        will resume after the exact prefix (`DraftRound.exact_prefix`), and is priced so."""
        rows = batch.rows
        if all(draft.source in ("", "layers") for draft in batch.drafts):
            batch.exact_prefix = self.exact_prefix
        inputs = [row.out.tokens[-1] for row in rows]
        device = self.runner.positions.device
        longest = max(batch.budgets[i] for i in serve)
        while batch.layer_steps < longest and self.go_on(batch, serve):
            j = batch.layer_steps
            logits = self.runner.draft_rows(torch.tensor(inputs, device=device)[:, None],
                                            [s + j for s in batch.starts], slice(0, len(rows)), self.layers,
                                            self.vocab, head=features, before=before)[:, 0]  # [rows, vocab]
            before = self.runner.drafted
            if batch.exact_prefix:
                batch.boundary.append(self.runner.boundary)  # [rows, 1, hidden]
            batch.pass_widths.append(1)
            for i in serve:
                if j >= batch.budgets[i]:
                    continue
                row, draft = rows[i], batch.drafts[i]
                scores = row.scorer.scores(logits[i : i + 1], row.out.tokens + draft.tokens, len(row.out.tokens) + j)
                token, confidence, q = row.scorer.draft_choice(scores, with_confidence=True)
                draft.tokens.append(token)
                draft.confidences.append(confidence)
                draft.odds.append(batch.acceptance.layer_token(j + 1, confidence))
                if q is not None:
                    draft.probs.append(q)
                inputs[i] = token

    def trees(self, batch: DraftRound, serve: list[int], features: FeatureHead | None,
              before: torch.Tensor | None) -> None:
        """Every row grows a layer tree (`tree.LayerTreeGrowth`, as one sequence's `Drafter.layer_tree`), one
        pass over all rows' levels at a time, while `go_on` says and the tree's rows fit in `tree` nodes.

        A served row's draft is then its likeliest deepest path (the chain the
        cut prices by its confidences), then its other nodes, likeliest first,
        each priced as its path probability times what nodes at its depth
        earned (`RowDraft.grown`, `gains`). The nodes are the draft's top
        choices, also when sampling: the tree rule takes fixed candidates.
        """
        rows, device = batch.rows, self.runner.positions.device
        growths = [LayerTreeGrowth(LAYER_BRANCHES) for _ in rows]  # every row runs the passes; served ones keep
        longest = max(batch.budgets[i] for i in serve)
        while (batch.layer_steps < longest and self.go_on(batch, serve)
               and (not batch.layer_steps or len(growths[0].ran) + LAYER_BRANCHES <= self.tree)):
            if not batch.layer_steps:
                ids, trees, first_row = [[row.out.tokens[-1]] for row in rows], None, 0
            else:
                if features is not None:  # each node reads its parent's output
                    slots = torch.tensor([growth.parent_slots for growth in growths], device=device)  # [rows, w]
                    drafted = self.runner.drafted  # [rows, w before, hidden]
                    before = drafted.gather(1, slots[:, :, None].expand(-1, -1, drafted.shape[-1]))  # [rows, w, hidden]
                levels = [growth.run_level() for growth in growths]
                trees, first_row = [level[0] for level in levels], levels[0][1]
                ids = [level[2] for level in levels]
            logits = self.runner.draft_rows(torch.tensor(ids, device=device), batch.starts, slice(0, len(rows)),
                                            self.layers, self.vocab, head=features, before=before,
                                            trees=trees, first_row=first_row)  # [rows, w, vocab]
            batch.pass_widths.append(len(ids[0]))
            for i, (row, growth) in enumerate(zip(rows, growths)):
                scores = logits[i]  # [w, vocab]
                if i in serve and row.scorer.processors:  # each node conditioned on its own path
                    contexts = [row.out.tokens + growth.lineage(node) for node in growth.level]
                    scores = torch.cat([row.scorer.scores(scores[j : j + 1], c, len(c)) for j, c in enumerate(contexts)])
                growth.expand(scores)
                if i in serve and batch.layer_steps <= batch.budgets[i]:
                    self.take_chain(batch, i, growth)
            batch.next_width = len(growths[0].level)  # every row's level is as wide
        if not batch.layer_steps:
            return
        calibration = self.calibration if batch.learned else DepthCalibration()
        for i in serve:
            draft = batch.drafts[i]
            tree, path_probs = growths[i].tree(self.tree, max_depth=batch.budgets[i])
            chain = len(draft.tokens)
            draft.grown, draft.values = tree, list(path_probs[chain:])
            draft.gains = calibration.gains(tree.depths()[1 + chain :], draft.values)
        if batch.learned:
            self.calibration.decay()

    @staticmethod
    def take_chain(batch: DraftRound, i: int, growth: LayerTreeGrowth) -> None:
        """Row i's chain: its tree's likeliest deepest path, each token's confidence the draft's probability of it
        after the path before it."""
        path = growth.best_path()
        reach = [1.0] + [growth.proposals[node][0] for node in path]
        draft = batch.drafts[i]
        draft.tokens = [growth.proposals[node][2] for node in path]
        draft.confidences = [p / r if r > 0 else 0.0 for p, r in zip(reach[1:], reach)]
        draft.odds = [batch.acceptance.layer_token(j + 1, c) for j, c in enumerate(draft.confidences)]

    def go_on(self, batch: DraftRound, serve: list[int]) -> bool:
        """Whether to draft one more token for the rows served: a fixed plan while some row's confidence holds,
        else while some longer cut beats stopping now."""
        j = batch.layer_steps
        if batch.fixed:
            return not j or self.threshold is None or any(
                batch.drafts[i].confidences and batch.drafts[i].confidences[-1] >= self.threshold for i in serve)
        futures = [[batch.acceptance.layer_position(j + m + 1) for m in range(batch.budgets[i] - j)]
                   if i in serve else [] for i in range(len(batch.rows))]
        return batch.length(futures)[0] > j

    def learn(self, batch: DraftRound, i: int, verified: int, kept: list[int], path: list[int] | None) -> None:
        """A chain's verified tokens teach the layer estimates; a tree's first path does, as far as it was kept,
        and its other nodes the depth calibration."""
        draft = batch.drafts[i]
        if draft.source != "layers" or not verified:
            return
        chain = min(verified, len(draft.tokens))
        shown = Draft(draft.tokens[:chain], None, [], confidences=draft.confidences[:chain])
        if path is None:
            batch.acceptance.observe(shown, len(kept) - 1)
            return
        batch.acceptance.observe(shown, draft.grown.first_path_kept(path) if chain else 0)
        if batch.learned:
            on_path, depths = set(path), draft.grown.depths()
            nodes = range(len(draft.tokens), min(verified, len(draft.grown)))
            self.calibration.observe(depths=[depths[1 + node] for node in nodes],
                                     values=[draft.values[node - len(draft.tokens)] for node in nodes],
                                     kept=[node in on_path for node in nodes])
