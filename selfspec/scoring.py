"""From logits to choices: the user's logits processors, then argmax or sampling.

The same processors (from `generate()`'s settings) are applied to the draft's
and the target's logits, each row with the token prefix it is conditioned on,
so a processor that looks at earlier tokens (a repetition penalty, say) sees
what it would see in plain decoding.

This module does not know layers, caches or the acceptance rule.
"""

from __future__ import annotations

import torch

from .hf_generation import GenerationSettings


class Scorer:
    def __init__(self, settings: GenerationSettings, generator: torch.Generator | None) -> None:
        self.processors = settings.processors
        self.do_sample = settings.do_sample
        self.generator = generator

    def scores(self, logits: torch.Tensor, tokens: list[int] | torch.Tensor, first: int) -> torch.Tensor:
        """Processed scores `[m, vocab]`: row j is conditioned on `tokens[:first + j]` (a list or a 1-d tensor)."""
        if not self.processors:
            return logits
        if not isinstance(tokens, torch.Tensor):
            tokens = torch.tensor(tokens, device=logits.device)
        rows = [self.processors(tokens[None, : first + j], logits[j : j + 1]) for j in range(logits.shape[0])]
        return torch.cat(rows)

    def tree_scores(self, logits: torch.Tensor, tokens: list[int], tree) -> torch.Tensor:
        """Processed scores `[n+1, vocab]` of a token tree's rows: row r is conditioned on `tokens` and r's ancestors."""
        if not self.processors:
            return logits
        rows = [[]] + [tree.path_tokens(tree.path_to(i)) for i in range(len(tree))]
        return torch.cat([self.scores(logits[r : r + 1], tokens + row, len(tokens) + len(row))
                          for r, row in enumerate(rows)])

    def probs(self, scores: torch.Tensor) -> torch.Tensor:
        return torch.softmax(scores, dim=-1)

    def target_choice(self, scores: torch.Tensor) -> int:
        """The target's token from one row of scores `[1, vocab]`."""
        if self.do_sample:
            return int(torch.multinomial(self.probs(scores)[0], 1, generator=self.generator))
        return int(scores[0].argmax())

    def draft_choice_on_device(
        self, scores: torch.Tensor, *, with_confidence: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """As `draft_choice`, read nothing back: the token `[1, 1]`, its confidence (0-d) and q `[vocab]` on the device."""
        if self.do_sample:
            q = self.probs(scores)[0]  # [vocab]
            token = torch.multinomial(q, 1, generator=self.generator)  # [1]
            return token.view(1, 1), q.max() if with_confidence else None, q
        top = scores[0].argmax()  # 0-d
        confidence = torch.softmax(scores[0], dim=-1)[top] if with_confidence else None
        return top.view(1, 1), confidence, None

    def draft_choice(
        self, scores: torch.Tensor, *, with_confidence: bool
    ) -> tuple[int, float | None, torch.Tensor | None]:
        """The draft's token, its confidence (top probability, if asked) and q `[vocab]` when sampling."""
        if self.do_sample:
            q = self.probs(scores)[0]
            token = int(torch.multinomial(q, 1, generator=self.generator))
            return token, float(q.max()) if with_confidence else None, q
        top = scores[0].argmax()
        confidence = float(torch.softmax(scores[0], dim=-1)[top]) if with_confidence else None
        return int(top), confidence, None
