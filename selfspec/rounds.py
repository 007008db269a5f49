"""One sequence's rounds, on every step: draft, verify, accept, roll back, emit, record.

`Decoding` holds what one generation's rounds run with; `run_rounds` runs
them. How a pass runs is the runner's: a `LayerRunner` (the eager step) reads
each drafted token back as it is chosen, so the policy may stop at any token;
a runner with `drafts_on_device` (`static.py`: fixed shapes, CUDA graphs)
drafts a length planned before drafting and keeps its choices on the device.
Either way the acceptance rule is the one device rule (`acceptance.py`,
`tree.py`), read back once a round with the draft's tokens, its confidences
and the target's top next tokens (`recycle.py`). The cache invariant: at the
top of a round it holds the target's entries for every token but the last
emitted one.

This module does not choose draft lengths (`policy.py`), propose tokens
(`draft.py`) or run passes itself (`passes.py`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .acceptance import accept_greedy_on_device, accept_sampling_on_device
from .auto_layers import AutoLayers
from .draft import Draft, Drafter
from .output import Output
from .passes import TargetPasses
from .policy import DraftPolicy
from .recycle import SuccessorTable, chain_contexts, tree_contexts
from .runner import LayerRunner
from .scoring import Scorer
from .stats import GenerationStats
from .tree import accept_tree_greedy_on_device, accept_tree_sampling_on_device


@dataclass
class Decoding:
    """What one generation's rounds run with (the round state)."""

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


def run_rounds(d: Decoding) -> None:
    """Decode until `d.out` is done; `d.out.tokens` ends with a token that is not in the cache yet."""
    runner, out = d.runner, d.out
    device = runner.positions.device
    clock = RoundClock(device)
    mark = clock.mark()  # the last round's end: a round's draft time runs from it
    while not out.done:
        start, recycling = d.begin_round()  # start: the position of the last emitted token
        # The last token `[1, 1]` on the device, where the draft's layers start from it there.
        last = torch.tensor([[out.tokens[-1]]], device=device) if runner.drafts_on_device else None
        # 1. draft: what is free first (an n-gram match, recycled predictions), else the plan's layers
        draft = d.drafter.propose(runner, d.scorer, out.tokens, d.policy, recycling, last)
        drafted_at = clock.mark()
        # 2.-4. verify in one pass, accept, read back once, roll back the cache to what was kept
        if draft.tree is None:
            accepted, token = verify_chain(d, draft, start, recycling, last)
            kept = draft.tokens[:accepted]
        else:
            path, token = verify_tree(d, draft, start, recycling)
            kept = draft.tree.path_tokens(path)
        verified_at = clock.mark()
        # 5. emit (stops at EOS, a stopping criterion or max_new_tokens)
        out.emit(kept + [token])
        # 6. record
        seconds = {"draft_seconds": clock.seconds(mark, drafted_at),
                   "verify_seconds": clock.seconds(drafted_at, verified_at)}
        if draft.tree is None:
            d.stats.record_round(drafted=len(draft.tokens), accepted=accepted, source=draft.source, **seconds)
            d.policy.observe(draft, accepted, width=len(draft.tokens) + 1, **seconds)
        else:
            record_tree_round(d.policy, d.stats, draft, path, **seconds)
        mark = verified_at


