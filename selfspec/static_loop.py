"""The decode loop of the static step: one read back to the host per round.

The round is the eager loop's (`engine.py`): draft, verify, accept, roll
back, emit, record. What differs is where the data lives. The drafted tokens,
their confidences, the acceptance and the next token stay on the device,
each step feeding the next, until one read at the round's end brings them all
back. So the draft length is chosen before drafting
(`policy.planned_length()`), not token by token on confidences, and the
confidences reach the policy with that read, to learn from.

Times come from CUDA events on a GPU (recording one does not wait), and from
the host clock on a CPU (where every operation has finished when it returns).

This module does not know shapes or graphs (`static.py`), nor the acceptance
rule itself (`acceptance.py`).
"""

from __future__ import annotations

import time

import torch

from .acceptance import accept_greedy_on_device, accept_sampling_on_device
from .draft import Draft, Drafter
from .passes import TargetPasses
from .scoring import Scorer
from .stats import GenerationStats
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


def run_static_rounds(
    *,
    runner,
    drafter: Drafter,
    passes: TargetPasses,
    policy,
    scorer: Scorer,
    out,
    stats: GenerationStats,
    draft_length: int,
    generator: torch.Generator | None,
    auto=None,
) -> None:
    """Decode until `out` is done; `out.tokens` ends with a token that is not in the cache yet.

    `auto`: an auto plan's layer choice (`auto_layers.AutoLayers`), or None.
    """
    device = runner.positions.device
    clock = RoundClock(device)
    last = torch.tensor([[out.tokens[-1]]], device=device)  # [1, 1]
    while not out.done:
        start = len(out.tokens) - 1  # position of `last`
        if auto is not None:  # an auto plan: maybe another layer set from this round
            auto.before_round(policy)
        policy.begin_round(min(draft_length, out.remaining - 1), context=start)
        # Logits processors that read earlier tokens get them on the device (none: nothing is copied).
        history = torch.tensor(out.tokens, device=device) if scorer.processors else None  # [n]
        began = clock.mark()
        # 1. draft: an n-gram match (decided on the host: it is free), else the plan's layers
        copied = drafter.ngram_draft(out.tokens, policy, scorer, runner.parts.vocab_size, device)
        if copied is not None and copied.tree is not None:
            static_tree_round(runner, passes, policy, scorer, out, stats, clock, copied, last, start, began)
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
        # The round's one read back: drafted tokens, accepted count, next token, confidences.
        k = drafted.shape[0]
        packed = [drafted.double(), accepted.view(1).double(), next_token.double()]
        if confidences is not None:
            packed.append(confidences.double())
        values = torch.cat(packed).tolist()
        tokens, n, token = [int(v) for v in values[:k]], int(values[k]), int(values[k + 1])
        # 4. roll back: keep the entries of the last token and of the accepted drafted tokens
        runner.cache.crop(start + 1 + n)
        passes.fill_head(runner, checked, start, start + 1 + n)
        # 5. emit
        out.emit(tokens[:n] + [token])
        # 6. record
        draft = copied or Draft(tokens, None, [], confidences=values[k + 2 :])
        draft_seconds, verify_seconds = clock.seconds(began, drafted_at), clock.seconds(drafted_at, verified_at)
        stats.record_round(drafted=k, accepted=n, draft_seconds=draft_seconds, verify_seconds=verify_seconds,
                           source=draft.source)
        policy.observe(draft, n, draft_seconds=draft_seconds, verify_seconds=verify_seconds, width=k + 1)
        last = next_token.view(1, 1)


def static_tree_round(runner, passes: TargetPasses, policy, scorer: Scorer, out, stats: GenerationStats,
                      clock: RoundClock, draft: Draft, last: torch.Tensor, start: int, began) -> None:
    """One round that verifies a token tree: acceptance on the device, one read back, compaction."""
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
    values = torch.cat([kept.long(), next_token]).tolist()  # the round's one read back
    path = [node for node, keep in enumerate(values[:-1]) if keep]
    passes.keep_tree_path(runner, checked, tree, path, start)
    out.emit(tree.path_tokens(path) + [values[-1]])
    draft_seconds, verify_seconds = clock.seconds(began, drafted_at), clock.seconds(drafted_at, verified_at)
    stats.record_round(drafted=len(tree), accepted=len(path), draft_seconds=draft_seconds,
                       verify_seconds=verify_seconds, source="ngram tree")
    policy.observe(draft, tree.first_path_kept(path),  # the policy learns from the first path: how far it was kept
                   draft_seconds=draft_seconds, verify_seconds=verify_seconds, width=len(tree) + 1)


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
