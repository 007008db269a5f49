"""One sequence's rounds on the eager step, and what every step's rounds share.

`Decoding` holds what one generation's rounds run with: the runner, the
drafter, the target's passes, the policy, the scorer, the output, the stats
and the optional auto-layer choice and successor table. `eager_rounds` runs
them with shapes that follow the tokens, reading each drafted token back as
it is chosen; the static step runs the same `Decoding` with one read back a
round (`static_loop.py`). Each round: draft, verify, accept, roll back, emit,
record. The cache invariant: at the top of a round it holds the target's
entries for every token but the last emitted one.

This module does not choose draft lengths (`policy.py`), propose tokens
(`draft.py`) or run passes itself (`passes.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .acceptance import accept_greedy, accept_sampling
from .auto_layers import AutoLayers
from .draft import Draft, Drafter
from .output import Clock, Output
from .passes import TargetPasses
from .policy import DraftPolicy
from .recycle import SuccessorTable, chain_contexts, tree_contexts
from .runner import LayerRunner
from .scoring import Scorer
from .stats import GenerationStats
from .tree import accept_tree_greedy, accept_tree_sampling


@dataclass
class Decoding:
    """What one generation's rounds run with (the round state every step shares)."""

    runner: LayerRunner
    drafter: Drafter
    passes: TargetPasses
    policy: DraftPolicy
    scorer: Scorer
    out: Output
    stats: GenerationStats
    draft_length: int  # the plan's most tokens a round
    auto: AutoLayers | None = None  # an auto plan's layer choice
    successors: SuccessorTable | None = None  # a recycled-draft plan's table

    def begin_round(self) -> tuple[int, SuccessorTable | None]:
        """A round starts: its position (the last emitted token's, not in the cache yet) and whether it recycles."""
        start = len(self.out.tokens) - 1
        if self.auto is not None:  # an auto plan: maybe another layer set from this round
            self.auto.before_round(self.policy)
        self.policy.begin_round(min(self.draft_length, self.out.remaining - 1), context=start)
        return start, recycling_this_round(self.policy, self.successors, self.stats)


def eager_rounds(d: Decoding, clock: Clock) -> None:
    """Decode until `d.out` is done: shapes follow the tokens; each drafted token is read back as chosen."""
    runner, scorer, out = d.runner, d.scorer, d.out
    while not out.done:
        start, recycling = d.begin_round()
        # 1. draft: an n-gram match, recycled predictions, else the plan's layers, as far as the policy finds it pays
        draft = d.drafter.propose(runner, scorer, out.tokens, d.policy, recycling)
        draft_seconds = clock.lap()
        if draft.tree is not None:  # several continuations at once
            eager_tree_round(d, draft, start, clock, draft_seconds, recycling)
            continue
        # 2. verify: one pass of the target over the last token and the draft
        ids = torch.tensor([[out.tokens[-1], *draft.tokens]], device=runner.positions.device)  # [1, k+1]
        checked = d.passes.verify(runner, ids, draft.boundary, start)
        scores = scorer.scores(checked.logits, out.tokens + draft.tokens, len(out.tokens))  # [k+1, vocab]
        if recycling is not None:
            recycling.record(chain_contexts(out.tokens, draft.tokens), scores)
        # 3. accept
        if scorer.do_sample:
            verdict = accept_sampling(draft.tokens, draft.probs, scorer.probs(scores), scorer.generator)
        else:
            verdict = accept_greedy(draft.tokens, scores)
        # 4. roll back: keep the entries of the last token and of the accepted drafted tokens
        runner.cache.crop(start + 1 + verdict.accepted)
        d.passes.fill_head(runner, checked, start, start + 1 + verdict.accepted)
        verify_seconds = clock.lap()
        # 5. emit (stops at EOS, a stopping criterion or max_new_tokens)
        out.emit(draft.tokens[: verdict.accepted] + [verdict.next_token])
        # 6. record
        d.stats.record_round(drafted=len(draft.tokens), accepted=verdict.accepted, draft_seconds=draft_seconds,
                             verify_seconds=verify_seconds, source=draft.source)
        d.policy.observe(draft, verdict.accepted, draft_seconds=draft_seconds, verify_seconds=verify_seconds,
                         width=len(draft.tokens) + 1)


def eager_tree_round(d: Decoding, draft: Draft, start: int, clock: Clock, draft_seconds: float,
                     successors: SuccessorTable | None) -> None:
    """Verify a token tree in one pass, keep a path (greedy or sampling), compact the cache (`tree.py`)."""
    runner, scorer, out, tree = d.runner, d.scorer, d.out, draft.tree
    ids = torch.tensor([[out.tokens[-1], *tree.tokens]], device=runner.positions.device)  # [1, n+1]
    checked = d.passes.verify_tree(runner, ids, tree, start)
    scores = scorer.tree_scores(checked.logits, out.tokens, tree)  # [n+1, vocab]
    if successors is not None:  # every row, rejected nodes' too: the recycling
        successors.record(tree_contexts(out.tokens, tree), scores)
    if scorer.do_sample:
        path, next_token = accept_tree_sampling(tree, scorer.probs(scores), scorer.generator)
    else:
        path, next_token = accept_tree_greedy(tree, scores)
    d.passes.keep_tree_path(runner, checked, tree, path, start)
    verify_seconds = clock.lap()
    out.emit(tree.path_tokens(path) + [next_token])
    record_tree_round(d.policy, d.stats, draft, path, draft_seconds=draft_seconds, verify_seconds=verify_seconds)


def record_tree_round(policy: DraftPolicy, stats: GenerationStats, draft: Draft, path: list[int], *,
                      draft_seconds: float, verify_seconds: float) -> None:
    """What a verified tree tells the stats and the policy (every step's rounds)."""
    tree = draft.tree
    first_recycled = len(tree) - len(draft.recycled)  # the tree's last nodes are the recycled ones
    on_path = set(path)
    kept = [node in on_path for node in range(first_recycled, len(tree))]  # per recycled node
    if draft.recycled:
        policy.observe_recycled(depths=tree.depths()[1 + first_recycled :], values=draft.recycled, kept=kept)
    stats.record_round(drafted=len(tree), accepted=len(path), draft_seconds=draft_seconds,
                       verify_seconds=verify_seconds, source=f"{draft.source} tree",
                       recycled=(len(draft.recycled), sum(kept)))
    # An n-gram tree teaches the policy how far its first path (the chain it would have verified) was kept; a
    # layer tree, how deep its kept path went (its confidences are the share of probability each level kept).
    kept_length = len(path) if draft.source == "layers" else tree.first_path_kept(path)
    policy.observe(draft, kept_length, draft_seconds=draft_seconds, verify_seconds=verify_seconds,
                   width=len(tree) + 1, emitted=len(path) + 1)


def recycling_this_round(policy: DraftPolicy, successors: SuccessorTable | None,
                         stats: GenerationStats) -> SuccessorTable | None:
    """`successors` when this round records and may draft recycled nodes; None without them, or while the
    policy's ledger has recycling paused (`policy.RecycleLedger`: it did not pay)."""
    if successors is None:
        return None
    if not policy.recycling:
        stats.recycling_paused += 1
        return None
    return successors
