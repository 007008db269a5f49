"""Offloaded models: which layers accelerate keeps out of fast memory, and a placement for a memory budget.

A model dispatched by accelerate (a `device_map` with "cpu" or "disk"
entries) keeps an offloaded module's weights on the meta device between
calls; the module's hook loads them for each call. selfspec streams such
layers itself (`streaming.py`), or, where it cannot read a layer's weights,
calls it through its module so the hook runs (`layer_call.py` checks for
hooks). This module says which layers are offloaded, so that the default
plan drafts only from resident weights and a plan that drafts through
offloaded layers is warned about.

`budget_device_map` places a model for a byte budget: room for a
generation's working set first (`working_set_bytes`: the KV cache, a
prefill's activations and a verify pass's logits for a context), then the
embeddings, LM head and final norm, then room for the two slots offloaded
layers stream through, then as many layers as fit, in order; the rest go to
the offload tier ("cpu" behind a GPU, "disk" behind the CPU).

This module reads module placement; it does not load weights or decide drafts.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch
from torch import nn

# Positions a budget keeps room for unless told otherwise (`selfspec.load(budget_context=)`): the KV cache and the
# prefill of a prompt that long.
BUDGET_CONTEXT = 1024
VERIFY_ROWS = 17  # the widest verify pass a budget keeps logits for: the default plans' trees of 16 nodes and the root
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(value: str | int) -> int:
    """Bytes from an int or a size such as "300MiB", "1.5GB", "512MB" (0 allowed)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"a size must not be negative, got {value}")
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"{value!r} is not a size (valid: bytes, or a number with KB, MB, GB, KiB, MiB or GiB, "
                         f"such as '300MiB')")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def _size(n: int) -> str:
    return f"{n} bytes ({n / 2**20:.1f} MiB)"


def is_offloaded(module: nn.Module) -> bool:
    """Whether some weight of `module` is held outside it between calls (on the meta device, loaded by a hook)."""
    return any(p.device.type == "meta" for p in module.parameters())


def offloaded_layers(layers) -> tuple[int, ...]:
    """Indices of the decoder layers whose weights are offloaded."""
    return tuple(i for i, layer in enumerate(layers) if is_offloaded(layer))


def describe_layers(indices: tuple[int, ...]) -> str:
    """"15-29", or "3, 5-7": runs of consecutive indices."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


@dataclass(frozen=True)
class Placement:
    """Where a budget puts a model: a device map for `from_pretrained`, and its resident and offloaded bytes."""

    device_map: dict[str, str]
    resident_bytes: int
    offloaded_bytes: int
    offloaded_layers: tuple[int, ...]
    reserved_bytes: int = 0  # kept free for a generation's working set


def working_set_bytes(config, dtype: torch.dtype, context: int) -> int:
    """Bytes a generation of up to `context` positions holds beside the weights (`config`: the text decoder's).

    - the KV cache (`kv_cache_bytes`);
    - a prefill of `context` tokens, what one layer holds at once, per token, in the dtype: the residual
      stream and normed states (2 x hidden), query, key and value and their head-major copies (2 x (query +
      2 x kv width)), the rotary function's five terms over query and key (5 x (query + kv width)), attention
      and projected output (2 x hidden), the MLP's gate, up, activation, product and output (5 x
      intermediate); and the norm's four float32 terms (4 x hidden x 4 bytes);
    - a verify pass's logits over `VERIFY_ROWS` rows: in the dtype and two float32 copies (the scores and
      their probabilities).
    Library pages, kernel caches and the allocator's slack are not counted (`benchmarks/offload_memory.py`
    measures them).
    """
    size = torch.empty(0, dtype=dtype).element_size()
    query, kv_width = attention_widths(config)
    hidden = config.hidden_size
    inner = getattr(config, "intermediate_size", None) or 4 * hidden
    kv = kv_cache_bytes(config, dtype, context=context, layers=config.num_hidden_layers)
    layer = (4 * hidden + 2 * (query + 2 * kv_width) + 5 * (query + kv_width) + 5 * inner) * size + 4 * hidden * 4
    return kv + context * layer + VERIFY_ROWS * config.vocab_size * (size + 8)


def attention_widths(config) -> tuple[int, int]:
    """(query width, key/value width) of a text decoder's attention: heads x head dim, kv heads x head dim."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads * head_dim, (getattr(config, "num_key_value_heads", None) or heads) * head_dim


