"""The decode loop of the static step: one read back to the host per round.

The round is the eager loop's (`engine.py`): draft, verify, accept, roll back,
emit, record. The drafted tokens, their confidences, the acceptance and the
next token stay on the device, each step feeding the next, until one read at
the round's end brings them back. So the draft length is chosen before
drafting (`policy.planned_length()`), and the confidences reach the policy
with that read. Times come from CUDA events on a GPU and the host clock on a
CPU. Recycled trees grow on the host from the successor table, as in the
eager loop; the top tokens of every verified row come back with the round's
one read.

This module does not know shapes or graphs (`static.py`), nor the acceptance
rule itself (`acceptance.py`).
"""

from __future__ import annotations

import time
import torch

from .acceptance import accept_greedy_on_device, accept_sampling_on_device
from .draft import Draft, Drafter
from .rounds import Decoding, record_tree_round
from .recycle import SuccessorTable, chain_contexts, top_successors, tree_contexts
from .scoring import Scorer
from .tree import accept_tree_greedy_on_device, accept_tree_sampling_on_device



class RoundClock:
    """Marks in a round, read after the round's one sync: CUDA events on a GPU, the host clock elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, begin, end) -> float:
        """Seconds between two marks (on CUDA both must have completed: call after the round's read)."""
        return begin.elapsed_time(end) / 1000 if self.cuda else end - begin


def run_static_rounds(d: Decoding) -> None:
    """Decode until `d.out` is done; `d.out.tokens` ends with a token that is not in the cache yet."""
    runner, drafter, passes, policy, scorer, out, stats = d.runner, d.drafter, d.passes, d.policy, d.scorer, d.out, d.stats
    generator = scorer.generator
    device = runner.positions.device
    clock = RoundClock(device)
    last = torch.tensor([[out.tokens[-1]]], device=device)  # [1, 1]
    while not out.done:
        start, recycling = d.begin_round()  # start: the position of `last`
        # Logits processors that read earlier tokens get them on the device (none: nothing is copied).
        history = torch.tensor(out.tokens, device=device) if scorer.processors else None  # [n]
        began = clock.mark()
        # 1. draft: an n-gram match and recycled predictions (decided on the host: they are free), else the layers
        copied = drafter.ngram_draft(out.tokens, policy, scorer, runner.parts.vocab_size, device)
        grown = None
        if recycling is not None and policy.round_budget > 0:
            grown = drafter.recycled_draft(out.tokens, policy, copied, recycling)
        if grown is not None or (copied is not None and copied.tree is not None):
            static_tree_round(d, clock, grown or copied, last, start, began, recycling)
            last = torch.tensor([[out.tokens[-1]]], device=device)  # [1, 1]: read back with the round already
            continue
        if copied is not None:
            drafted = torch.tensor(copied.tokens, device=device)  # [k]
            confidences, q, boundary = None, copied.probs, []
        else:
            k = policy.planned_length() if drafter.has_layers else 0
            drafted, confidences, q, boundary = draft_on_device(
                runner, drafter, scorer, last, start, k, history, with_confidence=policy.wants_confidence
            )
        drafted_at = clock.mark()
        # 2. verify: the target over the last token and the draft, padded to its bucket by the runner
        checked = passes.verify(runner, torch.cat([last, drafted[None]], dim=1), boundary, start)
        context = None if history is None else torch.cat([history, drafted])
        scores = scorer.scores(checked.logits, context, len(out.tokens))  # [k+1, vocab]
        # 3. accept, on the device
        if scorer.do_sample:
            accepted, next_token = accept_sampling_on_device(drafted, q, scorer.probs(scores), generator)
        else:
            accepted, next_token = accept_greedy_on_device(drafted, scores)
        verified_at = clock.mark()
        # The round's one read back: drafted tokens, accepted count, next token, confidences (and each row's top
        # next tokens, for the successor table).
        k = drafted.shape[0]
        packed = [drafted.double(), accepted.view(1).double(), next_token.double()]
        if confidences is not None:
            packed.append(confidences.double())
        top = top_successors(scores) if recycling is not None else None
        values = read_back(packed, top)
        tokens, n, token = [int(v) for v in values[:k]], int(values[k]), int(values[k + 1])
        if top is not None:
            recycling.record_top(chain_contexts(out.tokens, tokens), *top_rows(values, top))
        # 4. roll back: keep the entries of the last token and of the accepted drafted tokens
        runner.cache.crop(start + 1 + n)
        passes.fill_head(runner, checked, start, start + 1 + n)
        # 5. emit
        out.emit(tokens[:n] + [token])
        # 6. record
        draft = copied or Draft(tokens, None, [], confidences=values[k + 2 : 2 * k + 2] if confidences is not None else [])
        draft_seconds, verify_seconds = clock.seconds(began, drafted_at), clock.seconds(drafted_at, verified_at)
        stats.record_round(drafted=k, accepted=n, draft_seconds=draft_seconds, verify_seconds=verify_seconds,
                           source=draft.source)
        policy.observe(draft, n, draft_seconds=draft_seconds, verify_seconds=verify_seconds, width=k + 1)
        last = next_token.view(1, 1)


def static_tree_round(d: Decoding, clock: RoundClock, draft: Draft, last: torch.Tensor, start: int, began,
                      successors: SuccessorTable | None) -> None:
    """One round that verifies a token tree: acceptance on the device, one read back, compaction."""
    runner, passes, scorer, out = d.runner, d.passes, d.scorer, d.out
    tree = draft.tree
    drafted_at = clock.mark()
    ids = torch.cat([last, torch.tensor([tree.tokens], device=last.device)], dim=1)  # [1, n+1]
    checked = passes.verify_tree(runner, ids, tree, start)
    scores = scorer.tree_scores(checked.logits, out.tokens, tree)  # [n+1, vocab]
    if scorer.do_sample:
        kept, next_token = accept_tree_sampling_on_device(tree, scorer.probs(scores), scorer.generator)
    else:
        kept, next_token = accept_tree_greedy_on_device(tree, scores)
    verified_at = clock.mark()
    top = top_successors(scores) if successors is not None else None
    values = read_back([kept.double(), next_token.double()], top)  # the round's one read back
    if top is not None:  # every row, rejected nodes' too: the recycling
        successors.record_top(tree_contexts(out.tokens, tree), *top_rows(values, top))
    path = [node for node, keep in enumerate(values[: len(tree)]) if keep]
    passes.keep_tree_path(runner, checked, tree, path, start)
    out.emit(tree.path_tokens(path) + [int(values[len(tree)])])
    record_tree_round(d.policy, d.stats, draft, path, draft_seconds=clock.seconds(began, drafted_at),
                      verify_seconds=clock.seconds(drafted_at, verified_at))


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


def draft_on_device(
    runner, drafter: Drafter, scorer: Scorer, last: torch.Tensor, start: int, k: int,
    history: torch.Tensor | None, *, with_confidence: bool,
):
    """k drafted tokens after `last` `[1, 1]` (at `start`), each step fed the previous step's choice on the device.

    Returns drafted `[k]`, confidences `[k]` (or None), q `[k, vocab]` (sampling, else None) and the
    boundary states for the verify pass.
    """
    tokens: list[torch.Tensor] = []  # each [1, 1]
    confidences: list[torch.Tensor] = []  # each 0-d
    probs: list[torch.Tensor] = []  # each [vocab]
    boundary: list[torch.Tensor] = []  # each [1, 1, hidden]
    token = last
    first = start + 1  # tokens before the first drafted one
    for i in range(k):
        logits = drafter.step(runner, token, start + i, boundary)  # [1, vocab]
        context = None if history is None else torch.cat([history, *(t.view(1) for t in tokens)])
        scores = scorer.scores(logits, context, first + i)  # [1, vocab]
        token, confidence, q = scorer.draft_choice_on_device(scores, with_confidence=with_confidence)
        tokens.append(token)
        if confidence is not None:
            confidences.append(confidence)
        if q is not None:
            probs.append(q)
    drafted = torch.cat(tokens).view(-1) if tokens else torch.empty(0, dtype=torch.long, device=last.device)  # [k]
    return (
        drafted,
        torch.stack(confidences) if confidences else None,
        torch.stack(probs) if probs else None,
        boundary,
    )
