"""Draft vocabulary sweep: what each K saves in draft time and loses in acceptance.

    python -m benchmarks.vocab_sweep [--dtype bfloat16] [--threads 2] [--vocab examples/heads/smollm2-e10-vocab.json]

For two drafts of SmolLM2 (the tuned layer set and the exit-10 head, k=4,
fixed), runs one Spec-Bench question from each of six categories for each K
and prints acceptance, tokens per pass, draft milliseconds per drafted token
and tokens/s, all from selfspec's own stats. Greedy output is the same for
every K (the target verifies over the full vocabulary); only speed moves.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

import selfspec
from benchmarks.workload import DEFAULT_DATA, build_workload

ROOT = Path(__file__).resolve().parent.parent

CATEGORIES = ["writing", "coding", "stem", "qa", "math_reasoning", "humanities"]
SIZES = (0, 16384, 8192, 4096, 2048, 1024)  # 0: the full vocabulary (no subset)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--vocab", default=str(ROOT / "examples/heads/smollm2-e10-vocab.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = selfspec.load("smollm2-135m-instruct", dtype=args.dtype)
    prompts = build_workload(tokenizer, data_path=DEFAULT_DATA, per_category=1, seed=0, use_chat_template=True,
                             categories=CATEGORIES).prompts
    plans = ROOT / "examples" / "plans"
    drafts = {
        "tuned layers k=4": dataclasses.replace(selfspec.DraftPlan.load(plans / "smollm2-tuned-layers.json"),
                                                adaptive=False, draft_length=4),
        "exit 10 + head k=4": selfspec.DraftPlan.load(plans / "smollm2-head.json"),
    }
    print(f"# {' '.join(sys.argv)}; {args.dtype}, {args.threads} threads, {len(prompts)} prompts")
    for name, base in drafts.items():
        for size in SIZES:
            plan = base if size == 0 else dataclasses.replace(base, draft_vocab=args.vocab, draft_vocab_size=size)
            spec = selfspec.wrap(model, plan=plan)
            spec.generate(prompts[0].input_ids, max_new_tokens=8)  # warm-up
            total = selfspec.GenerationStats()
            seconds = 0.0
            for prompt in prompts:
                start = time.perf_counter()
                spec.generate(prompt.input_ids, max_new_tokens=args.max_new_tokens)
                seconds += time.perf_counter() - start
                stats = spec.last_stats
                for key in ("new_tokens", "verify_passes", "drafted", "accepted", "draft_seconds"):
                    setattr(total, key, getattr(total, key) + getattr(stats, key))
            total.total_seconds = seconds
            print(f"{name:20s} K={size or 'all':>6}  acceptance {total.acceptance_rate:6.1%}  "
                  f"tokens/pass {total.tokens_per_pass:.2f}  "
                  f"draft ms/token {1000 * total.draft_seconds / max(1, total.drafted):6.2f}  "
                  f"tok/s {total.tokens_per_second:5.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