def kv_cache_bytes(config, dtype: torch.dtype, *, context: int, layers: int) -> int:
    """context x layers x kv heads x head dim x 2 x dtype size: what `SharedKVCache` allocates."""
    return context * layers * attention_widths(config)[1] * 2 * torch.empty(0, dtype=dtype).element_size()


def budget_device_map(sizes: dict[str, int], layer_names: list[str], *, budget: int, fast: str,
                      slow: str, reserve: int = 0) -> Placement:
    """Place modules (their byte `sizes`, by name) in `budget` bytes of `fast` memory, the rest on `slow`.

    `reserve` bytes stay free first (a generation's working set, `working_set_bytes`). Every module that is
    not a layer goes next (embeddings, LM head, norms: the draft reads them), then layers in order while they
    fit. A budget short of the reserve and the non-layer modules is refused, naming the bytes.
    """
    others = {name: size for name, size in sizes.items() if name not in layer_names}
    needed = sum(others.values()) + reserve
    kept = f" and a generation's working set of {_size(reserve)}" if reserve else ""
    if needed > budget:
        raise ValueError(f"a memory budget of {_size(budget)} is under the {_size(needed)} that must stay resident "
                         f"for the draft (the embeddings, LM head and norms{kept})")
    # Offloaded layers stream through two slots of one layer each (`streaming.py`): room kept for them.
    slots = 0 if needed + sum(sizes[n] for n in layer_names) <= budget else 2 * max(sizes[n] for n in layer_names)
    if needed + slots > budget:
        raise ValueError(f"a memory budget of {_size(budget)} is under the {_size(needed + slots)} that must stay "
                         f"resident for the draft (the embeddings, LM head and norms{kept}: {_size(needed)}) and "
                         f"the two layer slots offloaded layers stream through")
    device_map = {name: fast for name in others}
    used, offloaded = needed + slots, []
    for i, name in enumerate(layer_names):
        if not offloaded and used + sizes[name] <= budget:
            device_map[name] = fast
            used += sizes[name]
        else:
            device_map[name] = slow
            offloaded.append(i)
    return Placement(device_map, used - reserve, sum(sizes[layer_names[i]] for i in offloaded), tuple(offloaded),
                     reserve)


def module_sizes(model: nn.Module, names: list[str]) -> dict[str, int]:
    """Bytes of each named module's parameters and buffers (a tied weight counts once, with its first owner)."""
    seen: set[int] = set()
    sizes = {}
    for name in names:
        module = model.get_submodule(name)
        total = 0
        for tensor in list(module.parameters()) + list(module.buffers()):
            if id(tensor) not in seen:
                seen.add(id(tensor))
                total += tensor.numel() * tensor.element_size()
        sizes[name] = total
    return sizes


def layers_path(model: nn.Module) -> str:
    """The name of the decoder layers' list: the `nn.ModuleList` that holds the most parameters."""
    lists = [(sum(p.numel() for p in m.parameters()), name) for name, m in model.named_modules()
             if isinstance(m, nn.ModuleList)]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no list of layers to place")
    return max(lists)[1]


def top_level_names(model: nn.Module, layers_path: str) -> tuple[list[str], list[str]]:
    """(every module to place, the layers among them): the layers under `layers_path` one by one, and each other
    child of the layers' parents that holds weights, up to the model."""
    layer_names = [f"{layers_path}.{i}" for i in range(len(model.get_submodule(layers_path)))]
    names: list[str] = []
    path = layers_path.split(".")
    for depth in range(len(path)):
        parent = ".".join(path[:depth])
        for child, module in (model.get_submodule(parent) if parent else model).named_children():
            full = f"{parent}.{child}" if parent else child
            if full == ".".join(path[: depth + 1]):
                continue
            if any(True for _ in module.parameters()) or any(True for _ in module.buffers()):
                names.append(full)
    return names + layer_names, layer_names


