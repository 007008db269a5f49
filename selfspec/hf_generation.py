"""The bridge to transformers' generation utilities, in one place.

`generate()` must mean what it means in transformers: the same merge of the
model's `generation_config` with the caller's keyword arguments, and the same
logits processors and warpers (repetition penalty, temperature, top-k, top-p,
min-new-tokens, ...), in the same order. Rather than re-deriving those rules we
call transformers' own helpers. They are private methods of `GenerationMixin`,
so every use of them is kept in this module; the tested transformers range is
pinned in pyproject.toml.

This module knows nothing about drafting or caches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList


@dataclass(frozen=True)
class GenerationSettings:
    """What one `generate()` call asked for, resolved against the model's defaults."""

    config: GenerationConfig
    max_new_tokens: int
    do_sample: bool
    eos_token_ids: frozenset[int]
    processors: LogitsProcessorList
    stopping_criteria: StoppingCriteriaList


def resolve_settings(
    model,
    *,
    prompt_length: int,
    generation_config: GenerationConfig | None,
    logits_processor: LogitsProcessorList | None,
    stopping_criteria: StoppingCriteriaList | None,
    device: torch.device,
    **kwargs,
) -> GenerationSettings:
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    config, unused = model._prepare_generation_config(generation_config, **kwargs)
    if unused:
        raise ValueError(f"generate() got unsupported keyword argument(s): {sorted(unused)}")
    for name in ("num_beams", "num_return_sequences"):
        value = getattr(config, name, None)
        if value not in (None, 1):
            raise ValueError(f"{name}={value} is not supported by selfspec (valid: 1)")

    if config.max_new_tokens is not None:
        max_new_tokens = config.max_new_tokens
    else:
        max_new_tokens = config.max_length - prompt_length
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} out of range (valid: >= 1)")

    # Sets the tensors (`_eos_token_tensor`, ...) that processors such as min_new_tokens read.
    model._prepare_special_tokens(config, kwargs_has_attention_mask=True, device=device, batch_size=1)
    eos = config.eos_token_id
    eos_ids = frozenset([] if eos is None else [eos] if isinstance(eos, int) else list(eos))
    processors = model._get_logits_processor(
        generation_config=config,
        input_ids_seq_length=prompt_length,
        logits_processor=LogitsProcessorList(logits_processor or []),
        device=device,
    )
    return GenerationSettings(
        config=config,
        max_new_tokens=max_new_tokens,
        do_sample=bool(config.do_sample),
        eos_token_ids=eos_ids,
        processors=processors,
        stopping_criteria=StoppingCriteriaList(stopping_criteria or []),
    )
