"""Calling conventions of decoder layers, named so adapters can refer to them.

An adapter's `layer_call` picks one of these functions. Each takes a layer
module, the hidden states `[1, q, hidden]` and what the engine prepared (mask,
rotary embeddings, position ids, the shared cache) and returns the layer's
output hidden states `[1, q, hidden]`, on the CPU kernels the calling thread
chose (`cpu_kernels.py`; none swapped for anyone else). `decoder_layer` and
`gpt2_block` call the layer's own forward; the direct calls (`llama_layer`,
`gemma_layer`, `phi3_layer`, `olmo2_layer`) compute a known transformers
family's layer from its parts, bit for bit, and hand any other layer to its
own forward. Nothing here keeps state beyond which layers were checked plain.
"""

from __future__ import annotations

import functools
import importlib
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.modules import module as _module

from .cpu_kernels import attention_function, chosen_kernels, linear_function


def decoder_layer(layer, hidden: torch.Tensor, *, mask, position_embeddings, position_ids, cache) -> torch.Tensor:
    """transformers 5.x decoder layers of the Llama kind (Llama, Mistral, Qwen, Gemma, Phi-3, OLMo 2, ...), on
    the kernels this thread chose (`cpu_kernels.chosen_kernels`)."""
    with chosen_kernels(hidden):
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
    with chosen_kernels(hidden):  # the kernels this thread chose (`cpu_kernels.py`)
        out = layer(hidden, cache=cache, attention_mask=mask, use_cache=True)
    return out[0] if isinstance(out, tuple) else out


def _direct(kind: str):
    """A direct call for layers of structure `kind`: the decorated body gets the layer's family first; any layer
    that is not that family's plain layer, or is training, runs its own forward (`decoder_layer`)."""

    def decorate(body):
        @functools.wraps(body)
        def call(layer, hidden: torch.Tensor, *, mask, position_embeddings, position_ids, cache) -> torch.Tensor:
            family = _family_of(layer)
            if layer.training or family is None or family.kind != kind or not _plain(layer, family, hidden.device):
                return decoder_layer(layer, hidden, mask=mask, position_embeddings=position_embeddings,
                                     position_ids=position_ids, cache=cache)
            return body(family, layer, hidden, mask=mask, position_embeddings=position_embeddings,
                        position_ids=position_ids, cache=cache)

        return call

    return decorate


@_direct("llama")
def llama_layer(family: "_Family", layer, hidden: torch.Tensor, *, mask, position_embeddings, position_ids,
                cache) -> torch.Tensor:
    """A decoder layer of the Llama structure (Llama, Mistral, Qwen 2, Qwen 3), computed from its parts without
    its module calls.

    The same operations in the same order as the layer's own forward (the
    norms' float32 formula, Qwen 3's query and key norms, the rotary
    function, the configured attention function with the same arguments,
    the sliding window where the family passes one, the MLP), so the
    result is the layer's own, bit for bit; what goes is the per-call cost
    of about a dozen module calls, keyword wrappers and hook checks a
    layer. Its linear layers and attention run the kernels this thread
    chose (`cpu_kernels.linear_function`, `attention_function`). A layer
    that is not exactly that structure (another class, a quantized or
    hooked linear, a norm of another kind, training mode) runs its own
    forward.
    """
    linear = linear_function()
    attn = layer.self_attn
    residual = hidden
    hidden = _rms_norm(layer.input_layernorm, hidden)
    query, key, value = _project(linear, attn, hidden)  # each [1, q, heads, head_dim]
    if family.qk_norm:  # Qwen 3: per head, before the heads move forward
        query, key = _rms_norm(attn.q_norm, query), _rms_norm(attn.k_norm, key)
    query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    out = _attend(family, attn, query, key, value, position_embeddings, mask, position_ids, cache)
    hidden = residual + linear(out, attn.o_proj.weight, attn.o_proj.bias)
    return hidden + _mlp(linear, layer.mlp, _rms_norm(layer.post_attention_layernorm, hidden))


