"""The decoding methods a benchmark compares, each behind one `run(input_ids)` call.

A `Method` is a name, a description and a `run` that generates greedily after
one prompt and returns the output ids (`[1, prompt + new]`, as `generate()`
does) with what it knows about its own passes (`PassCounts`).

- `hf-greedy`: `model.generate(do_sample=False)`, the baseline.
- `hf-early-exit`: Hugging Face assisted generation with the target's own
  first E layers as the assistant (`assistant_early_exit=E`).
- `hf-prompt-lookup`: Hugging Face prompt lookup decoding
  (`prompt_lookup_num_tokens=n`), which drafts by copying n-grams of the context.
- `hf-static-compile`: `model.generate` with a static cache (one
  `StaticCache` of fixed length per model, reset per call, so one compile
  serves every prompt) and a compiled forward (`torch.compile`, mode
  "reduce-overhead": CUDA graphs on a GPU). Its compile time is the warm-up's,
  reported apart by the harness.
- `selfspec-plain`: selfspec's own loop with drafting off (`DraftPlan.plain()`).
- `selfspec-plan`: selfspec with the plan given (`--plan`) or the adapter's plan.
- `selfspec-fixed`: the same plan with `policy="fixed"`: its own draft-length
  rule (fixed k, or the adaptive confidence threshold) without the cost model,
  which is what selfspec did before it measured costs.
- `selfspec-plain-fast`, `selfspec-plan-fast`: the same two on the fast step,
  `step="graphs"` on CUDA, `step="static"` elsewhere and with offloaded layers;
  the three above run `step="eager"`.
- `llama-cpp` (optional, `benchmarks/llama_cpp.py`): llama.cpp's plain greedy
  decoding of the same weights as an F32 or BF16 GGUF (the model's dtype, CPU
  only), when llama-cpp-python is installed: the CPU anchor.

Hugging Face does not report passes for assisted generation. For the `hf-*`
methods we count the full forward passes by a forward hook on the last decoder
layer, attached only for the duration of the call: the early-exit assistant runs
layers 0..E-1 only (E < number of layers), so every call of the last layer is a
pass of the full model. Drafted and accepted counts stay unknown (None) there.
For selfspec every number comes from `last_stats`.

This module does not time, compare or report.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import selfspec
from selfspec import DraftPlan
from selfspec.offload import is_offloaded
from selfspec.plan import ignored_fields

TARGET_ACCEPTANCE = next(f.default for f in dataclasses.fields(DraftPlan) if f.name == "target_acceptance")

BASELINE = "hf-greedy"
ALL_METHODS = (
    "hf-greedy",
    "hf-early-exit",
    "hf-prompt-lookup",
    "selfspec-plain",
    "selfspec-plan",
    "selfspec-fixed",
    "hf-static-compile",
    "selfspec-plain-fast",
    "selfspec-plan-fast",
    "selfspec-plain-hooks",
    "selfspec-plan-hooks",
    "selfspec-plain-packed",
    "selfspec-plan-packed",
    "llama-cpp",
)
FAST_METHODS = ("hf-static-compile", "selfspec-plain-fast", "selfspec-plan-fast")  # by default on CUDA only
OPTIONAL_METHODS = ("llama-cpp",)  # in the default run only where llama-cpp-python is installed, on a CPU
# An offloaded model's layers loaded by accelerate's hooks at every call instead of selfspec's stream: asked for by
# name only (`--methods`), to separate what streaming gives from what drafting gives.
HOOKS_METHODS = ("selfspec-plain-hooks", "selfspec-plan-hooks")
# `wrap(kernels="packed")`: oneDNN on packed copies of the weights (the weights' bytes again): asked for by name only.
PACKED_METHODS = ("selfspec-plain-packed", "selfspec-plan-packed")
STATIC_CACHE_LENGTH = 2048  # positions of hf-static-compile's one cache: prompt + new tokens must fit


@dataclass
class PassCounts:
    """What a method knows about one generation; None where it cannot know."""

    verify_passes: int | None = None  # full forward passes of the target, prefill included
    drafted: int | None = None
    accepted: int | None = None
    details: dict = field(default_factory=dict)  # e.g. selfspec's GenerationStats.as_dict()


@dataclass
class Method:
    name: str
    description: str
    run: Callable[..., tuple[torch.Tensor, PassCounts]]  # (input_ids, streamer=None): `generate`'s streamer
    settings: dict = field(default_factory=dict)


class LastLayerCounter:
    """Counts calls of the model's last decoder layer while in a `with` block; the hook is then removed."""

    def __init__(self, model) -> None:
        self.layer = decoder_layers(model)[-1]
        self.calls = 0

    def _hook(self, module, args, output) -> None:
        self.calls += 1

    def __enter__(self) -> "LastLayerCounter":
        self.calls = 0
        self.handle = self.layer.register_forward_hook(self._hook)
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()


def decoder_layers(model) -> torch.nn.ModuleList:
    """The model's decoder layers: where selfspec's adapter says, else the usual `get_decoder().layers`."""
    try:
        return selfspec.wrap(model, plan=selfspec.DraftPlan.plain()).parts.layers
    except ValueError:  # no adapter for this architecture: the selfspec methods will say so
        return model.get_decoder().layers


