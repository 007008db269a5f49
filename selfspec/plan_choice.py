"""Which plan a wrapper runs, and the head it loads: what `wrap(plan=...)` accepts, resolved.

`as_plan` turns what `wrap` was given (a `DraftPlan`, a dict, a path, "auto"
or None) into a `DraftPlan`: None is the adapter's plan for this model, or
drafting from resident weights when layers are offloaded.
`warn_offloaded_draft` says when a plan drafts through offloaded layers.
`load_any_head` loads the plan's head, a feature head or an exit head, as its
manifest says.

It does not validate a plan against the model's layers (`draft.Drafter`).
"""

from __future__ import annotations

import os
import warnings

from .adapter import Adapter
from .feature_head import artifact_kind, load_feature_head
from .head import load_head
from .offload import describe_layers
from .plan import DraftPlan


def as_plan(plan, adapter: Adapter, config, offloaded: tuple[int, ...] = ()) -> DraftPlan:
    if plan is None and offloaded:  # draft from resident weights only: every offloaded layer a draft ran is a load
        return DraftPlan.resident_plan()
    if plan is None:
        return adapter.plan_for(config)
    if isinstance(plan, DraftPlan):
        return plan
    if isinstance(plan, dict):
        return DraftPlan.from_dict(plan)
    if isinstance(plan, str) and plan == "auto":
        return DraftPlan.auto_plan()
    if isinstance(plan, (str, os.PathLike)):
        return DraftPlan.load(plan)
    raise ValueError(f"plan must be a DraftPlan, a dict, \"auto\", a path to a plan JSON file or None, "
                     f"got {type(plan).__name__}")


def warn_offloaded_draft(plan: DraftPlan, offloaded: tuple[int, ...], num_layers: int) -> None:
    """Warn when a plan's draft runs offloaded layers: each draft step then loads their weights."""
    if not offloaded or not plan.drafts or plan.head is not None and plan.exit_layer is None:
        return
    runs = set(range(num_layers)) if plan.auto else set(plan.draft_layers(num_layers))
    through = tuple(sorted(runs & set(offloaded)))
    if through:
        warnings.warn(f"the plan's draft runs offloaded layers ({describe_layers(through)}): "
                      f"each draft step loads their weights. Plans that draft from resident weights only: n-grams and "
                      f"recycled predictions (the default here), a feature head, or an exit before layer "
                      f"{offloaded[0]} with its head", stacklevel=4)


def load_any_head(plan: DraftPlan, *, model, parts):
    """The plan's head: a feature head when its manifest says so (the plan then names no exit), else an exit head."""
    if artifact_kind(plan.head) == "feature_head":
        if plan.exit_layer is not None:
            raise ValueError(f"the feature head {plan.head} drafts without the target's layers: drop exit_layer=")
        return load_feature_head(plan.head, model=model, parts=parts)
    if plan.exit_layer is None:
        raise ValueError(f"head={plan.head!r} needs exit_layer=E, the exit the head was trained for")
    return load_head(plan.head, model=model, parts=parts)
