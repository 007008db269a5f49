"""Prompt sets for the tools (plan search, head training): built-in chat prompts, prompt files, token ids.

It finds, reads and orders prompts and turns them into token ids (through the
chat template when there is one). It knows nothing about models, drafts or
timing, and the engine never imports it.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Sequence
from pathlib import Path

import torch

SPEC_BENCH = "spec_bench_questions.jsonl"

BUILTIN_PROMPTS: tuple[str, ...] = (
    "Write a short poem about the ocean at night.",
    "Explain how a refrigerator keeps food cold, in simple terms.",
    "What are three tips for staying focused while studying?",
    "Write a Python function that checks whether a string is a palindrome.",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "Translate into French: 'The weather is lovely today, let's go for a walk.'",
    "A train travels at 60 miles per hour for 2.5 hours. How far does it go? Show your reasoning.",
    "Give me a recipe for a simple vegetable soup.",
    "What is the difference between a virus and a bacterium?",
    "Write a polite email asking a colleague to review my report by Friday.",
    "List five countries in South America and their capitals.",
    "Why do leaves change color in autumn?",
    "Describe the rules of chess for a beginner.",
    "What is photosynthesis?",
    "Write a haiku about coffee.",
    "Explain what a linked list is and when to use one.",
    "Give three arguments for and against working from home.",
    "How do I convert Celsius to Fahrenheit? Give an example.",
    "Tell me a short story about a robot who learns to paint.",
    "What causes the seasons on Earth?",
)


def builtin_prompts(*, seed: int = 0) -> list[str]:
    """The built-in chat prompts (varied tasks), in a seeded order."""
    prompts = list(BUILTIN_PROMPTS)
    random.Random(seed).shuffle(prompts)
    return prompts


def prompt_file(data: str | os.PathLike) -> Path:
    """The prompt file `data` names: a path, or "spec-bench" for the Spec-Bench questions.

    "spec-bench" is looked up in `$SELFSPEC_SPEC_BENCH`, then `../shared/data/`
    from the working directory and from the repository.
    """
    if os.fspath(data) != "spec-bench":
        path = Path(data)
        if not path.is_file():
            raise ValueError(f"prompt file {os.fspath(data)!r} not found (valid: an existing file, or 'spec-bench')")
        return path
    here = Path(__file__).resolve().parent.parent
    for candidate in (os.environ.get("SELFSPEC_SPEC_BENCH"), Path.cwd() / "../shared/data" / SPEC_BENCH,
                      here / "../shared/data" / SPEC_BENCH):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    raise ValueError("'spec-bench': Spec-Bench questions not found; set SELFSPEC_SPEC_BENCH to the .jsonl path")


def read_prompts(path: str | os.PathLike, *, seed: int = 0) -> list[str]:
    """Prompts from a file, in a seeded order that interleaves categories.

    `.jsonl`: one object a line, the prompt in `turns[0]` (Spec-Bench) or in
    `prompt`, `text`, `question` or `instruction`; rows with a `category` are
    taken round-robin over the categories, so any prefix of the list is varied.
    `.json`: a list of strings. Anything else: one prompt per non-empty line.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"prompt file {path} is not UTF-8 text (byte {error.object[error.start]:#04x} at offset "
                         f"{error.start})") from None
    rows: list[tuple[str, str]] = []  # (category, prompt)
    if path.suffix == ".jsonl":
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not valid JSON ({error.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
            prompt = (row.get("turns") or [None])[0]
            for key in ("prompt", "text", "question", "instruction"):
                prompt = prompt or row.get(key)
            if not isinstance(prompt, str):
                raise ValueError(f"{path}:{number}: no prompt in turns[0], prompt, text, question or instruction")
            rows.append((str(row.get("category", "")), prompt))
    elif path.suffix == ".json":
        try:
            items = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: not valid JSON ({error})") from None
        if not isinstance(items, list):
            raise ValueError(f"{path}: expected a JSON list of prompts, got {type(items).__name__}")
        rows = [("", str(p)) for p in items]
    else:
        rows = [("", line.strip()) for line in text.splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"no prompts in {path}")
    rng = random.Random(seed)
    groups: dict[str, list[str]] = {}
    for category, prompt in rows:
        groups.setdefault(category, []).append(prompt)
    for prompts in groups.values():
        rng.shuffle(prompts)
    ordered: list[str] = []
    queues = [groups[c] for c in sorted(groups)]
    while any(queues):
        for queue in queues:
            if queue:
                ordered.append(queue.pop(0))
    return ordered


def encode_prompts(tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each prompt, through the chat template when the tokenizer has one."""
    encoded = []
    for text in texts:
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=True
            )["input_ids"]
        else:
            ids = tokenizer(text)["input_ids"]
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        if ids and isinstance(ids[0], list):
            ids = ids[0]
        encoded.append([int(i) for i in ids])
    return encoded


def as_ids(prompt) -> list[int]:
    """One prompt's token ids as a list of ints (from a list or a tensor of any shape); empty is refused."""
    if isinstance(prompt, torch.Tensor):
        prompt = prompt.reshape(-1).tolist()
    ids = [int(i) for i in prompt]
    if not ids:
        raise ValueError("empty prompt: every prompt needs at least one token")
    return ids
