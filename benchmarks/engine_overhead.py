"""model.generate vs selfspec's plain path vs selfspec's default plan, side by side.

    python -m benchmarks.engine_overhead bfloat16 2 64     # dtype, threads, new tokens
    python -m benchmarks.engine_overhead bfloat16 2 64 int8   # ... of the model quantized (selfspec.load quantize=)

Three chat prompts, each run twice per method, methods interleaved in a
rotating order in one process after a warm-up; every run generates exactly N
tokens (min_new_tokens=N). Prints median tokens/s and the ratio to
model.generate measured in the same run, the CPU capability torch dispatches
to, and what `spec.memory()` reports for the model. The full comparison with other
methods over Spec-Bench is benchmarks/run.py.
"""

import platform
import statistics
import sys
import time

import torch
import transformers

import selfspec
from selfspec.costs import cpu_capability

dtype, threads = sys.argv[1], int(sys.argv[2])
N = int(sys.argv[3]) if len(sys.argv) > 3 else 64
quantize = sys.argv[4] if len(sys.argv) > 4 else None
torch.set_num_threads(threads)
model, tok = selfspec.load("smollm2-135m-instruct", dtype=dtype, progress=False, quantize=quantize)
prompts = ["Write a haiku about autumn.", "Explain how a bicycle works in simple terms.", "List three tips for learning to program."]
ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"] for p in prompts]
plain = selfspec.wrap(model, plan=selfspec.DraftPlan.plain())
default = selfspec.wrap(model)
methods = {
    "model.generate": lambda x: (model.generate(x, max_new_tokens=N, min_new_tokens=N, do_sample=False), None),
    "selfspec plain": lambda x: (plain.generate(x, max_new_tokens=N, min_new_tokens=N), plain.last_stats),
    "selfspec default plan": lambda x: (default.generate(x, max_new_tokens=N, min_new_tokens=N), default.last_stats),
}
speeds = {m: [] for m in methods}
counts = {m: dict(drafted=0, accepted=0, new=0, passes=0, identical=0) for m in methods}
with torch.no_grad():
    for run in methods.values():
        run(ids[0][:, :10])  # warm up
    for rep in range(2):
        for i, x in enumerate(ids):
            names = list(methods)
            shift = (rep + i) % len(names)
            outputs = {}
            for name in names[shift:] + names[:shift]:
                began = time.perf_counter()
                out, stats = methods[name](x)
                speeds[name].append(N / (time.perf_counter() - began))
                outputs[name] = out
                if stats is not None:
                    c = counts[name]
                    c["drafted"] += stats.drafted
                    c["accepted"] += stats.accepted
                    c["new"] += stats.new_tokens
                    c["passes"] += stats.verify_passes
            for name, out in outputs.items():
                counts[name]["identical"] += int(torch.equal(out, outputs["model.generate"]))

print(f"command: python {' '.join(sys.argv)}")
print(f"machine: {platform.platform()}, {platform.processor() or 'cpu'}, torch {torch.__version__}, transformers {transformers.__version__}")
print(f"cpu capability: {cpu_capability()}; {default.memory(context=512).summary()} (context 512)")
print(f"dtype={dtype} quantize={quantize} threads={threads} new_tokens={N} prompts={len(ids)} x 2 repeats, interleaved; plan: {default.describe_plan()}")
base = statistics.median(speeds["model.generate"])
for name, values in speeds.items():
    c = counts[name]
    line = f"  {name:22s} {statistics.median(values):6.1f} tok/s ({statistics.median(values) / base:.2f}x), identical {c['identical']}/{len(values)}"
    if c["drafted"]:
        line += f", acceptance {c['accepted'] / c['drafted']:.1%}, tokens/pass {c['new'] / c['passes']:.2f}"
    print(line)
