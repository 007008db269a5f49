"""Train an exit head by self-distillation: the target labels its own text (from `text`).

1. Features: each sequence runs once through the frozen target (the engine's
   `LayerRunner`); keep the states
   after layer E-1 (the head's input) and the final normed states (p is
   recomputed from them by the shared LM head).
2. Training: the head (`head.py`) runs on the states after layer E-1, then
   the model's own final norm and LM head give q; the loss is KL(p || q)
   over positions. AdamW, warm-up then cosine decay, gradient clipping,
   until the epoch or time budget runs out.
3. Held-out sequences measure top-1 agreement with the target, with and
   without the head.

Training runs in float32; a plan casts the saved head to the model's dtype.
The model is never modified. This module does not know plans or the decode loop.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.nn import functional as F

from ..head import ExitHead
from ..parts import ModelParts, soft_cap
from ..runner import LayerRunner


@dataclass
class Features:
    exit_states: torch.Tensor  # [T, hidden] float32: after layer E-1
    final_normed: torch.Tensor  # [T, hidden] float32: after the final norm


@dataclass
class TrainingLog:
    steps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    eval_steps: list[int] = field(default_factory=list)
    eval_agreement: list[float] = field(default_factory=list)  # head's top-1 agreement with the target
    exit_agreement: float = 0.0  # the same exit without a head
    tokens: int = 0  # training tokens (one epoch)
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items()}


@torch.no_grad()
def features(parts: ModelParts, sequence: list[int], exit_layer: int) -> Features:
    device = parts.lm_head.weight.device
    runner = LayerRunner(parts, capacity=len(sequence), device=device)
    exit_states = runner.run(runner.embed(sequence, 0), range(exit_layer), 0)  # [1, T, hidden]
    last = runner.run(exit_states, range(exit_layer, parts.num_layers), 0)
    return Features(exit_states[0].float().cpu(), parts.norm(last)[0].float().cpu())


def _logits(parts: ModelParts, normed: torch.Tensor) -> torch.Tensor:
    return soft_cap(parts.lm_head(normed).float(), parts.logit_softcap)


def _head_states(head: ExitHead, parts: ModelParts, exit_states: torch.Tensor):
    """The head's output `[1, T, hidden]`, computed as the engine computes it (through `LayerRunner`)."""
    runner = LayerRunner(parts, capacity=exit_states.shape[0],
                         device=exit_states.device, head=head)
    return runner.run(exit_states[None], [head.slot], 0)


def agreement(head: ExitHead | None, parts: ModelParts, data: Sequence[Features]) -> float:
    """Top-1 agreement with the target over `data`, for the head (or for the bare exit when `head` is None)."""
    same = total = 0
    with torch.no_grad():
        for f in data:
            target = _logits(parts, f.final_normed).argmax(-1)
            states = f.exit_states[None] if head is None else _head_states(head, parts, f.exit_states)
            draft = _logits(parts, parts.norm(states.to(parts.lm_head.weight.dtype))[0]).argmax(-1)
            same += int((draft == target).sum())
            total += len(target)
    return same / max(1, total)


def train(head: ExitHead, parts: ModelParts, train_data: Sequence[Features],
          eval_data: Sequence[Features], *, epochs: float, minutes: float, lr: float, seed: int = 0,
          eval_every: int = 50, progress=None) -> TrainingLog:
    """Fit `head` (float32, trainable) to KL(p || q) on `train_data`; returns the loss and agreement curve."""
    torch.manual_seed(seed)
    log = TrainingLog(tokens=sum(len(f.exit_states) for f in train_data))
    log.exit_agreement = agreement(None, parts, eval_data)
    total_steps = max(1, int(epochs * len(train_data)))
    warmup = max(1, total_steps // 20)
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total_steps))),
    )
    order: list[int] = []
    rng = random.Random(seed)
    began = time.perf_counter()
    for step in range(total_steps):
        if not order:
            order = list(range(len(train_data)))
            rng.shuffle(order)
        f = train_data[order.pop()]
        with torch.no_grad():
            log_p = F.log_softmax(_logits(parts, f.final_normed), dim=-1)  # [T, V]
        states = _head_states(head, parts, f.exit_states)  # [1, T, hidden]
        log_q = F.log_softmax(_logits(parts, parts.norm(states)[0]), dim=-1)  # [T, V]
        loss = F.kl_div(log_q, log_p, log_target=True, reduction="batchmean")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        log.steps.append(step)
        log.losses.append(loss.item())
        if progress is not None:
            progress(log.losses[-1])
        out_of_time = time.perf_counter() - began > minutes * 60
        if (step + 1) % eval_every == 0 or step + 1 == total_steps or out_of_time:
            log.eval_steps.append(step + 1)
            log.eval_agreement.append(agreement(head, parts, eval_data))
        if out_of_time:
            break
    log.seconds = time.perf_counter() - began
    return log


def plot(log: TrainingLog, path) -> bool:
    """Loss and held-out agreement against steps, as a PNG; False when matplotlib is absent."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    window = max(1, len(log.losses) // 50)
    smooth = [sum(log.losses[max(0, i - window + 1) : i + 1]) / len(log.losses[max(0, i - window + 1) : i + 1])
              for i in range(len(log.losses))]
    left.plot(log.steps, smooth)
    left.set(xlabel="step (one sequence)", ylabel="KL(p || q), smoothed", title="training loss")
    right.plot(log.eval_steps, log.eval_agreement, marker="o", label="with the head")
    right.axhline(log.exit_agreement, color="gray", linestyle="--", label="same exit, no head")
    right.set(xlabel="step", ylabel="top-1 agreement with the target", title="held-out agreement", ylim=(0, 1))
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
