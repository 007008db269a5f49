"""Checks on what `generate` is handed: prompts as `model.generate` takes them, and room in the context.

Each failure is a ValueError naming the bad value and the valid range. This
module knows tensors, the vocabulary size and the context length; nothing
about models, plans or decoding.
"""

from __future__ import annotations

import torch


def check_prompts(input_ids, attention_mask, *, vocab_size: int, device: torch.device) -> list[list[int]]:
    """Each row's prompt, its left padding removed; a clear error for anything else (`device`: the model's)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        got = f"a {input_ids.dim()}-d tensor" if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be a [batch, length] tensor of token ids, got {got}")
    if input_ids.dtype == torch.bool or input_ids.dtype.is_floating_point or input_ids.dtype.is_complex:
        raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype} (valid: torch.long)")
    if input_ids.device.type == "meta":
        raise ValueError(f"input_ids is on the meta device (no data); valid: the CPU or the model's device "
                         f"({device})")
    batch, length = input_ids.shape
    if batch < 1:
        raise ValueError("input_ids has no rows (valid: batch size >= 1)")
    if length < 1:
        raise ValueError("input_ids is empty: the prompt needs at least one token")
    pads = [0] * batch
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != tuple(input_ids.shape):
            shape = list(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
            raise ValueError(f"attention_mask of shape {shape} does not match input_ids of shape "
                             f"{list(input_ids.shape)} (valid: the same shape)")
        for row, mask in enumerate(attention_mask.tolist()):
            pads[row] = pad = length - sum(1 for m in mask if m)
            if any(mask[:pad]) or not all(mask[pad:]) or pad == length:
                what = "no token" if pad == length else "padding that is not all on the left"
                raise ValueError(f"attention_mask row {row} has {what}: {mask} (valid: left padding, 0s then "
                                 f"at least one 1, as model.generate takes it; tokenizer.padding_side='left')")
    prompts = []
    for row, pad in enumerate(pads):
        prompt = input_ids[row, pad:].tolist()
        if min(prompt) < 0 or max(prompt) >= vocab_size:
            position, token = next((pad + i, t) for i, t in enumerate(prompt) if not 0 <= t < vocab_size)
            where = f"position {position}" if batch == 1 else f"row {row}, position {position}"
            raise ValueError(f"input_ids holds token id {token} at {where}, out of range for the "
                             f"model's vocabulary of {vocab_size} tokens (valid: 0..{vocab_size - 1})")
        prompts.append(prompt)
    return prompts


def check_context(context: int | None, prompt_length: int, max_new_tokens: int | None) -> None:
    """The prompt, and the prompt with `max_new_tokens` more (when given), must fit in the `context` (positions;
    None: no limit known)."""
    if context is None:
        return
    if prompt_length >= context:
        where = "is longer than" if prompt_length > context else "fills"
        raise ValueError(
            f"prompt of {prompt_length} tokens {where} the model's context (max_position_embeddings={context}): "
            f"no token can be generated after it (valid prompt length: 1..{context - 1})"
        )
    if max_new_tokens is not None and prompt_length + max_new_tokens > context:
        raise ValueError(
            f"prompt ({prompt_length} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
            f"context of {context} tokens (valid max_new_tokens: 1..{context - prompt_length})"
        )
