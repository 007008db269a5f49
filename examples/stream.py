"""Stream tokens as they are accepted, with sampling, using transformers' TextStreamer.

    python examples/stream.py "Tell me a short story about a lighthouse."
"""

import sys

import torch
from transformers import TextStreamer

import selfspec

prompt = sys.argv[1] if len(sys.argv) > 1 else "Tell me a short story about a lighthouse."
model, tokenizer = selfspec.load("smollm2-135m-instruct", dtype="bfloat16")
spec = selfspec.wrap(model)

messages = [{"role": "user", "content": prompt}]
input_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)  # one put() per accepted chunk

spec.generate(input_ids, max_new_tokens=200, do_sample=True, temperature=0.7, top_p=0.9,
              generator=torch.Generator().manual_seed(0), streamer=streamer)
print(spec.last_stats)
