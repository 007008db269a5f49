"""The one KV cache: the target's, position-indexed, shared by draft and verify.

Each layer owns a buffer `[batch, kv_heads, capacity, head_dim]`, allocated on
its first write, and a length: the positions that hold valid entries. A write
of q positions goes to `[length, length + q)` and the layer attends to `[0,
length + q)`; the draft writes only the layers it runs. Rollback is
`crop(length)`: it moves the pointer and copies nothing, O(1).

A layer with a sliding window returns only the entries some query of the pass
can see (`visible_from`, from the runner's `first_query`), as transformers'
sliding cache layers do; nothing is dropped from the buffer.

Attention modules call `update(key, value, layer_idx)`. This module does not
know which layers a plan runs or which entries are exact: the decode loop
decides what to crop.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class SharedKVCache:
    """Preallocated, position-indexed KV cache with O(1) rollback."""

    def __init__(self, num_layers: int, capacity: int, windows: list[int | None] | None = None) -> None:
        self.capacity = capacity
        self.lengths = [0] * num_layers
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.windows = list(windows) if windows is not None else [None] * num_layers  # per layer, or None
        self.first_query = 0  # the position of the pass's first query (set by the runner)

    def visible_from(self, layer_idx: int) -> int:
        """The first entry a query of this pass can see on `layer_idx`: 0, or within its sliding window."""
        window = self.windows[layer_idx]
        return 0 if window is None else max(0, self.first_query - window + 1)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append `key_states`/`value_states` `[batch, kv_heads, q, head_dim]`; return the valid entries from
        `visible_from(layer_idx)` on."""
        start = self.lengths[layer_idx]
        end = start + key_states.shape[-2]
        if end > self.capacity:
            raise RuntimeError(
                f"KV cache overflow at layer {layer_idx}: {end} positions > capacity {self.capacity}"
            )
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if keys is None or values is None:
            keys = self.keys[layer_idx] = _buffer_like(key_states, self.capacity)
            values = self.values[layer_idx] = _buffer_like(value_states, self.capacity)
        keys[:, :, start:end].copy_(key_states)
        values[:, :, start:end].copy_(value_states)
        self.lengths[layer_idx] = end
        first = self.visible_from(layer_idx)
        return keys[:, :, first:end], values[:, :, first:end]

    def crop(self, length: int, layers: Iterable[int] | None = None) -> None:
        """Keep the first `length` positions of `layers` (all layers when None). O(1)."""
        for i in range(len(self.lengths)) if layers is None else layers:
            if self.lengths[i] > length:
                self.lengths[i] = length

    def fill_zeros(self, length: int) -> None:
        """Every layer holds `length` entries, all zeros (for timing a pass at a long context without a
        prefill: attention costs by the entries' count, not their values). Layers must have been written."""
        if length > self.capacity or any(k is None for k in self.keys):
            raise ValueError(f"fill_zeros({length}) needs every layer written and length <= capacity {self.capacity}")
        for buffer in (*self.keys, *self.values):
            buffer.zero_()
        self.lengths = [length] * len(self.lengths)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.lengths[layer_idx]

    def restore(self, entries: list, length: int) -> None:
        """Hold positions 0..length-1 from `entries` (per layer: keys and values `[kv_heads, >=length, head_dim]`,
        or None for a layer left empty; the prefix cache's), for a batch of one."""
        for i, pair in enumerate(entries[: len(self.lengths)]):
            if pair is None:
                continue
            for buffers, states in ((self.keys, pair[0]), (self.values, pair[1])):
                if buffers[i] is None:
                    buffers[i] = _buffer_like(states[None], self.capacity)
                buffers[i][0, :, :length].copy_(states[:, :length])
            self.lengths[i] = length

    def held(self, layers: int) -> tuple[int, list]:
        """(n, entries): the positions every one of the first `layers` layers holds, and their views (per
        layer `[kv_heads, n, head_dim]` of row 0, or None for a layer never written)."""
        n = min(self.lengths[:layers])
        return n, [None if k is None else (k[0, :, :n], v[0, :, :n]) for k, v in zip(self.keys, self.values)]

    def entries(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The valid keys and values of one layer, `[batch, kv_heads, length, head_dim]` views."""
        n = self.lengths[layer_idx]
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if keys is None or values is None:
            raise ValueError(f"layer {layer_idx} has no cache entries yet")
        return keys[:, :, :n], values[:, :, :n]


def _buffer_like(states: torch.Tensor, capacity: int) -> torch.Tensor:
    batch, heads, _, head_dim = states.shape
    return torch.empty(batch, heads, capacity, head_dim, dtype=states.dtype, device=states.device)


class StaticKVCache(SharedKVCache):
    """The same cache with fixed shapes, for the static step (`static.py`).

    A write goes to the positions in `write_positions`, a device tensor `[q]`
    the runner sets before a pass, and a layer attends to its whole buffer
    `[batch, kv_heads, capacity, head_dim]` under a mask that hides what is not
    valid for each query. So no shape and no host integer depends on how many
    tokens the cache holds, and a pass can be captured once and replayed. The
    lengths are still kept, on the host, by the runner: it knows them without
    reading the device.

    A pass attends to the first `span` positions, set by the runner per pass
    (a multiple of a fixed step uncaptured, a power of two when captured), to
    spare the work on empty ones.

    Buffers start zeroed: a masked-out key gets weight 0, and 0 x NaN would
    still be NaN.
    """

    def __init__(self, num_layers: int, capacity: int, windows: list[int | None] | None = None) -> None:
        super().__init__(num_layers, capacity, windows)  # its masks hide what a window hides: it returns all
        self.write_positions: torch.Tensor | None = None  # [q] int64, set by the runner
        self.span: int = capacity  # positions a layer attends to (set by the runner per pass)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if keys is None or values is None:
            keys = self.keys[layer_idx] = _buffer_like(key_states, self.capacity).zero_()
            values = self.values[layer_idx] = _buffer_like(value_states, self.capacity).zero_()
        keys.index_copy_(2, self.write_positions, key_states)
        values.index_copy_(2, self.write_positions, value_states)
        return keys[:, :, : self.span], values[:, :, : self.span]
