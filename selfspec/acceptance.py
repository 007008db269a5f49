"""The acceptance rule: which drafted tokens the target keeps, losslessly.

`p` is the target's distribution and `q` the draft's, everywhere in selfspec
(published code uses the letters both ways).

- Greedy: keep the longest drafted prefix equal to the target's argmax
  choices, then the target's own choice (a *recovered* token at the first
  mismatch, else a *bonus* token): identical to greedy decoding.
- Sampling (Leviathan et al. 2023; Chen et al. 2023): accept x with
  probability min(1, p(x) / q(x)); at the first rejection sample from the
  normalised residual max(0, p - q); when all are accepted, sample a bonus
  token from p. The tokens are distributed exactly as p's samples.

Each rule is written once, on the device (`accept_greedy_on_device`,
`accept_sampling_on_device`: the accepted count 0-d and the next token `[1]`,
read nothing back, so the static step syncs once per round after them);
`accept_greedy` and `accept_sampling` are the same rules read back.

Scores arrive already processed; this module does not know logits
processors, caches or layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Verdict:
    """The outcome of verifying one round's draft."""

    accepted: int  # how many drafted tokens the target kept
    next_token: int  # the target's own token: recovered (accepted < drafted) or bonus


def accept_greedy(draft_tokens: list[int], target_scores: torch.Tensor) -> Verdict:
    """`target_scores` `[k+1, vocab]`: row i scores the token after draft position i (`accept_greedy_on_device`)."""
    draft = torch.tensor(draft_tokens, dtype=torch.long, device=target_scores.device)  # [k]
    return read_verdict(*accept_greedy_on_device(draft, target_scores))


def accept_sampling(
    draft_tokens: list[int],
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> Verdict:
    """`draft_probs` q `[k, vocab]`, `target_probs` p `[k+1, vocab]` (rows sum to 1) (`accept_sampling_on_device`)."""
    draft = torch.tensor(draft_tokens, dtype=torch.long, device=target_probs.device)  # [k]
    return read_verdict(*accept_sampling_on_device(draft, draft_probs, target_probs, generator))


def read_verdict(accepted: torch.Tensor, next_token: torch.Tensor) -> Verdict:
    """A device rule's (accepted 0-d, next token `[1]`) read back in one transfer."""
    accepted, token = torch.cat([accepted.view(1), next_token.view(1)]).tolist()
    return Verdict(accepted, token)


def sample(weights: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """One token from unnormalised non-negative `weights` `[vocab]`."""
    return int(torch.multinomial(weights.float(), 1, generator=generator))


def accept_greedy_on_device(draft: torch.Tensor, target_scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`draft` `[k]`, `target_scores` `[k+1, vocab]`: (accepted 0-d, next token `[1]`), on the device."""
    k = draft.shape[0]
    choices = target_scores.argmax(dim=-1)  # [k+1]
    accepted = (choices[:k] == draft).long().cumprod(0).sum()  # 0-d: the agreeing prefix
    return accepted, choices.index_select(0, accepted.view(1))


def accept_sampling_on_device(
    draft: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`draft` `[k]`, q `[k, vocab]`, p `[k+1, vocab]`: (accepted 0-d, next token `[1]`), on the device."""
    k = draft.shape[0]
    device = target_probs.device
    if k == 0:
        return torch.zeros((), dtype=torch.long, device=device), torch.multinomial(target_probs[0].float(), 1, generator=generator)
    index = torch.arange(k, device=device)
    p_x = target_probs[index, draft]  # [k]
    q_x = draft_probs[index, draft]  # [k]
    u = torch.rand(k, generator=generator, device=device)
    accepted = (u * q_x <= p_x).long().cumprod(0).sum()  # 0-d: accept iff u < p/q, up to the first rejection
    q_rows = torch.cat([draft_probs, torch.zeros_like(draft_probs[:1])])  # [k+1, vocab]: no q after the last draft
    p_row = target_probs.index_select(0, accepted.view(1))[0]  # [vocab]
    residual = (p_row - q_rows.index_select(0, accepted.view(1))[0]).clamp_min(0)  # p itself after the last draft
    residual = torch.where(residual.sum() > 0, residual, p_row)  # p == q up to rounding: the residual is p
    return accepted, torch.multinomial(residual.float(), 1, generator=generator)
