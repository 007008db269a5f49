"""Run any subset of the target's layers on a few tokens, over the shared cache.

`LayerRunner` is the one place that calls the model's modules. It owns the
generation's `SharedKVCache`, the rotary tables and the attention masks; the
draft runs the plan's layers through it, the verify pass the full stack (or
what follows the plan's exact prefix). Per-family mechanisms, as the
adapter's `ModelParts` says: rotary tables per model or per layer type
(Gemma 3), learned absolute positions added at `start` (GPT-2), causal masks
with per-layer sliding windows (bool for sdpa, additive for eager; a windowed
layer sees only what `SharedKVCache.visible_from` shows), final-logit
soft-capping (Gemma 2). An exit head is one more layer, index N.

It counts the weights its passes read (`weights_read`: each layer a pass
runs, and the LM head or a draft vocabulary's rows when logits are computed).
It does not know plans, acceptance or sampling.
"""

from __future__ import annotations

import contextlib

import torch

from .cache import SharedKVCache
from .cpu_kernels import chosen_kernels
from .memory import parameter_bytes
from .parts import ModelParts, soft_cap
from .tree import TokenTree
from .vocab import DraftVocab


class LayerRunner:
    cache_class = SharedKVCache  # the static step (`static.py`) swaps in its fixed-shape cache
    drafts_on_device = False  # the eager step: a round reads each drafted token back as it is chosen (`rounds.py`)

    def __init__(self, parts: ModelParts, *, capacity: int, device: torch.device | None = None, head=None):
        device = parts.device if device is None else device
        self.parts = parts
        self.layers = list(parts.layers)
        self.call = parts.layer_call
        self.dtype = parts.dtype
        self.bool_masks = parts.attn_implementation == "sdpa"
        self.windows = list(parts.windows) or [None] * parts.num_layers
        self.rotary_kinds = list(parts.rotary_kinds) or [None] * parts.num_layers
        self.head = head
        if head is not None:  # an exit head (head.py) is layer N
            self.layers.append(head.layer)
            self.windows.append(self.windows[head.source_layer])
            self.rotary_kinds.append(self.rotary_kinds[head.source_layer])
        self.cache = self.cache_class(len(self.layers), capacity, self.windows)
        self.layer_bytes = [parameter_bytes([layer]) for layer in self.layers]  # per layer (an exit head's: N)
        self.head_bytes = parameter_bytes([parts.lm_head, parts.norm])
        self.weights_read = 0  # bytes of weights the passes read since the last reset (what a pass costs where
        # its width is free: a memory-bound machine)
        self.positions = torch.arange(capacity, device=device)[None]  # [1, capacity]
        self.rotary = self.rotary_tables(self.positions)
        # A feature head's (`feature_head.py`) inputs, `[1, 1, hidden]` each: f at the last cached position (set by
        # the passes), and its own output at the last drafted position this round (set by the draft; None after
        # a verify pass).
        self.head_feature: torch.Tensor | None = None
        self.draft_feature: torch.Tensor | None = None

    def head_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the head's layer takes at these rows `[r, q, hidden]` for a pass that only times or fills it: an
        exit head, the hidden states; a feature head, their join with zero preceding states (its layer may be
        wider)."""
        inputs = getattr(self.head, "inputs", None)
        return hidden if inputs is None else inputs(hidden, torch.zeros_like(hidden))

    def rotary_tables(self, positions: torch.Tensor) -> dict[str | None, tuple[torch.Tensor, torch.Tensor]]:
        """(cos, sin) per layer type, each `[1, capacity, rot_dim]`, for `positions` `[1, capacity]`.

        Rotary embeddings are elementwise in the position (length-dependent
        rope types are refused by the adapter), so one table per layer type,
        computed up front, equals what each forward pass would compute.
        """
        tables: dict[str | None, tuple[torch.Tensor, torch.Tensor]] = {}
        if self.parts.rotary is not None:
            probe = torch.zeros(1, 1, 1, dtype=self.dtype, device=positions.device)
            for kind in dict.fromkeys(self.rotary_kinds):
                extra = {} if kind is None else {"layer_type": kind}
                tables[kind] = self.parts.rotary(probe, position_ids=positions, **extra)
        return tables

    def embed(self, token_ids: list[int] | torch.Tensor, start: int, tree: TokenTree | None = None,
              first_row: int = 0) -> torch.Tensor:
        """`[1, q, hidden]` input embeddings of `token_ids` (a list, or `[1, q]` on the device) at start..start+q-1.

        With a `tree` (`tree.py`), they are its rows first_row.. and row r sits at start + its depth instead.
        """
        if isinstance(token_ids, torch.Tensor):
            ids = token_ids  # [1, q]
        else:
            ids = torch.tensor([token_ids], device=self.positions.device)  # [1, q]
        hidden = self.parts.embed(ids)
        if self.parts.position_embed is not None:  # learned absolute positions (GPT-2)
            hidden = hidden + self.parts.position_embed(self.row_positions(start, ids.shape[1], tree, first_row)[None])
        return hidden

    def row_positions(self, start: int, q: int, tree: TokenTree | None, first_row: int = 0) -> torch.Tensor:
        """`[q]` positions of q rows written from `start`: consecutive, or start + depth for a tree's rows
        first_row..first_row+q-1."""
        if tree is None:
            return self.positions[0, start : start + q]
        return start + torch.tensor(tree.depths()[first_row : first_row + q], device=self.positions.device)

    def run(self, hidden: torch.Tensor, layers, start: int, tree: TokenTree | None = None, *, probe=None,
            first_row: int = 0) -> torch.Tensor:
        """Run `layers` in order on `hidden` `[1, q, hidden]` at positions start..start+q-1.

        Every layer in `layers` must hold exactly `start` cache entries. With a
        `tree` (`tree.py`) `hidden` holds its rows first_row..first_row+q-1
        (all of them, q = its nodes + 1, by default; each layer must then hold
        start + first_row entries, the rows before): row r is written at slot
        start + r but sits at start + its depth and sees the prefix and its ancestors.
        `probe(layer, before, after)`, when given, sees each layer's input and
        output `[1, q, hidden]` (an auto plan's signal, `auto_layers.py`).
        """
        q = hidden.shape[1]
        rows = self.row_positions(start, q, tree, first_row)  # [q]
        position_ids = rows[None]  # [1, q]
        # A chain's rows are a range: slice the tables (views); a tree's are gathered.
        index = slice(start, start + q) if tree is None else rows
        rotary = {kind: tuple(t[:, index] for t in table) for kind, table in self.rotary.items()}
        for i in layers:
            if self.cache.lengths[i] != start + first_row:
                raise RuntimeError(f"cache out of step: layer {i} holds {self.cache.lengths[i]} positions, "
                                   f"expected {start + first_row}")

        def mask_for(window: int | None) -> torch.Tensor | None:
            if tree is None:
                return self.mask(q, start, window)
            return self.tree_mask(tree, start, window, first_row, q)

        self.cache.first_query = start  # no row sits before start: a window shows entries from start - window + 1
        self.weights_read += sum(self.layer_bytes[i] for i in layers)
        return self.run_layers(hidden, layers, mask_for=mask_for, rotary=rotary, position_ids=position_ids,
                               probe=probe)

    def run_layers(self, hidden: torch.Tensor, layers, *, mask_for, rotary: dict, position_ids: torch.Tensor,
                   probe=None) -> torch.Tensor:
        """The layer loop every runner shares: `layers` in order on `hidden` `[r, q, hidden]`, over the cache.

        `mask_for(window)` makes the attention mask for a sliding window (None:
        none), once per window a pass meets; `rotary` holds the (cos, sin) per
        layer type; `probe` as `run`'s. The attention and linear kernels are
        those this thread chose (`cpu_kernels.cpu_kernels`), else transformers' own.
        """
        masks: dict[int | None, torch.Tensor | None] = {}
        stream = self.parts.stream  # offloaded layers selfspec loads (`streaming.py`), or None
        resident = contextlib.nullcontext()
        for i in layers:
            window = self.windows[i]
            if window not in masks:
                masks[window] = mask_for(window)
            before = hidden
            with stream.weights_of(i) if stream is not None and i in stream else resident:
                hidden = self.call(self.layers[i], hidden, mask=masks[window],
                                   position_embeddings=rotary.get(self.rotary_kinds[i]), position_ids=position_ids,
                                   cache=self.cache)
            if probe is not None:
                probe(i, before, hidden)
        return hidden

    def causal_prefill(self, start: int, q: int, window: int | None) -> bool:
        """Whether a pass can go without a mask: q > 1 queries from position 0, under sdpa, within any window.

        transformers' sdpa then runs the kernel's own causal attention, as
        `model.generate`'s prefill does: it skips the masked half of a long
        prompt's attention (measured, AVX512 CPU, SmolLM2, 868 tokens: 0.52 s against 0.62 s in
        bfloat16, 1.33 against 1.44 s in float32). Eager attention needs the mask.
        """
        return start == 0 and q > 1 and self.bool_masks and (window is None or q <= window)

    def logits(self, hidden: torch.Tensor, vocab: DraftVocab | None = None) -> torch.Tensor:
        """`[q, vocab]` float32 logits from the last hidden states `[1, q, hidden]`.

        With a draft vocabulary only its rows are computed; the rest are -inf.
        """
        cap = self.parts.logit_softcap
        normed = self.parts.norm(hidden)
        if vocab is not None:
            self.weights_read += vocab.weight.numel() * vocab.weight.element_size()
            with chosen_kernels(normed):  # its rows' GEMM on the kernel this thread chose (`cpu_kernels.py`)
                return vocab.logits(normed, cap)
        self.weights_read += self.head_bytes
        with chosen_kernels(normed):
            logits = self.parts.lm_head(normed)[0]  # [q, vocab]
        return soft_cap(logits, cap).float()  # capped in the model's dtype, as the model's own forward does

    @staticmethod
    def first_visible(start: int, window: int | None) -> int:
        """The first cache entry a pass whose rows sit at start.. attends to (`SharedKVCache.visible_from`)."""
        return 0 if window is None else max(0, start - window + 1)

    def mask(self, q: int, start: int, window: int | None) -> torch.Tensor | None:
        """Attention mask for q queries at start.. over the keys first_visible..start + q; None when nothing is
        hidden (one query), or for a prefill from position 0 under sdpa (see `causal_prefill`)."""
        kv = start + q
        if q == 1 or self.causal_prefill(start, q, window):
            return None
        query_pos = self.positions[0, start:kv, None]  # [q, 1]
        key_pos = self.positions[0, None, self.first_visible(start, window):kv]  # [1, kv - first_visible]
        allowed = key_pos <= query_pos  # [q, kv]
        if window is not None:
            allowed &= key_pos > query_pos - window
        return self.as_mask(allowed)

    def tree_mask(self, tree: TokenTree, start: int, window: int | None, first_row: int = 0,
                  q: int | None = None) -> torch.Tensor:
        """`[1, 1, q, start+first_row+q - first_visible]` mask for a tree's rows first_row..first_row+q-1
        (default: all n+1 rows) over the keys from `first_visible(start, window)`: each sees the prefix, then its
        ancestors and itself."""
        device = self.positions.device
        end = len(tree) + 1 if q is None else first_row + q
        visible = tree.visibility()[first_row:end, :end].to(device)  # [q, first_row + q]
        allowed = torch.cat([torch.ones(len(visible), start, dtype=torch.bool, device=device), visible], dim=1)
        if window is not None:
            query_pos = self.row_positions(start, len(visible), tree, first_row)  # [q]
            key_pos = torch.cat([self.positions[0, :start], self.row_positions(start, end, tree)])  # [start+end]
            allowed &= key_pos[None] > query_pos[:, None] - window
        return self.as_mask(allowed[:, self.first_visible(start, window):])

    def as_mask(self, allowed: torch.Tensor) -> torch.Tensor:
        """`[1, 1, q, kv]` mask in the form the attention takes: bool for sdpa, additive for eager."""
        if self.bool_masks:
            return allowed[None, None]
        additive = torch.zeros(allowed.shape, dtype=self.dtype, device=allowed.device)
        return additive.masked_fill(~allowed, torch.finfo(self.dtype).min)[None, None]