def num_layers(model) -> int:
    return len(decoder_layers(model))


def hf_method(name: str, description: str, model, *, max_new_tokens: int, **generate_options) -> Method:
    """A method that calls `model.generate` greedily with `generate_options`."""

    def run(input_ids: torch.Tensor, streamer=None) -> tuple[torch.Tensor, PassCounts]:
        layers = model.config.num_hidden_layers
        try:
            with LastLayerCounter(model) as counter:
                out = model.generate(
                    input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    do_sample=False,
                    max_new_tokens=max_new_tokens,
                    streamer=streamer,
                    **generate_options,
                )
        finally:
            # HF's early exit truncates the model by editing config.num_hidden_layers while it drafts;
            # if that edit ever leaked, every later method on this model would be wrong.
            if model.config.num_hidden_layers != layers:
                model.config.num_hidden_layers = layers
                raise RuntimeError(f"{name} left config.num_hidden_layers changed; restored to {layers}")
        return out, PassCounts(verify_passes=counter.calls)

    return Method(name, description, run, settings=dict(generate_options))


_STATIC_CACHES: dict[int, object] = {}  # by id(model): hf-static-compile's one cache (the compiled graph keeps its shape)


def hf_static_compile_method(model, *, max_new_tokens: int) -> Method:
    """`model.generate` on one fixed-length `StaticCache`, reset per call, with a compiled forward."""
    from transformers import CompileConfig, StaticCache

    if id(model) not in _STATIC_CACHES:
        _STATIC_CACHES[id(model)] = StaticCache(config=model.config, max_cache_len=STATIC_CACHE_LENGTH)
    cache = _STATIC_CACHES[id(model)]
    # transformers compiles only on accelerators unless told to compile on every device.
    compile_config = CompileConfig(fullgraph=False)
    compile_config._compile_all_devices = True
    method = hf_method("hf-static-compile", f"model.generate, StaticCache({STATIC_CACHE_LENGTH}) + torch.compile "
                       "(reduce-overhead)", model, max_new_tokens=max_new_tokens, cache=cache,
                       compile_config=compile_config)
    inner = method.run

    def run(input_ids: torch.Tensor, streamer=None) -> tuple[torch.Tensor, PassCounts]:
        cache.reset()
        return inner(input_ids, streamer)

    method.run = run
    method.settings = {"cache": f"StaticCache(max_cache_len={STATIC_CACHE_LENGTH})", "compile": "reduce-overhead"}
    return method


def fast_step(model) -> str:
    """The step the `-fast` methods run: CUDA graphs on a GPU, the static step elsewhere and where layers are
    offloaded (their weights on the meta device between passes: graphs cannot read them)."""
    on_cuda = next(model.parameters()).device.type == "cuda"
    return "graphs" if on_cuda and not is_offloaded(model) else "static"


HELD = "held"  # `costs=HELD`: each plan's cost table measured once, then injected (`held_costs`)
_held_tables = weakref.WeakKeyDictionary()  # model -> {(plan, step, offload_stream, kernels): PassCosts}


def held_costs(model, plan: DraftPlan, step: str, offload_stream: bool = True, kernels: str = "measured"):
    """The plan's cost table as this machine measures it (or its cache holds it), measured once per process and
    then injected: an injected table is never refined by the rounds' timings, so plans compared in one run price
    their passes the same from the first prompt to the last (refined tables part ways with the timing noise, and
    two plans then decide differently on the same text). None where the plan decides without a table."""
    if not (plan.drafts and plan.policy == "cost"):
        return None
    tables = _held_tables.setdefault(model, {})
    key = (repr(plan.to_dict()), step, offload_stream, kernels)
    if key not in tables:
        tables[key] = selfspec.wrap(model, plan=plan, step=step, offload_stream=offload_stream, kernels=kernels).costs
    return tables[key]


def selfspec_method(name: str, description: str, model, plan: DraftPlan, *, max_new_tokens: int, costs=None,
                    step: str = "eager", offload_stream: bool = True, kernels: str = "measured") -> Method:
    if costs == HELD:
        costs = held_costs(model, plan, step, offload_stream, kernels)
    spec = selfspec.wrap(model, plan=plan, costs=costs, step=step, offload_stream=offload_stream, kernels=kernels)

    def run(input_ids: torch.Tensor, streamer=None) -> tuple[torch.Tensor, PassCounts]:
        out = spec.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=False, streamer=streamer)
        stats = spec.last_stats
        counts = PassCounts(stats.verify_passes, stats.drafted, stats.accepted, stats.as_dict())
        return out, counts

    settings = {"plan": plan.to_dict(), "describe": spec.describe_plan(), "step": step, "kernel choice": kernels,
                "kernels": f"linear layers {spec.linear_kernels().describe()}; "
                           f"attention {spec.attention_kernels().describe()}"}
    if plan.drafts and plan.policy == "cost":
        settings["costs"] = spec.costs.summary()
    return Method(name, description, run, settings=settings)


