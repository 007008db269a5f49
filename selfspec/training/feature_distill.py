"""Train a feature head by self-distillation, unrolled on its own predicted states (training-time test).

1. Target states: each sequence runs once through the frozen target (the
   engine's `LayerRunner`); keep the states after the head's read layers and
   the final normed states (the LM head recomputes p from them).
2. Unrolled steps: step 0 is the head on (f at t - 1, token t) for every t,
   as the engine fills its cache. Step j joins token t with the head's step
   j - 1 output at t - 1, and attends as a draft chain started at s = t - j
   would: to step 0's entries up to s and to steps 1..j at s + 1..t.
3. Loss: KL(p || q) at each step, averaged, on a sample of positions (the
   LM head is most of the cost; over a draft vocabulary, a tenth of it). AdamW, warm-up, clipping, cosine decay over
   the epochs or the time budget, whichever runs out first.
4. Held-out agreement per draft position, and the mean accepted chain
   length, over the answer positions (templated prompts are easier).

Training runs in float32; the model is never modified. No plans, no decode loop.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.nn import functional as F

from ..feature_head import FeatureHead
from ..parts import ModelParts, soft_cap
from ..runner import LayerRunner


@dataclass
class TargetStates:
    tokens: list[int]  # the sequence
    reads: torch.Tensor  # [T, reads * hidden] float32: the states after the head's read layers
    final_normed: torch.Tensor  # [T, hidden] float32: after the final norm
    answer_start: int = 0  # the first position agreement is measured at (the answer's; 0: all)


@dataclass
class FeatureLog:
    steps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    eval_steps: list[int] = field(default_factory=list)
    eval_agreement: list[list[float]] = field(default_factory=list)  # per evaluation: agreement per draft position
    eval_chain: list[float] = field(default_factory=list)  # per evaluation: mean accepted chain length
    tokens: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@torch.no_grad()
def target_states(parts: ModelParts, sequence: list[int], reads: Sequence[int], answer_start: int = 0) -> TargetStates:
    runner = LayerRunner(parts, capacity=len(sequence), device=parts.lm_head.weight.device)
    hidden, states, first = runner.embed(sequence, 0), [], 0
    for r in reads:
        hidden = runner.run(hidden, range(first, r + 1), 0)  # [1, T, hidden]
        states.append(hidden)
        first = r + 1
    last = runner.run(hidden, range(first, parts.num_layers), 0)
    return TargetStates(list(sequence), torch.cat(states, dim=-1)[0].float().cpu(), parts.norm(last)[0].float().cpu(),
                        answer_start)


def answer_start(sequence: list[int], answer: list[int]) -> int:
    """Where `answer` begins in `sequence` (a prompt and the answer, perhaps cut short at the end); 0 when it
    is not there (then every position counts)."""
    if not answer:
        return len(sequence)
    for start in range(max(0, len(sequence) - len(answer)), len(sequence)):
        if sequence[start:] == answer[: len(sequence) - start]:
            return start
    return 0


def state_scale(data: Sequence[TargetStates]) -> float:
    """The median root-mean-square of the highest read state over every position: what a new head's join is
    scaled by (`FeatureHead.from_model(scale=)`)."""
    hidden = data[0].final_normed.shape[-1]
    return float(torch.cat([d.reads[:, -hidden:].pow(2).mean(-1).sqrt() for d in data]).median())


class _Steps:
    """The cache the unrolled steps' attention writes: every step's keys and values so far, concatenated."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        self.keys.append(key)
        self.values.append(value)
        return torch.cat(self.keys, dim=-2), torch.cat(self.values, dim=-2)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return sum(k.shape[-2] for k in self.keys)


def unroll_mask(length: int, step: int, window: int | None) -> torch.Tensor:
    """`[T, (step + 1) * T]` bool: step `step`'s query at t sees step 0 at positions <= t - step (within a
    sliding window) and step i (1..step) at position t - step + i."""
    t = torch.arange(length)[:, None]
    p = torch.arange(length)[None]
    first = p <= t - step
    if window is not None:
        first &= p > t - window
    return torch.cat([first] + [p == t - step + i for i in range(1, step + 1)], dim=1)


def unrolled_states(head: FeatureHead, parts: ModelParts, runner: LayerRunner, data: TargetStates,
                    steps: int) -> list[torch.Tensor]:
    """The head's output `[1, T, hidden]` at each of `steps` unrolled steps (see the module's docstring)."""
    length = len(data.tokens)
    embeds = runner.embed(data.tokens, 0)  # [1, T, hidden]
    fused = head.fused(list(data.reads[None].to(embeds.dtype).split(embeds.shape[-1], dim=-1)))  # [1, T, hidden]
    zero = torch.zeros_like(embeds[:, :1])
    before = torch.cat([zero, fused[:, :-1]], dim=1)
    slot = head.slot
    rotary = runner.rotary.get(runner.rotary_kinds[slot])
    rotary = None if rotary is None else tuple(t[:, :length] for t in rotary)
    cache, outputs = _Steps(), []
    for step in range(steps):
        mask = runner.as_mask(unroll_mask(length, step, runner.windows[slot]).to(embeds.device))
        out = parts.layer_call(head.layer, head.inputs(embeds, before), mask=mask, position_embeddings=rotary,
                               position_ids=runner.positions[:, :length], cache=cache)
        outputs.append(out)
        before = torch.cat([zero, out[:, :-1]], dim=1)
    return outputs


