"""The draft phase: propose tokens with a cheap path through the target's own layers.

`Drafter.propose` runs the plan's layers one token at a time on the shared
cache, writing entries only for those layers. It saves the hidden states after
the plan's exact prefix (layers 0..s-1, which compute what the target
computes), so the verify pass resumes at layer s. One sequence's drafts;
a batch's rows draft through `batch_draft.py`.

With a trained exit head (`head.py`) the draft is layers 0..E-1, then the head
(layer N of the cache). With a draft vocabulary (`vocab.py`) the draft scores
only its tokens. An n-gram match (`ngram.py`), when the plan looks for one,
comes first: it is free. With the plan's `tree`, the layers may draft a token
tree instead of a chain (`Drafter.layer_tree`: one pass per level over the
level's likeliest nodes, written in tree rows beyond the last token). With
the plan's `recycle`, nodes grown from the target's recorded predictions
(`recycle.py`) join the n-gram proposal or form a tree of their own.

This module proposes and records; it does not run the target's full passes
(`passes.py`), decide acceptance (`acceptance.py`) or choose the draft length
(`policy.py`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from .feature_head import FeatureHead
from .head import ExitHead
from .ngram import NgramIndex, agreement
from .plan import DraftPlan, exact_prefix_of
from .recycle import SuccessorTable
from .runner import LayerRunner
from .scoring import Scorer
from .tree import LayerTreeGrowth, TokenTree
from .vocab import DraftVocab


@dataclass
class Draft:
    tokens: list[int]  # the drafted tokens d_1..d_k
    probs: torch.Tensor | None  # q: [k, vocab] draft distributions (sampling only)
    boundary: list[torch.Tensor]  # k x [1, 1, hidden]: states after the exact prefix for inputs x, d_1..d_{k-1}
    source: str = "layers"  # "layers", or "ngram" (copied from an earlier match; no boundary states)
    confidences: list[float] = field(default_factory=list)  # per drafted token: the draft's top probability
    match_length: int = 0  # n-gram drafts: how far back the match agrees (`ngram.matched_length`)
    tree: TokenTree | None = None  # n-gram continuations or a layer draft as a tree (`tree.py`); `tokens`: its first path
    path_probs: tuple[float, ...] = ()  # a layer tree: per node, the draft's probability of the path to it
    pass_widths: tuple[int, ...] = ()  # a layer tree: per draft pass, the nodes it ran (empty: one token each)
    recycled: tuple[float, ...] = ()  # a tree's last len(recycled) nodes are recycled (`recycle.py`): their values
    # A chain drafted on the device and not read back yet (the static step): its tokens `[k]` and confidences `[k]`
    # (or None); `tokens` and `confidences` are filled in by the round's one read.
    pending: tuple[torch.Tensor, torch.Tensor | None] | None = None


TREE_BRANCHES = 4  # n-gram continuations a tree draws from
LAYER_BRANCHES = 3  # a layer tree: each level runs its 3 likeliest nodes, each proposing its 3 likeliest tokens


class Drafter:
    def __init__(
        self, plan: DraftPlan, num_layers: int, *, head: ExitHead | None = None, vocab: DraftVocab | None = None
    ) -> None:
        self.num_layers = num_layers
        self.ngram = plan.ngram
        self.ngrams = NgramIndex(plan.ngram)  # the n-gram lookup of the sequence `indexed_tokens` (it only grows)
        self.indexed_tokens: list[int] | None = None
        # This sequence's last n-gram proposal, until the tokens emitted after it judge it: where it starts in
        # the sequence, its match length, its tokens, and how many of them its round verified.
        self.offer: tuple[int, int, tuple[int, ...], int] | None = None
        self.tree_nodes = plan.tree  # a round may verify a token tree of up to this many nodes
        self.set_layers(plan.draft_layers(num_layers))
        self.head = head
        self.vocab = vocab
        self.features = head if isinstance(head, FeatureHead) else None
        if self.features is not None:
            if plan.draft_layers(num_layers):
                raise ValueError(f"the feature head {plan.head} drafts without the target's layers: "
                                 "drop the plan's layers= and exit_layer=")
            self.set_layers((head.slot,))
        elif head is not None:
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
        self.exact_prefix = exact_prefix_of(layers)  # s
        self.prefix_layers = range(self.exact_prefix)
        self.other_layers = self.draft_layers[self.exact_prefix :]

    def propose(self, runner: LayerRunner, scorer: Scorer, tokens: list[int], policy,
                successors: SuccessorTable | None = None, last: torch.Tensor | None = None) -> Draft:
        """Draft after `tokens` as far as `policy` says; the last of `tokens` is not in the cache yet.

        `policy` (`policy.DraftPolicy`) has had `begin_round(budget)` called. An n-gram
        match, when the plan looks for one, comes first: it is free, and the
        policy says how much of it to verify; when that is nothing, the layers
        may draft. With the plan's `tree`, an n-gram proposal may be a tree of
        several continuations, and the layers draft a tree (`layer_tree`)
        wherever the policy finds a wider verify pass nearly as cheap. With
        `successors` (the plan's `recycle`), recycled nodes join the n-gram
        proposal, or make a tree of their own where that beats the layers.
        With `last` (the last token `[1, 1]` on the device: the static step),
        the layers draft a chain on the device (`layer_chain`).
        """
        copied = self.free_draft(runner, scorer, tokens, policy, successors)
        if copied is not None:
            return copied
        if last is None and self.tree_nodes and self.has_layers and policy.tree_nodes(
                1, self.tree_nodes, exact_prefix=self.exact_prefix) > 1:
            return self.layer_tree(runner, scorer, tokens, policy)
        return self.layer_chain(runner, scorer, tokens, policy, last)

    def free_draft(self, runner: LayerRunner, scorer: Scorer, tokens: list[int], policy,
                   successors: SuccessorTable | None) -> Draft | None:
        """What costs no pass: an n-gram proposal, grown with recycled nodes where `policy` finds them worth it."""
        copied = self.ngram_draft(tokens, policy, scorer, runner.parts.vocab_size, runner.positions.device)
        if successors is not None and policy.round_budget > 0:
            grown = self.recycled_draft(tokens, policy, copied, successors)
            if grown is not None:
                return grown
        return copied

    def layer_chain(self, runner: LayerRunner, scorer: Scorer, tokens: list[int], policy,
                    last: torch.Tensor | None) -> Draft:
        """The plan's layers, one token at a time. On the host (`last` None) each token is read back as it is
        chosen, and `policy.draft_next` may stop at any; on the device (after `last` `[1, 1]`) the chain is
        `policy.planned_length()` tokens, each step fed the previous step's choice, and nothing is read back
        (`Draft.pending`)."""
        on_device = last is not None
        planned = policy.planned_length() if on_device and self.has_layers else 0
        start = len(tokens) - 1  # the last token's position
        # On the device, logits processors that read earlier tokens get them there (none: nothing is copied).
        history = torch.tensor(tokens, device=last.device) if on_device and scorer.processors else None  # [n]
        drafted: list = []  # token ids, or `[1, 1]` device tensors
        confidences: list = []  # floats, or 0-d device tensors
        probs: list[torch.Tensor] = []  # q `[vocab]` each (sampling)
        boundary: list[torch.Tensor] = []  # `[1, 1, hidden]` each: the states after the exact prefix
        token, confidence = (last if on_device else tokens[-1]), None
        while self.has_layers and (len(drafted) < planned if on_device else policy.draft_next(len(drafted), confidence)):
            i = len(drafted)
            logits = self.step(runner, token, start + i, boundary)  # [1, vocab]
            if on_device:
                context = None if history is None else torch.cat([history, *(t.view(1) for t in drafted)])
                scores = scorer.scores(logits, context, len(tokens) + i)  # [1, vocab]
                token, confidence, q = scorer.draft_choice_on_device(scores, with_confidence=policy.wants_confidence)
            else:
                scores = scorer.scores(logits, tokens + drafted, len(tokens) + i)  # [1, vocab]
                token, confidence, q = scorer.draft_choice(scores, with_confidence=policy.wants_confidence)
            drafted.append(token)
            if confidence is not None:
                confidences.append(confidence)
            if q is not None:
                probs.append(q)
        q = torch.stack(probs) if probs else None  # [k, vocab]
        if not on_device:
            return Draft(drafted, q, boundary, confidences=confidences)
        chain = torch.cat(drafted).view(-1) if drafted else torch.empty(0, dtype=torch.long, device=last.device)  # [k]
        return Draft([], q, boundary, pending=(chain, torch.stack(confidences) if confidences else None))

    def layer_tree(self, runner: LayerRunner, scorer: Scorer, tokens: list[int], policy) -> Draft:
        """A layer draft grown as a tree, level by level (EAGLE-2's expansion), as deep as `policy` says.

        Each level is one pass of the plan's layers over the level's
        `LAYER_BRANCHES` likeliest nodes (by the draft's probability of the
        path to them), the first over the last token alone; each node
        proposes its `LAYER_BRANCHES` likeliest next tokens. Where the draft is
        sure, the likeliest paths go on down one branch; where it is unsure,
        they split. The tree verified is the `policy.tree_nodes` likeliest
        proposals (a parent is always likelier than its child, so they form
        a tree), the likeliest path first. The policy decides each next level
        from the share of the draft's probability the level kept (for a
        chain: the drafted token's confidence), and learns how deep the kept
        path went. The nodes' tokens are the draft's top choices, also when
        sampling: the tree's acceptance rule takes any fixed candidates.
        The draft's entries are written in the rows of its passes, beyond
        the last token's; the verify pass writes every layer's anew.
        """
        start = len(tokens) - 1
        layers = (*self.prefix_layers, *self.other_layers)  # what `step` runs: the plan's layers, or a head's
        growth = LayerTreeGrowth(LAYER_BRANCHES)
        coverage: float | None = None
        confidences: list[float] = []  # per level: the share of its parents' probability it kept
        hidden = None  # the last level's outputs `[1, w, hidden]` (a feature head's nodes read their parent's)
        # Every row a pass writes fits in the verify pass's room (the tree's node budget, plus the last token).
        while (len(growth.ran) + (len(growth.level) if growth.depth else 0) <= self.tree_nodes
               and policy.draft_next(growth.depth, coverage, width=len(growth.level))):
            if not growth.depth:
                hidden = self.tree_inputs(runner, runner.embed([tokens[-1]], start), None)  # [1, 1, hidden]
                hidden = runner.run(hidden, layers, start)
            else:
                parents = hidden[:, growth.parent_slots] if self.features is not None else None  # [1, w, hidden]
                grown, first_row, level_tokens = growth.run_level()
                hidden = runner.embed(level_tokens, start, grown, first_row)  # [1, w, hidden]
                hidden = runner.run(self.tree_inputs(runner, hidden, parents), layers, start, grown,
                                    first_row=first_row)
            logits = runner.logits(hidden, self.vocab)  # [w, vocab]
            if scorer.processors:  # each row conditioned on its own path
                contexts = [tokens + growth.lineage(node) for node in growth.level]
                logits = torch.cat([scorer.scores(logits[j : j + 1], c, len(c)) for j, c in enumerate(contexts)])
            coverage = growth.expand(logits)
            confidences.append(coverage)
        runner.cache.crop(start + 1, layers=layers)  # the verify pass writes the rest (a head: `fill_head`)
        if not growth.proposals:
            return Draft([], None, [])
        depth = growth.depth
        tree, path_probs = growth.tree(max(depth, policy.tree_nodes(depth, self.tree_nodes,
                                                                    exact_prefix=self.exact_prefix)))
        # Verified as a tree even when it is a chain.
        return Draft(tree.path_tokens(list(range(depth))), None, [], confidences=confidences, tree=tree,
                     path_probs=path_probs, pass_widths=tuple(growth.pass_widths))

    def recycled_draft(self, tokens: list[int], policy, base: Draft | None, successors: SuccessorTable) -> Draft | None:
        """`base` (an n-gram proposal, or None) grown with recycled nodes, as many as `policy` finds worth a
        wider pass; None when none are.

        The n-gram proposal's first path keeps its tokens and its estimated
        acceptance; recycled nodes hang under the root and under that path.
        """
        if base is None:
            base_tree, reach = None, []
        else:
            base_tree = base.tree or TokenTree.chain(base.tokens)
            # `base.tokens` is the tree's first path: nodes 0..len-1 (`TokenTree.from_paths`); other branches: 0.
            first = policy.ngram_reach(base.match_length, len(base.tokens))
            reach = first + [0.0] * (len(base_tree) - len(first))
        tree, values, depths = successors.grow_after(tokens, base_tree, reach, max_nodes=self.tree_nodes,
                                                     max_depth=policy.round_budget)
        base_nodes = len(base_tree) if base_tree is not None else 0
        added = policy.recycled_nodes(values, depths, base_nodes=base_nodes, base_expected=1.0 + sum(reach),
                                      layers=self.has_layers)
        if not added:
            return None
        tree = TokenTree(tree.tokens[: base_nodes + added], tree.parents[: base_nodes + added])
        if base is None:
            return Draft([tree.tokens[0]], None, [], source="recycled", tree=tree,
                         recycled=tuple(values[:added]))
        return dataclasses.replace(base, probs=None, tree=tree, recycled=tuple(values[:added]))

    def ngram_draft(self, tokens: list[int], policy, scorer: Scorer, vocab_size: int, device) -> Draft | None:
        """An n-gram proposal cut to the length `policy` finds worth verifying, or None (no match, or not worth it).

        With the plan's `tree`, other earlier matches' continuations
        join it as branches of a tree, as many nodes as `policy.tree_nodes` says
        verify at about the chain's cost.
        """
        if not self.ngram:
            return None
        if tokens is not self.indexed_tokens:  # a new sequence (each generation's grows in place): a new index
            self.ngrams, self.indexed_tokens, self.offer = NgramIndex(self.ngram), tokens, None
        self.judge_offer(tokens, policy)
        paths, match_length = self.ngrams.continuations(tokens, budget=policy.round_budget,
                                                        branches=TREE_BRANCHES if self.tree_nodes else 1)
        if not paths:
            return None
        copied = paths[0][: policy.ngram_length(match_length, len(paths[0]))]
        self.offer = (len(tokens), match_length, tuple(paths[0]), len(copied))
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

    def judge_offer(self, tokens: list[int], policy) -> None:
        """Tell `policy` how the last n-gram proposal's unverified tokens fared against what was emitted since.

        Its round verified its first v tokens (0 when it was cut to nothing):
        those the policy has learned from already. From token v + 1 on, as
        far as tokens were emitted and up to the first that differs, each is
        judged as a verify pass would have judged it.
        """
        if self.offer is None:
            return
        start, match_length, proposal, verified = self.offer
        self.offer = None
        judged = agreement(proposal, tokens[start:])
        if len(judged) > verified:
            policy.observe_unverified(match_length, verified + 1, judged[verified:])

    def step(self, runner: LayerRunner, token: int | torch.Tensor, position: int,
             boundary: list[torch.Tensor] | None = None) -> torch.Tensor:
        """One drafted token's pass: the plan's layers on `token` at `position`; `[1, vocab]` draft logits.

        `token` is an id, or a `[1, 1]` device tensor (the static step keeps
        its choices on the device). The hidden states after the exact prefix
        are appended to `boundary` (the verify pass resumes from them).
        """
        ids = token if isinstance(token, torch.Tensor) else [token]
        if self.features is not None:
            return self.feature_step(runner, ids, position)
        hidden = runner.run(runner.embed(ids, position), self.prefix_layers, position)  # [1, 1, hidden]
        if boundary is not None:
            boundary.append(hidden)
        hidden = runner.run(hidden, self.other_layers, position)
        return runner.logits(hidden, self.vocab)

    def tree_inputs(self, runner: LayerRunner, embeds: torch.Tensor, parents: torch.Tensor | None):
        """A tree level's input `[1, w, hidden]`: the embeddings, joined for a feature head with each node's
        parent's output (`parents` `[1, w, hidden]`; None for the root: the target's f)."""
        if self.features is None:
            return embeds
        if parents is None:
            parents = runner.head_feature if runner.head_feature is not None else torch.zeros_like(embeds)
        return self.features.inputs(embeds, parents)

    def feature_step(self, runner: LayerRunner, ids, position: int) -> torch.Tensor:
        """A feature head's draft step: (the state before `position`, the token's embedding) through the head.

        The state is the target's fused f for the round's first step, then the
        head's own output (zero before any pass, as when costs are measured).
        """
        embeds = runner.embed(ids, position)  # [1, 1, hidden]
        before = runner.draft_feature if runner.draft_feature is not None else runner.head_feature
        if before is None:
            before = torch.zeros_like(embeds)
        hidden = runner.run(self.features.inputs(embeds, before), self.other_layers, position)  # [1, 1, hidden]
        runner.draft_feature = hidden
        return runner.logits(hidden, self.vocab)
