"""The acceptance rule: which drafted tokens the target keeps, losslessly.

Notation, used this way everywhere in selfspec: `p` is the target's
distribution, `q` the draft's. (Published code uses the letters both ways.)

- Greedy: keep the longest prefix of the draft that equals the target's own
  argmax choices, then add the target's choice at the first mismatch (a
  *recovered* token) or after the last drafted token (a *bonus* token). The
  result is token-identical to greedy decoding with the target alone.
- Sampling (Leviathan et al. 2023; Chen et al. 2023): accept drafted token x
  with probability min(1, p(x) / q(x)); at the first rejection sample the
  recovered token from the normalised residual max(0, p - q); when every
  drafted token is accepted, sample a bonus token from p. The emitted tokens
  are distributed exactly as if sampled from p one at a time.

Both functions take scores that have already been through the caller's logits
processors; this module does not know about processors, caches or layers.
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
    """`target_scores` `[k+1, vocab]`: row i scores the token after draft position i."""
    choices = target_scores.argmax(dim=-1).tolist()
    accepted = 0
    while accepted < len(draft_tokens) and draft_tokens[accepted] == choices[accepted]:
        accepted += 1
    return Verdict(accepted, choices[accepted])


def accept_sampling(
    draft_tokens: list[int],
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> Verdict:
    """`draft_probs` q `[k, vocab]`, `target_probs` p `[k+1, vocab]` (rows sum to 1)."""
    k = len(draft_tokens)
    if k:
        index = torch.arange(k, device=target_probs.device)
        tokens = torch.tensor(draft_tokens, device=target_probs.device)
        p_x = target_probs[index, tokens]  # [k]
        q_x = draft_probs[index, tokens]  # [k]
        u = torch.rand(k, generator=generator, device=target_probs.device)
        rejected = (u * q_x > p_x).nonzero()  # accept iff u < p/q
        if len(rejected):
            i = int(rejected[0, 0])
            residual = (target_probs[i] - draft_probs[i]).clamp_min(0)  # [vocab]
            if residual.sum() <= 0:  # p == q up to rounding: the residual is p itself
                residual = target_probs[i]
            return Verdict(i, sample(residual, generator))
    return Verdict(k, sample(target_probs[k], generator))


def sample(weights: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """One token from unnormalised non-negative `weights` `[vocab]`."""
    return int(torch.multinomial(weights.float(), 1, generator=generator))
