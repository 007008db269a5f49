"""Tiny random models, one per supported architecture, built from configs.

`TINY_CONFIGS` is the one list the shared tests run over: adding an
architecture to selfspec means adding its adapter file and a line here.
Weights are random but seeded, with a larger init scale than the default so
logits are well separated and greedy choices are not numerical near-ties;
biases and norm weights (zero or one at init) get seeded noise so that Qwen's
attention biases and every norm actually matter.

Each model uses the attention implementation transformers picks for it (sdpa,
or eager for Gemma 2, whose attention soft-capping sdpa cannot do).
Families with sliding-window attention get a window of `WINDOW` tokens, which
the longer tests cross; `tiny_model(name, window=8)` builds the same model with
a short window, for prompts longer than the window.
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
WINDOW = 48  # longer than the cache test's sequences, shorter than the longest greedy tests
GEMMA = dict(head_dim=8, query_pre_attn_scalar=8, pad_token_id=0, bos_token_id=1, eos_token_id=2)

# name -> (config class, model class, config overrides); "sliding_window" in the
# overrides marks a family with windowed attention. For "gemma3" the overrides
# describe the text config of a multimodal checkpoint.
TINY_CONFIGS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW)),
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2, tie_word_embeddings=True),
    ),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=8, attention_bias=True, tie_word_embeddings=True)),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(GEMMA, sliding_window=WINDOW, attn_logit_softcapping=20.0, final_logit_softcapping=15.0),
    ),
    "gemma3_text": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(GEMMA, sliding_window=WINDOW, sliding_window_pattern=3, final_logit_softcapping=15.0),
    ),
    "gemma3": (
        "Gemma3Config",
        "Gemma3ForConditionalGeneration",
        dict(GEMMA, sliding_window=WINDOW, sliding_window_pattern=3),
    ),
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            sliding_window=WINDOW,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
        ),
    ),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_inner=64, bos_token_id=1, eos_token_id=2)),
}

# A tiny SigLIP tower, only so that a multimodal Gemma 3 checkpoint can be built; text prompts never use it.
GEMMA3_VISION = dict(
    hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
)


def has_window(name: str) -> bool:
    return "sliding_window" in TINY_CONFIGS[name][2]


def build_config(name: str, window: int | None = None):
    config_cls, _, overrides = TINY_CONFIGS[name]
    fields = {**COMMON, **overrides}
    if window is not None:
        if not has_window(name):
            raise ValueError(f"{name} has no sliding-window attention")
        fields["sliding_window"] = window
    if name == "gemma3":
        return transformers.Gemma3Config(
            text_config=fields, vision_config=GEMMA3_VISION, mm_tokens_per_image=4, image_token_id=10**6
        )
    return getattr(transformers, config_cls)(**fields)


@functools.cache
def tiny_model(name: str, dtype: torch.dtype = torch.float64, seed: int = 0, window: int | None = None):
    _, model_cls, _ = TINY_CONFIGS[name]
    config = build_config(name, window)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("bias") or "norm" in param_name or ".ln_" in param_name:
                param.add_(0.1 * torch.randn_like(param))
    model = model.to(dtype).eval()
    model.generation_config.pad_token_id = model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    return model


def random_prompt(length: int, vocab: int = COMMON["vocab_size"], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (1, length), generator=g)


def make_head(model, path, *, exit_layer: int, source_layer: int | None = None, noise: float = 0.0, seed: int = 0):
    """Save an (untrained) exit head for `model`: a copy of `source_layer`, its weights perturbed by `noise`."""
    from selfspec.registry import model_parts
    from selfspec.head import ExitHead, save_head

    parts = model_parts(model)
    head = ExitHead.from_model(parts, exit_layer=exit_layer, source_layer=source_layer)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in head.parameters():
            param.add_(noise * torch.randn(param.shape, generator=g, dtype=param.dtype).to(param.device))
    return save_head(path, head, model=model, parts=parts, training={"note": "untrained test head"})


def make_feature_head(model, path, *, reads: tuple[int, ...] | None = None, noise: float = 0.05, seed: int = 0,
                      layout: str = "joined"):
    """Save an (untrained) feature head of `layout` for `model`, its weights perturbed by `noise`."""
    from selfspec.registry import model_parts
    from selfspec.feature_head import FeatureHead, save_feature_head

    parts = model_parts(model)
    head = FeatureHead.from_model(parts, reads=reads, layout=layout)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in head.parameters():
            param.add_(noise * torch.randn(param.shape, generator=g, dtype=param.dtype).to(param.device))
    return save_feature_head(path, head, model=model, parts=parts, training={"note": "untrained test head"})


def make_vocab(model, path, *, seed: int = 0):
    """Save a draft vocabulary for `model` counted on random sequences (skewed, so the order matters)."""
    from selfspec.registry import model_parts
    from selfspec.vocab import count_tokens, save_vocab

    parts = model_parts(model)
    vocab = parts.lm_head.weight.shape[0]
    g = torch.Generator().manual_seed(seed)
    weights = torch.rand(vocab, generator=g) ** 4
    seqs = [torch.multinomial(weights, 64, replacement=True, generator=g).tolist() for _ in range(8)]
    return save_vocab(path, count_tokens(seqs, vocab), model=model, parts=parts, source="random test sequences")


def save_word_tokenizer(folder, words: list[str]) -> None:
    """A word-level tokenizer over `words` (its first two: the unknown and the pad token), saved in `folder`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token=words[0],
                                         pad_token=words[1]).save_pretrained(folder)


def save_tiny_llama(folder, words: list[str], **config) -> None:
    """A random Llama over `words` (a word-level tokenizer), saved as a Hugging Face folder: 2 layers of width 16
    unless `config` says otherwise."""
    fields = dict(vocab_size=len(words), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                  tie_word_embeddings=True, initializer_range=0.3, pad_token_id=1, bos_token_id=None,
                  eos_token_id=None)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**fields, **config})).save_pretrained(folder)
    save_word_tokenizer(folder, words)