def build_method(
    name: str, model, *, max_new_tokens: int, plan: DraftPlan, early_exit: int, prompt_lookup: int, costs=None
) -> Method:
    """One method by name; raises ValueError for an unknown name."""
    if name == "hf-greedy":
        return hf_method(name, "model.generate, greedy (baseline)", model, max_new_tokens=max_new_tokens)
    if name == "hf-early-exit":
        return hf_method(
            name,
            f"HF assisted generation, assistant_early_exit={early_exit}",
            model,
            max_new_tokens=max_new_tokens,
            assistant_early_exit=early_exit,
        )
    if name == "hf-prompt-lookup":
        return hf_method(
            name,
            f"HF prompt lookup, prompt_lookup_num_tokens={prompt_lookup}",
            model,
            max_new_tokens=max_new_tokens,
            prompt_lookup_num_tokens=prompt_lookup,
        )
    if name == "hf-static-compile":
        return hf_static_compile_method(model, max_new_tokens=max_new_tokens)
    if name == "selfspec-plain":
        return selfspec_method(name, "selfspec, no drafting", model, DraftPlan.plain(), max_new_tokens=max_new_tokens)
    if name == "selfspec-plain-fast":
        step = fast_step(model)
        return selfspec_method(name, f"selfspec, no drafting, step={step}", model, DraftPlan.plain(),
                               max_new_tokens=max_new_tokens, step=step)
    if name == "selfspec-plan-fast":
        step = fast_step(model)
        return selfspec_method(name, f"selfspec, plan {plan.name or '(unnamed)'}, policy {plan.policy}, step={step}",
                               model, plan, max_new_tokens=max_new_tokens, costs=costs, step=step)
    if name == "selfspec-plain-hooks":
        return selfspec_method(name, "selfspec, no drafting, offloaded layers loaded by accelerate's hooks", model,
                               DraftPlan.plain(), max_new_tokens=max_new_tokens, offload_stream=False)
    if name == "selfspec-plan-hooks":
        return selfspec_method(name, f"selfspec, plan {plan.name or '(unnamed)'}, offloaded layers loaded by "
                               f"accelerate's hooks", model, plan, max_new_tokens=max_new_tokens, costs=costs,
                               offload_stream=False)
    if name == "selfspec-plain-packed":
        return selfspec_method(name, "selfspec, no drafting, packed weight copies", model, DraftPlan.plain(),
                               max_new_tokens=max_new_tokens, kernels="packed")
    if name == "selfspec-plan-packed":
        return selfspec_method(name, f"selfspec, plan {plan.name or '(unnamed)'}, packed weight copies", model, plan,
                               max_new_tokens=max_new_tokens, costs=costs, kernels="packed")
    if name == "llama-cpp":
        from .llama_cpp import llama_cpp_method

        return llama_cpp_method(model, max_new_tokens=max_new_tokens)
    if name in ("selfspec-plan", "selfspec-fixed"):
        variant = plan if name == "selfspec-plan" else fixed_rule(plan)
        return selfspec_method(
            name, f"selfspec, plan {variant.name or '(unnamed)'}, policy {variant.policy}", model, variant,
            max_new_tokens=max_new_tokens, costs=costs,
        )
    raise ValueError(f"unknown method {name!r}; valid: {', '.join(ALL_METHODS)}")


def fixed_rule(plan: DraftPlan) -> DraftPlan:
    """`plan` with `policy="fixed"`; a cost plan's prior (`target_acceptance`) goes back to its default where the
    fixed rule does not read it (a plan may not carry a field its policy ignores)."""
    fixed = dataclasses.replace(plan, policy="fixed", target_acceptance=TARGET_ACCEPTANCE)
    if "target_acceptance" in ignored_fields(fixed):
        return fixed
    return dataclasses.replace(fixed, target_acceptance=plan.target_acceptance)


def default_methods(plan: DraftPlan | None, device: str = "cpu") -> list[str]:
    """Every method that makes sense for this plan and device.

    `selfspec-fixed` only where the plan chooses k by cost; the fast-step
    methods on CUDA only (on a CPU, compiling takes minutes and the static
    step is a GPU's path: ask for them with --methods); `llama-cpp` on a CPU
    where llama-cpp-python is installed.
    """
    with_fixed = plan is not None and plan.drafts and plan.policy == "cost"
    with_llama_cpp = device.startswith("cpu") and llama_cpp_installed()
    return [m for m in ALL_METHODS
            if (m != "selfspec-fixed" or with_fixed) and (m not in FAST_METHODS or device.startswith("cuda"))
            and (m not in OPTIONAL_METHODS or with_llama_cpp) and m not in HOOKS_METHODS + PACKED_METHODS]


def llama_cpp_installed() -> bool:
    """Whether llama-cpp-python can be imported (looked up, not imported)."""
    try:
        return importlib.util.find_spec("llama_cpp") is not None
    except (ImportError, ValueError):
        return False


def early_exit_candidates(layers: int) -> list[int]:
    """The default sweep: about a fifth, a third and half of the depth (6, 10, 15 for 30 layers)."""
    return sorted({min(layers - 1, max(1, round(layers * f))) for f in (0.2, 1 / 3, 0.5)})
