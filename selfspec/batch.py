"""Batched generation: several sequences, each with its own draft and acceptance rule, over one cache of rows.

A `BatchSession` holds the sequences that decode together (`BatchRow`): a
row joins with `add` and leaves when done; `step` runs a round for all rows:

1. draft: each row's proposal from the plan's sources (`batch_draft.py`):
   an n-gram copy (grown with recycled nodes), else a recycled tree, else
   the plan's layers (a chain or a tree), all rows in each draft pass;
2. choose: one verify width, by expected tokens per second;
3. verify: one pass of the full model over `[rows, width]`, padded; a row
   whose draft is shorter than the width may fill that room with a tree;
   where every row drafted a layer chain, the pass resumes after the
   draft's exact prefix;
4. accept: per row, the greedy or the rejection rule (a tree's for a tree);
5. roll back: each row's length moves to what it kept (a tree's kept path
   is moved into place first);
6. emit, record (every source learns), drop the rows that finished.

Greedy rows equal `model.generate` alone; sampling rows keep their law.
Not in a batch: the static step and CUDA graphs.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch

from .acceptance import accept_greedy, accept_sampling
from .batch_draft import BATCH_MARGIN, BatchRow, DraftRound, DraftSource, LayerRows, NgramRows, RecycledRows
from .batch_runner import BatchRunner
from .draft import TREE_BRANCHES
from .cpu_kernels import NO_ATTENTION_CHANGE, NO_CHANGE, AttentionKernels, LinearKernels, cpu_kernels
from .costs import PassCosts, RuntimeCosts
from .feature_head import FeatureHead
from .head import ExitHead
from .hf_generation import GenerationSettings
from .output import Clock, Output
from .parts import ModelParts
from .plan import DraftPlan
from .prefix_cache import PrefixCache
from .policy import DECAY, IDLE_DECAY, AcceptanceEstimates, Calibration
from .recycle import SuccessorTable, chain_contexts, tree_contexts
from .scoring import Scorer
from .stats import BatchStats
from .tree import TokenTree, accept_tree_greedy, accept_tree_sampling
from .vocab import DraftVocab

GROW_BLOCK = 256  # new-token positions a row is given room for at a time (the cache grows as rows need more)

__all__ = ["BATCH_MARGIN", "BatchRow", "BatchRunner", "BatchSession"]


class BatchSession:
    """Sequences decoding together (see the module docstring); `add` a row, `step` a round, until empty.

    `settings_for(prompt, kwargs)`: a row's `GenerationSettings`, resolved
    as `model.generate` resolves them. `costs_for(rows, learn)`: the
    `RuntimeCosts` of passes over that many rows (measured on first use).
    `draft_layers` (with `head`, `vocab`): the layers a draft step runs.
    """

    def __init__(self, parts: ModelParts, plan: DraftPlan, *, settings_for: Callable[..., GenerationSettings],
                 costs_for: Callable[[int, bool], RuntimeCosts], check_context: Callable[[int, int], None],
                 linear: LinearKernels = NO_CHANGE, attention: AttentionKernels = NO_ATTENTION_CHANGE,
                 draft_layers: tuple[int, ...] = (), head: ExitHead | FeatureHead | None = None,
                 vocab: DraftVocab | None = None, prefix: PrefixCache | None = None) -> None:
        self.parts = parts
        # Rows start from a stored prefix and are stored when they finish (not with a feature head: its first
        # entry after a reused prefix would need the target's state there, which the store does not keep).
        self.prefix = prefix if not isinstance(head, FeatureHead) or not draft_layers else None
        # How the linear layers and the attention run here (`cpu_kernels.py`), for every pass of the session.
        self.linear, self.attention = linear, attention
        self.head = head if draft_layers else None
        self.sources: list[DraftSource] = []
        # With the plan's `tree`, a row's other n-gram continuations fill the room its chain leaves in the pass.
        trees = bool(plan.tree)
        self.ngram = (NgramRows(plan.ngram, branches=TREE_BRANCHES if trees else 1)
                      if plan.drafts and plan.ngram else None)
        self.layers = None
        if plan.drafts and draft_layers:
            threshold = plan.threshold if plan.policy == "fixed" and plan.adaptive else None
            self.layers = LayerRows(tuple(draft_layers), head=self.head, vocab=vocab, threshold=threshold,
                                    tree=plan.tree)
        # With the plan's `recycle`, each row's recorded next tokens grow its n-gram chain or make a tree alone.
        self.recycled = RecycledRows(plan.tree) if plan.drafts and plan.recycle and plan.tree else None
        # The first that proposes for a row drafts (recycled nodes may grow an n-gram chain).
        self.sources = [s for s in (self.ngram, self.recycled, self.layers) if s is not None]
        self.fixed = plan.policy == "fixed"
        self.max_draft = plan.draft_length if self.sources else 0
        # The most nodes a row verifies: its chain, or a tree (its chain, then recycled nodes or a layer tree's).
        self.max_nodes = max(self.max_draft, plan.tree if self.recycled or self.layers else 0)
        self.acceptance = AcceptanceEstimates(prior=plan.target_acceptance)  # every row's outcomes
        self.calibration = Calibration()  # the share of predicted extra tokens the chosen drafts brought
        self.last_table: PassCosts | None = None  # the cost table the last drafting decision used (for the stats)
        self.settings_for = settings_for
        self.costs_for = costs_for
        self.check_context = check_context
        self.runner: BatchRunner | None = None  # made on the first add, sized for that row
        self.rows: list[BatchRow] = []  # in cache order: rows[i] is cache row i
        self.stats = BatchStats()

    def __len__(self) -> int:
        return len(self.rows)

    def restart_stats(self) -> BatchStats:
        """Start the session's totals anew and return the old ones: a long-lived session (a server's) would
        otherwise keep every finished row's stats for ever."""
        done, self.stats = self.stats, BatchStats()
        return done

    def prepare(self, max_rows: int) -> None:
        """Measure (or load) the batched pass costs for 1..max_rows rows now, not in a request's first round."""
        if self.max_draft:
            with cpu_kernels(linear=self.linear, attention=self.attention):
                for rows in range(1, max_rows + 1):
                    self.costs_for(rows, True)

    def kv_cache_bytes(self) -> int:
        return 0 if self.runner is None else self.runner.cache.nbytes()

    def add(self, prompt: list[int], **options) -> BatchRow:
        """A new row: its settings (`options` as `generate` takes them: `max_new_tokens`, `streamer`,
        `stopping_criteria`, `logits_processor`, `generation_config`, `tokenizer`, `generator`, ...), its
        prefill and its first token.

        A row that is done at once (`max_new_tokens=1`, or EOS first) is
        returned finished and does not join.
        """
        with torch.no_grad(), cpu_kernels(linear=self.linear, attention=self.attention), self._counting_stream():
            return self._add(prompt, **options)

    def step(self) -> list[BatchRow]:
        """One round for every row; returns the rows that finished in it (they have left the batch)."""
        with torch.no_grad(), cpu_kernels(linear=self.linear, attention=self.attention), self._counting_stream():
            return self._step()

    @contextlib.contextmanager
    def _counting_stream(self):
        """Add the offloaded bytes the passes inside read (`streaming.py`) to the session's stats."""
        stream = self.parts.stream
        before = stream.bytes_read if stream is not None else 0
        try:
            yield
        finally:
            if stream is not None:
                self.stats.streamed_bytes += stream.bytes_read - before

    def _add(self, prompt: list[int], *, streamer=None, stopping_criteria=None, logits_processor=None,
             generation_config=None, tokenizer=None, generator: torch.Generator | None = None, **kwargs) -> BatchRow:
        self.check_context(len(prompt), None)
        settings = self.settings_for(prompt, logits_processor=logits_processor, stopping_criteria=stopping_criteria,
                                     generation_config=generation_config, tokenizer=tokenizer, kwargs=kwargs)
        self.check_context(len(prompt), settings.max_new_tokens)
        # Room for the prompt and a block of new tokens, not for max_new_tokens (often the whole context, in a
        # server): rounds grow the cache as rows near its end (doubling, so it copies rarely).
        capacity = len(prompt) + min(settings.max_new_tokens, GROW_BLOCK) + self.max_nodes + 1
        if self.runner is None:
            self.runner = BatchRunner(self.parts, capacity=capacity, head=self.head)
            if self.layers is not None:
                self.layers.runner = self.runner
        self.runner.grow(capacity)
        row = BatchRow(Output(prompt, settings, streamer), Scorer(settings, generator), len(prompt),
                       self.ngram.index() if self.ngram else None,
                       successors=SuccessorTable() if self.recycled else None)
        if streamer is not None:
            streamer.put(torch.tensor(prompt))
        clock = Clock(self.parts.device)
        index = self.runner.cache.add_row()
        reused, entries = self.prefix.lookup(prompt) if self.prefix is not None else (0, None)
        if reused:
            self.runner.cache.restore_row(index, entries, reused)
            row.stats.cached_tokens = reused
        ids = torch.tensor([prompt[reused:]], device=self.runner.positions.device)  # [1, prompt - reused]
        logits = self.runner.forward_rows(ids, [reused], slice(index, index + 1), last=True, head=self.head)[:, -1]
        if isinstance(self.head, FeatureHead):
            row.feature = self.runner.fused[:, -1:]  # [1, 1, hidden]
        scores = row.scorer.scores(logits, row.out.tokens, len(row.out.tokens))  # [1, vocab]
        if row.successors is not None:
            row.successors.record(chain_contexts(prompt, []), scores)
        row.out.emit([row.scorer.target_choice(scores)])
        row.stats.verify_passes += 1
        row.stats.prefill_seconds = clock.lap()
        self.stats.passes += 1
        self.stats.row_passes += 1
        self.rows.append(row)
        if row.done:
            self._finish([row])
        return row

    def _step(self) -> list[BatchRow]:
        if not self.rows:
            return []
        clock = Clock(self.parts.device)
        n = len(self.rows)
        batch = self._round()
        self.runner.grow(max(batch.starts) + self.max_nodes + 1)  # the round's drafts and verify fit
        # 1. draft: each row's proposal, from the first source that has one; 2. choose the batch's cut k
        for source in self.sources if any(batch.budgets) else ():
            source.propose(batch)
        k, predicted = batch.length() if any(d.tokens or d.gains for d in batch.drafts) else (0, 0.0)
        if self.fixed and batch.layer_steps:  # a fixed plan verifies its layer drafts whole (a tree's every node)
            k = max([k, batch.layer_steps] + [len(d.odds) + len(d.gains) for d in batch.drafts if d.source == "layers"])
        drafts = [d.tokens[:k] for d in batch.drafts]
        width = 1 + max(d.nodes(k) for d in batch.drafts)
        # A row whose chain is shorter than the pass is wide verifies its recycled nodes or other continuations
        # there, as a tree.
        trees = [d.tree(len(chain), width - 1) for d, chain in zip(batch.drafts, drafts)]  # None: a chain
        draft_seconds = clock.lap()
        # 3. verify: one pass over [rows, width], each row its last token and its draft (chain or tree), padded
        nodes = [list(tree.tokens) if tree else chain for tree, chain in zip(trees, drafts)]
        ids = [[row.out.tokens[-1], *d] + [row.out.tokens[-1]] * (width - 1 - len(d))
               for row, d in zip(self.rows, nodes)]
        features = isinstance(self.head, FeatureHead)
        before = torch.cat([row.feature for row in self.rows]) if features else None  # [n, 1, hidden]
        # Every row drafted a layer chain (or nothing): the pass resumes after the draft's exact prefix.
        resume = batch.exact_prefix if k and batch.boundary and not any(trees) else 0
        logits = self.runner.forward_rows(torch.tensor(ids, device=self.runner.positions.device), batch.starts,
                                          slice(0, n), head=self.head, before=before,
                                          trees=trees if any(trees) else None, exact_prefix=resume,
                                          boundary=batch.boundary)  # [n, width, vocab]
        verify_seconds = clock.lap()
        if batch.costs is not None:
            batch.costs.observe_verify(width, resume, verify_seconds)
            batch.costs.observe_draft(batch.costs.draft_steps(batch.pass_widths), draft_seconds)
            self.last_table = batch.costs.table
        finished = []
        self.acceptance.decay(layers_drafted=any(d and s.source == "layers" for d, s in zip(drafts, batch.drafts)))
        self.calibration.decay()
        accepted = recycled = 0
        for i, (row, draft, tree) in enumerate(zip(self.rows, drafts, trees)):
            proposal, path = batch.drafts[i], None
            # 4. accept, with the row's own scores; 5. roll back: the row keeps its last token and what it accepted
            if tree is not None:
                kept, path = self._accept_tree(i, row, tree, logits[i, : len(tree) + 1], batch.starts[i])
            else:
                kept = self._accept_chain(i, row, proposal, draft, logits[i, : len(draft) + 1], batch.starts[i])
            # 6. emit and record
            row.out.emit(kept)
            # Recycled nodes verified: a grown tree's nodes past its whole chain (a cut chain's tree has none; a
            # layer tree's are the draft's own).
            recycled_tree = tree is not None and proposal.grown is not None and proposal.source != "layers"
            grown = max(0, len(tree) - len(proposal.tokens)) if recycled_tree else 0
            on_path = sum(node >= len(proposal.tokens) for node in path) if grown else 0
            row.stats.record_round(drafted=len(tree) if tree else len(draft), accepted=len(kept) - 1,
                                   draft_seconds=draft_seconds / n, verify_seconds=verify_seconds / n,
                                   source=f"{proposal.source} tree" if tree else proposal.source or "layers",
                                   recycled=(grown, on_path))
            for learner in self.sources:
                learner.learn(batch, i, len(tree) if tree else len(draft), kept, path)
            # What the cut's pricing predicted for: a chain's tokens, a grown tree's priced nodes; an n-gram tree's
            # first path (its branches come on top).
            if path is None:
                accepted += len(kept) - 1
            elif proposal.grown is not None:
                accepted += sum(node < proposal.nodes(k) for node in path)
            else:
                accepted += tree.first_path_kept(path)
            recycled += grown
            if row.done:
                finished.append(row)
        if k:
            self.calibration.observe(predicted=predicted, realized=accepted)
        if self.recycled is not None and batch.learned:  # recycled estimates fade slower while none are verified
            self.recycled.calibration.decay(DECAY if recycled else IDLE_DECAY)
        self.stats.passes += 1
        self.stats.rounds += 1
        self.stats.row_passes += n
        self.stats.draft_passes += batch.layer_steps
        self.stats.resumed_passes += bool(resume)
        self._finish(finished)
        return finished

    def _accept_chain(self, i: int, row: BatchRow, proposal, draft: list[int], logits: torch.Tensor,
                      start: int) -> list[int]:
        """Row i's verdict on its chain `draft` from `logits` `[len(draft) + 1, vocab]`: the kept tokens (the
        accepted ones, then the target's), its cache cut to them."""
        scores = row.scorer.scores(logits, row.out.tokens + draft, len(row.out.tokens))
        if row.successors is not None:  # every verified row, rejected tokens' too: the recycling
            row.successors.record(chain_contexts(row.out.tokens, draft), scores)
        if row.scorer.do_sample:
            q = proposal.q(len(draft), scores.shape[-1], scores.device)  # [k, vocab]
            verdict = accept_sampling(draft, q, row.scorer.probs(scores), row.scorer.generator)
        else:
            verdict = accept_greedy(draft, scores)
        self.runner.cache.lengths[i] = start + 1 + verdict.accepted
        if isinstance(self.head, FeatureHead):  # f at the row's last cached position
            row.feature = self.runner.fused[i : i + 1, verdict.accepted : verdict.accepted + 1]
        return draft[: verdict.accepted] + [verdict.next_token]

    def _accept_tree(self, i: int, row: BatchRow, tree: TokenTree, logits: torch.Tensor,
                     start: int) -> tuple[list[int], list[int]]:
        """Row i's verdict on its `tree` from `logits` `[len(tree) + 1, vocab]`: the kept tokens and the kept
        path's nodes, whose entries are moved into place (`tree.py`'s rules: greedy, or recursive rejection for
        fixed candidates)."""
        scores = row.scorer.tree_scores(logits, row.out.tokens, tree)  # [n + 1, vocab]
        if row.successors is not None:  # every verified row, rejected nodes' too: the recycling
            row.successors.record(tree_contexts(row.out.tokens, tree), scores)
        if row.scorer.do_sample:
            path, token = accept_tree_sampling(tree, row.scorer.probs(scores), row.scorer.generator)
        else:
            path, token = accept_tree_greedy(tree, scores)
        self.runner.cache.keep_path(i, start, path)
        if isinstance(self.head, FeatureHead):  # f at the row's last cached position: the kept path's last node
            last = path[-1] + 1 if path else 0
            row.feature = self.runner.fused[i : i + 1, last : last + 1]
        return tree.path_tokens(path) + [token], path

    def _round(self) -> DraftRound:
        """This round's draft state: each row's position and budget, and the costs and acceptance it decides by.

        When sampling, the session decides from the cost table and the plan's
        prior alone, not from timing noise or what earlier requests taught it:
        a seed then reproduces its sample whatever ran before it.
        """
        starts = [len(row.out.tokens) - 1 for row in self.rows]  # each row's last token is not in the cache yet
        budgets = [max(0, min(self.max_draft, row.out.remaining - 1)) for row in self.rows]
        learned = not any(row.scorer.do_sample for row in self.rows)
        acceptance = self.acceptance if learned else AcceptanceEstimates(prior=self.acceptance.prior)
        return DraftRound(self.rows, starts, budgets, acceptance, lambda: self.costs_for(len(self.rows), learned),
                          scale=self.calibration.ratio if learned else 1.0, fixed=self.fixed, learned=learned)

    def _finish(self, rows: list[BatchRow]) -> None:
        """Rows that are done leave the batch; their stats are completed and kept in the session's."""
        for row in rows:
            index = self.rows.index(row)
            last = self.rows.pop()
            if last is not row:
                self.rows[index] = last
            if self.prefix is not None:  # what the row's cache holds, for a later prompt that starts alike
                length = self.runner.cache.lengths[index]
                self.prefix.add(row.out.tokens[:length], self.runner.cache.row_entries(index))
            self.runner.cache.remove_row(index)
            if row.out.streamer is not None:
                row.out.streamer.end()
            row.stats.new_tokens = len(row.new_tokens)
            row.stats.total_seconds = time.perf_counter() - row.began
            row.stats.policy = f"batch cost (acceptance {self.acceptance.summary()})" if self.sources else "plain"
            self.stats.row_stats.append(row.stats)
        if rows and self.last_table is not None:
            self.stats.costs = self.last_table.summary()
        if not self.rows:  # an empty batch holds no cache (nor does its layer source); the next row allocates anew
            self.runner = None
            if self.layers is not None:
                self.layers.runner = None
