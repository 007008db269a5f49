"""A draft vocabulary: the draft scores only the K most frequent tokens.

On a small model the LM head is a large part of a draft step (SmolLM2-135M:
49,152 x 576, about an eighth of a plain step per drafted token in bf16). A
draft vocabulary keeps the rows of the K tokens counted most often (on the
model's own outputs or a user's text) and the draft scores those alone.

What stays exact: the target always verifies over the full vocabulary, so
greedy output is unchanged; for sampling the draft's q is zero outside the
subset (its logits are -inf there) and the rejection rule is exact for any q.
A token outside the subset can still be emitted: as the target's recovered or
bonus token.

Memory: `DraftVocab` holds a gathered copy of K rows of the LM head (K/V of
its size; 9 MB for K=8192 on SmolLM2 in bf16). It is the lever's one cost,
and it is reported by `describe`.

The file is an artifact (`artifacts.py`): every token id ordered by count
(ties by id) and the counts, so one file serves any K.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from .adapter import ModelParts, soft_cap
from .artifacts import load_artifact, model_identity, save_artifact

KIND = "draft_vocab"


def count_tokens(sequences: Iterable[list[int]], vocab_size: int) -> torch.Tensor:
    """How often each token id occurs in `sequences`: `[vocab]` int64."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for seq in sequences:
        ids = torch.tensor(seq, dtype=torch.int64)
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            raise ValueError(f"token id out of range (valid: 0..{vocab_size - 1})")
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def save_vocab(path: str | os.PathLike, counts: torch.Tensor, *, model, parts: ModelParts, source: str) -> os.PathLike:
    """Save token counts `[vocab]` as a draft-vocabulary artifact; returns the manifest path."""
    # Sort by count, descending; a stable sort keeps ties in id order.
    order = torch.sort(-counts, stable=True).indices
    return save_artifact(
        path,
        kind=KIND,
        model_id=model_identity(model, parts),
        settings={"source": source, "tokens_counted": int(counts.sum()), "distinct_tokens": int((counts > 0).sum())},
        tensors={"ids_by_count": order.to(torch.int64), "counts": counts[order]},
    )


@dataclass
class DraftVocab:
    """The K token ids the draft scores and the matching rows of the LM head."""

    ids: torch.Tensor  # [K] int64, on the model's device
    weight: torch.Tensor  # [K, hidden]: lm_head.weight[ids]
    bias: torch.Tensor | None  # [K] or None
    vocab_size: int  # V, the full vocabulary

    @property
    def size(self) -> int:
        return int(self.ids.shape[0])

    def logits(self, normed: torch.Tensor, softcap: float | None) -> torch.Tensor:
        """`[q, V]` float32 logits from final-normed states `[1, q, hidden]`: -inf outside the subset."""
        sub = soft_cap(F.linear(normed, self.weight, self.bias)[0], softcap)  # [q, K]
        full = torch.full((sub.shape[0], self.vocab_size), float("-inf"), device=sub.device)  # [q, V]
        full[:, self.ids] = sub.float()
        return full

    def describe(self) -> str:
        mib = self.weight.numel() * self.weight.element_size() / 2**20
        return f"draft vocabulary {self.size}/{self.vocab_size} tokens ({mib:.1f} MiB of LM-head rows)"


def load_vocab(path: str | os.PathLike, size: int, *, model, parts: ModelParts) -> DraftVocab:
    """The `size` most frequent tokens of a vocabulary file (0: every token it counted)."""
    artifact = load_artifact(path, kind=KIND, model_id=model_identity(model, parts))
    ids, counts = artifact.tensors["ids_by_count"], artifact.tensors["counts"]
    counted = int((counts > 0).sum())
    if size == 0:
        size = counted
    if not 1 <= size <= len(ids):
        raise ValueError(f"draft_vocab_size={size} out of range for {artifact.path} (valid: 1..{len(ids)}, or 0 for "
                         f"the {counted} tokens it counted)")
    weight = parts.lm_head.weight
    ids = ids[:size].to(weight.device)
    bias = getattr(parts.lm_head, "bias", None)
    return DraftVocab(
        ids=ids,
        weight=weight.detach()[ids].contiguous(),
        bias=None if bias is None else bias.detach()[ids].contiguous(),
        vocab_size=int(weight.shape[0]),
    )
