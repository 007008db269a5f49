"""Per-architecture adapters: where a model's parts live and how a layer is called.

An adapter is a small declarative TOML file in `adapters/` (shipped inside the
wheel as `selfspec/adapters/`). This module reads those files, picks the one
whose `model_types` contains the model's `config.model_type`, and binds it to a
model as `ModelParts` (the embedding, the layer list, the final norm, the LM
head and the rotary embedding, found by attribute path).

It does not know how to run a layer (see `layer_call.py`) nor what a plan
means (see `plan.py`). It never modifies the model.
"""

from __future__ import annotations

import functools
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .plan import DraftPlan

ADDING_AN_ADAPTER = (
    "To add one, copy adapters/llama.toml to adapters/<family>.toml, list the model_type "
    "and point the module paths at the model's parts (see adapters/README.md)."
)


@dataclass(frozen=True)
class Adapter:
    """One architecture family, as declared in its TOML file."""

    name: str
    model_types: tuple[str, ...]
    embed: str
    layers: str
    norm: str
    lm_head: str
    rotary: str | None
    layer_call: str
    default_plan: dict[str, Any] = field(default_factory=dict)
    tuned_plans: tuple[dict[str, Any], ...] = ()
    source: str = ""

    @classmethod
    def from_toml(cls, path: Path) -> "Adapter":
        with open(path, "rb") as f:
            data = tomllib.load(f)
        modules = data.get("modules", {})
        try:
            return cls(
                name=data["name"],
                model_types=tuple(data["model_types"]),
                embed=modules["embed"],
                layers=modules["layers"],
                norm=modules["norm"],
                lm_head=modules["lm_head"],
                rotary=modules.get("rotary"),
                layer_call=data.get("call", {}).get("layer_call", "decoder_layer"),
                default_plan=data.get("default_plan", {}),
                tuned_plans=tuple(data.get("tuned_plans", [])),
                source=str(path),
            )
        except KeyError as missing:
            raise ValueError(f"adapter file {path} lacks the required key {missing}") from None

    def bind(self, model: nn.Module) -> "ModelParts":
        """Find this adapter's parts on `model`."""
        def get(path: str) -> Any:
            obj: Any = model
            for attr in path.split("."):
                if not hasattr(obj, attr):
                    raise ValueError(
                        f"adapter {self.name!r} ({self.source}) expects module {path!r} "
                        f"but {type(model).__name__} has no {attr!r} there"
                    )
                obj = getattr(obj, attr)
            return obj

        return ModelParts(
            embed=get(self.embed),
            layers=get(self.layers),
            norm=get(self.norm),
            lm_head=get(self.lm_head),
            rotary=get(self.rotary) if self.rotary else None,
        )

    def plan_for(self, config: Any) -> DraftPlan:
        """The tuned plan whose `match` fits `config`, else the default rule."""
        num_layers = config.num_hidden_layers
        for tuned in self.tuned_plans:
            match = tuned.get("match", {})
            if all(getattr(config, key, None) == value for key, value in match.items()):
                fields = {k: v for k, v in tuned.items() if k not in ("match", "command")}
                return DraftPlan.from_dict(fields)
        rule = dict(self.default_plan)
        fraction = rule.pop("exit_fraction", 0.5)
        exit_layer = min(max(1, round(fraction * num_layers)), num_layers)
        return DraftPlan(exit_layer=exit_layer, name=f"{self.name}-default", **rule)


@dataclass(frozen=True)
class ModelParts:
    """The modules of one model that the engine calls, found through an adapter."""

    embed: nn.Module
    layers: nn.ModuleList
    norm: nn.Module
    lm_head: nn.Module
    rotary: nn.Module | None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.lm_head.parameters()).dtype


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


def adapter_for(model: nn.Module) -> Adapter:
    """The adapter for `model`'s architecture, or a ValueError that says how to add one."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    for adapter in all_adapters():
        if model_type in adapter.model_types:
            return adapter
    raise ValueError(
        f"unsupported architecture: model_type={model_type!r} ({type(model).__name__}) has no selfspec adapter. "
        f"Supported model types: {', '.join(supported_model_types())}. {ADDING_AN_ADAPTER}"
    )
