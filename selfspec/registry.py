"""Which adapter fits a model: the adapter files shipped with selfspec, then the checked generic one.

`adapter_for(model)` picks the adapter whose `model_types` lists the model's
`config.model_type`. A model with no adapter file but the common decoder
layout may run through the generic adapter (`generic.py`), and only after its
self-check passes (with a warning); otherwise the error lists the supported
types and says how to add an adapter.

This module sits above the runner and the passes (the generic self-check runs
them); nothing in the engine's lower modules imports it.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

from torch import nn

from .adapter import ADDING_AN_ADAPTER, Adapter
from .generic import GENERIC, GenericAdapterWarning, generic_problem
from .parts import ModelParts


def adapter_dirs() -> list[Path]:
    """Where adapter files live: inside the installed package, or in the source tree."""
    here = Path(__file__).resolve().parent
    return [d for d in (here / "adapters", here.parent / "adapters") if d.is_dir()]


@functools.cache
def all_adapters() -> tuple[Adapter, ...]:
    found: dict[str, Adapter] = {}
    for folder in adapter_dirs():
        for path in sorted(folder.glob("*.toml")):
            adapter = Adapter.from_toml(path)
            found.setdefault(adapter.name, adapter)
    return tuple(found.values())


def supported_model_types() -> list[str]:
    return sorted(t for a in all_adapters() for t in a.model_types)


def unsupported_message(model: nn.Module, reason: str = "") -> str:
    """The error for a model no adapter fits: its type, the supported types, and how to add one."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    because = f" {reason}" if reason else ""
    return (
        f"unsupported architecture: model_type={model_type!r} ({type(model).__name__}) has no selfspec adapter.{because} "
        f"Supported model types: {', '.join(supported_model_types())}. {ADDING_AN_ADAPTER}"
    )


def adapter_for(model: nn.Module) -> Adapter:
    """The adapter for `model`'s architecture.

    A `model_type` without an adapter gets the generic decoder adapter only when
    the model has the common layout and passes the generic self-check (with a
    warning saying so); otherwise a ValueError lists the supported types and
    says how to add one.
    """
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    for adapter in all_adapters():
        if model_type in adapter.model_types:
            return adapter
    problem, detail = generic_problem(model)
    if problem is not None:
        raise ValueError(unsupported_message(model, problem))
    where = adapter_dirs()[0] if adapter_dirs() else "adapters"
    warnings.warn(
        f"selfspec: model_type={model_type!r} has no adapter; using the generic decoder adapter "
        f"(model.embed_tokens, model.layers, model.norm, lm_head), which passed its self-check ({detail}). "
        f"To make this explicit, add {model_type!r} to the model_types of the matching file in {where}/ "
        f"or add a new adapter file (see adapters/README.md).",
        GenericAdapterWarning,
        stacklevel=4,  # the caller of selfspec.wrap
    )
    return GENERIC


def model_parts(model: nn.Module) -> ModelParts:
    """`model`'s parts through its adapter (what `wrap(model).parts` holds)."""
    return adapter_for(model).bind(model)
