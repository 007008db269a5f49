"""Calling conventions of decoder layers, named so adapters can refer to them.

An adapter's `layer_call` picks one of these functions. Each takes a layer
module, the hidden states `[1, q, hidden]` and what the engine prepared (mask,
rotary embeddings, position ids, the shared cache) and returns the layer's
output hidden states `[1, q, hidden]`. Nothing here keeps state.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def decoder_layer(layer, hidden: torch.Tensor, *, mask, position_embeddings, position_ids, cache) -> torch.Tensor:
    """transformers 5.x decoder layers of the Llama kind (Llama, Mistral, Qwen, Gemma, Phi-3, OLMo 2, ...)."""
    out = layer(
        hidden,
        attention_mask=mask,
        position_embeddings=position_embeddings,
        position_ids=position_ids,
        cache=cache,
        use_cache=True,
    )
    return out[0] if isinstance(out, tuple) else out


def gpt2_block(layer, hidden: torch.Tensor, *, mask, position_embeddings, position_ids, cache) -> torch.Tensor:
    """GPT-2 blocks: positions were added to the embeddings, so the block takes no rotary or position ids.

    The block's attention writes the shared cache with `cache.update(key, value, layer_idx)`
    (a plain cache, not an `EncoderDecoderCache`: GPT-2 adapters require `add_cross_attention=false`).
    """
    out = layer(hidden, cache=cache, attention_mask=mask, use_cache=True)
    return out[0] if isinstance(out, tuple) else out


LAYER_CALLS: dict[str, Callable[..., torch.Tensor]] = {
    "decoder_layer": decoder_layer,
    "gpt2_block": gpt2_block,
}


def layer_call(name: str) -> Callable[..., torch.Tensor]:
    try:
        return LAYER_CALLS[name]
    except KeyError:
        raise ValueError(f"unknown layer_call {name!r}; known: {sorted(LAYER_CALLS)}") from None