def verify_chain(d: Decoding, draft: Draft, start: int, recycling: SuccessorTable | None,
                 last: torch.Tensor | None) -> tuple[int, int]:
    """The target over the last token and the chain; (accepted drafted tokens, the target's next token).

    A device draft (after `last` `[1, 1]`) has its tokens and confidences come back with the verdict
    (`Draft.pending` is then filled in)."""
    runner, scorer, out = d.runner, d.scorer, d.out
    pending = draft.pending
    if pending:
        ids = torch.cat([last, pending[0][None]], dim=1)  # [1, k+1]
    else:
        ids = torch.tensor([[out.tokens[-1], *draft.tokens]], device=runner.positions.device)  # [1, k+1]
    drafted = ids[0, 1:]  # [k]
    checked = d.passes.verify(runner, ids, draft.boundary, start)
    if not scorer.processors:
        context = None  # processors alone read earlier tokens
    elif pending:
        context = torch.cat([torch.tensor(out.tokens, device=drafted.device), drafted])  # [n + k]
    else:
        context = out.tokens + draft.tokens
    scores = scorer.scores(checked.logits, context, len(out.tokens))  # [k+1, vocab]
    if scorer.do_sample:
        accepted, next_token = accept_sampling_on_device(drafted, draft.probs, scorer.probs(scores), scorer.generator)
    else:
        accepted, next_token = accept_greedy_on_device(drafted, scores)
    packed = [accepted.view(1).double(), next_token.double()]
    if pending:
        packed += [drafted.double()] + ([pending[1].double()] if pending[1] is not None else [])
    top = recycling.top(scores) if recycling is not None else None
    values = read_back(packed, top)  # the round's one read
    accepted, token = int(values[0]), int(values[1])
    if pending:
        k = drafted.shape[0]
        draft.tokens = [int(v) for v in values[2 : 2 + k]]
        draft.confidences = values[2 + k : 2 + 2 * k] if pending[1] is not None else []
        draft.pending = None
    if top is not None:  # every row, rejected drafted tokens' too: the recycling
        recycling.record_top(chain_contexts(out.tokens, draft.tokens), *top_rows(values, top))
    # Keep the entries of the last token and of the accepted drafted tokens.
    runner.cache.crop(start + 1 + accepted)
    d.passes.fill_head(runner, checked, start, start + 1 + accepted)
    return accepted, token


def verify_tree(d: Decoding, draft: Draft, start: int, recycling: SuccessorTable | None) -> tuple[list[int], int]:
    """The target over the last token and a token tree; (the kept path's nodes, the target's next token), the
    kept path's entries moved into place (`tree.py`)."""
    runner, scorer, out, tree = d.runner, d.scorer, d.out, draft.tree
    ids = torch.tensor([[out.tokens[-1], *tree.tokens]], device=runner.positions.device)  # [1, n+1]
    checked = d.passes.verify_tree(runner, ids, tree, start)
    scores = scorer.tree_scores(checked.logits, out.tokens, tree)  # [n+1, vocab]
    if scorer.do_sample:
        kept, next_token = accept_tree_sampling_on_device(tree, scorer.probs(scores), scorer.generator)
    else:
        kept, next_token = accept_tree_greedy_on_device(tree, scores)
    top = recycling.top(scores) if recycling is not None else None
    values = read_back([kept.double(), next_token.double()], top)  # the round's one read
    if top is not None:  # every row, rejected nodes' too: the recycling
        recycling.record_top(tree_contexts(out.tokens, tree), *top_rows(values, top))
    path = [node for node, keep in enumerate(values[: len(tree)]) if keep]
    d.passes.keep_tree_path(runner, checked, tree, path, start)
    return path, int(values[len(tree)])


def record_tree_round(policy: DraftPolicy, stats: GenerationStats, draft: Draft, path: list[int], *,
                      draft_seconds: float, verify_seconds: float) -> None:
    """What a verified tree tells the stats and the policy."""
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


class RoundClock:
    """Marks in a round, read after the round's read back: CUDA events on a GPU, the host clock elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, begin, end) -> float:
        """Seconds between two marks (on CUDA, once the later one's work is done)."""
        if not self.cuda:
            return end - begin
        end.synchronize()
        return begin.elapsed_time(end) / 1000


def read_back(packed: list[torch.Tensor], top: tuple[torch.Tensor, torch.Tensor] | None) -> list[float]:
    """The round's one device read: the 1-d float64 tensors `packed`, then the rows' top successors' probabilities
    and ids (`top`, each `[rows, TOP]`), flattened; ids up to 2**53 are exact in float64."""
    if top is not None:
        packed = [*packed, top[0].double().flatten(), top[1].double().flatten()]
    return torch.cat(packed).tolist()


def top_rows(values: list[float], top: tuple[torch.Tensor, torch.Tensor]) -> tuple[list[list[int]], list[list[float]]]:
    """From the end of `read_back`'s values: per row, the top successors' ids and probabilities."""
    rows, width = top[0].shape
    probs, ids = values[len(values) - 2 * rows * width : len(values) - rows * width], values[len(values) - rows * width :]
    return ([[int(t) for t in ids[r * width : (r + 1) * width]] for r in range(rows)],
            [probs[r * width : (r + 1) * width] for r in range(rows)])
