"""EAGLE-3's draft layer, for a feature head of layout "eagle3" (`feature_head.py`).

One decoder layer of the Llama kind whose attention reads two things side
by side: the token's embedding and the fused state f, each RMS-normalised
by its own norm (`input_layernorm`, `hidden_norm`), so its query, key and
value projections take 2 x hidden inputs. The residual stream starts at f
itself; the MLP follows as in a Llama layer. These are the module names and
shapes of the EAGLE-3 checkpoints vLLM and SGLang load (the "midlayer"), so a
head trained here can be exported to them (`training/eagle3_export.py`).

The layer's input is `[.., 2 x hidden]`: the embedding, then f. It is called
as the target's decoder layers are (`layer_call.decoder_layer`) and writes
the one cache at the head's slot.

Built from a copy of one of the target's layers, which must be of the Llama
structure: a self-attention with q/k/v/o projections, an MLP, and exactly the
two norms around them (Llama, Mistral, Qwen 2 and 3). Other layers (Gemma's
four norms, fused projections, GPT-2 blocks) are refused with the reason.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

LLAMA_CHILDREN = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
PROJECTIONS = ("q_proj", "k_proj", "v_proj")


def llama_structure_problem(layer: nn.Module) -> str | None:
    """Why `layer` cannot become an EAGLE-3 layer, or None when it can."""
    children = {name for name, _ in layer.named_children()}
    if children != LLAMA_CHILDREN:
        return (f"{type(layer).__name__} has modules {sorted(children)}; an EAGLE-3 layer needs exactly "
                f"{sorted(LLAMA_CHILDREN)} (a Llama-structured layer)")
    attn = layer.self_attn
    if not all(isinstance(getattr(attn, name, None), nn.Linear) for name in (*PROJECTIONS, "o_proj")):
        return f"{type(attn).__name__} lacks separate q/k/v/o linear projections"
    return None


class Eagle3Layer(nn.Module):
    """attention over `[norm(embedding), norm(f)]` `[.., 2 * hidden]`, residual f, then the MLP; `[.., hidden]` out."""

    def __init__(self, layer: nn.Module, *, token_share: float) -> None:
        """From a (copied) Llama-structured layer: q/k/v widened to 2 x hidden inputs, the f half the layer's own
        weights and the embedding half `token_share` times them; both norms start as the layer's input norm."""
        super().__init__()
        problem = llama_structure_problem(layer)
        if problem is not None:
            raise ValueError(f"a feature head of layout 'eagle3' needs a Llama-structured layer: {problem}")
        self.self_attn, self.mlp = layer.self_attn, layer.mlp
        self.post_attention_layernorm = layer.post_attention_layernorm
        self.hidden_norm = layer.input_layernorm
        self.input_layernorm = copy.deepcopy(layer.input_layernorm)  # EAGLE-3's name for the embedding's norm
        for name in PROJECTIONS:
            old = getattr(self.self_attn, name)
            wide = nn.Linear(2 * old.in_features, old.out_features, bias=old.bias is not None,
                             device=old.weight.device, dtype=old.weight.dtype)
            with torch.no_grad():
                wide.weight.copy_(torch.cat([token_share * old.weight, old.weight], dim=1))
                if old.bias is not None:
                    wide.bias.copy_(old.bias)
            setattr(self.self_attn, name, wide)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, position_ids=None, cache=None,
                use_cache: bool = False, position_embeddings=None, **kwargs) -> torch.Tensor:
        embeds, features = hidden_states.chunk(2, dim=-1)  # [.., hidden] each
        joined = torch.cat([self.input_layernorm(embeds), self.hidden_norm(features)], dim=-1)  # [.., 2 * hidden]
        attended, _ = self.self_attn(hidden_states=joined, attention_mask=attention_mask, position_ids=position_ids,
                                     cache=cache, use_cache=use_cache, position_embeddings=position_embeddings,
                                     **kwargs)
        hidden = features + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden))