@_direct("gemma")
def gemma_layer(gemma: "_Family", layer, hidden: torch.Tensor, *, mask, position_embeddings, position_ids,
                cache) -> torch.Tensor:
    """transformers' Gemma 2 and Gemma 3 decoder layers, computed from their parts as `llama_layer` computes
    Llama's.

    The same operations in the same order as the layer's own forward: four
    norms (Gemma's float32 formula with `1 + weight`), Gemma 3's query and
    key norms per head, the rotary function, the configured attention with
    the layer's sliding window (and Gemma 2's attention soft-cap), the MLP.
    The same fallback: a layer of another structure, hooked or training runs
    its own forward.
    """
    linear = linear_function()
    attn = layer.self_attn
    residual = hidden
    hidden = _gemma_norm(layer.input_layernorm, hidden)
    query, key, value = (t.transpose(1, 2) for t in _project(linear, attn, hidden))  # each [1, heads, q, head_dim]
    if gemma.qk_norm:  # Gemma 3
        query, key = _gemma_norm(attn.q_norm, query), _gemma_norm(attn.k_norm, key)
    out = _attend(gemma, attn, query, key, value, position_embeddings, mask, position_ids, cache)
    hidden = _gemma_norm(layer.post_attention_layernorm, linear(out, attn.o_proj.weight, attn.o_proj.bias))
    hidden = residual + hidden
    mlp = _mlp(linear, layer.mlp, _gemma_norm(layer.pre_feedforward_layernorm, hidden))
    return hidden + _gemma_norm(layer.post_feedforward_layernorm, mlp)


@_direct("phi3")
def phi3_layer(phi: "_Family", layer, hidden: torch.Tensor, *, mask, position_embeddings, position_ids,
               cache) -> torch.Tensor:
    """transformers' Phi-3 decoder layer, computed from its parts as `llama_layer` computes Llama's: one fused
    query-key-value projection, one fused gate-up projection (the residual dropouts are identities in eval)."""
    linear = linear_function()
    attn, mlp = layer.self_attn, layer.mlp
    residual = hidden
    hidden = _rms_norm(layer.input_layernorm, hidden)
    shape = (*hidden.shape[:-1], -1, attn.head_dim)
    qkv = linear(hidden, attn.qkv_proj.weight, attn.qkv_proj.bias)  # [1, q, (heads + 2 kv_heads) * head_dim]
    queries, keys = attn.config.num_attention_heads * attn.head_dim, attn.num_key_value_heads * attn.head_dim
    query, key, value = (t.view(shape).transpose(1, 2) for t in (
        qkv[..., :queries], qkv[..., queries : queries + keys], qkv[..., queries + keys :]))
    out = _attend(phi, attn, query, key, value, position_embeddings, mask, position_ids, cache)
    hidden = residual + linear(out, attn.o_proj.weight, attn.o_proj.bias)
    gate, up = linear(_rms_norm(layer.post_attention_layernorm, hidden), mlp.gate_up_proj.weight,
                      mlp.gate_up_proj.bias).chunk(2, dim=-1)
    return hidden + linear(up * mlp.activation_fn(gate), mlp.down_proj.weight, mlp.down_proj.bias)


@_direct("olmo2")
def olmo2_layer(olmo: "_Family", layer, hidden: torch.Tensor, *, mask, position_embeddings, position_ids,
                cache) -> torch.Tensor:
    """transformers' OLMo 2 decoder layer, computed from its parts as `llama_layer` computes Llama's: no input
    norm, the query and key normed over all heads, norms after the attention and the MLP (the product with the
    weight in float32)."""
    linear = linear_function()
    attn = layer.self_attn
    shape = (*hidden.shape[:-1], -1, attn.head_dim)
    query = _olmo_norm(attn.q_norm, linear(hidden, attn.q_proj.weight, attn.q_proj.bias))
    key = _olmo_norm(attn.k_norm, linear(hidden, attn.k_proj.weight, attn.k_proj.bias))
    value = linear(hidden, attn.v_proj.weight, attn.v_proj.bias)
    query, key, value = (t.view(shape).transpose(1, 2) for t in (query, key, value))
    out = _attend(olmo, attn, query, key, value, position_embeddings, mask, position_ids, cache)
    hidden = hidden + _olmo_norm(layer.post_attention_layernorm, linear(out, attn.o_proj.weight, attn.o_proj.bias))
    return hidden + _olmo_norm(layer.post_feedforward_layernorm, _mlp(linear, layer.mlp, hidden))


def _attend(family: _Family, attn, query, key, value, position_embeddings, mask, position_ids, cache) -> torch.Tensor:
    """Rotary positions, the cache, then the configured attention as the family's forward calls it; the output
    `[1, q, heads * head_dim]`, contiguous."""
    cos, sin = position_embeddings
    query, key = family.module.apply_rotary_pos_emb(query, key, cos, sin)
    key, value = cache.update(key, value, attn.layer_idx)
    attention = attention_function(attn.config._attn_implementation, family.module.eager_attention_forward)
    out, _ = attention(attn, query, key, value, mask, dropout=0.0, scaling=attn.scaling, **family.attention_kwargs(attn),
                       position_ids=position_ids, use_cache=True)
    return out.reshape(*out.shape[:2], -1).contiguous()


