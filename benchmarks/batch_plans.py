"""Batches of chat prompts through `spec.generate` under several plans, interleaved: speed and tokens per pass.

    python -m benchmarks.batch_plans                                  # the adapter plan with and without trees
    python -m benchmarks.batch_plans --rows 4 --repeats 3 --variants "chains=tree:0,recycle:false" plain
    python -m benchmarks.batch_plans --offload-from 15 --variants "heads=head:H.json,draft_vocab:V.json" plain

Each variant is the adapter's plan with fields replaced (`name=field:value,...`;
`plain` alone: drafting off); "default" is the plan itself. Every repeat runs each variant on the same
batches of `--rows` left-padded Spec-Bench prompts (one per category, in
turn), the order of the variants rotating, after each wrapper's batched pass costs
for 1..rows rows are measured (or loaded) and one warm-up batch. Reports per variant the median
new tokens per second over batches, tokens per row-pass, how many row-rounds
verified a tree, and whether its outputs equal the default's. The figures
belong to this machine: the header says which.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import selfspec
from selfspec.costs import cpu_capability, cpu_model
from selfspec.offload import offload_layers

from .workload import DEFAULT_DATA, build_workload, save_results


def variant(plan: selfspec.DraftPlan, spec: str) -> tuple[str, selfspec.DraftPlan]:
    """`name=field:value,...` over `plan` (values read as JSON, else as text); `plain`: drafting off."""
    name, _, fields = spec.partition("=")
    if name == "plain" and not fields:
        return name, selfspec.DraftPlan.plain()
    changes = {}
    for item in filter(None, fields.split(",")):
        key, _, value = item.partition(":")
        try:
            changes[key] = json.loads(value)
        except json.JSONDecodeError:
            changes[key] = value
    return name, dataclasses.replace(plan, **changes)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, default=4, help="prompts per batch (default 4)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--variants", nargs="*", default=["chains=tree:0,recycle:false"])
    p.add_argument("--data", type=Path, default=DEFAULT_DATA)
    p.add_argument("--out", type=Path, default=Path("results"))
    p.add_argument("--offload-from", type=int, default=None, metavar="N",
                   help="layers N.. on disk behind accelerate's hooks, as `benchmarks.run`'s +offloadN")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = selfspec.load(args.model, dtype=args.dtype, progress=False)
    if args.offload_from is not None:
        model = offload_layers(model, args.offload_from, folder=tempfile.mkdtemp(prefix="selfspec-offload-"))
    base = selfspec.wrap(model)
    specs = {"default": base}
    for text in args.variants:
        name, plan = variant(base.plan, text)
        specs[name] = selfspec.wrap(model, plan=plan)
    prompts = build_workload(tokenizer, data_path=args.data, per_category=1, seed=0, use_chat_template=True).prompts
    batches = [prompts[i : i + args.rows] for i in range(0, len(prompts) - args.rows + 1, args.rows)]
    header = {"command": "python -m benchmarks.batch_plans " + shlex.join(sys.argv[1:] if argv is None else argv),
              "cpu": cpu_model(), "capability": cpu_capability(), "threads": args.threads, "dtype": args.dtype,
              "torch": torch.__version__, "batches": f"{len(batches)} of {args.rows} rows",
              "offloaded": f"layers {args.offload_from}.. on disk" if args.offload_from is not None else "none",
              **{f"plan {name}": spec.describe_plan() for name, spec in specs.items()}}
    print("\n".join(f"{k}: {v}" for k, v in header.items()), flush=True)
    results = {name: {"tok_s": [], "tokens_per_pass": [], "tree_rows": 0, "same": 0} for name in specs}
    tokenizer.padding_side = "left"
    warm = tokenizer.pad({"input_ids": [p.input_ids[0].tolist() for p in batches[0]]}, return_tensors="pt")
    for spec in specs.values():  # each wrapper measures (or loads) its batched pass costs for 1..rows rows here,
        spec.batch_session().prepare(args.rows)  # not inside a timed batch whose rows finish one by one
        spec.generate(**warm, max_new_tokens=8, do_sample=False)
    for repeat in range(args.repeats):
        for b, batch in enumerate(batches):
            enc = tokenizer.pad({"input_ids": [p.input_ids[0].tolist() for p in batch]}, return_tensors="pt")
            names = list(specs)
            names = names[(repeat + b) % len(names):] + names[: (repeat + b) % len(names)]  # rotate who goes first
            outputs = {}
            for name in names:
                began = time.perf_counter()
                out = specs[name].generate(**enc, max_new_tokens=args.max_new_tokens, do_sample=False)
                seconds = time.perf_counter() - began
                stats = specs[name].last_stats
                outputs[name] = out
                results[name]["tok_s"].append(stats.new_tokens / seconds)
                results[name]["tokens_per_pass"].append(stats.tokens_per_pass)
                results[name]["tree_rows"] += sum(s.tree_rounds for s in stats.row_stats)
            for name in specs:
                results[name]["same"] += torch.equal(outputs[name], outputs["default"])
            print(f"repeat {repeat + 1}, batch {b + 1}: " + "  ".join(
                f"{n} {results[n]['tok_s'][-1]:.1f} tok/s" for n in specs), flush=True)
    runs = args.repeats * len(batches)
    for name, r in results.items():
        print(f"{name}: median {statistics.median(r['tok_s']):.1f} tok/s, "
              f"{statistics.median(r['tokens_per_pass']):.2f} tokens per row-pass, {r['tree_rows']} row-rounds "
              f"verified a tree, outputs as the default's in {r['same']}/{runs} batches", flush=True)
    save_results(args.out, "batch-plans", header, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
