"""The cost tables (`costs.py`) of one wrapped model: their keys on disk, and the tables its rounds refine.

A table's key holds what its times depend on: the model, dtype, device,
threads, processor, the step's shapes, a quantization and the CPU kernels
the passes ran with; not the plan, whose verify passes are every plan's (a
plan's draft step is keyed apart, and batched passes by their row count).
`CostTables` loads a table or has it measured, keeps one per thread count
and device in memory, and writes what the rounds refined beside the measured
table, never over it: a reproducible wrapper reads the measured one alone.
A profile handed in (`handed_costs`) prices a draft by the weights it reads.

It does not time a pass itself (`plan_costs` hands `costs.py` the wrapper's
runners) and does not decide anything from a table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from .artifacts import model_identity
from .offload import describe_layers
from .auto_layers import layer_weights
from .batch_runner import measure_batch_costs
from .costs import (PassCosts, RuntimeCosts, cache_key, costs_cache_dir, load_costs, load_or_measure, machine_description,
                    measure_pass_costs, save_costs)
from .draft import Drafter
from .head import ExitHead
from .kernel_choice import KernelChoice
from .heap import give_back_freed
from .memory import parameter_bytes, tensor_bytes
from .parts import ModelParts
from .vocab import DraftVocab


class CostTables:
    """Keys and in-memory tables for one wrapped model, its step, its plan (`plan_name`) and its kernels."""

    def __init__(self, model, parts: ModelParts, *, kernels: KernelChoice, quantization: str | None, step: str,
                 plan_name: str, draft_layers: bool, offloaded: tuple[int, ...] = ()) -> None:
        self.model, self.parts, self.kernels = model, parts, kernels
        self.offloaded = offloaded  # layers whose weights load every pass (`offload.py`)
        self.quantization, self.step, self.plan_name, self.draft_layers = quantization, step, plan_name, draft_layers
        self.measured: dict[tuple, RuntimeCosts] = {}  # by (threads, device): a table, refined by the rounds
        self.batch: dict[tuple, RuntimeCosts] = {}  # by (threads, device, rows): batched passes (`batch.py`)

    def key(self, **extra) -> str:
        """The disk cache's key: the model, dtype, device, threads, processor and kernels (and `extra`): not the
        plan, whose verify passes are every plan's (a plan's draft step is keyed apart, `draft_key`)."""
        device = self.parts.device
        # A quantized model's passes cost other times than its float twin's (same dtype, same identity).
        weights = {} if self.quantization is None else {"quantization": self.quantization}
        step = {} if self.step == "eager" else {"step": self.step}  # other shapes, other costs
        # Offloaded layers load their weights every pass: a verify over 16 tokens may cost what 1 does.
        placement = {"offloaded": describe_layers(self.offloaded)} if self.offloaded else {}
        if self.offloaded and self.parts.stream:  # selfspec loads them itself (`streaming.py`): other costs
            placement["streamed"] = describe_layers(tuple(self.parts.stream.order))
        return cache_key(
            **weights,
            **step,
            **placement,
            model=model_identity(self.model, self.parts),
            dtype=str(self.parts.dtype),
            device=str(device),
            threads=torch.get_num_threads(),
            machine=machine_description(device),
            linear=self.kernels.linear().to_dict(),  # the kernels the passes ran with
            attention=self.kernels.attention().to_dict(),
            **extra,
        )

    def draft_key(self, **extra) -> str:
        """The disk cache's key for the plan's draft step (`PassCosts.draft_only`)."""
        return self.key(draft=self.plan_name, **extra)

    def load_or_measure(self, measure: Callable[..., PassCosts], *, max_width: int, cached: bool = True,
                        refined: bool = False) -> PassCosts:
        """The passes up to `max_width` tokens and the plan's draft step: read from disk, else `measure(draft=...)`.

        The passes are the model's and the machine's: one table for every plan
        (their draft keys it apart), timed for the widest plan that asked so
        far; a wider one keeps the widths timed before (`PassCosts.merged_into`),
        so a narrower plan's table does not change. `cached=False` measures
        afresh and replaces the cached tables, dropping their refinements.
        `refined`: as the rounds refined them, where they did (`save_refined`).
        """
        folder = costs_cache_dir()
        timed = load_costs(folder, self.key()) if cached else None
        if timed is None or timed.max_width < max_width:
            fresh = trimmed(measure, draft=False)
            if timed is not None:  # the widths timed before stay as they were; the wider ones join in their shape
                merged = timed.merged_into(fresh)
                fresh = fresh if merged.max_width < max_width else dataclasses.replace(
                    merged, source=fresh.source, measure_seconds=fresh.measure_seconds)
            save_costs(folder, self.key(), fresh)
            timed = fresh
            if not cached:
                self._drop(folder, self.key(refined=True))
        if refined:
            better = load_costs(folder, self.key(refined=True))
            timed = better if better is not None and better.max_width >= max_width else timed
        passes = timed.up_to(max_width)
        if not self.draft_layers:
            return passes
        draft = load_or_measure(folder, self.draft_key(), lambda: trimmed(measure, draft=True),
                                usable=lambda _: cached)
        if not cached:
            self._drop(folder, self.draft_key(refined=True))
        if refined:
            draft = load_costs(folder, self.draft_key(refined=True)) or draft
        return passes.with_draft(draft)

    @staticmethod
    def _drop(folder, key: str) -> None:
        if folder is not None:
            (folder / f"{key}.json").unlink(missing_ok=True)

    def forget(self) -> None:
        """Drop the tables held in memory: the next generation reads them from disk (or measures) again."""
        self.measured.clear()

    def runtime(self, measure: Callable[[], PassCosts]) -> RuntimeCosts:
        """The table the rounds start from and refine: `measure()` once per thread count and device."""
        key = (torch.get_num_threads(), str(self.parts.device))
        if key not in self.measured:
            self.measured[key] = RuntimeCosts(measure())
        return self.measured[key]

    def save_refined(self, costs: RuntimeCosts) -> None:
        """What the rounds measured, for the next process that refines to start from: kept beside the measured
        tables (which a reproducible wrapper reads alone), not over them."""
        refined, folder = costs.refined(), costs_cache_dir()
        # A wider plan's widths beyond this one's are kept: the widest of the refined and the measured table.
        tables = [t for t in (load_costs(folder, self.key(refined=True)), load_costs(folder, self.key())) if t]
        timed = max(tables, key=lambda t: t.max_width, default=None)
        passes = refined.passes_only()
        save_costs(folder, self.key(refined=True), passes if timed is None else passes.merged_into(timed))
        if self.draft_layers and refined.draft_step:
            save_costs(folder, self.draft_key(refined=True), refined.draft_only())

    def batch_costs(self, rows: int, learn: bool, *, injected: PassCosts | None, width: int,
                    draft_layers: tuple[int, ...] = (), draft: str = "", head=None, vocab=None) -> RuntimeCosts:
        """What a pass over `rows` rows of up to `width` tokens, and a draft step through `draft_layers` (the plan
        `draft` describes) over them, cost here: measured once per row count (and cached on disk); `injected`, a
        table handed in, prices each row's share as one sequence's pass."""
        if injected is not None:
            return RuntimeCosts(dataclasses.replace(injected, verify=tuple(t * rows for t in injected.verify),
                                                    draft_step=injected.draft_step * rows), learn=False)
        key = (torch.get_num_threads(), str(self.parts.device), rows)
        if key not in self.batch:
            drafted = {"draft": draft} if draft_layers else {}
            table = load_or_measure(costs_cache_dir(), self.key(batch_rows=rows, batch_width=width, **drafted),
                                    lambda: trimmed(measure_batch_costs, self.parts, rows=rows, max_width=width,
                                                    draft_layers=draft_layers, head=head, vocab=vocab))
            self.batch[key] = RuntimeCosts(table)
        runtime = self.batch[key]
        return runtime if learn else RuntimeCosts(runtime.table, learn=False)


def trimmed(measure: Callable[..., PassCosts], *args, **kwargs) -> PassCosts:
    """`measure(...)`, then the memory its scratch caches (up to a long context) held handed back to the system:
    freed, it would otherwise stay in the process's heap for good (`heap.give_back_freed`)."""
    try:
        return measure(*args, **kwargs)
    finally:
        give_back_freed()


