"""What a wrapped model holds in memory: weights as stored, the KV cache for a context, and the draft's extras.

- Weights: every parameter once (a tied embedding once), at its size as
  stored: a quantized tensor (torchao's subclasses) counts its inner tensors,
  a bitsandbytes weight its packed data and scales. The embedding and the LM
  head are also reported on their own, since they often stay in float.
- KV cache: what `cache.py` allocates for `context` positions: capacity x
  layers x kv heads x head dim x 2 (keys and values) x the activations' dtype
  size. An exit head is one more layer of it.
- Extras of a plan: an exit head's float layer, a draft vocabulary's K
  gathered LM-head rows (and their ids).

This module counts bytes and can bound the CPU kernel caches of a long-lived
process (`bound_kernel_caches`); handing freed memory back is `heap.py`'s. It
does not allocate anything or know the decode loop.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from . import offload
from .offload import describe_layers, offloaded_layers
from .parts import ModelParts, text_config

MIB = 2**20
# oneDNN's primitive cache and ideep's matmul cache keep a compiled kernel per GEMM shape, up to 1,024 each by
# default. A server prefills prompts of every length, so each new length adds entries that stay.
KERNEL_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
SERVER_KERNEL_CACHE = 128  # shapes kept by each: a batch's decode widths fit, old prefill lengths leave


@dataclass(frozen=True)
class MemoryReport:
    """Bytes a wrapped model uses (`SelfSpecModel.memory()`)."""

    weight_bytes: int  # every parameter of the model once, as stored (quantized: packed data + scales)
    embedding_bytes: int  # of those: the input embedding and the LM head (once when tied)
    kv_cache_bytes: int  # the one KV cache for `context` positions (exit head included)
    context: int  # positions the KV cache holds
    head_bytes: int  # the exit head's layer (0 without one)
    vocab_bytes: int  # the draft vocabulary's gathered rows and ids (0 without one)
    quantization: str | None  # what is quantized, or None
    offloaded_bytes: int = 0  # of the weights: those held outside fast memory between calls (accelerate's offload)
    offloaded_layers: tuple[int, ...] = ()  # the decoder layers they belong to
    slot_bytes: int = 0  # the two layer slots selfspec streams offloaded layers through (`streaming.py`)
    packed_bytes: int = 0  # oneDNN's packed copies of weights the passes run (`wrap(kernels="packed")`)

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_cache_bytes + self.head_bytes + self.vocab_bytes + self.packed_bytes

    @property
    def resident_bytes(self) -> int:
        """What stays in fast memory: everything but the offloaded weights, plus the slots they stream through."""
        return self.total_bytes - self.offloaded_bytes + self.slot_bytes

    def summary(self) -> str:
        """One line: weights (of which embedding), KV cache for the context, and the plan's extras, in MiB."""
        line = (f"memory: weights {self.weight_bytes / MIB:.1f} MiB "
                f"(embedding and LM head {self.embedding_bytes / MIB:.1f}), "
                f"KV cache {self.kv_cache_bytes / MIB:.1f} MiB for {self.context} tokens")
        if self.head_bytes:
            line += f", exit head {self.head_bytes / MIB:.1f} MiB"
        if self.vocab_bytes:
            line += f", draft vocabulary {self.vocab_bytes / MIB:.1f} MiB"
        if self.packed_bytes:
            line += f", packed weight copies {self.packed_bytes / MIB:.1f} MiB"
        line += f"; {self.total_bytes / MIB:.1f} MiB in all"
        if self.offloaded_layers:
            line += (f"; offloaded: layers {describe_layers(self.offloaded_layers)} "
                     f"({self.offloaded_bytes / MIB:.1f} MiB, read from the offload for every pass")
            if self.slot_bytes:
                line += f", streamed through two slots of {self.slot_bytes / 2 / MIB:.1f} MiB"
            line += f"); resident {self.resident_bytes / MIB:.1f} MiB"
        return line + (f" ({self.quantization})" if self.quantization else "")


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes of a tensor as stored: a wrapper subclass counts its inner tensors (and bitsandbytes' scales)."""
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if callable(flatten) and type(tensor) not in (torch.Tensor, nn.Parameter):
        names, _ = flatten()
        return sum(tensor_bytes(getattr(tensor, name)) for name in names if getattr(tensor, name) is not None)
    size = tensor.numel() * tensor.element_size()
    for extra in (getattr(tensor, "SCB", None), getattr(getattr(tensor, "quant_state", None), "absmax", None)):
        if isinstance(extra, torch.Tensor):  # bitsandbytes: int8 row scales, 4-bit block scales
            size += extra.numel() * extra.element_size()
    return size


def parameter_bytes(modules: list[nn.Module]) -> int:
    """Bytes of the parameters of `modules`, each parameter counted once."""
    seen: dict[int, int] = {}
    for module in modules:
        for param in module.parameters():
            seen.setdefault(id(param), tensor_bytes(param))
    return sum(seen.values())


def kv_cache_bytes(parts: ModelParts, config, *, context: int, extra_layers: int = 0) -> int:
    """capacity x layers x kv heads x head dim x 2 x dtype size: what `SharedKVCache` allocates."""
    return offload.kv_cache_bytes(text_config(config), parts.dtype, context=context,
                                  layers=parts.num_layers + extra_layers)


def memory_report(model: nn.Module, parts: ModelParts, *, context: int, head: nn.Module | None = None,
                  vocab_tensors: tuple[torch.Tensor | None, ...] = (), quantization: str | None = None,
                  packed_bytes: int = 0) -> MemoryReport:
    if context < 1:
        raise ValueError(f"context={context} out of range (valid: an integer >= 1)")
    offloaded = offloaded_layers(parts.layers)
    return MemoryReport(
        weight_bytes=parameter_bytes([model]),
        embedding_bytes=parameter_bytes([parts.embed, parts.lm_head]),
        kv_cache_bytes=kv_cache_bytes(parts, model.config, context=context, extra_layers=int(head is not None)),
        context=context,
        head_bytes=0 if head is None else parameter_bytes([head]),
        vocab_bytes=sum(tensor_bytes(t) for t in vocab_tensors if t is not None),
        quantization=quantization,
        offloaded_bytes=parameter_bytes([parts.layers[i] for i in offloaded]),
        offloaded_layers=offloaded,
        slot_bytes=parts.stream.slot_bytes() if parts.stream else 0,
        packed_bytes=packed_bytes,
    )


def bound_kernel_caches(capacity: int = SERVER_KERNEL_CACHE) -> dict[str, str]:
    """Bound oneDNN's and ideep's kernel caches to `capacity` shapes each (least recently used leave), so that
    a process that sees ever new GEMM shapes (a server) keeps a flat RSS. Both libraries read their variable
    once, at the process's first oneDNN call: call this before it. A value already in the environment wins.
    Returns the values in force."""
    for name in KERNEL_CACHE_VARIABLES:
        os.environ.setdefault(name, str(capacity))
    return {name: os.environ[name] for name in KERNEL_CACHE_VARIABLES}
