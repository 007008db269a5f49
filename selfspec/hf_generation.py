"""The bridge to transformers' generation utilities, in one place.

`generate()` must mean what it means in transformers: the same merge of the
model's `generation_config` with the caller's keyword arguments (an explicit
`None` overrides the model's default, as in transformers), the same length
rule (no `max_new_tokens` and no `max_length`: 20 *new* tokens), the same
logits processors and warpers (repetition penalty, temperature, top-k, top-p,
min-new-tokens, ...) in the same order, and the same stopping criteria
(`max_time`, `stop_strings` with `tokenizer=`). Rather than re-deriving those
rules we call transformers' own helpers. They are private methods of
`GenerationMixin`, so every use of them is kept in this module; the tested
transformers range is pinned in pyproject.toml.

Every `GenerationConfig` field is either implemented here, without effect on
which tokens come out (cache and compile settings, beam-only settings), or
refused with a clear error when set to anything but its default. The refused
list is derived from the fields a fresh `GenerationConfig` has, so a field a
later transformers adds is refused, never silently ignored.

This module knows nothing about drafting or caches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation import GenerateDecoderOnlyOutput, MaxTimeCriteria, StopStringCriteria

# Fields selfspec implements exactly as transformers does.
SUPPORTED_FIELDS = frozenset({
    # length and stopping
    "max_length", "max_new_tokens", "min_length", "min_new_tokens", "max_time", "stop_strings",
    # choice of tokens: logits processors and warpers, applied to draft and target alike
    "do_sample", "temperature", "top_k", "top_p", "min_p", "top_h", "typical_p", "epsilon_cutoff", "eta_cutoff",
    "repetition_penalty", "encoder_repetition_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size",
    "bad_words_ids", "renormalize_logits", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens", "sequence_bias",
    "watermarking_config",
    # special tokens and the output's form
    "pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "return_dict_in_generate",
})
# Fields that do not change which tokens come out here: selfspec keeps its own cache and does not compile,
# and beam-search settings have no effect without beams (num_beams > 1 is refused).
NO_EFFECT_FIELDS = frozenset({
    "use_cache", "cache_implementation", "cache_config", "max_cache_len", "compile_config", "disable_compile",
    "prefill_chunk_size", "early_stopping", "length_penalty", "transformers_version",
})
LENGTH_ARGUMENTS = ("max_new_tokens", "max_length", "min_new_tokens", "min_length")


@dataclass(frozen=True)
class GenerationSettings:
    """What one `generate()` call asked for, resolved against the model's defaults."""

    config: GenerationConfig
    max_new_tokens: int
    do_sample: bool
    eos_token_ids: frozenset[int]
    processors: LogitsProcessorList
    stopping_criteria: StoppingCriteriaList
    return_dict: bool = False

    def output(self, sequences: torch.Tensor):
        """`sequences`, or (with `return_dict_in_generate=True`) transformers' output object holding them."""
        return GenerateDecoderOnlyOutput(sequences=sequences) if self.return_dict else sequences


def generation_fields() -> frozenset[str]:
    """The public fields of a fresh `GenerationConfig` of the installed transformers."""
    return frozenset(name for name in vars(GenerationConfig()) if not name.startswith("_"))


def unsupported_settings(config: GenerationConfig) -> dict[str, Any]:
    """Fields of `config` set to a non-default value that selfspec does not implement."""
    fields = {name for name in vars(type(config)()) if not name.startswith("_")}
    defaults = GenerationConfig._get_default_generation_params()
    bad = {}
    for name in sorted(fields - SUPPORTED_FIELDS - NO_EFFECT_FIELDS):
        value = getattr(config, name, None)
        default = defaults.get(name)
        if value is None or value is False and not default:
            continue
        if value != default:
            bad[name] = value
    return bad