def offload_layers(model: nn.Module, first: int, *, folder: str | os.PathLike, slow: str = "disk") -> nn.Module:
    """`model` dispatched by accelerate with its layers from `first` on `slow` ("disk" into `folder`, or "cpu"
    behind a GPU) and everything else where it is; what a user would do with `accelerate.dispatch_model`."""
    from accelerate import dispatch_model

    names, layer_names = top_level_names(model, layers_path(model))
    if not 0 <= first <= len(layer_names):
        raise ValueError(f"first offloaded layer {first} out of range (valid: 0..{len(layer_names)})")
    here = str(next(model.parameters()).device)
    device_map = {name: here for name in names}
    device_map.update({name: slow for name in layer_names[first:]})
    return dispatch_model(model, device_map, offload_dir=str(folder))


def shared_weight_maps(layer: nn.Module) -> dict[int, object]:
    """A `copy.deepcopy` memo that shares (does not copy) the offloaded weights accelerate's hooks on `layer`
    read from: a copy of an offloaded layer then costs its own weights, not the whole offload's."""
    memo: dict[int, object] = {}
    for module in layer.modules():
        hook = getattr(module, "_hf_hook", None)
        for h in getattr(hook, "hooks", None) or ([hook] if hook is not None else []):
            weights = getattr(h, "weights_map", None)
            if weights is not None:
                memo[id(weights)] = weights
    return memo


def resident_copy(layer: nn.Module, device: torch.device) -> nn.Module:
    """`layer` (a copy: a head's own layer) without accelerate's hooks: detaching them loads an offloaded
    copy's weights from the offload; any still on the meta device become uninitialised on `device`."""
    if any(hasattr(m, "_hf_hook") for m in layer.modules()):
        from accelerate.hooks import remove_hook_from_module

        remove_hook_from_module(layer, recurse=True)
    if is_offloaded(layer):
        layer.to_empty(device=device)
    return layer


def device_of(tier: str) -> torch.device:
    return torch.device("cpu" if tier in ("cpu", "disk") else tier)


@dataclass(frozen=True)
class Offload:
    """What `selfspec.load` was asked to place: accelerate's `device_map` / `max_memory` (a dict) passed through,
    or a budget alone (`max_memory` as bytes or "300MiB"), placed by `budget_device_map`."""

    device_map: dict | str | None = None
    max_memory: dict | int | str | None = None
    offload_folder: str | os.PathLike | None = None
    context: int = BUDGET_CONTEXT  # positions a budget alone keeps a working set for (`working_set_bytes`)

    def __post_init__(self) -> None:
        if self.max_memory is not None and not isinstance(self.max_memory, dict):
            parse_bytes(self.max_memory)  # a bad size fails before any loading
        if isinstance(self.context, bool) or not isinstance(self.context, int) or self.context < 0:
            raise ValueError(f"budget_context must be a count of positions >= 0, got {self.context!r}")

    @property
    def budget(self) -> int | None:
        """The budget alone (bytes), or None where accelerate's own conventions place the model."""
        return None if self.device_map is not None or isinstance(self.max_memory, dict) else parse_bytes(self.max_memory)

    def placement(self, folder, dtype: torch.dtype, device: torch.device, default_folder) -> dict:
        """Keyword arguments for `from_pretrained`: a device map, the offload folder, accelerate's max_memory."""
        offload_folder = str(self.offload_folder or default_folder)
        budget = self.budget
        if budget is None:
            kwargs = {"device_map": self.device_map or "auto", "offload_folder": offload_folder}
            if self.max_memory is not None:
                kwargs["max_memory"] = self.max_memory
            return kwargs
        fast, slow = ("cpu", "disk") if device.type == "cpu" else (str(device), "cpu")
        placed = place_for_budget(folder, dtype, budget, fast=fast, slow=slow, context=self.context)
        return {"device_map": placed.device_map, "offload_folder": offload_folder}


def place_for_budget(folder, dtype: torch.dtype, budget: int, *, fast: str, slow: str,
                     context: int = BUDGET_CONTEXT) -> Placement:
    """`budget_device_map` for the model in `folder`, sized on an empty (meta) copy built from its config, with
    room kept for a generation of `context` positions (`working_set_bytes`)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    with init_empty_weights():
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=dtype)
    skeleton.tie_weights()  # a tied LM head counts once (an empty model is built untied)
    names, layer_names = top_level_names(skeleton, layers_path(skeleton))
    config = skeleton.config.get_text_config()  # the text decoder's (Gemma 3's `text_config`)
    reserve = working_set_bytes(config, dtype, context)
    return budget_device_map(module_sizes(skeleton, names), layer_names, budget=budget, fast=fast, slow=slow,
                             reserve=reserve)
