"""What the engine calls on a model: its parts, found once through an adapter.

`ModelParts` holds the modules of one model that the engine runs (embedding,
layers, final norm, LM head, rotary embedding, learned positions), the
attention layout read from its config (per-layer sliding windows and rotary
kinds, the final-logit soft cap) and the layer calling convention. An adapter
(`adapter.py`) builds it; everything below the adapter registry works from it
alone and never reads the model's config again.

This module does not know where parts live in a model (that is the adapter's
job), nor plans, caches or acceptance.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .layer_call import decoder_layer


def text_config(config: Any) -> Any:
    """The config of the text decoder: the config itself, or e.g. Gemma 3's `text_config`."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


@dataclass(frozen=True)
class ModelParts:
    """The modules of one model that the engine calls, and its attention layout, found through an adapter."""

    embed: nn.Module
    layers: nn.ModuleList
    norm: nn.Module
    lm_head: nn.Module
    rotary: nn.Module | None
    position_embed: nn.Module | None = None  # learned absolute positions, added to the token embeddings
    rotary_kinds: tuple[str | None, ...] = ()  # per layer: the layer type passed to the rotary module, or None
    windows: tuple[int | None, ...] = ()  # per layer: sliding-window length, or None for global attention
    logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap)
    attn_implementation: str = "sdpa"
    layer_call: Callable[..., torch.Tensor] = decoder_layer  # how one layer is called (`layer_call.py`)
    stream: Any = None  # offloaded layers selfspec loads itself (`streaming.LayerStream`), set by the wrapper

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.lm_head.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def max_positions(self) -> int | None:
        """Positions the model can embed: the learned table's size (GPT-2), None where rotary has no end."""
        return None if self.position_embed is None else int(self.position_embed.num_embeddings)

    @property
    def vocab_size(self) -> int:
        return int(self.lm_head.weight.shape[0])


def soft_cap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Final-logit soft-capping (Gemma 2): cap * tanh(logits / cap), in the dtype given; identity without a cap."""
    return logits if cap is None else torch.tanh(logits / cap) * cap
