"""A draft vocabulary: the draft scores only the K most frequent tokens.

The LM head is a large part of a small model's draft step. A draft
vocabulary keeps the rows of the K tokens counted most often (on the model's
own outputs or a user's text), and the draft scores those alone. The target
still verifies over the full vocabulary, so greedy output is unchanged; when
sampling, q is zero outside the subset and the rejection rule stays exact.
A token outside it can still be emitted (recovered or bonus).

`DraftVocab` holds a copy of K rows of the LM head, its one cost; from a
quantized head
the rows are dequantized (`quant.dense_rows`). The file is an artifact
(`artifacts.py`): every token id ordered by count (ties by id) and the
counts, so one file serves any K.

This module does not know plans or the decode loop.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from .parts import ModelParts, soft_cap
from .quant import dense_rows
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


def check_vocab_header(header: dict, vocab_size: int) -> None:
    """A vocabulary file holds `ids_by_count` and `counts`, int64 `[n]` each, 1 <= n <= the vocabulary size."""
    expected = {"ids_by_count", "counts"}
    if set(header) != expected:
        raise ValueError(f"tensors {sorted(header)} (valid: exactly {sorted(expected)})")
    lengths = set()
    for name, (dtype, shape) in header.items():
        if dtype != "I64" or len(shape) != 1:
            raise ValueError(f"tensor {name!r} is {dtype} of shape {list(shape)} (valid: I64 (int64) of shape [n])")
        lengths.add(shape[0])
    n = lengths.pop()
    if lengths:
        raise ValueError("ids_by_count and counts differ in length (valid: the same length)")
    if not 1 <= n <= vocab_size:
        raise ValueError(f"{n} token ids, out of range for this model's vocabulary of {vocab_size} (valid: 1..{vocab_size})")


def check_vocab_ids(ids: torch.Tensor, counts: torch.Tensor, vocab_size: int, path) -> None:
    """Every id in 0..V-1, each once; counts not negative."""
    bad = ((ids < 0) | (ids >= vocab_size)).nonzero()
    if len(bad):
        i = int(bad[0])
        raise ValueError(f"{path}: token id {int(ids[i])} at index {i} out of range (valid: 0..{vocab_size - 1})")
    seen = torch.bincount(ids, minlength=vocab_size)
    if int(seen.max()) > 1:
        raise ValueError(f"{path}: token id {int(seen.argmax())} appears {int(seen.max())} times (valid: each id once)")
    if len(counts) and int(counts.min()) < 0:
        raise ValueError(f"{path}: negative count {int(counts.min())} (valid: counts >= 0)")


def load_vocab(path: str | os.PathLike, size: int, *, model, parts: ModelParts) -> DraftVocab:
    """The `size` most frequent tokens of a vocabulary file (0: every token it counted)."""
    vocab_size = int(parts.lm_head.weight.shape[0])
    artifact = load_artifact(path, kind=KIND, model_id=model_identity(model, parts),
                             check_tensors=lambda manifest, header: check_vocab_header(header, vocab_size))
    ids, counts = artifact.tensors["ids_by_count"], artifact.tensors["counts"]
    check_vocab_ids(ids, counts, vocab_size, artifact.path)
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
        weight=dense_rows(parts.lm_head, ids, dtype=parts.dtype).contiguous(),  # [K, hidden]
        bias=None if bias is None else bias.detach()[ids].contiguous(),
        vocab_size=int(weight.shape[0]),
    )
