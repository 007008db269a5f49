"""A wrapper's batches: the session it opens (`open_session`) and a left-padded batch through it (`generate_rows`).

`open_session` gives a `BatchSession` (`batch.py`) what the wrapper knows:
how a row's options resolve (as `model.generate` resolves them), what passes
over R rows cost (`batch_costs`: measured once per row count, cached on
disk), the layers a batched draft step runs, the kernels, head, vocabulary
and prefix cache. `generate_rows` adds every row of a padded batch to one
session, steps it until every row is done, and pads the output as
`model.generate` pads it.

It does not run a round (`batch.py`) nor time a pass (`batch_runner.py`).
"""

from __future__ import annotations

import copy
import functools
import warnings

import torch

from .batch import BatchSession
from .costs import RuntimeCosts
from .feature_head import FeatureHead
from .hf_generation import GenerationSettings, resolve_settings
from .output import Clock


def open_session(spec) -> BatchSession:
    """`spec.batch_session()`: a session over the wrapper `spec`'s model, plan and kernels. It warns where a batch
    runs the wrapper otherwise than one sequence does: on the eager step, with an auto plan's reference set."""
    notes = []
    if spec.step != "eager":
        notes.append(f"a batch's passes run the eager step, not step={spec.step!r} (one sequence's)")
    if spec.plan.auto and spec.plan.drafts:
        notes.append(f"a batch drafts with the auto plan's reference layer set "
                     f"{list(batch_draft_layers(spec))}, not a set chosen per context (one sequence's)")
    if notes:
        warnings.warn(f"plan {spec.describe_plan()!r}: " + "; ".join(notes), stacklevel=3)
    return BatchSession(spec.parts, spec.plan, settings_for=functools.partial(row_settings, spec),
                        costs_for=lambda rows, learn: batch_costs(spec, rows, learn),
                        check_context=spec.check_context, linear=spec.linear_kernels(),
                        attention=spec.attention_kernels(), draft_layers=batch_draft_layers(spec),
                        head=spec.head, vocab=spec.vocab, prefix=spec.prefix)


def row_settings(spec, prompt: list[int], *, logits_processor, stopping_criteria, kwargs, generation_config=None,
                 tokenizer=None) -> GenerationSettings:
    """A row's generation settings, resolved as `model.generate` resolves them for that prompt alone."""
    device = spec.parts.lm_head.weight.device
    return resolve_settings(spec.model, prompt=torch.tensor([prompt], dtype=torch.long, device=device),
                            has_attention_mask=True, generation_config=generation_config,
                            logits_processor=logits_processor, stopping_criteria=stopping_criteria,
                            tokenizer=tokenizer, device=device, kwargs=kwargs)


def batch_costs(spec, rows: int, learn: bool) -> RuntimeCosts:
    """What a pass over `rows` rows costs here, by width, and a draft step over them: measured once per row
    count (and cached on disk); refined by the rounds only when `learn` and the wrapper is not reproducible."""
    return spec.cost_tables.batch_costs(rows, learn and not spec.reproducible, injected=spec.injected_costs,
                                        width=spec.plan.draft_length + 1, draft_layers=batch_draft_layers(spec),
                                        draft=spec.describe_plan(), head=spec.head, vocab=spec.vocab)


def batch_draft_layers(spec) -> tuple[int, ...]:
    """The layers a batch's draft step runs: the plan's (an auto plan's reference set), or 0..E-1 and a head."""
    if isinstance(spec.head, FeatureHead):
        return (spec.head.slot,)
    if spec.head is not None:
        return (*range(spec.head.exit_layer), spec.head.slot)
    return tuple(spec.plan.draft_layers(spec.parts.num_layers))


def generate_rows(spec, input_ids: torch.Tensor, prompts: list[list[int]], *, generation_config, logits_processor,
                  stopping_criteria, streamer, generator, tokenizer, kwargs):
    """A left-padded batch: every row in one `BatchSession`; the output padded as `model.generate` pads it."""
    if streamer is not None and len(prompts) > 1:
        raise ValueError(f"a streamer takes one sequence; this batch has {len(prompts)} "
                         f"(valid: batch size 1 with a streamer, as transformers' streamers)")
    device = spec.parts.lm_head.weight.device
    padded = input_ids.to(device)
    # The length rule counts the padded prompt, as model.generate does; each row then gets that many new tokens.
    whole = resolve_settings(spec.model, prompt=padded[:1], has_attention_mask=True,
                             generation_config=generation_config, logits_processor=None, stopping_criteria=None,
                             tokenizer=tokenizer, device=device, kwargs=kwargs)
    row_kwargs = {k: v for k, v in kwargs.items() if k != "max_length"}
    row_kwargs["max_new_tokens"] = whole.max_new_tokens
    if generation_config is not None:
        generation_config = copy.deepcopy(generation_config)
        generation_config.max_length = None
    session = spec.batch_session()
    clock = Clock(spec.parts.device)
    rows = [session.add(prompt, streamer=streamer, stopping_criteria=stopping_criteria,
                        logits_processor=logits_processor, generator=generator,
                        generation_config=generation_config, tokenizer=tokenizer, **row_kwargs)
            for prompt in prompts]
    while len(session):
        session.step()
    stats = session.stats
    stats.total_seconds = clock.total()
    stats.plan = spec.describe_plan()
    spec.last_stats = stats
    pad = whole.config._pad_token_tensor
    pad = int(pad.reshape(-1)[0]) if pad is not None else min(whole.eos_token_ids, default=0)
    longest = max(len(row.new_tokens) for row in rows)
    new = [row.new_tokens + [pad] * (longest - len(row.new_tokens)) for row in rows]
    sequences = torch.cat([input_ids.long(), torch.tensor(new, dtype=torch.long, device=input_ids.device)], dim=1)
    return whole.output(sequences)
