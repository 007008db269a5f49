"""Which CPU kernels (`cpu_kernels.py`) one wrapped model's passes run, per thread count.

`KernelChoice` measures the linear layers' and the attention's kernels once
per machine, model, dtype and thread count, and caches each choice on disk
in the cost tables' folder (`kernels/`). Off the CPU, for a quantized model,
under another attention than sdpa, or with `choice="transformers"`, it
chooses nothing: transformers' own functions run.

It knows the model's shapes and the disk cache; it does not know plans,
cost tables or when a pass runs.
"""

from __future__ import annotations

import torch

from .artifacts import model_identity
from .costs import cache_key, costs_cache_dir, load_or_measure, machine_description
from .cpu_kernels import (LINEAR_KERNELS, NO_ATTENTION_CHANGE, NO_CHANGE, AttentionKernels, LinearKernels, cpu_kernels,
                          measure_attention_kernels, measure_linear_kernels)
from .parts import ModelParts, text_config

# How the CPU's passes run (`wrap(kernels=...)`): the kernels measured fastest here, or transformers' own.
KERNEL_CHOICES = ("measured", "transformers")


def check_choice(choice: str) -> None:
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"kernels must be one of {', '.join(map(repr, KERNEL_CHOICES))}, got {choice!r}")


class KernelChoice:
    """The kernels a wrapped model's passes run here: `linear()`, `attention()`, and `context()` to run in."""

    def __init__(self, model, parts: ModelParts, *, quantization: str | None, choice: str = "measured") -> None:
        check_choice(choice)
        self.model, self.parts, self.quantization, self.choice = model, parts, quantization, choice
        self.linear_choices: dict[int, LinearKernels] = {}  # by threads: the linear layers' kernels
        self.attention_choices: dict[int, AttentionKernels] = {}  # by threads: the attention kernel, likewise

    def linear(self) -> LinearKernels:
        """How the linear layers run their passes here: measured once per machine, model, dtype and thread count
        on the CPU (cached on disk with the cost tables); unchanged elsewhere."""
        if self.parts.device.type != "cpu" or self.quantization is not None or self.choice == "transformers":
            return NO_CHANGE
        threads = torch.get_num_threads()
        if threads not in self.linear_choices:
            key = cache_key(kind="linear kernels", candidates=list(LINEAR_KERNELS),  # a new kernel: timed afresh
                            model=model_identity(self.model, self.parts),
                            dtype=str(self.parts.dtype), threads=threads, machine=machine_description(self.parts.device))
            modules = [*self.parts.layers.modules(), self.parts.lm_head]
            folder = costs_cache_dir()  # beside the cost tables, in a folder of its own
            self.linear_choices[threads] = load_or_measure(None if folder is None else folder / "kernels", key,
                                                           lambda: measure_linear_kernels(modules),
                                                           kind=LinearKernels)
        return self.linear_choices[threads]

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
