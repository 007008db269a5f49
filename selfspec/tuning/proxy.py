"""The acceptance proxy: a draft's greedy agreement with the target, measured without decoding.

The target's hidden states after every layer, and its keys and values, are
captured once per calibration sequence. A round then starts at every
generated position at once: the draft's layers past its exact prefix run on
all positions in one batch, each query seeing the target's entries before its
round and the draft's own entries for its round's earlier tokens, exactly
what the engine's draft sees. `ProxyEvaluator.evaluate` replays the engine's
rounds for every policy of a grid and keeps the best by the cost model;
depth d is scored only where tokens 0..d-1 were accepted. This "rounds"
context equals real greedy acceptance (tested token for token in float64);
the cheaper one-pass "target" context scores round starts only and does the
wide search.

It does not know sampling, logits processors, batches or which sets to try.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..registry import model_parts
from ..plan import DraftPlan
from ..runner import LayerRunner
from .calibration import CalibrationSequence
from .candidate import Candidate
from .cost import CostModel, iid_speedup
from .replay import Agreement, Policy, Simulation, policy_grid, simulate


class _RoundCache:
    """The keys a draft query sees: the target's entries, the draft's own from earlier depths, then its own.

    Stands in for the engine's cache in the proxy's batched rounds; which of
    these keys each query may attend to is the mask's business.
    """

    def __init__(self, target: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.target = target  # layer -> the target's (keys, values) [1, kv_heads, all positions, head_dim]
        self.draft: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # layer -> one (k, v) per depth

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = self.target[layer_idx]
        earlier = self.draft.setdefault(layer_idx, [])
        all_keys = torch.cat([keys, *(k for k, _ in earlier), key_states], dim=-2)
        all_values = torch.cat([values, *(v for _, v in earlier), value_states], dim=-2)
        earlier.append((key_states, value_states))
        return all_keys, all_values


def _as_mask(allowed: torch.Tensor, runner: LayerRunner) -> torch.Tensor:
    """`[q, kv]` allowed-pairs as the runner's attention wants it: bool (sdpa) or additive (eager)."""
    if runner.bool_masks:
        return allowed[None, None]
    additive = torch.zeros(allowed.shape, dtype=runner.dtype, device=allowed.device)
    return additive.masked_fill(~allowed, torch.finfo(runner.dtype).min)[None, None]


@dataclass
class _Trace:
    """One calibration sequence through the target: hidden states after every layer and the target's cache."""

    sequence: CalibrationSequence
    hidden: list[torch.Tensor]  # L+1 x [1, rows, hidden]: input to layer s (s = L: the final states)
    first_row: int  # position of hidden[s][:, 0]
    runner: LayerRunner  # its cache holds the target's entries for positions 0..T-2 (until flattened)
    next_tokens: torch.Tensor  # [T-1-P]: the target's token after each generated input


