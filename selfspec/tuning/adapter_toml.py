"""A tuned plan as a `[[tuned_plans]]` entry for an adapter file (TOML).

It writes the entry for a plan and a model config; it does not read adapter
files or decide which plan goes in.
"""

from __future__ import annotations

import json
import math
from typing import Any

from ..parts import text_config
from ..plan import DraftPlan


def adapter_entry(plan: DraftPlan, config, *, command: str) -> str:
    """A `[[tuned_plans]]` TOML entry for an adapter file, matching this model's shape."""
    keys = ("num_hidden_layers", "hidden_size", "intermediate_size", "vocab_size")
    config = text_config(config)
    match = ", ".join(f"{k} = {getattr(config, k)}" for k in keys if isinstance(getattr(config, k, None), int))
    lines = ["[[tuned_plans]]", f"match = {{ {match} }}", f"command = {json.dumps(command)}"]
    for key, value in plan.to_dict().items():
        if key == "format" or value is None:
            continue
        lines.append(f"{key} = {_toml_value(value)}")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value) if not isinstance(value, float) or math.isfinite(value) else "nan"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value))