def check_length_argument(name: str, value: Any) -> int | None:
    """An integer length argument (integral floats accepted, as transformers does); ValueError otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}={value!r} must be an integer")
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            raise ValueError(f"{name}={value!r} must be a whole number of tokens")
        value = int(value)
    if value < 0 or (name == "max_new_tokens" and value < 1):
        low = 1 if name == "max_new_tokens" else 0
        raise ValueError(f"{name}={value} out of range (valid: >= {low})")
    return value


def resolve_settings(
    model,
    *,
    prompt: torch.Tensor,
    has_attention_mask: bool,
    generation_config: GenerationConfig | None,
    logits_processor: LogitsProcessorList | None,
    stopping_criteria: StoppingCriteriaList | None,
    tokenizer=None,
    device: torch.device,
    kwargs: dict[str, Any],
) -> GenerationSettings:
    """Resolve one call's arguments as `GenerationMixin.generate` does; `prompt` is `[1, n]` int64 on `device`.

    `kwargs` are exactly the generation arguments the caller passed (a `None`
    among them overrides the model's default, as in transformers).
    """
    if generation_config is not None and not isinstance(generation_config, GenerationConfig):
        raise ValueError(f"generation_config must be a transformers.GenerationConfig, got {type(generation_config).__name__}")
    kwargs = dict(kwargs)
    if "max_length" in kwargs and kwargs["max_length"] is None:
        # transformers 5.24 crashes on an explicit max_length=None (None + int) although it counts it as the
        # default; we take it as the default it stands for: 20 new tokens.
        del kwargs["max_length"]
    for name in LENGTH_ARGUMENTS:
        if name in kwargs:
            kwargs[name] = check_length_argument(name, kwargs[name])
    prompt_length = int(prompt.shape[1])
    # As in GenerationMixin.generate: decided before the configs are merged with their defaults.
    has_default_max_length = (
        kwargs.get("max_length") is None
        and (generation_config is None or generation_config.max_length is None)
        and model.generation_config.max_length is None
    )
    has_default_min_length = (
        kwargs.get("min_length") is None
        and (generation_config is None or generation_config.min_length is None)
        and model.generation_config.min_length is None
    )
    config, unused = model._prepare_generation_config(generation_config, **kwargs)
    unused = {k: v for k, v in unused.items() if k not in ("output_attentions", "output_hidden_states")}
    if unused:
        raise ValueError(
            f"generate() got unsupported keyword argument(s): {sorted(unused)} "
            "(valid: the fields of transformers.GenerationConfig that selfspec implements, "
            "attention_mask, streamer, generator, tokenizer, logits_processor, stopping_criteria)"
        )
    bad = unsupported_settings(config)
    if bad:
        name, value = next(iter(bad.items()))
        default = GenerationConfig._get_default_generation_params().get(name)
        others = f"; also set and unsupported: {sorted(bad)[1:]}" if len(bad) > 1 else ""
        raise ValueError(f"{name}={value!r} is not supported by selfspec (valid: {default!r}, the default){others}")
    for name in LENGTH_ARGUMENTS:  # a generation_config object may carry them too
        setattr(config, name, check_length_argument(name, getattr(config, name)))

    # The length rule of transformers, with its warnings: 20 new tokens by default, capped by the context.
    config = model._prepare_generated_length(
        generation_config=config,
        has_default_max_length=has_default_max_length,
        has_default_min_length=has_default_min_length,
        model_input_name="input_ids",
        input_ids_length=prompt_length,
        inputs_tensor=prompt,
    )
    model._validate_generated_length(config, prompt_length, has_default_max_length)
    max_new_tokens = int(config.max_length) - prompt_length

    # Sets the tensors (`_eos_token_tensor`, ...) that processors such as min_new_tokens read.
    model._prepare_special_tokens(config, kwargs_has_attention_mask=has_attention_mask, device=device, batch_size=1)
    eos = config._eos_token_tensor  # 1-d (or None) whether given as an int, a list or a tensor
    eos_ids = frozenset() if eos is None else frozenset(int(t) for t in eos.reshape(-1).tolist())
    processors = model._get_logits_processor(
        generation_config=config,
        input_ids_seq_length=prompt_length,
        encoder_input_ids=prompt,
        logits_processor=LogitsProcessorList(logits_processor or []),
        device=device,
        model_kwargs={"attention_mask": None},  # batch of one, no padding
    )
    return GenerationSettings(
        config=config,
        max_new_tokens=max_new_tokens,
        do_sample=bool(config.do_sample),
        eos_token_ids=eos_ids,
        processors=processors,
        stopping_criteria=_stopping_criteria(model, config, stopping_criteria, tokenizer),
        return_dict=bool(config.return_dict_in_generate),
    )


def _stopping_criteria(model, config: GenerationConfig, user, tokenizer) -> StoppingCriteriaList:
    """`max_time`, `stop_strings` and the caller's criteria, as `GenerationMixin._get_stopping_criteria` builds them.

    The length limit and EOS are the engine's own checks (the same rules).
    """
    criteria = StoppingCriteriaList()
    if config.max_time is not None:
        criteria.append(MaxTimeCriteria(max_time=config.max_time))
    if config.stop_strings is not None:
        if tokenizer is None:
            raise ValueError(
                f"stop_strings={config.stop_strings!r} needs the model's tokenizer: pass tokenizer= to generate()"
            )
        criteria.append(StopStringCriteria(stop_strings=config.stop_strings, tokenizer=tokenizer))
    return model._merge_criteria_processor_list(criteria, StoppingCriteriaList(user or []))



def inferred_padding(model, input_ids, *, generation_config, kwargs: dict[str, Any]):
    """The tokens `model.generate` hides in `input_ids` given without an `attention_mask`, moved to the left as padding.

    With no mask, transformers infers one as `input_ids != pad_token_id` when
    the prompt holds the pad id and the pad id is not an EOS id (an
    `eos_token_id` that leaves it out): those tokens are neither attended to
    nor counted in positions, so the other tokens compute exactly what they
    compute with the hidden ones as left padding. Returns None when nothing is
    hidden (or `input_ids` is not a batch of ids: the caller's checks report
    it), else `(ids, mask)`: each row's hidden tokens first, then the others,
    and the left-padding mask. A row whose last token is hidden is refused:
    what transformers computes there has no padded equivalent. Emits the
    warnings transformers emits for a batch given without a mask.
    """
    if (not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype not in (torch.int, torch.long)
            or 0 in input_ids.shape or input_ids.device.type == "meta"):
        return None
    if generation_config is not None and not isinstance(generation_config, GenerationConfig):
        return None
    special = {k: kwargs[k] for k in ("pad_token_id", "eos_token_id", "bos_token_id") if k in kwargs}
    config, _ = model._prepare_generation_config(generation_config, **special)
    model._prepare_special_tokens(config, kwargs_has_attention_mask=False, device=input_ids.device,
                                  batch_size=int(input_ids.shape[0]))
    mask = model._prepare_attention_mask_for_generation(input_ids, config, {}).bool()
    if bool(mask.all()):
        return None
    pad = int(config._pad_token_tensor.reshape(-1)[0])
    for row in range(mask.shape[0]):
        if not mask[row, -1]:
            where = "the prompt" if mask.shape[0] == 1 else f"row {row} of input_ids"
            raise ValueError(f"{where} ends with the pad token id {pad}, which model.generate hides when no "
                             f"attention_mask is given and the pad id is not an EOS id (it infers the mask "
                             f"input_ids != {pad}); selfspec cannot reproduce that: pass attention_mask (all 1s to "
                             f"attend to every token), or an eos_token_id that includes {pad}")
    order = torch.argsort(mask.long(), dim=1, stable=True)  # hidden (0) first, each group in its own order
    return torch.gather(input_ids, 1, order), torch.gather(mask.long(), 1, order)
