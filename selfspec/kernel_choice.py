"""Which CPU kernels (`cpu_kernels.py`) one wrapped model's passes run, per thread count.

`KernelChoice` measures the linear layers' and the attention's kernels once
per machine, model, dtype and thread count, and caches each choice on disk
in the cost tables' folder (`kernels/`). Off the CPU, for a quantized model,
under another attention than sdpa, or with `choice="transformers"`, it
chooses nothing: transformers' own functions run. With `choice="packed"` it
also makes oneDNN's packed copies of the resident linear weights and times
them; the copies (the weights' bytes again) are kept only where they win.

It knows the model's shapes and the disk cache; it does not know plans,
cost tables or when a pass runs.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch

from .artifacts import model_identity
from .costs import cache_key, costs_cache_dir, load_or_measure, machine_description
from .cpu_kernels import (COPYLESS_KERNELS, LINEAR_KERNELS, NO_ATTENTION_CHANGE, NO_CHANGE, AttentionKernels,
                          LinearKernels, PackedWeights, cpu_kernels, measure_attention_kernels, measure_linear_kernels)
from .parts import ModelParts, text_config

# How the CPU's passes run (`wrap(kernels=...)`): the kernels measured fastest here, those and packed copies of the
# weights (more memory), or transformers' own.
KERNEL_CHOICES = ("measured", "packed", "transformers")


def check_choice(choice: str) -> None:
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"kernels must be one of {', '.join(map(repr, KERNEL_CHOICES))}, got {choice!r}")


class KernelChoice:
    """The kernels a wrapped model's passes run here: `linear()`, `attention()`, and `context()` to run in."""

    def __init__(self, model, parts: ModelParts, *, quantization: str | None, choice: str = "measured") -> None:
        check_choice(choice)
        self.model, self.parts, self.quantization, self.choice = model, parts, quantization, choice
        self.linear_choices: dict[int, LinearKernels] = {}  # by threads: the linear layers' kernels
        self._packed: PackedWeights | None = None  # `choice="packed"`: the copies, shared by the thread counts
        self.attention_choices: dict[int, AttentionKernels] = {}  # by threads: the attention kernel, likewise
        if choice == "packed" and (parts.device.type != "cpu" or quantization is not None):
            where = f"an {quantization}-quantized model" if quantization else f"a model on {parts.device.type}"
            warnings.warn(f"kernels='packed' packs the weights of CPU passes; {where} runs its own kernels, "
                          f"nothing is packed", stacklevel=4)  # the caller of wrap()

    def linear(self) -> LinearKernels:
        """How the linear layers run their passes here: measured once per machine, model, dtype and thread count
        on the CPU (cached on disk with the cost tables); unchanged elsewhere."""
        if self.parts.device.type != "cpu" or self.quantization is not None or self.choice == "transformers":
            return NO_CHANGE
        threads = torch.get_num_threads()
        if threads not in self.linear_choices:
            candidates = LINEAR_KERNELS if self.choice == "packed" else COPYLESS_KERNELS
            key = cache_key(kind="linear kernels", candidates=list(candidates),  # a new kernel: timed afresh
                            model=model_identity(self.model, self.parts),
                            dtype=str(self.parts.dtype), threads=threads, machine=machine_description(self.parts.device))
            modules = [*self.parts.layers.modules(), self.parts.lm_head]

            def measure() -> LinearKernels:  # the copies are made to be timed, or once a choice read runs them
                packed = self.packed_weights(modules) if self.choice == "packed" else None
                return measure_linear_kernels(modules, packed=packed)

            folder = costs_cache_dir()  # beside the cost tables, in a folder of its own
            choice = load_or_measure(None if folder is None else folder / "kernels", key, measure, kind=LinearKernels)
            if "packed" in choice.kernels and choice.packed is None:  # read from disk: the copies made here
                choice = dataclasses.replace(choice, packed=self.packed_weights(modules))
            self.linear_choices[threads] = choice
            if not any(c.packed is not None for c in self.linear_choices.values()):
                self._packed = None  # no row count runs them: the copies go
        return self.linear_choices[threads]

    def packed_weights(self, modules) -> PackedWeights:
        """oneDNN's packed copies of `modules`' resident linear weights, made once for every thread count."""
        if self._packed is None:
            self._packed = PackedWeights(modules)
        return self._packed

    def packed_bytes(self) -> int:
        """The bytes the packed copies the passes run hold (0 where none is kept)."""
        return sum({id(c.packed): c.packed.nbytes for c in self.linear_choices.values() if c.packed}.values())

    def attention(self) -> AttentionKernels:
        """Which attention kernel the passes run here, by queries and cache entries: measured once per machine,
        model shape, dtype and thread count on the CPU under sdpa (cached on disk with the linear kernels);
        unchanged elsewhere."""
        if (self.parts.device.type != "cpu" or self.parts.attn_implementation != "sdpa"
                or self.choice == "transformers"):
            return NO_ATTENTION_CHANGE
        threads = torch.get_num_threads()
        if threads not in self.attention_choices:
            config = text_config(self.model.config)
            heads = config.num_attention_heads
            shape = dict(heads=heads, kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                         head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads)
            key = cache_key(kind="attention kernels", **shape, dtype=str(self.parts.dtype), threads=threads,
                            max_keys=self.parts.max_positions, machine=machine_description(self.parts.device))
            folder = costs_cache_dir()
            self.attention_choices[threads] = load_or_measure(
                None if folder is None else folder / "kernels", key,
                lambda: measure_attention_kernels(**shape, dtype=self.parts.dtype, device=self.parts.device,
                                                  max_keys=self.parts.max_positions),
                kind=AttentionKernels)
        return self.attention_choices[threads]

    def context(self):
        """The context every pass of this model runs in: the linear and attention kernels chosen here."""
        return cpu_kernels(linear=self.linear(), attention=self.attention())
