"""The generic decoder adapter, for models whose `model_type` has no adapter file.

Many fine-tunes reuse a known layout under a new `model_type`. A model with
the common decoder layout (`model.embed_tokens`, a `model.layers` list,
`model.norm`, `lm_head`, optionally `model.rotary_emb`) and no sliding-window
attention may run with `GENERIC`, but never on a guess: `generic_problem`
first runs a self-check (a prefill plus one draft-and-verify round on the
shared cache, compared with one plain forward pass, to a tolerance set by the
dtype). Only when they agree does the registry (`registry.py`) use it, with a
`GenericAdapterWarning`; otherwise its error lists the supported model types
and says how to add an adapter. `self_check` works on any adapter (the tests
run it on every family).

This module does not know family quirks: a model that needs one (soft-capping,
positions applied outside their modules, another layer call) fails the check
and needs an adapter file.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .adapter import Adapter
from .draft import Drafter
from .parts import text_config
from .passes import TargetPasses
from .plan import DraftPlan
from .policy import policy_for
from .runner import LayerRunner

GENERIC = Adapter(
    name="generic",
    model_types=(),
    embed="model.embed_tokens",
    layers="model.layers",
    norm="model.norm",
    lm_head="lm_head",
    rotary="model.rotary_emb",
    layer_call="decoder_layer",
    default_plan={"exit_fraction": 0.5, "draft_length": 6},
    source="selfspec/generic.py",
)

# Largest |our logit - plain forward's logit|, relative to the largest |logit|, that passes.
# A layout error (a missing scale, soft cap, norm or mask) is off by far more. Float64
# allows 1e-6 because eager attention takes its softmax in float32 whatever the dtype.
TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}
CHECK_PROMPT_LENGTH = 12
CHECK_DRAFT_LENGTH = 3


class GenericAdapterWarning(UserWarning):
    """A model without an adapter runs through the generic decoder adapter (after passing its self-check)."""


@dataclass(frozen=True)
class SelfCheck:
    """The outcome of one self-check round."""

    passed: bool
    max_error: float  # max |logit difference| / max(1, max |logit|) over the compared rows
    detail: str  # what was compared, or why the check could not run


def layout_problem(model: nn.Module) -> str | None:
    """Why `model` does not have the common decoder layout, or None when it has."""
    if not hasattr(model, "config"):
        return "it has no config"
    for path in (GENERIC.embed, GENERIC.layers, GENERIC.norm, GENERIC.lm_head):
        obj = model
        for attr in path.split("."):
            obj = getattr(obj, attr, None)
            if obj is None:
                return f"it does not match the common decoder layout (no module {path!r})"
    if not isinstance(model.model.layers, nn.ModuleList) or len(model.model.layers) == 0:
        return "it does not match the common decoder layout (model.layers is not a non-empty ModuleList)"
    config = text_config(model.config)
    window = getattr(config, "sliding_window", None)
    kinds = getattr(config, "layer_types", None) or []
    if window is not None or any(kind != "full_attention" for kind in kinds):
        return (
            f"its config sets sliding_window={window!r} / layer_types, and a short self-check cannot "
            f"tell how the model applies them"
        )
    return None


def self_check(model: nn.Module, adapter: Adapter = GENERIC) -> SelfCheck:
    """One prefill and one draft-and-verify round through `adapter`, against one plain forward pass."""
    try:
        return _self_check(model, adapter)
    except Exception as error:  # a wrong layout shows up as any exception at all
        return SelfCheck(False, float("inf"), f"the round raised {type(error).__name__}: {error}")


@torch.no_grad()
def _self_check(model: nn.Module, adapter: Adapter) -> SelfCheck:
    parts = adapter.bind(model)
    num_layers = parts.num_layers
    device = parts.lm_head.weight.device
    vocab = parts.lm_head.weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (CHECK_PROMPT_LENGTH,), generator=generator).tolist()
    # Layer 0 is an exact prefix (its entries are kept and the verify pass resumes
    # after it); the last layer's draft entries are written, then dropped.
    plan = DraftPlan(layers=sorted({0, num_layers - 1}), draft_length=CHECK_DRAFT_LENGTH, policy="fixed")
    drafter = Drafter(plan, num_layers)
    passes = TargetPasses(num_layers, exact_prefix=drafter.exact_prefix)
    k = CHECK_DRAFT_LENGTH
    runner = LayerRunner(parts, capacity=len(prompt) + k + 2, device=device)

    prefill = runner.logits(runner.run(runner.embed(prompt, 0), range(num_layers), 0))  # [P, vocab]
    tokens = prompt + [int(prefill[-1].argmax())]
    start = len(tokens) - 1
    policy = policy_for(plan)  # fixed k: the check must draft
    policy.begin_round(k)
    draft = drafter.propose(runner, _Greedy(), tokens, policy)
    # The verify pass, as the engine runs it: it resumes after layer 0 from the draft's saved states.
    ids = torch.tensor([tokens + draft.tokens], device=device)
    verify = passes.verify(runner, ids[:, start:], draft.boundary, start).logits  # [k+1, vocab]

    reference = model(input_ids=ids, use_cache=False).logits[0].float()  # [P+1+k, vocab]
    ours = torch.cat([prefill, verify])
    expected = torch.cat([reference[: len(prompt)], reference[start:]])
    scale = max(1.0, float(expected.abs().max()))
    error = float((ours - expected).abs().max()) / scale
    tolerance = TOLERANCE.get(parts.dtype, 1e-2)
    detail = (
        f"{len(prompt)} prompt positions and a round of {k} drafted tokens through layers {list(plan.layers)}: "
        f"max relative logit error {error:.2e} (tolerance {tolerance:.0e} for {parts.dtype})"
    )
    return SelfCheck(error <= tolerance, error, detail)


class _Greedy:
    """The two `Scorer` methods the drafter calls, for plain greedy drafting without processors."""

    def scores(self, logits: torch.Tensor, tokens: list[int], first: int) -> torch.Tensor:
        return logits

    def draft_choice(self, scores: torch.Tensor, *, with_confidence: bool):
        return int(scores[0].argmax()), None, None


def generic_problem(model: nn.Module) -> tuple[str | None, str]:
    """Why `GENERIC` may not run `model` (None when it may), and the self-check's detail."""
    problem = layout_problem(model)
    if problem is not None:
        return f"The generic decoder adapter cannot be used: {problem}.", ""
    if model.training:
        return "The generic adapter's self-check needs the model in eval mode (call model.eval()).", ""
    check = self_check(model, GENERIC)
    if not check.passed:
        return (
            f"It has the common decoder layout, but the generic adapter failed its self-check: {check.detail}.",
            check.detail,
        )
    return None, check.detail
