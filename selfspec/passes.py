"""The target's full passes: the prefill, the verify pass, and filling an exit head's cache.

A full pass runs every layer, so what it writes to the cache is the target's
own. The verify pass runs over the last emitted token and the round's draft
in one call, reusing what the draft computed exactly (the entries of the
plan's exact prefix, layers 0..s-1, and the hidden states after it), so it
resumes at layer s. It returns logits and decides nothing: acceptance is
`acceptance.py`, the roll back the decode loop's.

With a trained exit head (`head.py`, layer N of the cache) the head's entries
must cover every verified token: the prefill and the verify pass keep the
states after layer E-1, and `fill_head` runs the head on the verified tokens
the draft did not already cover. With a feature head (`feature_head.py`) the
passes keep the fused states after its read layers instead, and `fill_head`
rewrites the head's entries for the kept tokens from them (its drafted
entries read predicted states).

This module does not know plans beyond the exact prefix, sampling or stopping.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .feature_head import FeatureHead
from .head import ExitHead
from .runner import LayerRunner
from .tree import TokenTree, compact


@dataclass
class Checked:
    """What a verify pass computed."""

    logits: torch.Tensor  # [k+1, vocab] target logits
    exit_states: torch.Tensor | None  # [1, k+1, hidden] states after layer E-1 (only with an exit head)
    features: torch.Tensor | None = None  # [1, k+1, hidden] a feature head's fused states per row (`FeatureHead`)
    ids: torch.Tensor | None = None  # [1, k+1] the rows' tokens (with a feature head)


class TargetPasses:
    """Full passes of a model with `num_layers` layers, for a draft whose layers 0..exact_prefix-1 are exact."""

    def __init__(self, num_layers: int, *, exact_prefix: int, head: ExitHead | FeatureHead | None = None) -> None:
        self.num_layers = num_layers
        self.exact_prefix = exact_prefix
        self.head = head
        self.features = head if isinstance(head, FeatureHead) else None
        self.probe = None  # when set, the next passes report each layer's (input, output) to it (`auto_layers.py`)

    def prefill(self, runner: LayerRunner, prompt: list[int], start: int = 0) -> torch.Tensor:
        """Run the prompt through the target (and the head, to fill its cache); `[1, vocab]` logits of its last row.
        `start`: the cache already holds the first `start` positions (a stored prefix; not with a feature head)."""
        hidden = runner.embed(prompt[start:], start)  # [1, prompt - start, hidden]
        if self.features is not None:
            if start:
                raise ValueError("a feature head's prefill starts at position 0")
            ids = torch.tensor([prompt], device=runner.positions.device)  # [1, prompt]
            runner.head_feature = None  # a new sequence: f before position 0 is zero
            last, features = self.run_reading(runner, hidden, 0)
            self.fill_features(runner, Checked(None, None, features, ids), 0, len(prompt))
            return runner.logits(last[:, -1:])
        rest = range(self.num_layers)
        if self.head is not None:
            hidden = runner.run(hidden, range(self.head.exit_layer), start, probe=self.probe)
            runner.run(hidden, [self.head.slot], start)
            rest = range(self.head.exit_layer, self.num_layers)
        return runner.logits(runner.run(hidden, rest, start, probe=self.probe)[:, -1:])

    def verify(self, runner: LayerRunner, ids: torch.Tensor, boundary: list[torch.Tensor], start: int) -> Checked:
        """Target logits `[k+1, vocab]` for `ids` `[1, k+1]`: the last emitted token (at `start`) and k drafted ones.

        `boundary`: the draft's states after the exact prefix for the first k
        inputs (empty when the draft saved none, as for an n-gram proposal).
        """
        k = ids.shape[1] - 1
        s = self.exact_prefix if k and boundary else 0
        if s:
            # The exact prefix already ran for x, d_1..d_{k-1}; only d_k still needs it.
            tail = runner.run(runner.embed(ids[:, -1:], start + k), range(s), start + k, probe=self.probe)  # [1, 1, hidden]
            hidden = torch.cat([*boundary, tail], dim=1)  # [1, k+1, hidden]
        else:
            hidden = runner.embed(ids, start)  # [1, k+1, hidden]
        runner.cache.crop(start, layers=range(s, self.num_layers))  # drop the draft's inexact entries
        if self.features is not None:
            last, features = self.run_reading(runner, hidden, start)
            return Checked(runner.logits(last), None, features, ids)
        exit_states = None
        if self.head is not None:  # keep the states after layer E-1 for the head's cache
            exit_layer = self.head.exit_layer
            hidden = exit_states = runner.run(hidden, range(s, exit_layer), start, probe=self.probe)  # [1, k+1, hidden]
            s = exit_layer
        return Checked(runner.logits(runner.run(hidden, range(s, self.num_layers), start, probe=self.probe)), exit_states)

    def verify_tree(self, runner: LayerRunner, ids: torch.Tensor, tree: TokenTree, start: int) -> Checked:
        """Target logits `[n+1, vocab]` for `ids` `[1, n+1]`: the last emitted token and a tree's n nodes.

        Row r is written at slot start + r and sits at start + its depth
        (`tree.py`); nothing of the draft is in the cache (trees are n-gram
        proposals), so every layer runs.
        """
        runner.cache.crop(start, layers=range(self.num_layers))
        hidden = runner.embed(ids, start, tree)  # [1, n+1, hidden]
        if self.features is not None:
            last, features = self.run_reading(runner, hidden, start, tree)
            return Checked(runner.logits(last), None, features, ids)
        exit_states, s = None, 0
        if self.head is not None:  # keep the states after layer E-1 for the head's cache
            hidden = exit_states = runner.run(hidden, range(self.head.exit_layer), start, tree, probe=self.probe)
            s = self.head.exit_layer
        return Checked(runner.logits(runner.run(hidden, range(s, self.num_layers), start, tree, probe=self.probe)),
                       exit_states)

    def keep_tree_path(self, runner: LayerRunner, checked: Checked, tree: TokenTree, path: list[int], start: int) -> int:
        """After a tree's verify pass: move the kept `path`'s entries into place, give the head its entries.

        Returns the number of positions the cache now holds (start + 1 + len(path)).
        """
        keep = start + 1 + len(path)
        compact(runner.cache, start=start, path=path, layers=range(self.num_layers))
        if checked.exit_states is not None:  # the head's cache: the states of the root and the kept path, in order
            rows = torch.tensor([0] + [node + 1 for node in path], device=checked.exit_states.device)
            checked = Checked(checked.logits, checked.exit_states[:, rows])
        if checked.features is not None:  # the kept rows, in order: a chain from the root
            rows = torch.tensor([0] + [node + 1 for node in path], device=checked.features.device)
            checked = Checked(checked.logits, None, checked.features[:, rows], checked.ids[:, rows])
        self.fill_head(runner, checked, start, keep)
        return keep

    def fill_head(self, runner: LayerRunner, checked: Checked, start: int, keep: int) -> None:
        """After the roll back to `keep` positions: give the head entries for the verified tokens it lacks."""
        if checked.features is not None:
            self.fill_features(runner, checked, start, keep)
            return
        if self.head is None or checked.exit_states is None:
            return
        slot = self.head.slot
        have = runner.cache.lengths[slot]  # start..keep: the draft's entries are exact (E is the exact prefix)
        if have < keep:
            runner.run(checked.exit_states[:, have - start : keep - start], [slot], have)

    def run_reading(self, runner: LayerRunner, hidden: torch.Tensor, start: int,
                    tree: TokenTree | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer on `hidden` `[1, q, hidden]` from position `start`: the last states and the feature
        head's fused states `[1, q, hidden]` (from the states after its read layers)."""
        states, s = [], 0
        for r in self.features.reads:
            hidden = runner.run(hidden, range(s, r + 1), start, tree, probe=self.probe)
            states.append(hidden)
            s = r + 1
        return runner.run(hidden, range(s, self.num_layers), start, tree, probe=self.probe), self.features.fused(states)

    def fill_features(self, runner: LayerRunner, checked: Checked, start: int, keep: int) -> None:
        """A feature head's entries for positions up to `keep` from the target's states of rows start..keep-1.

        Only the head's first draft step (at `start`) read the target's
        state; its later entries are dropped and rewritten. Row r's input is
        (f of row r - 1, the embedding of row r's token); row 0's f is the
        one kept from the last pass (`runner.head_feature`).
        """
        slot = self.features.slot
        have = min(runner.cache.lengths[slot], start + 1)
        runner.cache.crop(have, layers=[slot])
        kept = keep - start
        features = checked.features[:, :kept]  # [1, kept, hidden]
        before = runner.head_feature
        if before is None:
            before = torch.zeros_like(features[:, :1])
        if have < keep:
            preceding = torch.cat([before, features[:, :-1]], dim=1)[:, have - start :]  # [1, keep - have, hidden]
            inputs = self.features.inputs(runner.embed(checked.ids[:, have - start : kept], have), preceding)
            runner.run(inputs, [slot], have)
        runner.head_feature = features[:, -1:]  # [1, 1, hidden]: f at position keep - 1
        runner.draft_feature = None
