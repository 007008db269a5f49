"""Tune a draft plan for a model on your prompts, save it, and use it.

    python examples/tune_plan.py            # about 10-20 minutes on a laptop CPU

The same search from the command line: `selfspec tune smollm2-135m-instruct --out plan.json`.
"""

import torch

import selfspec
from selfspec.prompts import builtin_prompts, encode_prompts
from selfspec.tuning import TuneConfig, tune

torch.set_num_threads(1)  # on a busy machine one thread is often the fastest; try yours
model, tokenizer = selfspec.load("smollm2-135m-instruct", dtype="bfloat16")

# Calibration prompts (the draft learns nothing from them: they are what it is scored on)
# and held-out prompts for the timed confirmation. Use prompts like your own traffic.
texts = builtin_prompts()
prompts = encode_prompts(tokenizer, texts[:10])
heldout = encode_prompts(tokenizer, texts[10:15])

result = tune(
    model,
    prompts=prompts,
    heldout=heldout,
    # budget: layer sets scored by the fast proxy; confirm: the best 3 are timed against plain decoding
    config=TuneConfig(max_new_tokens=48, budget=150, confirm=3, name="smollm2-bf16-tuned"),
)
print(result.table())
result.best_plan.save("smollm2-bf16-plan.json")
result.plot("smollm2-bf16-front.png")  # acceptance against draft cost (needs matplotlib)

# Use the plan: wrap(model, plan=...) takes the object or the file.
spec = selfspec.wrap(model, plan="smollm2-bf16-plan.json")
ids = torch.tensor([encode_prompts(tokenizer, ["Write a haiku about tea."])[0]])
out = spec.generate(ids, max_new_tokens=48)
print(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
print(spec.last_stats)
