"""One sequence's growing tokens and when they stop; a clock that measures work, not launches.

`Output` holds the prompt and what was emitted so far, applies the stopping
rules of `model.generate` (EOS, `max_new_tokens`, the stopping criteria, all
checked token by token) and feeds the streamer one `put` per emitted chunk.
The single-sequence loop (`engine.py`) has one; a batch (`batch.py`) has one
per row. This module does not know models, caches or drafts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .hf_generation import GenerationSettings


class Output:
    """The growing token sequence; decides when generation stops and feeds the streamer."""

    def __init__(self, prompt: list[int], settings: GenerationSettings, streamer) -> None:
        self.tokens = list(prompt)
        self.limit = len(prompt) + settings.max_new_tokens
        self.eos = settings.eos_token_ids
        self.criteria = settings.stopping_criteria
        self.streamer = streamer
        self.done = False

    @property
    def remaining(self) -> int:
        return self.limit - len(self.tokens)

    def emit(self, chunk: list[int]) -> None:
        kept = []
        for token in chunk:
            self.tokens.append(token)
            kept.append(token)
            if token in self.eos or len(self.tokens) >= self.limit or self._criteria_met():
                self.done = True
                break
        if self.streamer is not None:
            self.streamer.put(torch.tensor(kept))

    def _criteria_met(self) -> bool:
        if not self.criteria:
            return False
        return bool(self.criteria(torch.tensor([self.tokens]), None).any())


@dataclass
class Clock:
    """Wall-clock laps; synchronises CUDA so a lap measures the work, not the launch."""

    device: torch.device

    def __post_init__(self) -> None:
        self.begin = self.mark = time.perf_counter()

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def lap(self) -> float:
        now = self._now()
        lap, self.mark = now - self.mark, now
        return lap

    def total(self) -> float:
        return self._now() - self.begin
