"""Batched generation: several sequences, each with its own draft and acceptance rule, over one cache of rows.

A `BatchSession` holds the sequences that decode together. Each is a
`BatchRow`: its tokens and stopping rules (`output.Output`), its scorer (its
own logits processors, sampling settings and generator) and its stats; the
n-gram acceptance estimates are the session's, learned from every row's
rounds (by match length and position, as the single-sequence cost policy
learns them, a proposal's first uncut token judged by the token the pass
emitted there), so a batch learns its traffic eight times as fast and a
joining row starts from what the others taught. A row joins with `add` (its prompt's prefill, one pass
of its own) and leaves when it is done; `step` runs one round for every row:

1. draft: each row's n-gram proposal (prompt lookup over its own tokens);
2. choose: one verify width for the batch, the one that maximises the
   batch's expected emitted tokens per second, from the session's learned
   n-gram acceptance (its predicted gains scaled by what the session's
   chosen drafts realized of theirs, `policy.Calibration`) and the measured
   cost of a pass over (rows, width) at the longest row's context; drafting
   at all must beat a plain step by `BATCH_MARGIN`. The cost model decides
   per batch, and width 1 is a plain step for every row;
3. verify: one pass of the full model over `[rows, width]`, row i holding
   its last token and its draft, padded;
4. accept: per row, the greedy prefix rule or the rejection rule
   (`acceptance.py`), with the row's own scores;
5. roll back: each row's length moves to what it kept (O(1));
6. emit, record, and drop the rows that finished.

The cache (`BatchedKVCache`) is the target's own, one row per sequence, rows
packed at the front: a finished row's place is taken by the last row (one
row's entries copied, never the cache), a joining row takes the next free
row, and the cache grows (doubling) when a longer sequence joins. Nothing
else is kept per sequence.

Greedy rows equal `model.generate` on their prompt alone (exactly in
float64); sampling rows keep the target's distribution, since every draft
length is chosen from what is known before the verify pass. A seed
reproduces a row's sample for the same batch (the batch's choice of width
depends on the other rows).

What this module does not do (today): layer drafts, exit heads, draft
vocabularies and token trees in a batch (a plan's n-gram lookup drafts for
every row; its layers do not), the static step and CUDA graphs (a batch runs
eager), and prefix sharing between rows.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .acceptance import accept_greedy, accept_sampling
from .cpu_kernels import NO_ATTENTION_CHANGE, NO_CHANGE, AttentionKernels, LinearKernels, chosen_kernels, cpu_kernels
from .costs import MEASURE_CONTEXT, PassCosts, RuntimeCosts, fastest, interpolate, long_context, machine_description
from .hf_generation import GenerationSettings
from .ngram import NgramIndex, agreement
from .output import Clock, Output
from .parts import ModelParts, soft_cap
from .plan import DraftPlan
from .policy import AcceptanceEstimates, Calibration
from .runner import LayerRunner
from .scoring import Scorer
from .stats import BatchStats, GenerationStats

# A batch drafts only where the predicted tokens per second beat not drafting by this fraction. A wrong
# guess widens the pass of every row, and the acceptance estimates run optimistic early (they start at the
# plan's prior; on Spec-Bench chat traffic, 8 rows, they predicted 12% more accepted tokens than came):
# a margin below that error turned speculation into a loss against drafting off.
BATCH_MARGIN = 0.10

class BatchedKVCache:
    """The one KV cache with a row per sequence: per layer `[rows, kv_heads, capacity, head_dim]`.

    The active rows are packed at the front (0..count-1). A pass runs on a
    contiguous block of them (`rows`: every active row for a round, one row
    for a prefill), writes its q new entries of row r at `write_slots[r]`
    (`[r, q]`, set by the runner) and attends to the first `span` positions.
    Each row has one length (`lengths`, host), the same in every layer: a
    batch verifies with the full model, so all layers hold the same entries.
    Entries past a row's length are stale and never seen: a query at slot s
    sees slots <= s, and those past the length are written by its own pass.
    Buffers start zeroed (a masked key gets weight 0, and 0 x NaN is NaN).
    """

    def __init__(self, num_layers: int, capacity: int, windows=None, rows: int = 1) -> None:
        # `windows` unused: a block's rows sit at different positions, so its masks hide what a window hides.
        self.capacity = capacity
        self.row_capacity = max(1, rows)
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.lengths: list[int] = []  # per active row
        self.rows = slice(0, 0)
        self.write_slots: torch.Tensor | None = None  # [r, q] int64
        self.write_rows: torch.Tensor | None = None  # [r, q] int64: j in row j (indexes the block's rows)
        self.span = 0

    @property
    def count(self) -> int:
        return len(self.lengths)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write `[r, kv_heads, q, head_dim]` at `write_slots`; return the block's first `span` positions."""
        if self.keys[layer_idx] is None:
            self.keys[layer_idx] = _zeros_like_rows(key_states, self.row_capacity, self.capacity)
            self.values[layer_idx] = _zeros_like_rows(value_states, self.row_capacity, self.capacity)
        keys, values = self.keys[layer_idx][self.rows], self.values[layer_idx][self.rows]  # views
        # Indexed assignment over (row, slot) pairs: a scatter along the slots with an index expanded over
        # heads and head_dim costs 20x more on CPU (measured, AVX512: 200 us against 10 us per layer at 8 rows).
        rows = self.write_rows  # [r, q]: row j, beside its slots
        keys.transpose(1, 2)[rows, self.write_slots] = key_states.transpose(1, 2)  # [r, q, kv_heads, head_dim]
        values.transpose(1, 2)[rows, self.write_slots] = value_states.transpose(1, 2)
        return keys[:, :, : self.span], values[:, :, : self.span]

    def add_row(self) -> int:
        """A new, empty row at the end of the active ones; more rows are allocated (doubling) when full."""
        if self.count == self.row_capacity:
            self._reallocate(2 * self.row_capacity, self.capacity)
        self.lengths.append(0)
        return self.count - 1

    def remove_row(self, row: int) -> None:
        """Drop `row`: the last active row moves into its place (its valid entries only)."""
        last = self.count - 1
        if row != last:
            n = self.lengths[last]
            for buffers in (self.keys, self.values):
                for buffer in buffers:
                    if buffer is not None:
                        buffer[row, :, :n].copy_(buffer[last, :, :n])
            self.lengths[row] = n
        self.lengths.pop()

    def grow(self, capacity: int) -> None:
        """Hold at least `capacity` positions per row (doubling, so a growing server copies rarely)."""
        if capacity > self.capacity:
            self._reallocate(self.row_capacity, max(capacity, 2 * self.capacity))

    def _reallocate(self, rows: int, capacity: int) -> None:
        for buffers in (self.keys, self.values):
            for i, old in enumerate(buffers):
                if old is not None:
                    new = old.new_zeros(rows, old.shape[1], capacity, old.shape[3])
                    new[: old.shape[0], :, : old.shape[2]].copy_(old)
                    buffers[i] = new
        self.row_capacity, self.capacity = rows, capacity

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values) if t is not None)


