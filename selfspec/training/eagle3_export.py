"""Write a feature head of layout "eagle3" as an EAGLE-3 draft checkpoint that vLLM and SGLang load.

The layout of vLLM's `llama_eagle3.py` (read at commit 00bd149) and
SGLang's (03d5a77): `config.json` (`LlamaForCausalLMEagle3`, one layer,
`draft_vocab_size`, the reads as `eagle_aux_hidden_state_layer_ids`) and
`model.safetensors`: `fc`, `midlayer.*`, `norm`, `lm_head` (the draft
vocabulary's rows of the target's), `d2t` (target id = draft id +
d2t[draft id]) and `t2d`. No embedding: those engines share the target's.

Their layer ids count the embedding as 0, so selfspec's read r (the output of
layer r) is their id r + 1. What the layout cannot say is refused: a head
reading other than 3 layers or the last layer's output, attention with
query/key norms (Qwen 3), a sliding window. One difference stays: selfspec's
head also keeps a cache entry for the first token (with f = 0), which those
engines' drafters do not make; and SGLang's layer has no attention bias, so
a head with q/k/v biases (Qwen 2) is exact in vLLM only.

A tool; the engine never imports it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..feature_head import FeatureHead
from ..parts import ModelParts

ARCHITECTURE = "LlamaForCausalLMEagle3"
FOLLOWS = "vLLM's llama_eagle3.py (commit 00bd149) and SGLang's llama_eagle3.py (commit 03d5a77)"


def layout_problem(head: FeatureHead, parts: ModelParts) -> str | None:
    """Why `head` cannot be written in the EAGLE-3 layout, or None."""
    if head.layout != "eagle3":
        return f"its layout is {head.layout!r}; train it with --layout eagle3"
    if len(head.reads) != 3:
        return f"it reads {len(head.reads)} layers; EAGLE-3's fc reads exactly 3"
    if max(head.reads) >= parts.num_layers - 1:
        return f"it reads the last layer's output ({max(head.reads)}), which EAGLE-3 engines do not capture"
    extra = sorted(name for name, _ in head.layer.self_attn.named_children()
                   if name not in ("q_proj", "k_proj", "v_proj", "o_proj"))
    if extra:
        return f"its attention has {extra}, which EAGLE-3's Llama layer does not"
    if parts.windows and parts.windows[head.source_layer] is not None:
        return "its layer attends within a sliding window, which EAGLE-3's Llama layer does not"
    return None


def eagle3_tensors(head: FeatureHead, parts: ModelParts, vocab_ids: torch.Tensor | None,
                   dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors by name. `vocab_ids` `[K]`: the draft vocabulary (None: the whole vocabulary)."""
    vocab_size = int(parts.lm_head.weight.shape[0])
    ids = torch.arange(vocab_size) if vocab_ids is None else vocab_ids.detach().cpu().long()  # [K]
    attn, layer = head.layer.self_attn, head.layer
    tensors = {"fc.weight": head.fuse.weight, "norm.weight": parts.norm.weight,
               "lm_head.weight": parts.lm_head.weight.detach().cpu()[ids]}
    for name, module in (("input_layernorm", layer.input_layernorm), ("hidden_norm", layer.hidden_norm),
                         ("post_attention_layernorm", layer.post_attention_layernorm)):
        tensors[f"midlayer.{name}.weight"] = module.weight
    biased = attn.q_proj.bias is not None
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        linear = getattr(attn, name)
        tensors[f"midlayer.self_attn.{name}.weight"] = linear.weight
        if biased:  # their layer gives o_proj a bias exactly when q/k/v have one: zero where the head has none
            tensors[f"midlayer.self_attn.{name}.bias"] = (linear.bias if linear.bias is not None
                                                        else torch.zeros(linear.out_features))
    for name in ("gate_proj", "up_proj", "down_proj"):
        tensors[f"midlayer.mlp.{name}.weight"] = getattr(layer.mlp, name).weight
    out = {k: v.detach().to(device="cpu", dtype=dtype).contiguous() for k, v in tensors.items()}
    out["d2t"] = ids - torch.arange(len(ids))  # [K] int64
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    out["t2d"] = t2d  # [V]
    return out


def eagle3_config(head: FeatureHead, parts: ModelParts, config, draft_vocab_size: int, dtype: torch.dtype) -> dict:
    """`config.json` of the draft: the target's layer shapes, one layer, the draft vocabulary, the read layers."""
    attn = head.layer.self_attn
    rope = dict(getattr(config, "rope_parameters", None) or {})
    theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    scaling = rope if rope.get("rope_type", "default") != "default" else None
    hidden = int(parts.embed.weight.shape[1])
    aux = [r + 1 for r in head.reads]
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": hidden,
        "target_hidden_size": hidden,
        "intermediate_size": int(head.layer.mlp.gate_proj.out_features),
        "num_hidden_layers": 1,
        "num_attention_heads": int(attn.q_proj.out_features // attn.head_dim),
        "num_key_value_heads": int(attn.k_proj.out_features // attn.head_dim),
        "head_dim": int(attn.head_dim),
        "hidden_act": getattr(config, "hidden_act", "silu"),
        "rms_norm_eps": float(head.layer.hidden_norm.variance_epsilon),
        "rope_theta": float(theta),
        "rope_scaling": scaling,
        "max_position_embeddings": int(getattr(config, "max_position_embeddings", 8192)),
        "attention_bias": attn.q_proj.bias is not None,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": int(parts.lm_head.weight.shape[0]),
        "draft_vocab_size": draft_vocab_size,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "eagle_aux_hidden_state_layer_ids": aux,
        "eagle_config": {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": aux},
    }


def export_eagle3(head: FeatureHead, parts: ModelParts, config, out: str | os.PathLike, *,
                  vocab_ids: torch.Tensor | None = None, dtype: torch.dtype = torch.float32,
                  note: dict | None = None) -> Path:
    """Write the folder `out` (config.json, model.safetensors); returns it. Refused (ValueError) when the head
    does not fit the layout (`layout_problem`). The MLP must have no biases (Llama's has none)."""
    problem = layout_problem(head, parts)
    if problem is not None:
        raise ValueError(f"this feature head cannot be written as EAGLE-3: {problem}")
    if getattr(head.layer.mlp.gate_proj, "bias", None) is not None:
        raise ValueError("this feature head cannot be written as EAGLE-3: its MLP has biases")
    tensors = eagle3_tensors(head, parts, vocab_ids, dtype)
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    settings = eagle3_config(head, parts, config, int(tensors["d2t"].shape[0]), dtype)
    settings["selfspec"] = {"follows": FOLLOWS, **(note or {})}
    (folder / "config.json").write_text(json.dumps(settings, indent=1) + "\n")
    return folder
