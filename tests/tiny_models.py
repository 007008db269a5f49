"""Tiny random models, one per supported architecture, built from configs.

`TINY_CONFIGS` is the one list the shared tests run over: adding an
architecture to selfspec means adding its adapter file and a line here.
Weights are random but seeded, with a larger init scale than the default so
logits are well separated and greedy choices are not numerical near-ties.
"""

from __future__ import annotations

import functools

import torch
import transformers

COMMON = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.3,
)

# name -> (config class, model class, config overrides)
TINY_CONFIGS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
}


@functools.cache
def tiny_model(name: str, dtype: torch.dtype = torch.float64, seed: int = 0):
    config_cls, model_cls, overrides = TINY_CONFIGS[name]
    config = getattr(transformers, config_cls)(**{**COMMON, **overrides})
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).to(dtype).eval()
    model.generation_config.pad_token_id = model.generation_config.eos_token_id = None
    return model


def random_prompt(length: int, vocab: int = COMMON["vocab_size"], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (1, length), generator=g)