def _zeros_like_rows(states: torch.Tensor, rows: int, capacity: int) -> torch.Tensor:
    return torch.zeros(rows, states.shape[1], capacity, states.shape[3], dtype=states.dtype, device=states.device)


class BatchRunner(LayerRunner):
    """Runs the target's layers on a block of rows, each row at its own positions (`BatchedKVCache`)."""

    cache_class = BatchedKVCache

    def grow(self, capacity: int) -> None:
        """Room for `capacity` positions per row: the cache and the rotary tables."""
        if capacity > self.cache.capacity:
            self.cache.grow(capacity)
            self.positions = torch.arange(self.cache.capacity, device=self.positions.device)[None]  # [1, capacity]
            self.rotary = self.rotary_tables(self.positions)

    def forward_rows(self, ids: torch.Tensor, starts: list[int], rows: slice, *, last: bool = False) -> torch.Tensor:
        """Float32 logits `[r, q, vocab]` of the full model over `ids` `[r, q]`; row j's tokens at starts[j]..

        Each row must hold exactly `starts[j]` valid entries; after the pass it
        holds starts[j] + q (the caller crops to what it keeps). `last`: the
        logits of the last position only, `[r, 1, vocab]` (a prefill).
        """
        r, q = ids.shape
        device = self.positions.device
        slots = torch.tensor(starts, device=device)[:, None] + torch.arange(q, device=device)  # [r, q]
        cache = self.cache
        cache.rows, cache.write_slots, cache.span = rows, slots, max(starts) + q
        cache.write_rows = torch.arange(r, device=device)[:, None].expand(r, q)  # [r, q]
        hidden = self.parts.embed(ids)  # [r, q, hidden]
        if self.parts.position_embed is not None:  # learned absolute positions (GPT-2)
            hidden = hidden + self.parts.position_embed(slots)
        rotary = {kind: tuple(t[0][slots] for t in table) for kind, table in self.rotary.items()}  # [r, q, dim]
        keys = torch.arange(cache.span, device=device)  # [span]

        def mask_for(window: int | None) -> torch.Tensor | None:
            # One row at one position sees every key of its span, and one row's prefill is causal: no mask (the
            # kernels that one-token steps and prefills use).
            if r == 1 and ((q == 1 and window is None) or self.causal_prefill(starts[0], q, window)):
                return None
            allowed = keys[None, None] <= slots[:, :, None]  # [r, q, span]
            if window is not None:
                allowed &= keys[None, None] > slots[:, :, None] - window
            return self.row_mask(allowed)

        hidden = self.run_layers(hidden, range(self.parts.num_layers), mask_for=mask_for, rotary=rotary,
                                 position_ids=slots)
        for j, start in enumerate(starts):
            cache.lengths[rows.start + j] = start + q
        if last:
            hidden = hidden[:, -1:]
        normed = self.parts.norm(hidden)
        with chosen_kernels(normed):  # the LM head on the kernel this thread chose (`cpu_kernels.py`)
            logits = self.parts.lm_head(normed)  # [r, q, vocab]
        return soft_cap(logits, self.parts.logit_softcap).float()

    def row_mask(self, allowed: torch.Tensor) -> torch.Tensor:
        """`[r, 1, q, span]` mask from `[r, q, span]`: bool for sdpa, additive for eager."""
        if self.bool_masks:
            return allowed[:, None]
        additive = torch.zeros(allowed.shape, dtype=self.dtype, device=allowed.device)
        return additive.masked_fill(~allowed, torch.finfo(self.dtype).min)[:, None]


