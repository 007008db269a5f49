"""The batch's cache and runner: the target's layers over a block of rows, each row at its own positions.

`BatchedKVCache` is the one KV cache with a row per sequence; `BatchRunner`
runs any subset of the layers (a draft step through the plan's layers, or a
full pass that also feeds an exit head its entries) over `[rows, q]` tokens;
`measure_batch_costs` times those passes by row count and width.

It knows positions, masks and the cache's rows; it does not know plans,
acceptance or when a pass is worth running (`batch.py`, `batch_draft.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .cpu_kernels import chosen_kernels
from .costs import MEASURE_CONTEXT, PassCosts, fastest, interpolate, long_context, machine_description
from .feature_head import FeatureHead
from .head import ExitHead
from .parts import ModelParts, soft_cap
from .plan import exact_prefix_of
from .runner import LayerRunner
from .tree import TokenTree, move_path
from .vocab import DraftVocab


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

    def restore_row(self, row: int, entries: list, length: int) -> None:
        """Row `row` holds positions 0..length-1 from `entries` (per layer: keys and values `[kv_heads, >=length,
        head_dim]`, or None for a layer it leaves unwritten; the prefix cache's)."""
        for buffers, side in ((self.keys, 0), (self.values, 1)):
            for i, pair in enumerate(entries):
                if pair is None or i >= len(buffers):
                    continue
                if buffers[i] is None:
                    buffers[i] = _zeros_like_rows(pair[side][None], self.row_capacity, self.capacity)
                buffers[i][row, :, :length].copy_(pair[side][:, :length])
        self.lengths[row] = length

    def row_entries(self, row: int) -> list:
        """Row `row`'s valid entries, per layer keys and values `[kv_heads, length, head_dim]` (views), or None."""
        n = self.lengths[row]
        return [None if k is None else (k[row, :, :n], v[row, :, :n]) for k, v in zip(self.keys, self.values)]

    def keep_path(self, row: int, start: int, path: list[int]) -> None:
        """After a tree's verify pass: row `row`'s kept `path` moves into place in every layer (`tree.move_path`),
        and the row holds start + 1 + len(path) positions."""
        move_path([*self.keys, *self.values], start=start, path=path, row=row)
        self.lengths[row] = start + 1 + len(path)

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


@dataclass
class RowPass:
    """One pass over a block of rows: row j's q tokens written at slots `slots[j]` (`[r, q]`) and sitting at
    `positions[j]` (the slots, or a tree's start + depth), their rotary tables and the masks (made once per
    sliding window a pass meets)."""

    slots: torch.Tensor  # [r, q] int64
    positions: torch.Tensor  # [r, q] int64
    rotary: dict
    mask_for: Callable[[int | None], torch.Tensor | None]
    masks: dict = field(default_factory=dict)

    def mask(self, window: int | None) -> torch.Tensor | None:
        if window not in self.masks:
            self.masks[window] = self.mask_for(window)
        return self.masks[window]


class BatchRunner(LayerRunner):
    """Runs the target's layers on a block of rows, each row at its own positions (`BatchedKVCache`)."""

    cache_class = BatchedKVCache
    fused: torch.Tensor | None = None  # a feature head's fused states of the last full pass's rows `[r, q, hidden]`
    drafted: torch.Tensor | None = None  # a feature head's outputs of the last draft step `[r, 1, hidden]`
    boundary: torch.Tensor | None = None  # the last draft step's states after its exact prefix `[r, w, hidden]`

    def grow(self, capacity: int) -> None:
        """Room for `capacity` positions per row: the cache and the rotary tables."""
        if capacity > self.cache.capacity:
            self.cache.grow(capacity)
            self.positions = torch.arange(self.cache.capacity, device=self.positions.device)[None]  # [1, capacity]
            self.rotary = self.rotary_tables(self.positions)

    def begin_pass(self, starts: list[int], q: int, rows: slice,
                   trees: list[TokenTree | None] | None = None, first_row: int = 0) -> RowPass:
        """Point the cache at `rows`, row j writing q entries from starts[j]; its layers attend to what it may see.

        Where `trees[j]` is a tree (`tree.py`) of n nodes, row j's tree rows
        are its root (at starts[j]) and nodes: node rows sit at start + depth
        and see, of the tree's entries, only their ancestors. The pass writes
        tree rows `first_row`.. (a layer tree's level: every row's tree then,
        its earlier levels already in the cache); with `first_row` 0, rows past
        the tree's are a chain after it.
        """
        r = len(starts)
        device = self.positions.device
        slots = torch.tensor(starts, device=device)[:, None] + first_row + torch.arange(q, device=device)  # [r, q]
        trees = trees or [None] * r
        positions = slots
        if any(trees):
            rows_of = range(first_row, first_row + q)
            depths = [list(rows_of) if tree is None else (tree.depths() + list(range(len(tree) + 1, first_row + q)))
                      [first_row:] for tree in trees]
            positions = torch.tensor(starts, device=device)[:, None] + torch.tensor(depths, device=device)
        cache = self.cache
        cache.rows, cache.write_slots, cache.span = rows, slots, max(starts) + first_row + q
        cache.write_rows = torch.arange(r, device=device)[:, None].expand(r, q)  # [r, q]
        rotary = {kind: tuple(t[0][positions] for t in table) for kind, table in self.rotary.items()}  # [r, q, dim]
        keys = torch.arange(cache.span, device=device)  # [span]

        def mask_for(window: int | None) -> torch.Tensor | None:
            # One row at one position sees every key of its span, and one row's prefill is causal: no mask (the
            # kernels that one-token steps and prefills use).
            if r == 1 and not any(trees) and ((q == 1 and window is None)
                                              or self.causal_prefill(starts[0], q, window)):
                return None
            allowed = keys[None, None] <= slots[:, :, None]  # [r, q, span]
            for j, tree in enumerate(trees):
                if tree is not None:  # within the tree's rows, each sees itself and its ancestors
                    n = len(tree) + 1
                    seen = tree.visibility()[first_row : first_row + q]  # [rows this pass writes, n]
                    allowed[j, : len(seen), starts[j] : starts[j] + n] = seen.to(device)
            if window is not None:  # an ancestor sits within a tree's depth of its node, inside any window
                allowed &= keys[None, None] > positions[:, :, None] - window
            return self.row_mask(allowed)

        return RowPass(slots, positions, rotary, mask_for)

    def embed_rows(self, ids: torch.Tensor, step: RowPass) -> torch.Tensor:
        """`[r, q, hidden]` input embeddings of `ids` `[r, q]` at the pass's slots."""
        hidden = self.parts.embed(ids)
        if self.parts.position_embed is not None:  # learned absolute positions (GPT-2)
            hidden = hidden + self.parts.position_embed(step.positions)
        return hidden

    def run_rows(self, hidden: torch.Tensor, layers, step: RowPass) -> torch.Tensor:
        """`layers` in order on `hidden` `[r, q, hidden]`, writing their entries at the pass's slots."""
        return self.run_layers(hidden, layers, mask_for=step.mask, rotary=step.rotary, position_ids=step.positions)

    def forward_rows(self, ids: torch.Tensor, starts: list[int], rows: slice, *, last: bool = False,
                     head: ExitHead | FeatureHead | None = None, before: torch.Tensor | None = None,
                     trees: list[TokenTree | None] | None = None, exact_prefix: int = 0,
                     boundary: list[torch.Tensor] = ()) -> torch.Tensor:
        """Float32 logits `[r, q, vocab]` of the full model over `ids` `[r, q]`; row j's tokens at starts[j]..

        Each row must hold exactly `starts[j]` valid entries; after the pass it
        holds starts[j] + q (the caller crops to what it keeps, and moves a
        tree's kept path into place: `BatchedKVCache.keep_path`). `last`: the
        logits of the last position only, `[r, 1, vocab]` (a prefill). With an
        exit `head` (layer N), the head is run on the states after its exit
        layer, so its entries cover every token the pass wrote. `trees`: see
        `begin_pass`; a feature head's node reads its parent's fused state.

        `exact_prefix` s > 0: layers 0..s-1 already ran for the first inputs (a
        layer chain's draft steps wrote their entries), and `boundary` holds
        the states after them, `[r, 1, hidden]` per input; the pass runs them
        only for the inputs past those, and every other layer for all.
        """
        q = ids.shape[1]
        first = 0
        if exact_prefix:
            known = list(boundary[:q])
            if len(known) < q:  # the inputs the draft did not run yet
                tail = self.begin_pass([start + len(known) for start in starts], q - len(known), rows)
                known.append(self.run_rows(self.embed_rows(ids[:, len(known) :], tail), range(exact_prefix), tail))
            step = self.begin_pass(starts, q, rows)
            hidden, first = torch.cat(known, dim=1), exact_prefix  # [r, q, hidden]
        else:
            step = self.begin_pass(starts, q, rows, trees)
            hidden = self.embed_rows(ids, step)  # [r, q, hidden]
        if isinstance(head, FeatureHead):
            hidden = self.run_feature_rows(hidden, head, step, before, trees)
            first = head.reads[-1] + 1
        elif head is not None:
            hidden = self.run_rows(hidden, range(first, head.exit_layer), step)
            self.run_rows(hidden, [head.slot], step)
            first = head.exit_layer
        hidden = self.run_rows(hidden, range(first, self.parts.num_layers), step)
        for j, start in enumerate(starts):
            self.cache.lengths[rows.start + j] = start + ids.shape[1]
        if last:
            hidden = hidden[:, -1:]
        normed = self.parts.norm(hidden)
        with chosen_kernels(normed):  # the LM head on the kernel this thread chose (`cpu_kernels.py`)
            logits = self.parts.lm_head(normed)  # [r, q, vocab]
        return soft_cap(logits, self.parts.logit_softcap).float()

    def draft_rows(self, ids: torch.Tensor, starts: list[int], rows: slice, layers,
                   vocab: DraftVocab | None = None, *, head: FeatureHead | None = None,
                   before: torch.Tensor | None = None, trees: list[TokenTree] | None = None,
                   first_row: int = 0) -> torch.Tensor:
        """A draft step for each row: `layers` on `ids` `[r, w]`; `[r, w, vocab]` float32 logits.

        A chain's step (w = 1) sits at starts[j]; a layer tree's level is tree
        rows `first_row`.. of `trees[j]` (`begin_pass`). Writes only `layers`'
        entries, past each row's length: the verify pass writes every layer's
        there anew. The rows' lengths stay. A feature `head` runs alone on the
        tokens joined with `before` `[r, w, hidden]` (zeros for None); its
        outputs are kept in `drafted`.
        """
        r, w = ids.shape
        step = self.begin_pass(starts, w, rows, trees, first_row)
        hidden = self.embed_rows(ids, step)  # [r, w, hidden]
        if head is not None:
            hidden = self.drafted = self.run_rows(head.inputs(hidden, _or_zeros(before, hidden)), [head.slot], step)
        else:
            s = exact_prefix_of(layers)
            if s:  # the states after layers 0..s-1, which compute what the target computes (a verify resumes there)
                self.boundary = hidden = self.run_rows(hidden, layers[:s], step)
            hidden = self.run_rows(hidden, layers[s:], step)  # [r, w, hidden]
        return self.logits(hidden.reshape(1, r * w, -1), vocab).view(r, w, -1)  # [r, w, vocab]

    def run_feature_rows(self, hidden: torch.Tensor, head: FeatureHead, step: RowPass, before: torch.Tensor | None,
                         trees: list[TokenTree | None] | None = None) -> torch.Tensor:
        """The target's layers up to the head's last read layer on `hidden` `[r, q, hidden]`, then the head on the
        rows' fused states (kept in `fused`, `[r, q, hidden]`); the states after the last read layer.

        Position t's head input joins its token with the fused state before it: `before` `[r, 1, hidden]` for
        t = 0, else row t - 1's, or in a tree (`trees[j]`) its parent's row."""
        states, first = [], 0
        embeds = hidden
        for r in head.reads:
            hidden = self.run_rows(hidden, range(first, r + 1), step)
            states.append(hidden)
            first = r + 1
        self.fused = head.fused(states)  # [r, q, hidden]
        known = torch.cat([_or_zeros(before, embeds[:, :1]), self.fused], dim=1)  # [r, q + 1, hidden]: before, rows
        q = embeds.shape[1]
        sources = [list(range(q)) if tree is None else [0] + [parent + 2 for parent in tree.parents]
                   + list(range(len(tree) + 1, q)) for tree in (trees or [None] * len(embeds))]  # [r, q]: rows of known
        index = torch.tensor(sources, device=known.device)[:, :, None].expand(-1, -1, known.shape[-1])
        preceding = known.gather(1, index)  # [r, q, hidden]
        self.run_rows(head.inputs(embeds, preceding), [head.slot], step)
        return hidden

    def row_mask(self, allowed: torch.Tensor) -> torch.Tensor:
        """`[r, 1, q, span]` mask from `[r, q, span]`: bool for sdpa, additive for eager."""
        if self.bool_masks:
            return allowed[:, None]
        additive = torch.zeros(allowed.shape, dtype=self.dtype, device=allowed.device)
        return additive.masked_fill(~allowed, torch.finfo(self.dtype).min)[:, None]


def _or_zeros(states: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if states is None else states


def measure_batch_costs(parts: ModelParts, *, rows: int, max_width: int, repeats: int = 2, draft_layers=(),
                        head: ExitHead | None = None, vocab: DraftVocab | None = None) -> PassCosts:
    """Seconds of a full pass over `[rows, q]` for q = 1, 2, 4, 8, ... `max_width` (others interpolated), and
    of one draft step through `draft_layers` (with `head` and `vocab`) over `[rows, 1]` (0.0 without layers).

    Timed on a scratch cache whose rows hold `MEASURE_CONTEXT` entries, then
    `costs.long_context(...)` (zeros: attention costs by their count, so no
    prefill is needed), as `costs.fastest` times (the minimum of `repeats`
    interleaved runs).
    """
    began = time.perf_counter()
    long = long_context(parts.max_positions, max_width)
    contexts = (MEASURE_CONTEXT, long) if long > MEASURE_CONTEXT else (MEASURE_CONTEXT,)
    runner = BatchRunner(parts, capacity=long + max_width, head=head)
    for _ in range(rows):
        runner.cache.add_row()
    generator = torch.Generator().manual_seed(0)
    device = runner.positions.device
    ids = torch.randint(0, parts.vocab_size, (rows, max_width), generator=generator).to(device)
    everyone = slice(0, rows)
    widths = sorted({q for q in (1, 2, 4, 8, 16, 32) if q < max_width} | {max_width})

    def full_pass(q: int, context: int) -> Callable[[], None]:
        return lambda: runner.forward_rows(ids[:, :q], [context] * rows, everyone)

    def draft_step(context: int) -> Callable[[], None]:
        return lambda: runner.draft_rows(ids[:, :1], [context] * rows, everyone, draft_layers, vocab,
                                         head=head if isinstance(head, FeatureHead) else None)

    timed = {(q, c): full_pass(q, c) for q in widths for c in contexts}
    if draft_layers:
        timed |= {("draft", c): draft_step(c) for c in contexts}
    best = fastest(timed, repeats=repeats, device=device)
    verify_long = interpolate({q: best[q, long] for q in widths}, max_width) if len(contexts) > 1 else ()
    draft = best["draft", MEASURE_CONTEXT] if draft_layers else 0.0
    draft_long = best["draft", long] if draft_layers and verify_long else 0.0
    return PassCosts(interpolate({q: best[q, MEASURE_CONTEXT] for q in widths}, max_width), draft, parts.num_layers,
                     machine=f"{machine_description(device)}, {rows} rows",
                     measure_seconds=time.perf_counter() - began, context=MEASURE_CONTEXT,
                     verify_long=verify_long, long_context=long if verify_long else 0, draft_long=draft_long)
