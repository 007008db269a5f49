"""SmolLM2 in float and quantized weights, side by side: memory, plain decoding speed, selfspec's plain path and default plan.

    python -m benchmarks.quantized                        # 2 threads, 3 chat prompts x 2 repeats, 64 new tokens
    python -m benchmarks.quantized --threads 1 --new-tokens 48 --variants bfloat16,bfloat16+int8,bfloat16+int4

Every variant is loaded once (`selfspec.load(..., quantize=...)`); the runs are
interleaved (each repeat visits every variant and method in a rotating order),
so a busy machine slows all of them alike. Every run generates exactly N tokens.
Prints, per variant: weight memory (`spec.memory()`), median tokens/s of
`model.generate`, of selfspec's plain path and of its default plan (with
acceptance and tokens per pass), and whether the outputs equal `model.generate`'s.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
import transformers

import selfspec

PROMPTS = ["Write a haiku about autumn.", "Explain how a bicycle works in simple terms.",
           "List three tips for learning to program."]


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.quantized")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--variants", default="float32,bfloat16,bfloat16+int8,bfloat16+int4",
                        help="comma list of DTYPE or DTYPE+int8|int4")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    n = args.new_tokens
    specs, tokenizer = {}, None
    for variant in args.variants.split(","):
        dtype, _, quantize = variant.partition("+")
        model, tokenizer = selfspec.load("smollm2-135m-instruct", dtype=dtype, quantize=quantize or None,
                                         progress=False)
        specs[variant] = (model, selfspec.wrap(model, plan=selfspec.DraftPlan.plain()), selfspec.wrap(model))
    ids = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)["input_ids"] for p in PROMPTS]
    runs = {}
    for variant, (model, plain, default) in specs.items():
        runs[(variant, "model.generate")] = (lambda x, m=model: m.generate(x, max_new_tokens=n, min_new_tokens=n,
                                                                           do_sample=False), None)
        runs[(variant, "selfspec plain")] = (lambda x, s=plain: s.generate(x, max_new_tokens=n, min_new_tokens=n), plain)
        runs[(variant, "selfspec default")] = (lambda x, s=default: s.generate(x, max_new_tokens=n, min_new_tokens=n),
                                               default)
    speeds = {key: [] for key in runs}
    counts = {key: dict(drafted=0, accepted=0, new=0, passes=0, identical=0) for key in runs}
    with torch.no_grad():
        for run, _ in runs.values():
            run(ids[0][:, :10])  # warm up (and measure each plan's costs once)
        keys = list(runs)
        for rep in range(args.repeats):
            for i, x in enumerate(ids):
                shift = (rep * len(ids) + i) % len(keys)
                outputs = {}
                for key in keys[shift:] + keys[:shift]:
                    run, spec = runs[key]
                    began = time.perf_counter()
                    outputs[key] = run(x)
                    speeds[key].append(n / (time.perf_counter() - began))
                    if spec is not None:
                        stats, c = spec.last_stats, counts[key]
                        c["drafted"] += stats.drafted
                        c["accepted"] += stats.accepted
                        c["new"] += stats.new_tokens
                        c["passes"] += stats.verify_passes
                for (variant, method), out in outputs.items():
                    counts[(variant, method)]["identical"] += int(torch.equal(out, outputs[(variant, "model.generate")]))

    print(f"machine: {platform.platform()}, {platform.processor() or 'cpu'}, cpu capability "
          f"{torch.backends.cpu.get_cpu_capability()}, {args.threads} threads; torch {torch.__version__}, "
          f"transformers {transformers.__version__}")
    print(f"{len(ids)} chat prompts x {args.repeats} repeats, {n} new tokens, interleaved")
    bf16 = statistics.median(speeds[("bfloat16", "model.generate")]) if ("bfloat16", "model.generate") in speeds else None
    for variant, (_, _, default) in specs.items():
        memory = default.memory(context=512)
        print(f"{variant}: weights {memory.weight_bytes / 2**20:.1f} MiB; default plan: {default.describe_plan()}")
        base = statistics.median(speeds[(variant, "model.generate")])
        for method in ("model.generate", "selfspec plain", "selfspec default"):
            key, c = (variant, method), counts[(variant, method)]
            speed = statistics.median(speeds[key])
            line = f"  {method:17s} {speed:6.1f} tok/s ({speed / base:.2f}x its model.generate"
            line += f", {speed / bf16:.2f}x bfloat16 model.generate)" if bf16 else ")"
            line += f", identical {c['identical']}/{len(speeds[key])}"
            if c["drafted"]:
                line += f", acceptance {c['accepted'] / c['drafted']:.1%}, tokens/pass {c['new'] / c['passes']:.2f}"
            print(line)


if __name__ == "__main__":
    main()