def measure_batch_costs(parts: ModelParts, *, rows: int, max_width: int, repeats: int = 2) -> PassCosts:
    """Seconds of a full pass over `[rows, q]` for q = 1, 2, 4, 8, ... `max_width` (others interpolated).

    Timed on a scratch cache whose rows hold `MEASURE_CONTEXT` entries, then
    `costs.long_context(...)` (zeros: attention costs by their count, so no
    prefill is needed), as `costs.fastest` times (the minimum of `repeats`
    interleaved runs). `draft_step` is 0: a batch drafts no layers.
    """
    began = time.perf_counter()
    long = long_context(parts.max_positions, max_width)
    contexts = (MEASURE_CONTEXT, long) if long > MEASURE_CONTEXT else (MEASURE_CONTEXT,)
    runner = BatchRunner(parts, capacity=long + max_width)
    for _ in range(rows):
        runner.cache.add_row()
    generator = torch.Generator().manual_seed(0)
    device = runner.positions.device
    ids = torch.randint(0, parts.vocab_size, (rows, max_width), generator=generator).to(device)
    everyone = slice(0, rows)
    widths = sorted({q for q in (1, 2, 4, 8, 16, 32) if q < max_width} | {max_width})

    def full_pass(q: int, context: int) -> Callable[[], None]:
        return lambda: runner.forward_rows(ids[:, :q], [context] * rows, everyone)

    best = fastest({(q, c): full_pass(q, c) for q in widths for c in contexts}, repeats=repeats, device=device)
    verify_long = interpolate({q: best[q, long] for q in widths}, max_width) if len(contexts) > 1 else ()
    return PassCosts(interpolate({q: best[q, MEASURE_CONTEXT] for q in widths}, max_width), 0.0, parts.num_layers,
                     machine=f"{machine_description(device)}, {rows} rows",
                     measure_seconds=time.perf_counter() - began, context=MEASURE_CONTEXT,
                     verify_long=verify_long, long_context=long if verify_long else 0)


@dataclass(eq=False)
class BatchRow:
    """One sequence in a batch."""

    out: Output
    scorer: Scorer
    prompt_length: int
    ngrams: NgramIndex | None = None  # its n-gram lookup, kept up to date as it grows
    stats: GenerationStats = field(default_factory=GenerationStats)
    began: float = field(default_factory=time.perf_counter)

    @property
    def done(self) -> bool:
        return self.out.done

    @property
    def new_tokens(self) -> list[int]:
        return self.out.tokens[self.prompt_length :]