def plan_costs(spec, *, refined: bool, cached: bool = True, repeats: int = 3) -> PassCosts:
    """The table of the passes the wrapper `spec`'s plan runs (`refined`: as earlier rounds refined it, where they
    did): read from disk, or timed on runners of the wrapper's step (`costs.measure_pass_costs`)."""
    parts, drafter = spec.parts, spec.drafter

    def draft_step(runner, position: int) -> None:
        logits = drafter.step(runner, 0, position)  # [1, vocab]
        float(torch.softmax(logits[0], dim=-1).max())  # the confidence the policy reads

    def measure(*, draft: bool) -> PassCosts:
        if draft and spec.plan.auto:  # an auto plan's draft times its reference set (`auto_layers.py` scales)
            drafter.set_layers(spec.plan.draft_layers(parts.num_layers))
        with spec.kernels():
            return measure_pass_costs(lambda capacity: spec.runner_for(capacity, keep=False),
                                      draft_step if draft else None, num_layers=parts.num_layers,
                                      vocab_size=parts.vocab_size, max_width=spec.max_width, repeats=repeats,
                                      bucketed=spec.step != "eager",  # the static step pads a pass to its bucket
                                      max_positions=parts.max_positions, draft_only=draft)

    return spec.cost_tables.load_or_measure(measure, max_width=spec.max_width, cached=cached, refined=refined)


def handed_costs(costs: PassCosts | str | None, *, max_width: int, num_layers: int,
                 draft_fraction: Callable[[], float]) -> PassCosts | None:
    """The table `wrap(costs=...)` hands in: None (measure here), a `PassCosts`, or a profile's, its draft priced
    at `draft_fraction()` of a plain step."""
    if costs is None or isinstance(costs, PassCosts):
        return costs
    if isinstance(costs, str):
        return PassCosts.profile(costs, max_width=max_width, num_layers=num_layers, draft_fraction=draft_fraction())
    raise ValueError(f"costs must be None, a PassCosts table or a profile name ('linear', 'flat'), got {costs!r}")


def draft_read_fraction(parts: ModelParts, drafter: Drafter, *, head: ExitHead | None,
                        vocab: DraftVocab | None) -> float:
    """The weights one drafted token reads, in plain steps: its layers (an exit head's included) and the LM
    head, or the draft vocabulary's rows (a profile's draft price: where a pass costs what it reads).

    A model whose LM head is most of a plain step's weights reads far more than half a step in half its layers.
    """
    if not drafter.has_layers:
        return 0.0  # n-gram and recycled drafts run nothing
    layers, head_bytes = layer_weights(parts)  # bytes per layer; the LM head with the final norm
    plain = sum(layers) + head_bytes
    if head is not None:
        layers.append(float(parameter_bytes([head])))
    drafted = sum(layers[i] for i in (*drafter.prefix_layers, *drafter.other_layers))
    rows = head_bytes if vocab is None else float(tensor_bytes(vocab.weight))
    return (drafted + rows) / plain
