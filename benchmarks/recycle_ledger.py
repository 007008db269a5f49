"""A plan with its recycle ledger against the same plan recycling every round, interleaved over Spec-Bench prompts.

    python -m benchmarks.recycle_ledger --model smollm2-135m-instruct --plan default --per-category 4
    python -m benchmarks.recycle_ledger --model gemma3-270m --plan auto --per-category 2

Two wrappers of one model with one plan (`default`: the adapter's, or a name
`selfspec.wrap` takes such as `auto`, or a plan file). In one the
`RecycleLedger` judges whether recycled drafts pay (as shipped); in the
other it never reaches a verdict, so recycled drafts and recording run
every round, as before the ledger. Both warm up, then every prompt runs on
both in alternating order. Prints the machine, dtype, threads and, per
prompt and overall, tokens per second, the paired ratio (geometric mean over
prompts, 95% bootstrap interval, over the prompts where both wrote the
same text, and of decode tokens per second, the prefill apart), recycled
nodes verified and kept, and the rounds the ledger paused recycling. The
full comparison with other methods is `benchmarks/run.py`.
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time

import torch
import transformers

import selfspec
from benchmarks.measure import FirstTokenClock, Row
from benchmarks.report import paired_comparison
from benchmarks.run import DEFAULT_DATA
from benchmarks.workload import build_workload
from selfspec.costs import cpu_capability, cpu_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--plan", default="default", help="default (the adapter's), auto, or a plan file")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = selfspec.load(args.model, dtype=args.dtype, progress=False)
    workload = build_workload(tokenizer, data_path=DEFAULT_DATA, per_category=args.per_category, seed=args.seed,
                              use_chat_template=tokenizer.chat_template is not None)
    plan = None if args.plan == "default" else args.plan  # `wrap` takes "auto" or a plan file's path
    print(f"command: python -m benchmarks.recycle_ledger {' '.join(sys.argv[1:] if argv is None else argv)}")
    print(f"machine: {platform.node()}, {cpu_model()}, capability {cpu_capability()}, {args.threads} threads; "
          f"torch {torch.__version__}, transformers {transformers.__version__}; {args.model} {args.dtype}, greedy, "
          f"{len(workload.prompts)} prompts ({workload.source}), {args.max_new_tokens} new tokens")
    specs = {"ledger": selfspec.wrap(model, plan=plan), "always": selfspec.wrap(model, plan=plan)}
    for spec in specs.values():  # warm up; the greedy call leaves the ledger the later calls share
        spec.generate(workload.prompts[0].input_ids, max_new_tokens=16)
    if specs["always"].recycle_ledger is None:
        raise SystemExit(f"plan {args.plan!r} has no recycle ledger (a cost-policy plan with recycle=True has one)")
    specs["always"].recycle_ledger.TRIAL = math.inf  # never a verdict: recycling every round
    print(f"plan: {specs['ledger'].describe_plan()}")
    rows: list[Row] = []
    totals = {name: {"recycled": 0, "kept": 0, "paused": 0} for name in specs}
    for i, prompt in enumerate(workload.prompts):
        speed = {}
        for name in (["ledger", "always"] if i % 2 == 0 else ["always", "ledger"]):
            spec = specs[name]
            clock = FirstTokenClock(model.device)
            began = time.perf_counter()
            out = spec.generate(prompt.input_ids, max_new_tokens=args.max_new_tokens, streamer=clock)
            seconds = time.perf_counter() - began
            stats = spec.last_stats
            rows.append(Row(name, prompt.prompt_id, prompt.category, prompt.input_ids.shape[1],
                            new_tokens=stats.new_tokens, seconds=seconds,
                            output=out[0, prompt.input_ids.shape[1]:].tolist(),
                            first_token_seconds=clock.since(began)))
            for key, value in (("recycled", stats.recycled_drafted), ("kept", stats.recycled_accepted),
                               ("paused", stats.recycling_paused)):
                totals[name][key] += value
            speed[name] = rows[-1].tokens_per_second
        print(f"[{i + 1}/{len(workload.prompts)}] {prompt.category}/{prompt.prompt_id}: ledger "
              f"{speed['ledger']:.1f} tok/s, always {speed['always']:.1f} tok/s", flush=True)
    for name, total in totals.items():
        tokens = sum(r.new_tokens for r in rows if r.method == name)
        seconds = sum(r.seconds for r in rows if r.method == name)
        print(f"{name}: {tokens / seconds:.1f} tok/s over all prompts; recycled nodes verified {total['recycled']}, "
              f"kept {total['kept']}; rounds with recycling paused {total['paused']}")
    paired = paired_comparison(rows, "ledger", "always")
    print(f"paired, ledger / always: {paired['ratio']:.3f}x ({paired['low']:.3f}-{paired['high']:.3f}) over "
          f"{paired['prompts']} prompts; same text {paired['same_text_ratio']:.3f}x "
          f"({paired['same_text_low']:.3f}-{paired['same_text_high']:.3f}) over {paired['same_text_prompts']}; "
          f"decode (the prefill apart) {paired['decode_ratio']:.3f}x ({paired['decode_low']:.3f}-"
          f"{paired['decode_high']:.3f}) over {paired['decode_prompts']}")
    print(f"the ledger at the end: {specs['ledger'].recycle_ledger.describe()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
