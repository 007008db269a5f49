"""The `selfspec` command: `selfspec generate PROMPT` streams an answer and its stats.

    selfspec generate "Write a haiku about autumn"
    selfspec generate --compare "Write a haiku about autumn"   # also plain model.generate, same process
    selfspec tune smollm2-135m-instruct --out my_plan.json     # search a fast plan
    selfspec train-head smollm2-135m-instruct --exit-layer 8 --out heads/e8   # train an exit head

This module parses arguments and prints; the work is done by `selfspec.load`,
`selfspec.wrap` and `SelfSpecModel.generate`.
"""

from __future__ import annotations

import argparse
import sys
import time

DEFAULT_MODEL = "smollm2-135m-instruct"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="selfspec", description="Self-speculative decoding, no second model.")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="generate text from a prompt, streamed, then print the stats")
    gen.add_argument("prompt", help="the prompt (the chat template is applied when the tokenizer has one)")
    gen.add_argument("--model", default=DEFAULT_MODEL, help=f"known model name or local folder (default: {DEFAULT_MODEL})")
    gen.add_argument("--plan", help="a plan JSON file (default: the adapter's plan for this model)")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=None, help="sample at this temperature (default: greedy)")
    gen.add_argument("--top-p", type=float, default=None, help="nucleus sampling (implies sampling)")
    gen.add_argument("--seed", type=int, default=0, help="seed for sampling")
    gen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"])
    gen.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    gen.add_argument("--device", default="cpu")
    gen.add_argument("--compare", action="store_true", help="also run plain model.generate and compare speed and output")
    gen.set_defaults(run=run_generate)
    try:
        from .tune_cli import add_tune_arguments, run_tune
    except ImportError:  # the tuner is optional
        pass
    else:
        tune = commands.add_parser("tune", help="search a fast draft plan for a model; writes a plan JSON")
        add_tune_arguments(tune)
        tune.set_defaults(run=run_tune)
    from .train_cli import add_count_vocab_arguments, add_train_head_arguments, run_count_vocab, run_train_head

    train_head = commands.add_parser("train-head", help="train an exit head by self-distillation; writes the head, "
                                                        "a plan and a draft vocabulary")
    add_train_head_arguments(train_head).set_defaults(run=run_train_head)
    count = commands.add_parser("count-vocab", help="count a draft vocabulary on the model's own answers")
    add_count_vocab_arguments(count).set_defaults(run=run_count_vocab)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, ModuleNotFoundError) as error:
        print(f"selfspec: error: {error}", file=sys.stderr)
        return 2


def run_generate(args) -> int:
    import torch
    from transformers import TextStreamer

    import selfspec

    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"selfspec: loading {args.model} ({args.dtype}, {args.device})...", file=sys.stderr, flush=True)
    began = time.perf_counter()
    model, tokenizer = selfspec.load(args.model, dtype=args.dtype, device=args.device)
    spec = selfspec.wrap(model, plan=args.plan)
    print(f"selfspec: loaded in {time.perf_counter() - began:.1f} s; plan: {spec.describe_plan()}", file=sys.stderr)

    input_ids = encode_prompt(tokenizer, args.prompt).to(args.device)
    sampling = args.temperature is not None or args.top_p is not None
    options = dict(max_new_tokens=args.max_new_tokens, do_sample=sampling)
    if sampling:
        options.update(temperature=args.temperature or 1.0, top_p=args.top_p or 1.0)
    if tokenizer.pad_token_id is not None:
        options["pad_token_id"] = tokenizer.pad_token_id

    torch.manual_seed(args.seed)
    output = spec.generate(input_ids, streamer=TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True), **options)
    stats = spec.last_stats
    print("\n")
    print(stats)
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


def encode_prompt(tokenizer, prompt: str):
    """Token ids `[1, n]`: through the chat template when the tokenizer has one, else the raw text."""
    if getattr(tokenizer, "chat_template", None):
        encoded = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        return encoded["input_ids"]
    return tokenizer(prompt, return_tensors="pt")["input_ids"]


if __name__ == "__main__":
    sys.exit(main())
