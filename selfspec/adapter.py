"""One architecture family's adapter: where a model's parts live and how a layer is called.

An adapter is a small declarative TOML file in `adapters/` (shipped in the
wheel as `selfspec/adapters/`; `adapters/README.md` documents every key).
This module reads one into an `Adapter` and binds it to a model as
`ModelParts` (`parts.py`): the modules found by attribute path, what to read
from the config (sliding windows, layer types, the final-logit soft cap) and
the layer calling convention. Family quirks are named options of the
adapter, each handled by one mechanism in `runner.py` or `layer_call.py`,
never by a family name in the decode loop; a config the adapter was not
written for (`requires`) is refused with a clear error.

Which adapter fits a model is the registry's decision (`registry.py`). This
module does not know how to run a layer or what a plan means, and never
modifies the model.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from .layer_call import layer_call
from .parts import ModelParts, text_config
from .plan import DraftPlan

ADDING_AN_ADAPTER = (
    "To add one, copy adapters/llama.toml to adapters/<family>.toml, list the model_type "
    "and point the module paths at the model's parts (see adapters/README.md)."
)

# Rotary types whose frequencies depend on the length of the current forward pass
# (transformers' `dynamic_rope_update`): a precomputed table cannot reproduce them.
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")
# Attention implementations whose masks the runner builds (bool for sdpa, additive for eager).
SUPPORTED_ATTENTION = ("sdpa", "eager")

_SECTIONS = {
    "modules": {"embed", "layers", "norm", "lm_head", "rotary", "position_embed"},
    "call": {"layer_call", "rotary_per_layer_type"},
    "attention": {"sliding_window", "layer_types"},
    "logits": {"softcap"},
}
_TOP_LEVEL = {"name", "model_types", "default_plan", "tuned_plans", "requires", *_SECTIONS}


@dataclass(frozen=True)
class Adapter:
    """One architecture family, as declared in its TOML file."""

    name: str
    model_types: tuple[str, ...]
    embed: str
    layers: str
    norm: str
    lm_head: str
    rotary: str | None = None
    position_embed: str | None = None
    layer_call: str = "decoder_layer"
    rotary_per_layer_type: bool = False
    sliding_window_attr: str | None = None
    layer_types_attr: str | None = None
    softcap_attr: str | None = None
    requires: tuple[tuple[str, Any], ...] = ()
    default_plan: dict[str, Any] = field(default_factory=dict)
    tuned_plans: tuple[dict[str, Any], ...] = ()
    source: str = ""

    @classmethod
    def from_toml(cls, path: Path) -> "Adapter":
        with open(path, "rb") as f:
            data = tomllib.load(f)
        unknown = sorted(set(data) - _TOP_LEVEL) + sorted(
            f"{section}.{key}"
            for section, keys in _SECTIONS.items()
            for key in data.get(section, {})
            if key not in keys
        )
        if unknown:
            raise ValueError(f"adapter file {path} has unknown key(s) {unknown}; see adapters/README.md")
        modules = data.get("modules", {})
        call = data.get("call", {})
        attention = data.get("attention", {})
        try:
            return cls(
                name=data["name"],
                model_types=tuple(data["model_types"]),
                embed=modules["embed"],
                layers=modules["layers"],
                norm=modules["norm"],
                lm_head=modules["lm_head"],
                rotary=modules.get("rotary"),
                position_embed=modules.get("position_embed"),
                layer_call=call.get("layer_call", "decoder_layer"),
                rotary_per_layer_type=bool(call.get("rotary_per_layer_type", False)),
                sliding_window_attr=attention.get("sliding_window"),
                layer_types_attr=attention.get("layer_types"),
                softcap_attr=data.get("logits", {}).get("softcap"),
                requires=tuple(sorted(data.get("requires", {}).items())),
                default_plan=data.get("default_plan", {}),
                tuned_plans=tuple(data.get("tuned_plans", [])),
                source=str(path),
            )
        except KeyError as missing:
            raise ValueError(f"adapter file {path} lacks the required key {missing}") from None

    def bind(self, model: nn.Module) -> "ModelParts":
        """Find this adapter's parts on `model` and read the layout it declares from the config."""

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

        config = text_config(model.config)
        self.check_config(config)
        layers = get(self.layers)
        num_layers = len(layers)
        kinds = self._layer_types(config, num_layers)
        softcap = getattr(config, self.softcap_attr, None) if self.softcap_attr else None
        return ModelParts(
            embed=get(self.embed),
            layers=layers,
            norm=get(self.norm),
            lm_head=get(self.lm_head),
            rotary=get(self.rotary) if self.rotary else None,
            position_embed=get(self.position_embed) if self.position_embed else None,
            rotary_kinds=tuple(kinds) if self.rotary_per_layer_type else (None,) * num_layers,
            windows=tuple(self._windows(config, kinds, num_layers)),
            logit_softcap=float(softcap) if softcap else None,
            attn_implementation=getattr(config, "_attn_implementation", None) or "sdpa",
            layer_call=layer_call(self.layer_call),
        )

    def check_config(self, config: Any) -> None:
        """Refuse configs this adapter cannot reproduce exactly, naming the value and what is supported."""
        for key, wanted in self.requires:
            value = getattr(config, key, None)
            if value != wanted:
                raise ValueError(
                    f"adapter {self.name!r} supports {key}={wanted!r} only, but this model has {key}={value!r}"
                )
        attn = getattr(config, "_attn_implementation", None) or "sdpa"
        if attn not in SUPPORTED_ATTENTION:
            raise ValueError(
                f"attention implementation {attn!r} is not supported by selfspec (valid: {', '.join(SUPPORTED_ATTENTION)}); "
                f"load the model with attn_implementation='sdpa' (or 'eager' where sdpa is not supported)"
            )
        for rope_type in _rope_types(config):
            if rope_type in LENGTH_DEPENDENT_ROPE:
                raise ValueError(
                    f"rope_type={rope_type!r} recomputes its frequencies from the length of every forward pass, "
                    f"which selfspec's precomputed rotary table does not reproduce (unsupported: "
                    f"{', '.join(LENGTH_DEPENDENT_ROPE)}; static types such as 'default', 'linear', 'llama3', 'yarn' work)"
                )

    def _layer_types(self, config: Any, num_layers: int) -> list[str | None]:
        if self.layer_types_attr is None:
            return [None] * num_layers
        kinds = getattr(config, self.layer_types_attr, None)
        if kinds is None:
            return [None] * num_layers
        if len(kinds) < num_layers:
            raise ValueError(
                f"config.{self.layer_types_attr} lists {len(kinds)} layer types for {num_layers} layers"
            )
        return list(kinds[:num_layers])

    def _windows(self, config: Any, kinds: list[str | None], num_layers: int) -> list[int | None]:
        """Per layer: the sliding-window length (a key is visible iff query - key < window), or None."""
        window = getattr(config, self.sliding_window_attr, None) if self.sliding_window_attr else None
        if window is None:
            return [None] * num_layers
        if all(kind is None for kind in kinds):
            return [int(window)] * num_layers  # one window for every layer (Mistral, Phi-3)
        return [int(window) if kind == "sliding_attention" else None for kind in kinds]

    def plan_for(self, config: Any) -> DraftPlan:
        """The tuned plan whose `match` fits `config`, else an auto plan (`DraftPlan.auto_plan`)."""
        config = text_config(config)
        for tuned in self.tuned_plans:
            match = tuned.get("match", {})
            if all(getattr(config, key, None) == value for key, value in match.items()):
                fields = {k: v for k, v in tuned.items() if k not in ("match", "command")}
                return DraftPlan.from_dict(fields)
        return DraftPlan.auto_plan(name=f"{self.name}-auto")

    def rule_plan(self, config: Any) -> DraftPlan:
        """The adapter's rule-of-thumb plan (`default_plan`: an early exit at a fraction of the layers), the
        default before auto plans; kept to compare with."""
        num_layers = text_config(config).num_hidden_layers
        rule = dict(self.default_plan)
        fraction = rule.pop("exit_fraction", 0.5)
        exit_layer = min(max(1, round(fraction * num_layers)), num_layers)
        return DraftPlan(exit_layer=exit_layer, name=f"{self.name}-default", **rule)


def _rope_types(config: Any) -> list[str]:
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict):
        return []
    if "rope_type" in params:
        return [params["rope_type"]]
    # One set of parameters per layer type (Gemma 3).
    return [p["rope_type"] for p in params.values() if isinstance(p, dict) and "rope_type" in p]