class ProxyEvaluator:
    """Scores layer sets by the draft's agreement with the target on calibration sequences.

    `context` says what a drafted token's queries attend to:

    - `"rounds"` (default, exact for greedy up to floating-point order): what
      the engine's draft sees. A round is started at every generated input;
      its depth-i token attends to the target's entries before the round and
      to the draft's own entries for the round's earlier tokens. Depth i is
      scored only for rounds whose tokens 0..i-1 were all accepted, so the
      cost is about the calibration tokens times the mean accepted length.
    - `"target"`: round starts only (exact for k = 1); deeper tokens are
      assumed to agree as round starts at their position do. One pass.
    - `"draft"`: teacher forcing through the draft's layers alone; the draft
      attends to its own entries for every earlier token. One pass.
    """

    CONTEXTS = ("rounds", "target", "draft")

    def __init__(
        self,
        model,
        calibration: Sequence[CalibrationSequence],
        cost_model: CostModel,
        *,
        context: str = "rounds",
        policies: Sequence[Policy] | None = None,
    ) -> None:
        if context not in self.CONTEXTS:
            raise ValueError(f"context={context!r} is not a proxy context (valid: {', '.join(self.CONTEXTS)})")
        self.model = model
        self.parts = model_parts(model)
        self.num_layers = self.parts.num_layers
        if cost_model.num_layers != self.num_layers:
            raise ValueError(
                f"the cost model is for {cost_model.num_layers} layers but the model has {self.num_layers}"
            )
        self.context = context
        self.cost_model = cost_model
        self.max_depth = cost_model.max_draft_length
        self.policies = list(policies) if policies is not None else policy_grid(cost_model.max_draft_length)
        self.device = self.parts.lm_head.weight.device
        self.calibration = [s for s in calibration if s.generated >= 2]
        if not self.calibration:
            raise ValueError("the calibration needs at least one sequence with 2 or more generated tokens")
        self.limits = [s.max_new_tokens for s in self.calibration]
        self.prompt_lengths = [s.prompt_length for s in self.calibration]
        with torch.no_grad():
            self.traces = [self._trace(s) for s in self.calibration]
            if context != "draft":
                self._flatten()
        self.results: dict[tuple[int, ...], Candidate] = {}
        self._agreements: dict[tuple[int, ...], Agreement] = {}

    def _trace(self, sequence: CalibrationSequence) -> _Trace:
        tokens = list(sequence.tokens[:-1])  # the last token is never an input
        runner = LayerRunner(self.parts, capacity=len(tokens), device=self.device)
        first_row = 0 if self.context == "draft" else sequence.prompt_length
        hidden = runner.embed(tokens, 0)
        states = [hidden[:, first_row:]]
        for layer in range(self.num_layers):
            hidden = runner.run(hidden, [layer], 0)
            states.append(hidden[:, first_row:])
        next_tokens = torch.tensor(sequence.tokens[sequence.prompt_length + 1 :], device=self.device)
        return _Trace(sequence, states, first_row, runner, next_tokens)

    def check_layers(self, layers: Sequence[int]) -> tuple[int, ...]:
        layers = tuple(sorted(set(int(i) for i in layers)))
        if not layers or layers[0] < 0 or layers[-1] >= self.num_layers:
            raise ValueError(f"layer set {list(layers)} out of range (valid: non-empty, 0..{self.num_layers - 1})")
        return layers

    @torch.no_grad()
    def agreement(self, layers: Sequence[int]) -> Agreement:
        """The draft's choices against the target's tokens (memoised per layer set)."""
        layers = self.check_layers(layers)
        if layers not in self._agreements:
            s = DraftPlan(layers=layers).exact_prefix(self.num_layers)
            rest = layers[s:]
            if self.context == "draft":
                self._agreements[layers] = self._teacher_forced(s, rest)
            else:
                # Without layers past the exact prefix the draft's output does not depend on
                # where its round started, so round starts tell everything.
                depth = self.max_depth if self.context == "rounds" and rest else 1
                self._agreements[layers] = self._rounds(s, rest, depth)
        return self._agreements[layers]

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # logits() uses only the model's parts (final norm, LM head, soft cap): any trace's runner will do.
        return self.traces[0].runner.logits(hidden)  # [rows, vocab]

    def _choices(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self._logits(hidden)
        top, choice = logits.max(dim=-1)
        return choice, torch.exp(top - torch.logsumexp(logits, dim=-1))

    def _teacher_forced(self, s: int, rest: tuple[int, ...]) -> Agreement:
        finals = []
        for trace in self.traces:
            hidden = trace.hidden[s]
            if rest:
                T = len(trace.sequence.tokens)
                runner = LayerRunner(self.parts, capacity=T - 1, device=self.device)
                hidden = runner.run(hidden, rest, 0)
            finals.append(hidden[:, trace.sequence.prompt_length :])
        choice, confidence = self._choices(torch.cat(finals, dim=1))
        hits = (choice == torch.cat([t.next_tokens for t in self.traces])).tolist()
        confidence = confidence.tolist()
        matches, confidences, at = [], [], 0
        for trace in self.traces:
            size = len(trace.next_tokens)
            matches.append(hits[at : at + size])
            confidences.append(confidence[at : at + size])
            at += size
        return Agreement(matches, confidences)

    def _flatten(self) -> None:
        """All sequences' generated inputs as one batch of rows; the target's entries as one key set per layer."""
        traces = self.traces
        sizes = [len(t.next_tokens) for t in traces]
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        dev = self.device

        def per_row(values):
            return torch.cat([torch.as_tensor(v, device=dev) for v in values])

        self.flat_hidden = [torch.cat([t.hidden[s] for t in traces], dim=1) for s in range(self.num_layers + 1)]
        self.flat_next = per_row([t.next_tokens for t in traces])  # [G] the token after each input row
        prompts = [t.sequence.prompt_length for t in traces]
        self.row_pos = per_row([p + torch.arange(n, device=dev) for p, n in zip(prompts, sizes)])  # [G] its position
        self.row_seq = per_row([torch.full((n,), i, device=dev) for i, n in enumerate(sizes)])  # [G] its sequence
        self.row_end = per_row([torch.full((n,), self.offsets[i + 1], device=dev) for i, n in enumerate(sizes)])
        lengths = [t.runner.cache.lengths[0] for t in traces]
        self.key_seq = per_row([torch.full((n,), i, device=dev) for i, n in enumerate(lengths)])
        self.key_pos = per_row([torch.arange(n, device=dev) for n in lengths])
        self.target_kv = {
            layer: tuple(torch.cat(parts, dim=-2) for parts in zip(*(t.runner.cache.entries(layer) for t in traces)))
            for layer in range(self.num_layers)
        }
        # Rotary tables, windows and the layer call for any position of any sequence.
        self.tables = LayerRunner(self.parts, capacity=max(lengths), device=dev)
        for t in traces:  # the flat copies replace them
            t.hidden, t.runner = [], self.tables

    def _rounds(self, s: int, rest: tuple[int, ...], max_depth: int) -> Agreement:
        """Start a round at every generated input of every sequence; score depth after depth.

        A round's depth-d token is scored only while its tokens 0..d-1 were all
        accepted: later ones cannot change how many the round keeps.
        """
        G = len(self.flat_next)
        runs = [0] * G
        run_confidences: list[list[float]] = [[] for _ in range(G)]
        cache, depth_rows = _RoundCache(self.target_kv), []
        active = torch.arange(G, device=self.device)  # rounds (by their first input's row) all accepted so far
        for depth in range(max_depth):
            starts = active[active + depth < self.row_end[active]]  # the round's depth-th input must exist
            if len(starts) == 0:
                break
            hidden = self.flat_hidden[s][:, starts + depth]  # the exact prefix computes the target's own states
            if rest:
                hidden = self._draft_layers(cache, depth_rows, hidden, starts, depth, rest)
            choice, confidence = self._choices(hidden)
            hit = choice == self.flat_next[starts + depth]
            for start, h, c in zip(starts.tolist(), hit.tolist(), confidence.tolist()):
                run_confidences[start].append(c)
                runs[start] += h
            active = starts[hit]
        matches = [r > 0 for r in runs]  # depth 0 is scored for every row
        split = [slice(a, b) for a, b in zip(self.offsets, self.offsets[1:])]
        agreement = Agreement([matches[i] for i in split], [[c[0] for c in run_confidences[i]] for i in split])
        if max_depth > 1:
            agreement.runs = [runs[i] for i in split]
            agreement.run_confidences = [run_confidences[i] for i in split]
        return agreement

    def _draft_layers(
        self,
        cache: _RoundCache,
        depth_rows: list[torch.Tensor],
        hidden: torch.Tensor,
        starts: torch.Tensor,
        depth: int,
        rest: tuple[int, ...],
    ) -> torch.Tensor:
        """The draft's layers past the exact prefix, on the depth-th token of the rounds at rows `starts`."""
        tables = self.tables
        query_pos = self.row_pos[starts] + depth  # [B] positions of the inputs
        round_pos = self.row_pos[starts]  # [B] where each round began
        same_seq = self.key_seq[None, :] == self.row_seq[starts][:, None]
        allowed = [same_seq & (self.key_pos[None, :] < round_pos[:, None])]  # the target's entries before the round
        key_pos = [self.key_pos[None, :].expand(len(starts), -1)]
        for d, rows in enumerate(depth_rows):  # the draft's entries for the same round's earlier tokens
            allowed.append(rows[None, :] == starts[:, None])
            key_pos.append((self.row_pos[rows] + d)[None, :].expand(len(starts), -1))
        allowed.append(torch.eye(len(starts), dtype=torch.bool, device=self.device))  # its own entry
        key_pos.append(query_pos[:, None].expand(-1, len(starts)))
        depth_rows.append(starts)
        allowed_all = torch.cat(allowed, dim=1)  # [B, keys]
        masks = {}
        for window in {tables.windows[i] for i in rest}:
            mask = allowed_all
            if window is not None:
                mask = mask & (query_pos[:, None] - torch.cat(key_pos, dim=1) < window)
            masks[window] = _as_mask(mask, tables)
        rotary = {kind: tuple(t[:, query_pos] for t in table) for kind, table in tables.rotary.items()}
        for i in rest:
            hidden = tables.call(
                self.parts.layers[i],
                hidden,
                mask=masks[tables.windows[i]],
                position_embeddings=rotary.get(tables.rotary_kinds[i]),
                position_ids=query_pos[None],
                cache=cache,
            )
        return hidden

    def evaluate(self, layers: Sequence[int], *, source: str = "") -> Candidate:
        """Score a layer set (memoised): agreement, then the best policy by simulated speedup."""
        layers = self.check_layers(layers)
        if layers in self.results:
            return self.results[layers]
        agreement = self.agreement(layers)
        cost = self.cost_model
        s = DraftPlan(layers=layers).exact_prefix(self.num_layers)
        step = cost.draft_step(len(layers))
        table = cost.table(len(layers))

        best_policy, best = None, None
        for policy in self.policies:
            sim = simulate(agreement, policy, limits=self.limits, costs=table, exact_prefix=s,
                           prompt_lengths=self.prompt_lengths)
            if best is None or sim.speedup > best.speedup + 1e-9:
                best_policy, best = policy, sim
        alpha = agreement.alpha
        iid_best, iid_k = max(
            (iid_speedup(alpha, k, draft_step=step, verify=cost.verify(k, s)), k)
            for k in range(1, cost.max_draft_length + 1)
        )
        candidate = Candidate(layers, self.num_layers, alpha, step, s, best_policy, best, iid_best, iid_k, source)
        self.results[layers] = candidate
        return candidate

    def simulate(self, layers: Sequence[int], policy: Policy, *, sequences: Sequence[int] | None = None) -> Simulation:
        """One policy's simulation for a layer set, optionally on a subset of the calibration sequences."""
        layers = self.check_layers(layers)
        agreement = self.agreement(layers)
        limits, prompt_lengths = self.limits, self.prompt_lengths
        if sequences is not None:
            agreement = agreement.subset(sequences)
            limits, prompt_lengths = [limits[i] for i in sequences], [prompt_lengths[i] for i in sequences]
        s = DraftPlan(layers=layers).exact_prefix(self.num_layers)
        return simulate(agreement, policy, limits=limits, costs=self.cost_model.table(len(layers)), exact_prefix=s,
                        prompt_lengths=prompt_lengths)

    @property
    def evaluated(self) -> list[Candidate]:
        """All candidates scored so far, best proxy speedup first."""
        return sorted(self.results.values(), key=lambda c: (-c.speedup, -c.alpha, len(c.layers)))