def _project(linear, attn, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The query, key and value projections of `hidden` `[1, q, hidden]`, each `[1, q, heads, head_dim]`."""
    shape = (*hidden.shape[:-1], -1, attn.head_dim)
    return tuple(linear(hidden, proj.weight, proj.bias).view(shape) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))


def _mlp(linear, mlp, hidden: torch.Tensor) -> torch.Tensor:
    """The gated MLP: down(act(gate(x)) * up(x))."""
    up = linear(hidden, mlp.up_proj.weight, mlp.up_proj.bias)
    return linear(mlp.act_fn(linear(hidden, mlp.gate_proj.weight, mlp.gate_proj.bias)) * up,
                  mlp.down_proj.weight, mlp.down_proj.bias)


def _rms_norm(norm, hidden: torch.Tensor) -> torch.Tensor:
    """`LlamaRMSNorm.forward`, operation for operation: cast back, then the product with the weight."""
    return norm.weight * _normalized(hidden, norm.variance_epsilon).to(hidden.dtype)


def _olmo_norm(norm, hidden: torch.Tensor) -> torch.Tensor:
    """`Olmo2RMSNorm.forward`, operation for operation: the product with the weight in float32, then cast."""
    return (norm.weight * _normalized(hidden, norm.variance_epsilon)).to(hidden.dtype)


def _gemma_norm(norm, hidden: torch.Tensor) -> torch.Tensor:
    """`Gemma3RMSNorm.forward` (and Gemma 2's), operation for operation: the product with `1 + weight` in
    float32, then cast."""
    return (_normalized(hidden, norm.eps) * (1.0 + norm.weight.float())).to(hidden.dtype)


def _normalized(hidden: torch.Tensor, eps: float) -> torch.Tensor:
    """The RMS normalization every family's norm starts with, in float32: x * rsqrt(mean(x^2) + eps)."""
    hidden = hidden.to(torch.float32)
    return hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)


_LINEARS = tuple(f"self_attn.{n}_proj" for n in "qkvo") + tuple(f"mlp.{n}_proj" for n in ("gate", "up", "down"))


@dataclass(frozen=True)
class _Family:
    """A transformers model family a direct layer call computes: its module and the classes its parts must be."""

    module: object  # transformers' modeling module (its rotary and eager attention functions)
    layer: type
    attention: type
    mlp: type
    norm: type
    norms: tuple[str, ...]  # the layer's norms, by attribute path
    attention_kwargs: Callable = lambda attn: {}  # attention module -> what else the family's forward passes
    qk_norm: bool = False  # query and key normed per head (Qwen 3, Gemma 3)
    kind: str = "llama"  # the structure, and so the call that computes it: "llama", "gemma", "phi3", "olmo2"
    linears: tuple[str, ...] = _LINEARS  # the layer's linear layers, by attribute path


_NORMS = ("input_layernorm", "post_attention_layernorm")
_GEMMA_NORMS = _NORMS + ("pre_feedforward_layernorm", "post_feedforward_layernorm")
_QK_NORMS = ("self_attn.q_norm", "self_attn.k_norm")


def _window(attn) -> dict:
    return {"sliding_window": attn.sliding_window}


def _config_window(attn) -> dict:
    return {"sliding_window": getattr(attn.config, "sliding_window", None)}


_FAMILIES = {  # transformers' modeling module: (its class prefix, what its layers' forward differs in)
    "transformers.models.llama.modeling_llama": ("Llama", dict(norms=_NORMS)),
    "transformers.models.mistral.modeling_mistral": ("Mistral", dict(norms=_NORMS, attention_kwargs=_config_window)),
    "transformers.models.qwen2.modeling_qwen2": ("Qwen2", dict(norms=_NORMS, attention_kwargs=_window)),
    "transformers.models.qwen3.modeling_qwen3": (
        "Qwen3", dict(norms=_NORMS + _QK_NORMS, attention_kwargs=_window, qk_norm=True)),
    "transformers.models.gemma2.modeling_gemma2": (
        "Gemma2", dict(norms=_GEMMA_NORMS, kind="gemma", attention_kwargs=lambda attn: {
            "sliding_window": attn.sliding_window, "softcap": attn.attn_logit_softcapping})),
    "transformers.models.gemma3.modeling_gemma3": (
        "Gemma3", dict(norms=_GEMMA_NORMS + _QK_NORMS, attention_kwargs=_window, qk_norm=True, kind="gemma")),
    "transformers.models.phi3.modeling_phi3": (
        "Phi3", dict(norms=_NORMS, kind="phi3", linears=("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                                                         "mlp.down_proj"), attention_kwargs=_config_window)),
    "transformers.models.olmo2.modeling_olmo2": (
        "Olmo2", dict(norms=("post_attention_layernorm", "post_feedforward_layernorm") + _QK_NORMS, kind="olmo2")),
}


def _family_of(layer) -> _Family | None:
    """The family of `layer`'s class, by the transformers module that defines it; None for any other."""
    return _family(type(layer).__module__)


@functools.cache
def _family(module_name: str) -> _Family | None:
    if module_name not in _FAMILIES:
        return None
    prefix, differences = _FAMILIES[module_name]
    module = sys.modules.get(module_name) or importlib.import_module(module_name)
    return _Family(module, *(getattr(module, prefix + part) for part in ("DecoderLayer", "Attention", "MLP", "RMSNorm")),
                   **differences)


# layer -> {family's layer class: the layer's modules, or () when it is not that family's plain layer}
_PLAIN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _plain(layer, family: _Family, device: torch.device) -> bool:
    """Whether `layer` is `family`'s decoder layer as transformers makes it, ready to compute on `device`: its
    classes, plain linears, and no hook now that could act on the call (torch's; accelerate's, but for one that
    only keeps a resident layer on `device`, see `_inert`). A hooked layer runs its own forward, so an
    offloaded layer's hook still loads its weights.

    The classes are checked once per layer; hooks at every call (one may be registered at any time).
    """
    checked = _PLAIN.get(layer)
    if checked is None:
        checked = _PLAIN[layer] = {}
    modules = checked.get(family.layer)
    if modules is None:
        plain = (type(layer) is family.layer and type(getattr(layer, "self_attn", None)) is family.attention
                 and type(getattr(layer, "mlp", None)) is family.mlp
                 and all(type(_attribute(layer, n)) is family.norm for n in family.norms)
                 and all(type(_attribute(layer, n)) is nn.Linear for n in family.linears))
        modules = checked[family.layer] = tuple(layer.modules()) if plain else ()
    hooked = any(_live_hooks(m) or not _inert(m.__dict__.get("_hf_hook"), device) for m in modules)
    return bool(modules) and not (_global_hooks() or hooked)


def _inert(hook, device: torch.device) -> bool:
    """Whether accelerate's hook on a module (`_hf_hook`; None: no hook) leaves a call on `device` as it is: an
    `AlignDevicesHook` that loads no weights and computes on `device`, where the module's weights are. Its
    work, moving the inputs to that device and the output back to theirs, is then nothing. accelerate leaves
    such hooks on every resident layer of a model it dispatched."""
    if hook is None:
        return True
    if type(hook).__name__ != "AlignDevicesHook" or type(hook).__module__ != "accelerate.hooks" or hook.offload:
        return False
    where = hook.execution_device
    where = torch.device("cuda", where) if isinstance(where, int) else torch.device(where)
    return where == device


def _attribute(module, path: str):
    for name in path.split("."):
        module = getattr(module, name, None)
    return module


# transformers installs these on a model's layers the first time it is asked for hidden states or attentions, and
# leaves them there; they record only inside that model's own forward call (its collector), never in selfspec's.
_CAPTURING = "transformers.utils.output_capturing"


def _live_hooks(module: nn.Module) -> bool:
    """Whether `module` has a forward hook that could act on selfspec's call: any but transformers' output
    capturing hooks."""
    hooks = (*module._forward_hooks.values(), *module._forward_pre_hooks.values())
    return any(getattr(hook, "__module__", None) != _CAPTURING for hook in hooks)


def _global_hooks() -> bool:
    """Whether forward hooks are registered for every module (`nn.modules.module.register_module_forward_hook`)."""
    return bool(_module._global_forward_hooks or _module._global_forward_pre_hooks)


LAYER_CALLS: dict[str, Callable[..., torch.Tensor]] = {
    "decoder_layer": decoder_layer,
    "llama_layer": llama_layer,
    "gemma_layer": gemma_layer,
    "phi3_layer": phi3_layer,
    "olmo2_layer": olmo2_layer,
    "gpt2_block": gpt2_block,
}


def layer_call(name: str) -> Callable[..., torch.Tensor]:
    try:
        return LAYER_CALLS[name]
    except KeyError:
        raise ValueError(f"unknown layer_call {name!r}; known: {sorted(LAYER_CALLS)}") from None
