"""Run any subset of the target's layers on a few tokens, over the shared cache.

`LayerRunner` is the one place that calls the model's modules. It owns the
generation's `SharedKVCache`, a table of rotary position embeddings, and the
attention masks. The draft and the verify pass both go through it: the draft
with the plan's layers, the verify pass with the full stack (or the part of it
after the plan's exact prefix).

It knows positions, masks and layer calling conventions (`layer_call.py`);
it does not know plans, acceptance or sampling.
"""

from __future__ import annotations

import torch

from .adapter import Adapter, ModelParts
from .cache import SharedKVCache
from .layer_call import layer_call


class LayerRunner:
    def __init__(self, parts: ModelParts, adapter: Adapter, config, *, capacity: int, device: torch.device):
        self.parts = parts
        self.cache = SharedKVCache(parts.num_layers, capacity)
        self.call = layer_call(adapter.layer_call)
        self.dtype = parts.dtype
        self.bool_masks = getattr(config, "_attn_implementation", "sdpa") == "sdpa"
        self.windows = _sliding_windows(config, parts.num_layers)
        self.positions = torch.arange(capacity, device=device)[None]  # [1, capacity]
        self.rotary = None
        if parts.rotary is not None:
            probe = torch.zeros(1, 1, 1, dtype=self.dtype, device=device)
            # Rotary embeddings are elementwise in the position, so one table
            # computed up front equals what each forward pass would compute.
            self.rotary = parts.rotary(probe, position_ids=self.positions)  # (cos, sin) [1, capacity, rot_dim]

    def embed(self, token_ids: list[int]) -> torch.Tensor:
        """`[1, q, hidden]` input embeddings of `token_ids`."""
        ids = torch.tensor([token_ids], device=self.positions.device)
        return self.parts.embed(ids)

    def run(self, hidden: torch.Tensor, layers, start: int) -> torch.Tensor:
        """Run `layers` in order on `hidden` `[1, q, hidden]` at positions start..start+q-1.

        Every layer in `layers` must hold exactly `start` cache entries.
        """
        q = hidden.shape[1]
        position_ids = self.positions[:, start : start + q]  # [1, q]
        rotary = None if self.rotary is None else tuple(t[:, start : start + q] for t in self.rotary)
        masks: dict[int | None, torch.Tensor | None] = {}
        for i in layers:
            if self.cache.lengths[i] != start:
                raise RuntimeError(
                    f"cache out of step: layer {i} holds {self.cache.lengths[i]} positions, expected {start}"
                )
            window = self.windows[i]
            if window not in masks:
                masks[window] = self.mask(q, start, window)
            hidden = self.call(
                self.parts.layers[i],
                hidden,
                mask=masks[window],
                position_embeddings=rotary,
                position_ids=position_ids,
                cache=self.cache,
            )
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[q, vocab]` float32 logits from the last hidden states `[1, q, hidden]`."""
        return self.parts.lm_head(self.parts.norm(hidden))[0].float()

    def mask(self, q: int, start: int, window: int | None) -> torch.Tensor | None:
        """Attention mask for q queries at start.. over start + q keys; None when nothing is hidden."""
        kv = start + q
        if q == 1 and (window is None or kv <= window):
            return None
        query_pos = self.positions[0, start:kv, None]  # [q, 1]
        key_pos = self.positions[0, None, :kv]  # [1, kv]
        allowed = key_pos <= query_pos  # [q, kv]
        if window is not None:
            allowed &= key_pos > query_pos - window
        if self.bool_masks:
            return allowed[None, None]
        additive = torch.zeros(allowed.shape, dtype=self.dtype, device=allowed.device)
        return additive.masked_fill(~allowed, torch.finfo(self.dtype).min)[None, None]


def _sliding_windows(config, num_layers: int) -> list[int | None]:
    """Per layer: the sliding-window length, or None for global attention."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window is None:
        return [None] * num_layers
    if layer_types is None:
        return [window] * num_layers
    return [window if kind == "sliding_attention" else None for kind in layer_types]