class BatchSession:
    """Sequences decoding together (see the module docstring); `add` a row, `step` a round, until empty.

    `settings_for(prompt, kwargs)`: a row's `GenerationSettings`, resolved
    as `model.generate` resolves them. `costs_for(rows, learn)`: the
    `RuntimeCosts` of a pass over that many rows (measured on first use).
    """

    def __init__(self, parts: ModelParts, plan: DraftPlan, *, settings_for: Callable[..., GenerationSettings],
                 costs_for: Callable[[int, bool], RuntimeCosts], check_context: Callable[[int, int], None],
                 linear: LinearKernels = NO_CHANGE, attention: AttentionKernels = NO_ATTENTION_CHANGE) -> None:
        self.parts = parts
        # How the linear layers and the attention run here (`cpu_kernels.py`), for every pass of the session.
        self.linear, self.attention = linear, attention
        self.ngram = plan.ngram
        self.max_draft = plan.draft_length if plan.ngram else 0
        self.acceptance = AcceptanceEstimates(prior=plan.target_acceptance)  # every row's n-gram outcomes
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
        with torch.no_grad(), cpu_kernels(linear=self.linear, attention=self.attention):
            return self._add(prompt, **options)

    def step(self) -> list[BatchRow]:
        """One round for every row; returns the rows that finished in it (they have left the batch)."""
        with torch.no_grad(), cpu_kernels(linear=self.linear, attention=self.attention):
            return self._step()

    def _add(self, prompt: list[int], *, streamer=None, stopping_criteria=None, logits_processor=None,
             generation_config=None, tokenizer=None, generator: torch.Generator | None = None, **kwargs) -> BatchRow:
        self.check_context(len(prompt), None)
        settings = self.settings_for(prompt, logits_processor=logits_processor, stopping_criteria=stopping_criteria,
                                     generation_config=generation_config, tokenizer=tokenizer, kwargs=kwargs)
        self.check_context(len(prompt), settings.max_new_tokens)
        capacity = len(prompt) + settings.max_new_tokens + self.max_draft + 1
        if self.runner is None:
            self.runner = BatchRunner(self.parts, capacity=capacity)
        self.runner.grow(capacity)
        row = BatchRow(Output(prompt, settings, streamer), Scorer(settings, generator), len(prompt),
                       NgramIndex(self.ngram) if self.ngram else None)
        if streamer is not None:
            streamer.put(torch.tensor(prompt))
        clock = Clock(self.parts.device)
        index = self.runner.cache.add_row()
        ids = torch.tensor([prompt], device=self.runner.positions.device)  # [1, prompt]
        logits = self.runner.forward_rows(ids, [0], slice(index, index + 1), last=True)[:, -1]  # [1, vocab]
        scores = row.scorer.scores(logits, row.out.tokens, len(row.out.tokens))
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
        starts = [len(row.out.tokens) - 1 for row in self.rows]  # each row's last token is not in the cache yet
        # 1. draft: each row's n-gram proposal
        proposals = [self._proposal(row) for row in self.rows]
        # 2. choose the batch's draft length by expected tokens per second
        costs, k, predicted = None, 0, 0.0
        if any(tokens for tokens, _ in proposals):
            sampling = any(row.scorer.do_sample for row in self.rows)
            costs = self.costs_for(n, not sampling)  # when sampling, decide from the table, not timing noise
            costs.context = max(starts)  # every row attends over the longest row's span
            # When sampling, decide from the table and the plan's prior alone, not from what earlier requests
            # taught the session: a seed then reproduces its sample whatever ran before it.
            k, predicted = self._draft_length(costs, proposals, learned=not sampling)
        drafts = [tokens[:k] for tokens, _ in proposals]
        width = 1 + max(len(d) for d in drafts)
        draft_seconds = clock.lap()
        # 3. verify: one pass over [rows, width], each row its last token and its draft, padded
        ids = [[row.out.tokens[-1], *d] + [row.out.tokens[-1]] * (width - 1 - len(d))
               for row, d in zip(self.rows, drafts)]
        logits = self.runner.forward_rows(torch.tensor(ids, device=self.runner.positions.device), starts,
                                          slice(0, n))  # [n, width, vocab]
        verify_seconds = clock.lap()
        if costs is not None:
            costs.observe_verify(width, 0, verify_seconds)
            self.last_table = costs.table
        finished = []
        self.acceptance.decay()  # once per round: old evidence fades
        self.calibration.decay()
        accepted = 0
        for i, (row, draft, (proposal, match_length)) in enumerate(zip(self.rows, drafts, proposals)):
            # 4. accept, with the row's own scores
            scores = row.scorer.scores(logits[i, : len(draft) + 1], row.out.tokens + draft, len(row.out.tokens))
            if row.scorer.do_sample:
                verdict = accept_sampling(draft, _one_hot(draft, scores), row.scorer.probs(scores),
                                          row.scorer.generator)
            else:
                verdict = accept_greedy(draft, scores)
            # 5. roll back: the row keeps its last token and the accepted drafted tokens
            self.runner.cache.lengths[i] = starts[i] + 1 + verdict.accepted
            # 6. emit and record
            row.out.emit(draft[: verdict.accepted] + [verdict.next_token])
            row.stats.record_round(drafted=len(draft), accepted=verdict.accepted, draft_seconds=draft_seconds / n,
                                   verify_seconds=verify_seconds / n, source="ngram" if draft else "layers")
            # The verified tokens as the verify pass judged them, and the first uncut one by the pass's own token.
            self.acceptance.observe_copied(match_length, 1,
                                           agreement(proposal, draft[: verdict.accepted] + [verdict.next_token]))
            accepted += verdict.accepted
            if row.done:
                finished.append(row)
        if k:
            self.calibration.observe(predicted=predicted, realized=accepted)
        self.stats.passes += 1
        self.stats.rounds += 1
        self.stats.row_passes += n
        self._finish(finished)
        return finished

    def _proposal(self, row: BatchRow) -> tuple[list[int], int]:
        """The row's n-gram proposal (tokens, matched suffix length), within what it may still emit."""
        budget = min(self.max_draft, row.out.remaining - 1)
        if not self.ngram or budget < 1:
            return [], 0
        return row.ngrams.match(row.out.tokens, budget=budget)

    def _draft_length(self, costs: RuntimeCosts, proposals: list[tuple[list[int], int]], *,
                      learned: bool = True) -> tuple[int, float]:
        """The common cut k of the rows' proposals that maximises expected emitted tokens per second, and the
        accepted tokens it is predicted to bring.

        Row i emits 1 + sum over j <= min(k, its proposal) of the chance that
        its first j copied tokens are all accepted; those extra tokens are
        scaled by what the session's chosen drafts realized of their
        predictions (`Calibration`); the pass costs `costs.verify(k + 1)` for
        the whole batch. Drafting at all must beat not drafting by
        `BATCH_MARGIN`; among drafts, ties go to the shorter. `learned=False`:
        the plan's prior acceptance and no calibration (nothing the session learned).
        """
        longest = max(len(tokens) for tokens, _ in proposals)
        if not longest:
            return 0, 0.0
        acceptance = self.acceptance if learned else AcceptanceEstimates(prior=self.acceptance.prior)
        odds = [[acceptance.ngram_token(match, j + 1) for j in range(len(tokens))] for tokens, match in proposals]
        reach = [1.0] * len(odds)
        rows, extra, scale = len(odds), 0.0, self.calibration.ratio if learned else 1.0
        best_k, best_extra, best_rate = 0, 0.0, rows / costs.verify(1) * (1 + BATCH_MARGIN)
        for k in range(1, longest + 1):
            for i, row_odds in enumerate(odds):
                if k <= len(row_odds):
                    reach[i] *= row_odds[k - 1]
                    extra += reach[i]
            rate = (rows + scale * extra) / costs.verify(k + 1)
            if rate > best_rate * (1 + 1e-9):
                best_k, best_extra, best_rate = k, extra, rate
        return best_k, best_extra

    def _finish(self, rows: list[BatchRow]) -> None:
        """Rows that are done leave the batch; their stats are completed and kept in the session's."""
        for row in rows:
            index = self.rows.index(row)
            last = self.rows.pop()
            if last is not row:
                self.rows[index] = last
            self.runner.cache.remove_row(index)
            if row.out.streamer is not None:
                row.out.streamer.end()
            row.stats.new_tokens = len(row.new_tokens)
            row.stats.total_seconds = time.perf_counter() - row.began
            row.stats.policy = f"batch cost (acceptance {self.acceptance.summary()})" if self.ngram else "plain"
            self.stats.row_stats.append(row.stats)
        if rows and self.last_table is not None:
            self.stats.costs = self.last_table.summary()
        if not self.rows:
            self.runner = None  # an empty batch holds no cache; the next row allocates anew


def _one_hot(draft: list[int], scores: torch.Tensor) -> torch.Tensor:
    """q `[k, vocab]` of a deterministic proposal: all its mass on the proposed token."""
    q = torch.zeros(len(draft), scores.shape[-1], device=scores.device)
    if draft:
        q[torch.arange(len(draft)), torch.tensor(draft)] = 1.0
    return q
