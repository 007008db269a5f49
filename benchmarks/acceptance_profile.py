"""Acceptance of real drafts, measured on a CPU, saved small enough to travel to a GPU machine.

    python -m benchmarks.acceptance_profile            # SmolLM2, one Spec-Bench prompt per category, ~5 min
    python -m benchmarks.acceptance_profile --plans head=examples/heads/smollm2-features.plan.json --only-given

The real checkpoints cannot travel to the GPU machine, so `gpu_check.py`
times passes there with random weights and projects a plan's speed from the
acceptance measured here. For each plan below, greedy generation drafts a
fixed k every round (no cost policy, no threshold), so every round's outcome
"source k n" (drafted k, accepted n) is recorded; a shorter draft's outcome
follows from it (a round that accepted n of k accepts min(n, k') of k' < k).
Per draft position j it prints the acceptance at j given j - 1 accepted, the
agreement a head's training reports offline, now measured in the engine.

Acceptance does not depend on the machine (greedy output is the target's),
only on the model, the dtype and the prompts; timing is not measured here.
Writes `benchmarks/data/acceptance_<model>.json`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

import selfspec

from .workload import DEFAULT_DATA, build_workload

OUT = Path(__file__).parent / "data"


def profile_plans(default: selfspec.DraftPlan, draft_length: int) -> dict[str, selfspec.DraftPlan]:
    """The adapter's layer set, its n-gram lookup alone, and an early exit at half depth; k fixed."""
    fixed = dict(draft_length=draft_length, adaptive=False, policy="fixed")
    plans = {"ngram only": selfspec.DraftPlan(ngram=default.ngram or 3, **fixed)}
    if default.layers is not None:
        plans["default layers"] = dataclasses.replace(default, ngram=0, name="", **fixed)
        plans["default (n-grams, then layers)"] = dataclasses.replace(default, name="", **fixed)
    for exit_layer in (15,):
        plans[f"exit after layer {exit_layer - 1}"] = selfspec.DraftPlan(exit_layer=exit_layer, **fixed)
    return plans


def by_position(outcomes: dict[str, int], draft_length: int) -> list[float]:
    """Per draft position j = 1..k: of the drafted rounds that accepted j - 1 tokens, the share that accepted j."""
    accepted = [0] * (draft_length + 1)  # accepted[n]: drafted rounds that accepted n
    for outcome, count in outcomes.items():
        _, drafted, n = outcome.rsplit(" ", 2)
        if int(drafted) == draft_length:
            accepted[int(n)] += count
    reached = [sum(accepted[j:]) for j in range(draft_length + 1)]  # rounds that accepted at least j
    return [reached[j] / reached[j - 1] if reached[j - 1] else 0.0 for j in range(1, draft_length + 1)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="a selfspec.load name (default smollm2)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--draft-length", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--plans", action="append", default=[], metavar="NAME=PLAN.json",
                        help="also profile a saved plan (a head's, say), its draft length fixed")
    parser.add_argument("--only-given", action="store_true", help="profile only the --plans")
    parser.add_argument("--out", type=Path, help="output JSON (default benchmarks/data/acceptance_<model>.json)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = selfspec.load(args.model, dtype=getattr(torch, args.dtype))
    workload = build_workload(tokenizer, data_path=DEFAULT_DATA, per_category=args.per_category, seed=0,
                              use_chat_template=tokenizer.chat_template is not None)
    default = selfspec.wrap(model).plan
    plans = {} if args.only_given else profile_plans(default, args.draft_length)
    for item in args.plans:
        name, _, path = item.partition("=")
        saved = selfspec.DraftPlan.load(path)
        plans[name] = dataclasses.replace(saved, draft_length=args.draft_length, adaptive=False, policy="fixed",
                                          tree=0, recycle=False)
    result = {
        "what": "greedy round outcomes 'source k n' (drafted k, accepted n) per plan, k fixed; CPU-measured",
        "command": "python -m benchmarks.acceptance_profile " + shlex.join(sys.argv[1:]),
        "model": args.model,
        "num_layers": selfspec.wrap(model).parts.num_layers,
        "dtype": args.dtype,
        "prompts": workload.source,
        "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}",
        "plans": {},
    }
    began = time.perf_counter()
    OUT.mkdir(exist_ok=True)
    path = args.out or OUT / f"acceptance_{args.model}.json"
    for name, plan in plans.items():
        spec = selfspec.wrap(model, plan=plan)
        outcomes: dict[str, int] = {}
        tokens = passes = 0
        for prompt in workload.prompts:
            spec.generate(prompt.input_ids, max_new_tokens=args.max_new_tokens)
            stats = spec.last_stats
            for outcome, count in stats.round_outcomes.items():
                outcomes[outcome] = outcomes.get(outcome, 0) + count
            tokens += stats.new_tokens
            passes += stats.verify_passes
        result["plans"][name] = {
            "plan": plan.to_dict(),
            "draft_layers": len(plan.draft_layers(result["num_layers"])),
            "exact_prefix": plan.exact_prefix(result["num_layers"]),
            "feature_head": plan.head is not None and plan.exit_layer is None,
            "outcomes": outcomes,
            "tokens_per_pass": round(tokens / passes, 3),
        }
        path.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")  # after each plan: a partial run counts
        print(f"{name}: {tokens / passes:.2f} tokens per pass ({time.perf_counter() - began:.0f} s); wrote {path}",
              flush=True)
        print(f"  acceptance at draft position 1..{args.draft_length}, given the ones before: "
              + " ".join(f"{a:.2f}" for a in by_position(outcomes, args.draft_length)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
