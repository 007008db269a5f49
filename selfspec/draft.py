"""The draft phase: propose tokens with a cheap path through the target's own layers.

`Drafter.propose` runs the plan's layers one token at a time on the shared
cache, writing entries only for those layers. It saves the hidden states after
the plan's exact prefix (layers 0..s-1, which compute what the target
computes), so the verify pass can resume at layer s instead of starting over.

With a trained exit head (`head.py`) the draft is layers 0..E-1, then the head
(layer N of the cache). With a draft vocabulary (`vocab.py`) the draft scores
only its tokens. An n-gram match (`ngram.py`), when the plan looks for one,
comes first: it is free.

This module proposes and records; it does not run the target's full passes
(`passes.py`), decide acceptance (`acceptance.py`) or choose the draft length
(`policy.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .head import ExitHead
from .ngram import continuations, longest_match
from .plan import DraftPlan
from .runner import LayerRunner
from .scoring import Scorer
from .tree import TokenTree
from .vocab import DraftVocab


@dataclass
class Draft:
    tokens: list[int]  # the drafted tokens d_1..d_k
    probs: torch.Tensor | None  # q: [k, vocab] draft distributions (sampling only)
    boundary: list[torch.Tensor]  # k x [1, 1, hidden]: states after the exact prefix for inputs x, d_1..d_{k-1}
    source: str = "layers"  # "layers", or "ngram" (copied from an earlier match; no boundary states)
    confidences: list[float] = field(default_factory=list)  # per drafted token: the draft's top probability
    match_length: int = 0  # n-gram drafts: the length of the matched suffix
    tree: TokenTree | None = None  # several n-gram continuations as a tree (`tree.py`); `tokens` is its first path


TREE_BRANCHES = 4  # n-gram continuations a tree draws from
LAYER_BRANCHES = 3  # a layer draft's tree: at each depth, the drafted token and up to 2 runners-up


class Drafter:
    def __init__(
        self, plan: DraftPlan, num_layers: int, *, head: ExitHead | None = None, vocab: DraftVocab | None = None
    ) -> None:
        self.num_layers = num_layers
        self.ngram = plan.ngram
        self.tree_nodes = plan.tree  # n-gram proposals may be token trees of up to this many nodes
        self.set_layers(plan.draft_layers(num_layers))
        self.head = head
        self.vocab = vocab
        if head is not None:
            if plan.exit_layer != head.exit_layer:
                raise ValueError(
                    f"the head {plan.head} was trained for exit_layer={head.exit_layer}, "
                    f"the plan has exit_layer={plan.exit_layer}"
                )
            self.other_layers = (head.slot,)  # layers 0..E-1 are the exact prefix; then the head

    def set_layers(self, layers: tuple[int, ...]) -> None:
        """Draft with `layers` (increasing) from the next round on (auto plans, `auto_layers.py`)."""
        self.has_layers = bool(layers)
        self.draft_layers = tuple(layers)
        self.exact_prefix = next((s for s, i in enumerate(layers) if i != s), len(layers))  # s
        self.prefix_layers = range(self.exact_prefix)
        self.other_layers = self.draft_layers[self.exact_prefix :]

    def propose(self, runner: LayerRunner, scorer: Scorer, tokens: list[int], policy) -> Draft:
        """Draft after `tokens` as far as `policy` says; the last of `tokens` is not in the cache yet.

        `policy` (`policy.py`) has had `begin_round(budget)` called. An n-gram
        match, when the plan looks for one, comes first: it is free, and the
        policy says how much of it to verify; when that is nothing, the layers
        may draft. With the plan's `tree`, an n-gram proposal may be a tree of
        several continuations.
        """
        copied = self.ngram_draft(tokens, policy, scorer, runner.parts.vocab_size, runner.positions.device)
        if copied is not None:
            return copied
        start = len(tokens) - 1
        drafted: list[int] = []
        confidences: list[float] = []
        probs: list[torch.Tensor] = []
        boundary: list[torch.Tensor] = []
        runners_up: list[list[tuple[float, float, int]]] = []  # per depth: (p of the drafted token, p, token)
        token = tokens[-1]
        confidence = None
        while self.has_layers and policy.draft_next(len(drafted), confidence):
            i = len(drafted)
            logits = self.step(runner, token, start + i, boundary)  # [1, vocab]
            scores = scorer.scores(logits, tokens + drafted, len(tokens) + i)  # [1, vocab]
            token, confidence, q = scorer.draft_choice(scores, with_confidence=policy.wants_confidence)
            drafted.append(token)
            if confidence is not None:
                confidences.append(confidence)
            if q is not None:
                probs.append(q)
            if self.tree_nodes:
                runners_up.append(_runners_up(scores, token, LAYER_BRANCHES - 1))
        draft = Draft(drafted, torch.stack(probs) if probs else None, boundary, confidences=confidences)
        if runners_up and drafted:
            nodes = policy.tree_nodes(len(drafted), self.tree_nodes, exact_prefix=self.exact_prefix)
            draft.tree = _branch(drafted, runners_up, nodes)
        return draft

    def ngram_draft(self, tokens: list[int], policy, scorer: Scorer, vocab_size: int, device) -> Draft | None:
        """An n-gram proposal cut to the length `policy` finds worth verifying, or None (no match, or not worth it).

        With the plan's `tree`, other earlier matches' continuations
        join it as branches of a tree, as many nodes as `policy.tree_nodes` says
        verify at about the chain's cost.
        """
        if not self.ngram:
            return None
        if self.tree_nodes:
            paths, match_length = continuations(tokens, max_ngram=self.ngram, budget=policy.round_budget,
                                                branches=TREE_BRANCHES)
        else:
            copied, match_length = longest_match(tokens, max_ngram=self.ngram, budget=policy.round_budget)
            paths = [copied] if copied else []
        if not paths:
            return None
        copied = paths[0][: policy.ngram_length(match_length, len(paths[0]))]
        if not copied:
            return None
        if len(paths) > 1:
            nodes = policy.tree_nodes(len(copied), self.tree_nodes)
            tree = TokenTree.from_paths([copied] + [p[: len(copied)] for p in paths[1:]], max_nodes=nodes)
            if not tree.is_chain:
                return Draft(copied, None, [], source="ngram", match_length=match_length, tree=tree)
        probs = None
        if scorer.do_sample:  # a deterministic proposal: q is one-hot
            probs = torch.zeros(len(copied), vocab_size, device=device)  # [k, vocab]
            probs[torch.arange(len(copied)), torch.tensor(copied)] = 1.0
        return Draft(copied, probs, [], source="ngram", match_length=match_length)

    def step(self, runner: LayerRunner, token: int | torch.Tensor, position: int,
             boundary: list[torch.Tensor] | None = None) -> torch.Tensor:
        """One drafted token's pass: the plan's layers on `token` at `position`; `[1, vocab]` draft logits.

        `token` is an id, or a `[1, 1]` device tensor (the static step keeps
        its choices on the device). The hidden states after the exact prefix
        are appended to `boundary` (the verify pass resumes from them).
        """
        ids = token if isinstance(token, torch.Tensor) else [token]
        hidden = runner.run(runner.embed(ids, position), self.prefix_layers, position)  # [1, 1, hidden]
        if boundary is not None:
            boundary.append(hidden)
        hidden = runner.run(hidden, self.other_layers, position)
        return runner.logits(hidden, self.vocab)


def _runners_up(scores: torch.Tensor, chosen: int, count: int) -> list[tuple[float, float, int]]:
    """The draft's `count` likeliest tokens other than `chosen`, from its scores `[1, vocab]`:
    (p of `chosen`, p, token) each."""
    p = torch.softmax(scores[0].float(), dim=-1)  # [vocab]
    top_p, top_tokens = p.topk(count + 1)
    p_chosen = float(p[chosen])
    return [(p_chosen, float(pt), int(t)) for pt, t in zip(top_p.tolist(), top_tokens.tolist()) if t != chosen][:count]


def _branch(chain: list[int], runners_up: list[list[tuple[float, float, int]]], nodes: int) -> TokenTree | None:
    """The chain with its runners-up as leaves, the likeliest paths (by the draft's own probabilities, as
    EAGLE-2 ranks them) first, `nodes` in all; None when no branch fits."""
    if nodes <= len(chain):
        return None
    branches, reach = [], 1.0  # reach: the draft's probability of the chain up to this depth
    for depth, options in enumerate(runners_up):
        for p_chosen, p, token in options:
            branches.append((reach * p, depth, token))
        reach *= options[0][0] if options else 1.0
    branches.sort(key=lambda b: -b[0])
    paths = [chain] + [chain[:depth] + [token] for _, depth, token in branches[: nodes - len(chain)]]
    tree = TokenTree.from_paths(paths, max_nodes=nodes)
    return None if tree.is_chain else tree
