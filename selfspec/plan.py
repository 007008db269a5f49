"""Draft plans: which layers the draft runs and how many tokens it proposes.

A `DraftPlan` is frozen data. It can be compared, hashed, saved to JSON and
loaded back. It knows nothing about a particular model until `draft_layers`
checks it against a layer count; the engine calls that once, at `wrap` time,
so a bad plan fails before any generation starts.

Every field is read by the draft or by the draft-length policy the plan
names (`policy.py`); a plan that sets a field its policy ignores is refused
(`ignored_fields`), so a plan never carries a setting that does nothing.
What each field means is in `DraftPlan`'s docstring. This module does not
run a model or decide draft lengths.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

PLAN_FORMAT = "selfspec.plan/1"
MAX_DRAFT_LENGTH = 64
MAX_NGRAM = 16
POLICIES = ("cost", "fixed")  # see `policy.py`


@dataclass(frozen=True)
class DraftPlan:
    """Which layers the draft runs, and the draft-length policy.

    Three ways to name the draft's layers (give at most one):

    - `exit_layer=E`: early exit, the draft runs layers 0..E-1, then the final norm
      and the LM head;
    - `layers=[...]`: the draft runs these layers, in increasing order;
    - `auto=True` (`DraftPlan.auto_plan()`, `wrap(model, plan="auto")`): the layers are
      chosen per context while generating (`auto_layers.py`), with no offline
      tuning; it needs `policy="cost"` (the choice weighs acceptance against cost).

    The draft-length policy: at most `draft_length` tokens per round (k_max).
    `policy="cost"` (the default) drafts, each round, the length 0..k_max that
    maximises expected tokens per second on this machine: measured pass costs
    and acceptance learned online (`policy.py`, `costs.py`); `target_acceptance`
    is its prior acceptance, and it reads no other policy field. `policy="fixed"`
    drafts what the plan says: k_max tokens, or with `adaptive=True` until a
    token whose draft probability is under a confidence threshold; the threshold
    starts at `threshold` and moves by `threshold_step` after each round so that
    the observed acceptance rate tracks `target_acceptance` (the rule of Draft &
    Verify, Zhang et al. 2023). A field the named policy ignores must keep its
    default (`ignored_fields`): a value equal to the default is accepted, so plan
    files saved with every field still load, and `to_dict` leaves such fields out.

    `ngram=N` adds n-gram proposals (prompt lookup): when the last n <= N tokens
    occurred earlier in the sequence, the draft is what followed them, at no model
    cost; otherwise the plan's layers draft. With `ngram` set, the layers may be
    left out (then a round without a match is a plain step).

    `tree=N` lets a round verify a token tree of up to N nodes instead of a chain
    (`tree.py`): several n-gram continuations, or a layer draft grown level by
    level over its likeliest nodes, so that it branches where the draft is
    unsure (the eager step). The cost policy adds branches only while the wider
    pass costs about what the chain's does. `recycle=True` (with `tree`) also
    grows trees from the target's own past predictions (`recycle.py`, Token
    Recycling): a free draft, sized by the cost policy, tried after an n-gram
    match and before the layers (the eager step).

    Two optional artifacts make the layer draft better or cheaper (each a path
    to a manifest, resolved against the plan file's folder when loaded from one):

    - `head=PATH`: a trained exit head (`head.py`) run after layer E-1, with
      `exit_layer=E`, the exit it was trained for; or a feature head
      (`feature_head.py`), which drafts from the target's states alone (no
      `layers` or `exit_layer`);
    - `draft_vocab=PATH`, `draft_vocab_size=K`: the draft scores only the K most
      frequent tokens of a counted vocabulary (`vocab.py`; K=0: every counted
      token). The target still verifies over the full vocabulary.

    `draft_length=0` turns drafting off: the engine then runs its own plain path,
    one full forward pass per token, which is the baseline every plan is measured
    against.
    """

    layers: tuple[int, ...] | None = None
    exit_layer: int | None = None
    draft_length: int = 4
    adaptive: bool = False
    threshold: float = 0.5
    target_acceptance: float = 0.8
    threshold_step: float = 0.05
    ngram: int = 0
    head: str | None = None
    draft_vocab: str | None = None
    draft_vocab_size: int = 0
    name: str = ""
    policy: str = "cost"
    tree: int = 0  # most nodes a drafted token tree may hold (0: chains only); see `tree.py` and `draft.py`
    auto: bool = False  # the draft's layers are chosen per context while generating (`auto_layers.py`)
    recycle: bool = False  # trees also grow from the target's own past predictions (`recycle.py`); needs `tree`

    def __post_init__(self) -> None:
        # One strict rule for every field: the type it names (ints are ints, never bools, floats or strings).
        if self.layers is not None:
            if not isinstance(self.layers, (list, tuple)):
                raise ValueError(f"layers must be a list of layer indices, got {self.layers!r}")
            for i in self.layers:
                if not _is_int(i):
                    raise ValueError(f"layers must hold integer layer indices, got {i!r} in {list(self.layers)!r}")
            object.__setattr__(self, "layers", tuple(int(i) for i in self.layers))
        if self.exit_layer is not None:
            if not _is_int(self.exit_layer):
                raise ValueError(f"exit_layer must be an integer, got {self.exit_layer!r}")
            object.__setattr__(self, "exit_layer", int(self.exit_layer))
        _check_int("draft_length", self.draft_length, 0, MAX_DRAFT_LENGTH)
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"adaptive must be true or false, got {self.adaptive!r}")
        for field in ("threshold", "target_acceptance", "threshold_step"):
            _check_unit_interval(field, getattr(self, field))
        _check_int("ngram", self.ngram, 0, MAX_NGRAM)
        _check_int("tree", self.tree, 0, MAX_DRAFT_LENGTH)
        if self.policy not in POLICIES:
            raise ValueError(f"policy={self.policy!r} is not a draft-length policy (valid: {', '.join(POLICIES)})")
        if not isinstance(self.auto, bool):
            raise ValueError(f"auto must be true or false, got {self.auto!r}")
        if not isinstance(self.recycle, bool):
            raise ValueError(f"recycle must be true or false, got {self.recycle!r}")
        if self.recycle and not self.tree:
            raise ValueError("recycle=True drafts token trees from the target's past predictions: give tree=N "
                             "(the most nodes a tree may hold), e.g. tree=16")
        if self.auto:
            named = [f for f in ("layers", "exit_layer", "head") if getattr(self, f) is not None]
            if named:
                raise ValueError(f"auto=True chooses the draft's layers itself: drop {', '.join(named)} "
                                 "(a trained head belongs to a fixed exit layer)")
            if self.policy != "cost":
                raise ValueError("auto=True needs policy='cost': it picks layers by expected tokens per second")
        _check_int("draft_vocab_size", self.draft_vocab_size, 0, None)
        for field in ("head", "draft_vocab"):
            value = getattr(self, field)
            if value is not None:
                if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
                    raise ValueError(f"{field} must be a path to a manifest (.json), got {value!r}")
                object.__setattr__(self, field, os.fspath(value))
        if not isinstance(self.name, str):
            raise ValueError(f"name must be a string, got {self.name!r}")
        if self.draft_vocab_size and self.draft_vocab is None:
            raise ValueError(
                f"draft_vocab_size={self.draft_vocab_size} needs draft_vocab=PATH, the vocabulary file it takes "
                "the most frequent tokens from"
            )
        if self.head is not None and self.layers is not None:
            raise ValueError(f"head={self.head!r} with layers=: an exit head needs exit_layer=E, the exit it was "
                             "trained for; a feature head takes neither")
        if self.layers is not None and self.exit_layer is not None:
            raise ValueError(
                f"DraftPlan takes either layers= or exit_layer=, not both "
                f"(got layers={list(self.layers)}, exit_layer={self.exit_layer})"
            )
        if self.draft_length == 0:
            return  # the plain path: which layers would draft, and how many, does not matter
        ignored = [f for f in ignored_fields(self) if getattr(self, f) != _DEFAULTS[f]]
        if ignored:
            field = ignored[0]
            raise ValueError(f"{field}={getattr(self, field)!r} does nothing under {_policy_words(self)}: "
                             f"{_IGNORED_WHY[self.policy]} Drop {', '.join(ignored)}{_IGNORED_FIX[self.policy]}")
        if self.exit_layer is not None:
            _check_int("exit_layer", self.exit_layer, 1, None)
            return
        if (not self.layers and not self.ngram and not self.auto and not self.recycle
                and (self.head is None or self.layers is not None)):
            raise ValueError(
                "empty plan: give exit_layer=E (E >= 1), a non-empty layers=[...] list or a feature head=PATH, "
                "or draft_length=0 for plain decoding"
            )
        if self.layers is None:
            return  # n-gram proposals only
        if self.layers and min(self.layers) < 0:
            raise ValueError(f"layer index {min(self.layers)} out of range: layer indices start at 0")
        duplicates = sorted({i for i in self.layers if self.layers.count(i) > 1})
        if duplicates:
            raise ValueError(f"duplicate layers in plan: {duplicates}; each layer may appear once")
        if list(self.layers) != sorted(self.layers):
            raise ValueError(
                f"plan layers must be in increasing order (the order they run in the model), got {list(self.layers)}"
            )

    # -- constructors -------------------------------------------------------------

    @classmethod
    def plain(cls) -> "DraftPlan":
        """No drafting: one full forward pass per token (the engine's plain path)."""
        return cls(draft_length=0, name="plain")

    @classmethod
    def auto_plan(cls, **overrides: Any) -> "DraftPlan":
        """`plan="auto"`: n-gram lookup and recycled predictions (as token trees where a wide verify is cheap),
        then layers chosen per context, k by measured cost. The default for a model with no tuned plan."""
        fields = {"auto": True, "ngram": 3, "tree": 16, "recycle": True, "draft_length": 8, "name": "auto",
                  **overrides}
        return cls(**fields)

    @classmethod
    def resident_plan(cls, **overrides: Any) -> "DraftPlan":
        """The default for a model with offloaded layers: n-gram lookup and recycled predictions, which read no
        layer's weights, as token trees (a wide verify costs about what a narrow one does when loading the
        offloaded weights dominates), k by measured cost."""
        fields = {"ngram": 3, "tree": 16, "recycle": True, "draft_length": 8, "name": "resident drafts", **overrides}
        return cls(**fields)

    # -- what the plan means for a model with `num_layers` layers ----------------

    @property
    def drafts(self) -> bool:
        return self.draft_length > 0

    def draft_layers(self, num_layers: int) -> tuple[int, ...]:
        """The layer indices the draft runs, checked against the model's layer count."""
        if not self.drafts:
            return ()
        if self.exit_layer is not None:
            if self.exit_layer > num_layers:
                raise ValueError(
                    f"exit_layer={self.exit_layer} out of range: this model has {num_layers} layers "
                    f"(valid: 1..{num_layers})"
                )
            return tuple(range(self.exit_layer))
        if self.auto:
            return auto_reference_layers(num_layers)
        if self.layers is None:
            return ()  # n-gram proposals only
        bad = [i for i in self.layers if i >= num_layers]
        if bad:
            raise ValueError(
                f"layer index {bad[0]} out of range: this model has {num_layers} layers "
                f"(valid: 0..{num_layers - 1})"
            )
        return self.layers

    def exact_prefix(self, num_layers: int) -> int:
        """How many leading layers (0..s-1) the draft runs exactly as the target does.

        Their cache entries and the hidden states after layer s-1 are the
        target's own, so the verify pass keeps them and resumes at layer s.
        """
        s = 0
        for i in self.draft_layers(num_layers):
            if i != s:
                break
            s += 1
        return s

    def describe(self, num_layers: int) -> str:
        if not self.drafts:
            return "plain decoding (no draft)"
        layers = self.draft_layers(num_layers)
        if self.exit_layer is not None:
            where = f"early exit after layer {self.exit_layer - 1}"
        elif self.auto:
            where = "layers chosen per context (auto)"
        elif layers:
            where = f"{len(layers)}/{num_layers} layers {list(layers)}"
        elif self.head is not None:
            where = f"feature head {os.path.basename(self.head)}"
        else:
            where = "no layer draft"
        if self.head is not None and self.exit_layer is not None:
            where += f" + trained head {os.path.basename(self.head)}"
        if self.draft_vocab is not None:
            size = self.draft_vocab_size or "all counted"
            where += f", draft vocabulary {size} from {os.path.basename(self.draft_vocab)}"
        if self.tree and (layers or self.auto or self.head is not None):
            where += " (branching where unsure)"
        if self.recycle:
            where = f"recycled predictions, then {where}"
        if self.ngram:
            tree = ", as a tree" if self.tree else ""
            where = f"n-gram lookup (n<={self.ngram}{tree}), then {where}"
        if self.tree:
            where += f"; trees of up to {self.tree} nodes"
        policy = f"k<={self.draft_length}" + (", k by measured cost" if self.policy == "cost" else "")
        if self.adaptive and self.policy == "fixed":
            policy += f", adaptive (threshold {self.threshold:g} -> acceptance {self.target_acceptance:g})"
        return f"{where}, {policy}"

    # -- serialisation ---------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The plan's fields, less those its policy ignores (they hold their defaults: see `ignored_fields`)."""
        data = dataclasses.asdict(self)
        if data["layers"] is not None:
            data["layers"] = list(data["layers"])
        for field in ignored_fields(self):
            del data[field]
        return {"format": PLAN_FORMAT, **data}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "DraftPlan":
        if not isinstance(data, dict):
            raise ValueError(f"a plan must be a JSON object of plan fields, got {type(data).__name__}: {data!r:.80}")
        data = dict(data)
        fmt = data.pop("format", PLAN_FORMAT)
        if fmt != PLAN_FORMAT:
            raise ValueError(f"unknown plan format {fmt!r}; this selfspec reads {PLAN_FORMAT!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known, key=str)
        if unknown:
            raise ValueError(f"unknown plan field(s) {unknown}; valid fields: {sorted(known)}")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "DraftPlan":
        return cls.from_dict(json.loads(text))

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> "DraftPlan":
        """Read a plan file; relative `head` / `draft_vocab` paths are taken from the plan file's folder."""
        if not os.fspath(path):
            raise ValueError("plan path is empty (valid: the path to a plan JSON file)")
        with open(path, "rb") as f:
            raw = f.read()
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"plan file {os.fspath(path)} is not valid JSON: {error}") from None
        try:
            plan = cls.from_dict(data)
        except ValueError as error:
            raise ValueError(f"plan file {os.fspath(path)}: {error}") from None
        folder = os.path.dirname(os.path.abspath(path))
        resolved = {
            field: os.path.join(folder, value)
            for field in ("head", "draft_vocab")
            if (value := getattr(plan, field)) is not None and not os.path.isabs(value)
        }
        return dataclasses.replace(plan, **resolved) if resolved else plan


def ignored_fields(plan: DraftPlan) -> tuple[str, ...]:
    """The draft-length fields the policy that runs `plan` never reads (`policy.py`); a plan must leave them at
    their defaults. A plain plan (`draft_length=0`) runs no policy, and is not checked."""
    if not plan.drafts:
        return ()
    if plan.policy == "cost":  # `CostPolicy` reads draft_length and target_acceptance (its prior)
        return ("adaptive", "threshold", "threshold_step")
    if plan.adaptive:  # `AdaptivePolicy` with its threshold reads them all
        return ()
    # Fixed k: the target acceptance only prices an n-gram proposal's nodes in a recycled tree (`draft.py`).
    return ("threshold", "threshold_step") + (() if plan.recycle and plan.ngram else ("target_acceptance",))


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(DraftPlan)}
_IGNORED_WHY = {
    "cost": "the cost policy drafts, each round, the length that maximises expected tokens per second, from "
            "draft_length (its most) and target_acceptance (its prior) alone; adaptive, threshold and threshold_step "
            "steer the fixed policy's confidence threshold.",
    "fixed": "with adaptive=False the fixed policy drafts draft_length tokens every round; threshold, threshold_step "
             "and target_acceptance steer its confidence threshold (adaptive=True).",
}
_IGNORED_FIX = {
    "cost": " (or give policy='fixed' with adaptive=True to draft by a confidence threshold).",
    "fixed": " (or give adaptive=True to draft by a confidence threshold).",
}


def _policy_words(plan: DraftPlan) -> str:
    return "policy='cost'" if plan.policy == "cost" else f"policy='fixed' with adaptive={plan.adaptive}"


def auto_reference_layers(num_layers: int) -> tuple[int, ...]:
    """An auto plan's layers before it has seen a context (and the draft its cost table times): the first half."""
    return tuple(range(max(1, num_layers // 2)))


def _is_int(value: Any) -> bool:
    """An integer (numpy's too), never a bool, a float or a string."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _check_int(name: str, value: Any, low: int, high: int | None) -> None:
    if not _is_int(value):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        valid = f"{low}..{high}" if high is not None else f">= {low}"
        raise ValueError(f"{name}={value} out of range (valid: {valid})")


def _check_unit_interval(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"{name}={value!r} out of range (valid: 0.0..1.0)")


def exact_prefix_of(layers) -> int:
    """s: a draft's layers start with 0..s-1, which compute what the target computes (its exact prefix)."""
    return next((s for s, i in enumerate(layers) if i != s), len(layers))
