"""The prompts every method runs on: Spec-Bench questions, or a small built-in set.

Spec-Bench (`../shared/data/spec_bench_questions.jsonl`, see the README beside
it) has 13 categories. We draw `per_category` questions from each with a fixed
seed, take the first turn only, and apply the model's chat template when it has
one (a base model such as Gemma 3 270M gets the raw question text). When the
file is absent we fall back to `BUILTIN_PROMPTS`, a dozen short prompts across
the same kinds of task, and the run's header says so.

This module knows prompts and tokenizers; it does not know methods or timing.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DATA = REPO_ROOT.parent / "shared" / "data" / "spec_bench_questions.jsonl"

# (category, prompt): used when the Spec-Bench file is absent. Written for this project.
BUILTIN_PROMPTS: tuple[tuple[str, str], ...] = (
    ("writing", "Write a short, friendly note inviting your neighbours to a street party next Saturday."),
    ("roleplay", "Pretend you are a museum guide. Introduce the dinosaur hall to a group of ten-year-olds."),
    ("reasoning", "If all bloops are razzies and all razzies are lazzies, are all bloops lazzies? Explain."),
    ("math", "A train travels 180 km in 2.5 hours. What is its average speed in km/h? Show your steps."),
    ("coding", "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring."),
    ("extraction", "List the people and places in this sentence: 'Maria flew from Lisbon to Oslo to meet Tom.'"),
    ("stem", "Explain in simple terms why the sky is blue during the day and red at sunset."),
    ("humanities", "Summarise the main causes of the French Revolution in a few sentences."),
    ("translation", "Translate into English: 'Le chat dort sur le canapé pendant que le chien joue dehors.'"),
    ("summarization", "Summarise: The city council met on Monday to discuss the new bicycle lanes. Residents "
     "supported safer streets, but shop owners worried about parking. The council agreed to a six-month trial "
     "on two streets and will review traffic and sales data before deciding."),
    ("qa", "What is the capital of Australia, and why was it chosen over Sydney and Melbourne?"),
    ("math_reasoning", "Tom has 3 boxes with 12 apples each. He gives away 7 apples. How many are left?"),
)


@dataclass(frozen=True)
class Prompt:
    prompt_id: str
    category: str
    text: str
    input_ids: torch.Tensor  # [1, prompt_length]

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[1])


@dataclass(frozen=True)
class Workload:
    prompts: list[Prompt]
    source: str  # what the prompts came from, for the header
    fallback: bool  # True when the built-in set replaced Spec-Bench

    @property
    def categories(self) -> list[str]:
        return list(dict.fromkeys(p.category for p in self.prompts))


def build_workload(
    tokenizer,
    *,
    data_path: Path,
    per_category: int,
    seed: int,
    use_chat_template: bool,
    categories: list[str] | None = None,
    device: str = "cpu",
) -> Workload:
    """Draw and tokenize the prompts; `categories` (None: all) also fixes their order."""
    questions, source, fallback = _questions(data_path, per_category, seed)
    if categories:
        unknown = sorted(set(categories) - {c for c, _, _ in questions})
        if unknown:
            known = sorted({c for c, _, _ in questions})
            raise ValueError(f"unknown categories {unknown}; this workload has {known}")
        questions = [q for c in categories for q in questions if q[0] == c]
    prompts = [
        Prompt(qid, category, text, encode(tokenizer, text, use_chat_template=use_chat_template).to(device))
        for category, qid, text in questions
    ]
    return Workload(prompts, source, fallback)


def _questions(data_path: Path, per_category: int, seed: int) -> tuple[list[tuple[str, str, str]], str, bool]:
    """(category, id, first-turn text) triples, grouped by category in file order."""
    if data_path.is_file():
        rows = [json.loads(line) for line in data_path.read_text(encoding="utf-8").splitlines() if line.strip()]
        pool = [(r["category"], str(r["question_id"]), r["turns"][0]) for r in rows]
        source = f"Spec-Bench {data_path} ({len(rows)} rows), {per_category} per category, seed {seed}"
        return _draw(pool, per_category, seed), source, False
    pool = [(category, f"builtin-{i}", text) for i, (category, text) in enumerate(BUILTIN_PROMPTS)]
    source = f"built-in prompt set ({len(pool)} prompts; {data_path} not found), up to {per_category} per category"
    return _draw(pool, per_category, seed), source, True


def _draw(pool: list[tuple[str, str, str]], per_category: int, seed: int) -> list[tuple[str, str, str]]:
    rng = random.Random(seed)
    by_category: dict[str, list[tuple[str, str, str]]] = {}
    for item in pool:
        by_category.setdefault(item[0], []).append(item)
    drawn = []
    for items in by_category.values():
        drawn += rng.sample(items, min(per_category, len(items)))
    return drawn


def encode(tokenizer, text: str, *, use_chat_template: bool) -> torch.Tensor:
    """`[1, length]` token ids: one user turn with the generation prompt, or the raw text."""
    if use_chat_template:
        encoded = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        return encoded["input_ids"]
    return tokenizer(text, return_tensors="pt")["input_ids"]


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def held_out(data_path: Path, *, per_category: int, seed: int) -> list[dict]:
    """The Spec-Bench rows no benchmark run with this seed and up to `per_category` questions draws.

    For training heads and counting vocabularies without leakage into the benchmark.
    """
    rows = [json.loads(line) for line in data_path.read_text(encoding="utf-8").splitlines() if line.strip()]
    pool = [(r["category"], str(r["question_id"]), r["turns"][0]) for r in rows]
    drawn = {qid for n in range(1, per_category + 1) for _, qid, _ in _draw(pool, n, seed)}
    return [r for r in rows if str(r["question_id"]) not in drawn]


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Write the Spec-Bench questions a benchmark run does not use.")
    parser.add_argument("--held-out", required=True, metavar="OUT.jsonl")
    parser.add_argument("--per-category", type=int, default=5, help="as in benchmarks/run.py (the largest you run)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    args = parser.parse_args()
    kept = held_out(args.data, per_category=args.per_category, seed=args.seed)
    Path(args.held_out).write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
    print(f"{len(kept)} questions written to {args.held_out}")


def save_results(out: Path, kind: str, header: dict, results) -> Path:
    """Write `{"header": ..., "results": ...}` to out/<time>-<kind>.json, say where, and return the path."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{time.strftime('%Y%m%d-%H%M%S')}-{kind}.json"
    path.write_text(json.dumps({"header": header, "results": results}, indent=1))
    print(f"written: {path}")
    return path