def _log_probs(parts: ModelParts, normed: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
    """Log-probabilities `[.., V]` from final-normed states; with `ids` `[K]`, over those tokens only `[.., K]`
    (the target's distribution given that the token is one of them)."""
    if ids is None:
        return F.log_softmax(soft_cap(parts.lm_head(normed).float(), parts.logit_softcap), dim=-1)
    bias = getattr(parts.lm_head, "bias", None)
    logits = F.linear(normed, parts.lm_head.weight[ids], None if bias is None else bias[ids])  # [.., K]
    return F.log_softmax(soft_cap(logits.float(), parts.logit_softcap), dim=-1)


@torch.no_grad()
def agreement(head: FeatureHead, parts: ModelParts, data: Sequence[TargetStates], steps: int,
              ids: torch.Tensor | None = None) -> tuple[list[float], float]:
    """Top-1 agreement with the target at each draft position (1..steps), and the mean accepted length of a
    chain of `steps` drafts (greedy: the leading drafts that agree), over each sequence's answer positions.
    With a draft vocabulary `ids` `[K]`, the head picks among those tokens and the target among all."""
    same, total = [0] * steps, [0] * steps
    chains, chain_total = 0, 0
    for d in data:
        runner = LayerRunner(parts, capacity=len(d.tokens), device=parts.lm_head.weight.device, head=head)
        target = _log_probs(parts, d.final_normed.to(parts.lm_head.weight)).argmax(-1)  # [T]
        hits = []
        for j, out in enumerate(unrolled_states(head, parts, runner, d, steps)):
            picked = _log_probs(parts, parts.norm(out)[0], ids).argmax(-1)  # [T]
            right = (picked if ids is None else ids[picked]) == target  # [T]
            first = max(j, d.answer_start)
            same[j] += int(right[first:].sum())
            total[j] += max(0, len(right) - first)
            hits.append(right)
        length = len(d.tokens)
        for s in range(d.answer_start, length - steps + 1):  # the chain drafted from s: step j checked at s + j
            kept = 0
            while kept < steps and hits[kept][s + kept]:
                kept += 1
            chains += kept
            chain_total += 1
    return [s / max(1, t) for s, t in zip(same, total)], chains / max(1, chain_total)


def train_features(head: FeatureHead, parts: ModelParts, train_data: Sequence[TargetStates],
                   eval_data: Sequence[TargetStates], *, steps: int, epochs: float, minutes: float, lr: float,
                   positions: int = 128, seed: int = 0, eval_every: int = 100, ids: torch.Tensor | None = None,
                   progress=None) -> FeatureLog:
    """Fit `head` (float32, trainable) to KL(p || q) over `steps` unrolled draft steps; the loss and agreement.

    With a draft vocabulary `ids` `[K]` (the tokens the head will draft from), p and q are over those tokens
    only: the LM head's cost, most of a step's, shrinks by V / K."""
    torch.manual_seed(seed)
    for module in (parts.lm_head, parts.norm, parts.embed):  # frozen: no gradients for the target's weights
        module.requires_grad_(False)
    log = FeatureLog(tokens=sum(len(d.tokens) for d in train_data))
    total_steps = max(1, int(epochs * len(train_data)))
    warmup = max(1, total_steps // 20)
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    rng, order = random.Random(seed), []
    device = parts.lm_head.weight.device
    began = time.perf_counter()
    for step in range(total_steps):
        if not order:
            order = list(range(len(train_data)))
            rng.shuffle(order)
        d = train_data[order.pop()]
        length = len(d.tokens)
        rows = torch.tensor(sorted(rng.sample(range(steps - 1, length), min(positions, length - steps + 1))),
                            device=device)  # [P] positions every step is scored at
        with torch.no_grad():
            log_p = _log_probs(parts, d.final_normed.to(device)[rows], ids)  # [P, V or K]
        runner = LayerRunner(parts, capacity=length, device=device, head=head)
        loss = sum(F.kl_div(_log_probs(parts, parts.norm(out[0, rows]), ids), log_p, log_target=True,
                            reduction="batchmean") for out in unrolled_states(head, parts, runner, d, steps)) / steps
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        # Warm-up, then cosine decay over whichever runs out first: the epochs or the time budget.
        progress_made = max(step / total_steps, (time.perf_counter() - began) / (minutes * 60))
        for group in optimizer.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress_made)))
        optimizer.step()
        log.steps.append(step)
        log.losses.append(loss.item())
        if progress is not None:
            progress(log.losses[-1])
        out_of_time = time.perf_counter() - began > minutes * 60
        if (step + 1) % eval_every == 0 or step + 1 == total_steps or out_of_time:
            head.eval()
            per_position, chain = agreement(head, parts, eval_data, steps, ids)
            head.train()
            log.eval_steps.append(step + 1)
            log.eval_agreement.append(per_position)
            log.eval_chain.append(chain)
        if out_of_time:
            break
    log.seconds = time.perf_counter() - began
    return log


def plot_agreement(log: FeatureLog, path, *, baseline: float | None = None, baseline_name: str = "") -> bool:
    """Loss, and held-out agreement per draft position (first and last evaluation), as a PNG; False without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(log.steps, log.losses)
    left.set(xlabel="step (one sequence)", ylabel="KL(p || q), mean over unrolled steps", title="training loss")
    for name, values in (("first evaluation", log.eval_agreement[0]), ("last evaluation", log.eval_agreement[-1])):
        right.plot(range(1, len(values) + 1), values, marker="o", label=name)
    if baseline is not None:
        right.axhline(baseline, color="gray", linestyle="--", label=baseline_name)
    right.set(xlabel="draft position", ylabel="top-1 agreement with the target", title="held-out agreement",
              ylim=(0, 1))
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
