"""Calibration: the target's own greedy continuations of the prompts, the tokens a draft must predict.

Generated once, with the engine's plain path (which also gives the plain
speed). It knows nothing about drafts, costs or layer sets.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from ..engine import wrap
from ..plan import DraftPlan
from ..prompts import as_ids


@dataclass(frozen=True)
class CalibrationSequence:
    """A prompt and the target's greedy continuation of it (what the draft must predict)."""

    tokens: tuple[int, ...]  # prompt + generated
    prompt_length: int
    max_new_tokens: int  # the limit it was generated with (fewer tokens mean EOS came first)

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_length


def make_calibration(
    model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 48, progress: bool = True
) -> tuple[list[CalibrationSequence], float]:
    """Greedy continuations with the engine's plain path; also returns its speed (tokens/s)."""
    plain = wrap(model, plan=DraftPlan.plain())
    sequences, tokens, seconds = [], 0, 0.0
    for prompt in tqdm(prompts, desc="calibration (plain greedy)", disable=not progress, leave=False):
        ids = as_ids(prompt)
        out = plain.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)
        sequences.append(CalibrationSequence(tuple(out[0].tolist()), len(ids), max_new_tokens))
        tokens += plain.last_stats.new_tokens
        seconds += plain.last_stats.total_seconds
    return sequences, tokens / seconds if seconds else 0.0
