"""The text an exit head and a draft vocabulary learn from: the model's own answers, and any text file.

`own_answers` gives prompt + the model's greedy answer for each prompt
(selfspec's batched engine, drafting off; resumable); `text_sequences` cuts any text into sequences.
`TrainingText` holds the result and saves it, since generating the answers is
the slow part. It knows nothing about heads, losses or vocabularies.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class TrainingText:
    sequences: list[list[int]]  # token ids to train on (prompt + answer, or a piece of a text file)
    answers: list[list[int]]  # the parts to count for a draft vocabulary (answers, text pieces)
    source: str  # where they came from, in words

    def save(self, path: str | os.PathLike) -> None:
        data = {"source": self.source, "sequences": self.sequences, "answers": self.answers}
        Path(path).write_text(json.dumps(data), encoding="utf-8")

    @classmethod
    def load(cls, path: str | os.PathLike, *, vocab_size: int | None = None) -> "TrainingText":
        """Read what `save` wrote; every id is checked (an int in 0..vocab_size-1 when given)."""
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"sequences file {os.fspath(path)} is not valid JSON: {error}") from None
        if not isinstance(data, dict) or not isinstance(data.get("source"), str):
            raise ValueError(f"sequences file {os.fspath(path)}: expected an object with source, sequences, answers")
        lists = {}
        for key in ("sequences", "answers"):
            rows = data.get(key)
            if not isinstance(rows, list) or not all(isinstance(r, list) for r in rows):
                raise ValueError(f"sequences file {os.fspath(path)}: {key} must be a list of token id lists")
            for row in rows:
                for token in row:
                    if isinstance(token, bool) or not isinstance(token, int) or token < 0 or (
                            vocab_size is not None and token >= vocab_size):
                        valid = f"0..{vocab_size - 1}" if vocab_size is not None else ">= 0"
                        raise ValueError(f"sequences file {os.fspath(path)}: token id {token!r} in {key} "
                                         f"out of range (valid: {valid})")
            lists[key] = rows
        if not lists["sequences"]:
            raise ValueError(f"sequences file {os.fspath(path)}: no sequences")
        return cls(lists["sequences"], lists["answers"], data["source"])


def own_answers(model, tokenizer, prompts: Sequence[list[int]], *, new_tokens: int, batch_size: int,
                progress: Callable[[int], None] | None = None, done: Sequence[list[int]] = (),
                save: Callable[[list[list[int]]], None] | None = None) -> list[list[int]]:
    """Prompt + the model's greedy answer for each prompt (stops at EOS), generated in left-padded batches by
    selfspec's batched engine with drafting off (token for token `model.generate`'s greedy output).

    `done`: the sequences of the first prompts, already made (an earlier, interrupted run); `save` is called
    with every sequence made so far after each batch (to resume from).
    """
    import selfspec  # the engine's public API (this is a tool, above the engine)

    spec = selfspec.wrap(model, plan=selfspec.DraftPlan.plain())
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos]) - {None}
    sequences = list(done)
    if progress and sequences:
        progress(len(sequences))
    for i in range(len(sequences), len(prompts), batch_size):
        batch = prompts[i : i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])  # [b, width]
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        out = spec.generate(ids.to(model.device), attention_mask=mask.to(model.device), do_sample=False,
                            max_new_tokens=new_tokens, pad_token_id=pad)
        for prompt, row in zip(batch, out[:, width:].tolist()):
            answer = []
            for token in row:
                answer.append(token)
                if token in eos:
                    break
            sequences.append(prompt + answer)
        if save is not None:
            save(sequences)
        if progress:
            progress(len(batch))
    return sequences


def text_sequences(tokenizer, text: str, *, length: int) -> list[list[int]]:
    """Any text, tokenized and cut into sequences of `length` tokens."""
    ids = tokenizer(text)["input_ids"]
    return [ids[i : i + length] for i in range(0, len(ids), length) if len(ids[i : i + length]) > 1]
