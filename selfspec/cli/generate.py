"""`selfspec generate PROMPT`: stream an answer, then print the stats (and, with --compare, plain speed).

    selfspec generate "Write a haiku about autumn"
    selfspec generate --compare --plan plan.json --temperature 0.7 "Write a haiku about autumn"

This module parses arguments and prints; the work is done by `selfspec.load`,
`selfspec.wrap` and `SelfSpecModel.generate`.
"""

from __future__ import annotations

import argparse
import sys
import time

from . import common

HELP = "generate text from a prompt, streamed, then print the stats"
DEFAULT_MODEL = "smollm2-135m-instruct"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", type=common.text,
                        help="the prompt (the chat template is applied when the tokenizer has one)")
    parser.add_argument("--model", default=DEFAULT_MODEL, type=common.text,
                        help=f"known model name or local folder (default: {DEFAULT_MODEL})")
    parser.add_argument("--plan", type=common.existing_file,
                        help="a plan JSON file (default: the adapter's plan for this model)")
    parser.add_argument("--max-new-tokens", type=common.integer(1), default=128)
    parser.add_argument("--temperature", type=common.number(0), default=None,
                        help="sample at this temperature (default, and 0: greedy)")
    parser.add_argument("--top-p", type=common.number(0, 1), default=None,
                        help="nucleus sampling (implies sampling; 0: greedy)")
    parser.add_argument("--seed", type=common.integer(0), default=0, help="seed for sampling")
    common.add_runtime_arguments(parser)
    common.add_offload_arguments(parser)
    common.add_step_argument(parser)
    common.add_reproducible_argument(parser)
    parser.add_argument("--compare", action="store_true",
                        help="also run plain model.generate and compare speed and output")


def sampling_options(temperature: float | None, top_p: float | None) -> dict:
    """`generate` options for `--temperature` and `--top-p`.

    Neither given, or either 0: greedy (temperature 0 means greedy in every
    sampling CLI, and top-p 0 keeps only the most likely token). Otherwise
    sampling, the one not given at 1.0.
    """
    if (temperature is None and top_p is None) or temperature == 0 or top_p == 0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": 1.0 if temperature is None else temperature,
            "top_p": 1.0 if top_p is None else top_p}


def run(args: argparse.Namespace) -> int:
    import torch
    from transformers import TextStreamer

    import selfspec
    from ..prompts import encode_prompts

    plan = selfspec.DraftPlan.load(args.plan) if args.plan else None  # a bad plan file fails before the model loads
    common.check_step(args.step, args.device)
    common.set_threads(args.threads)
    weights = f", {args.quantize} weights" if args.quantize else ""
    print(f"selfspec: loading {args.model} ({args.dtype}{weights}, {args.device})...", file=sys.stderr, flush=True)
    began = time.perf_counter()
    model, tokenizer = selfspec.load(args.model, dtype=args.dtype, device=args.device, verify=args.verify,
                                     quantize=args.quantize, **common.offload_options(args))
    spec = selfspec.wrap(model, plan=plan, step=args.step, kernels=args.kernels, reproducible=args.reproducible)
    print(f"selfspec: loaded in {time.perf_counter() - began:.1f} s; plan: {spec.describe_plan()}", file=sys.stderr,
          flush=True)

    input_ids = torch.tensor(encode_prompts(tokenizer, [args.prompt]), device=args.device)  # [1, n]
    options = dict(max_new_tokens=args.max_new_tokens, **sampling_options(args.temperature, args.top_p))
    sampling = options["do_sample"]
    if tokenizer.pad_token_id is not None:
        options["pad_token_id"] = tokenizer.pad_token_id

    if args.compare:  # a fair race: both warmed up (first passes allocate; selfspec measures its pass costs)
        warm_up = {**options, "max_new_tokens": 4}
        with torch.no_grad():
            spec.generate(input_ids, **warm_up)
            model.generate(input_ids, **warm_up)
    torch.manual_seed(args.seed)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    output = spec.generate(input_ids, streamer=streamer, **options)
    stats = spec.last_stats
    print("\n")
    print(stats)
    context = input_ids.shape[1] + args.max_new_tokens + spec.plan.draft_length + 1  # what the cache held
    print(spec.memory(context=context).summary())
    if args.compare:
        torch.manual_seed(args.seed)
        with torch.no_grad():
            began = time.perf_counter()
            reference = model.generate(input_ids, **options)
            seconds = time.perf_counter() - began
        plain_speed = (reference.shape[1] - input_ids.shape[1]) / seconds
        print(f"\nmodel.generate: {plain_speed:.1f} tok/s; selfspec: {stats.tokens_per_second:.1f} tok/s "
              f"({stats.tokens_per_second / plain_speed:.2f}x)")
        if sampling:
            print("outputs: sampled, so not expected to be identical (the distribution is the same)")
        else:
            same = torch.equal(output, reference)
            print(f"outputs identical: {'yes' if same else 'NO'}")
            if not same:
                print(explain_difference(model, output, reference, input_ids.shape[1]))
                print(tokenizer.decode(reference[0, input_ids.shape[1]:], skip_special_tokens=True))
    return 0


def explain_difference(model, output, reference, prompt_length: int) -> str:
    """Where two greedy outputs part, and how close the target's top two logits are there."""
    import torch

    n = min(output.shape[1], reference.shape[1])
    first = next((i for i in range(prompt_length, n) if output[0, i] != reference[0, i]), n)
    if first == n:
        return f"outputs agree on their first {n - prompt_length} new tokens; one is longer"
    with torch.no_grad():
        top2 = model(reference[:, :first]).logits[0, -1].float().topk(2).values
    return (
        f"first difference at new token {first - prompt_length}, where the target's top two logits differ by "
        f"{float(top2[0] - top2[1]):.2e} (a gap this small is a rounding near-tie: the verify pass scores "
        f"several tokens at once and may round differently from one-token steps)"
    )
