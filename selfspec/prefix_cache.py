"""The prefix cache: KV entries of earlier sequences, kept across calls, so a prompt that repeats one's start
prefills only the rest (multi-turn chat: every turn resends the history).

A stored sequence holds, for each cache layer, its keys and values for
positions 0..L-1 (`[kv_heads, L, head_dim]`, copies). The entry at position p
depends only on tokens 0..p, so a prompt that shares its first m tokens with
a stored sequence can reuse m entries of it, whether the stored sequence is
longer, shorter or the same (a radix tree's answer, found here by comparing
with each stored sequence: a store holds tens of sequences, not thousands).
At least the prompt's last token is always prefilled: its logits start the
generation.

Bounded by a byte budget: the least recently used sequences go first, and a
sequence larger than the budget is not kept. A stored sequence that is a
prefix of a newer one is dropped (the newer one holds its entries).

This module keeps tensors; it does not run passes or know rows (`batch.py`
and `engine.py` restore entries into their caches and store them back).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

Entries = list[tuple[torch.Tensor, torch.Tensor] | None]  # per cache layer: keys, values [kv_heads, L, head_dim]


@dataclass
class PrefixStats:
    hits: int = 0  # lookups that reused at least one entry
    lookups: int = 0
    cached_tokens: int = 0  # positions reused, over every lookup
    evictions: int = 0


def _bytes(entries: Entries) -> int:
    return sum(t.numel() * t.element_size() for pair in entries if pair is not None for t in pair)


def _one_block(entries: Entries, length: int) -> Entries:
    """Copies of the first `length` positions of `entries`, every layer's keys and values in one allocation: a
    dropped sequence then frees one block, not a few small ones per layer scattered through the heap (which a
    long-running server could not hand back to the system)."""
    parts = [t[:, :length] for pair in entries if pair is not None for t in pair]
    if not parts:
        return list(entries)
    if any(t.dtype != parts[0].dtype or t.device != parts[0].device for t in parts):  # no one block: copy each
        return [None if pair is None else (pair[0][:, :length].clone(), pair[1][:, :length].clone())
                for pair in entries]
    block = torch.empty(sum(t.numel() for t in parts), dtype=parts[0].dtype, device=parts[0].device)
    copies, start = [], 0
    for t in parts:
        copy = block[start : start + t.numel()].view(t.shape)
        copy.copy_(t)
        copies.append(copy)
        start += t.numel()
    it = iter(copies)
    return [None if pair is None else (next(it), next(it)) for pair in entries]


def _common(a: tuple[int, ...], b: list[int], limit: int) -> int:
    """How many leading tokens `a` and `b` share, at most `limit`."""
    n = min(len(a), limit)
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """KV of token sequences, least recently used first out, within `budget` bytes."""

    def __init__(self, budget: int) -> None:
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
            raise ValueError(f"prefix cache budget must be a number of bytes >= 0, got {budget!r}")
        self.budget = budget
        self.store: OrderedDict[tuple[int, ...], Entries] = OrderedDict()  # oldest use first
        self.bytes = 0
        self.stats = PrefixStats()

    def __len__(self) -> int:
        return len(self.store)

    def lookup(self, tokens: list[int]) -> tuple[int, Entries | None]:
        """(m, entries): the most leading positions of `tokens` some stored sequence holds (m <= len - 1), and
        that sequence's entries (views; use the first m positions); (0, None) when none."""
        self.stats.lookups += 1
        best, found = 0, None
        for key in self.store:
            m = _common(key, tokens, len(tokens) - 1)
            if m > best:
                best, found = m, key
        if found is None:
            return 0, None
        self.store.move_to_end(found)
        self.stats.hits += 1
        self.stats.cached_tokens += best
        return best, self.store[found]

    def add(self, tokens: list[int], entries: Entries) -> None:
        """Keep copies of `entries` (positions 0..len(tokens)-1 of each layer) for `tokens`."""
        key = tuple(tokens)
        for stored in list(self.store):  # one that `tokens` extends, or the same: the new one holds its entries
            if len(stored) <= len(key) and key[: len(stored)] == stored:
                self._drop(stored)
            elif len(stored) > len(key) and stored[: len(key)] == key:
                self.store.move_to_end(stored)  # already held, in a longer sequence
                return
        parts = [t[:, : len(key)] for pair in entries if pair is not None for t in pair]
        size = sum(t.numel() * t.element_size() for t in parts)
        if size > self.budget:
            return
        copied = _one_block(entries, len(key))
        self.store[key] = copied
        self.bytes += size
        while self.bytes > self.budget:
            self._drop(next(iter(self.store)))
            self.stats.evictions += 1

    def _drop(self, key: tuple[int, ...]) -> None:
        self.bytes -= _bytes(self.store.pop(key))

    def clear(self) -> None:
        self.store.clear()
        self.bytes = 0
