"""Quickstart: wrap a model, generate, read the stats, check the output against plain decoding.

    python examples/quickstart.py
"""

import torch

import selfspec

model, tokenizer = selfspec.load("smollm2-135m-instruct", dtype="bfloat16")
spec = selfspec.wrap(model)  # the adapter's plan for this model
print("plan:", spec.describe_plan())

messages = [{"role": "user", "content": "Explain how a bicycle works in simple terms."}]
input_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]

out = spec.generate(input_ids, max_new_tokens=96)
print(tokenizer.decode(out[0, input_ids.shape[1]:], skip_special_tokens=True))
print(spec.last_stats)

with torch.no_grad():
    plain = model.generate(input_ids, max_new_tokens=96, do_sample=False)
print("identical to model.generate:", torch.equal(out, plain))
