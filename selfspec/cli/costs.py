"""`selfspec costs [MODEL]`: what a pass costs on this machine, and what that means for drafting.

    selfspec costs                                   # SmolLM2, float32 and bfloat16, its default plan
    selfspec costs gemma3-270m --dtype bfloat16 --plan examples/plans/gemma3-ngram-exit14.json

For each dtype it measures afresh (the engine's own measurement, `selfspec.costs`;
it replaces the cached table generations decide with) a verify pass over
1..k+1 tokens and one draft step of the plan, in units of
one plain decoding step, and the acceptance a drafted token needs before
drafting pays: an n-gram copy (free to draft) and a layer draft. With two
dtypes it says which one decodes faster here.
"""

from __future__ import annotations

import argparse

from . import common

HELP = "measure what a verify pass and a draft step cost on this machine"
DTYPE_CHOICES = ("float32", "bfloat16", "float16")


def dtypes(value: str) -> list[str]:
    names = [v.strip() for v in common.text(value).split(",") if v.strip()]
    bad = [n for n in names if n not in DTYPE_CHOICES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"{value!r}: valid dtypes are {', '.join(DTYPE_CHOICES)} (comma list)")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default="smollm2-135m-instruct", type=common.text,
                        help="a selfspec.load name or a local folder (default: smollm2-135m-instruct)")
    parser.add_argument("--plan", type=common.existing_file, help="a plan JSON (default: the adapter's plan)")
    parser.add_argument("--dtype", type=dtypes, default=["float32", "bfloat16"],
                        help="comma list of dtypes to measure (default: float32,bfloat16)")
    common.add_step_argument(parser)
    parser.add_argument("--repeats", type=common.integer(1, 50), default=3, help="timed runs per pass (default 3)")
    common.add_runtime_arguments(parser, dtype=None)


def run(args: argparse.Namespace) -> int:
    import selfspec

    common.check_step(args.step, args.device)
    common.set_threads(args.threads)
    steps = {}
    for dtype in args.dtype:
        model, _ = selfspec.load(args.model, dtype=dtype, device=args.device, verify=args.verify,
                                  quantize=args.quantize)
        spec = selfspec.wrap(model, plan=args.plan, step=args.step, kernels=args.kernels)
        costs = spec.measure_costs(cached=False, repeats=args.repeats)
        steps[dtype] = costs.step
        print(f"{args.model}, {dtype}, {costs.machine}")
        print(f"  plan: {spec.describe_plan()}; step: {spec.step}")
        print(f"  plain step: {costs.step * 1e3:.2f} ms ({costs.measure_seconds:.2f} s to measure)")
        widths = " ".join(f"{q}:{t / costs.step:.2f}" for q, t in enumerate(costs.verify, start=1))
        print(f"  verify pass over q tokens, in plain steps: {widths}")
        if costs.verify_long:
            long = " ".join(f"{q}:{t / costs.step:.2f}" for q, t in enumerate(costs.verify_long, start=1))
            print(f"  the same with {costs.long_context} entries in the cache (not {costs.context}): {long}")
        copy = costs.verify_seconds(2) / costs.step - 1
        print(f"  an n-gram copy pays when more than {copy:.0%} of copied tokens are accepted (k=1)")
        if costs.draft_step:
            layer = (costs.draft_step + costs.verify_seconds(2, spec.drafter.exact_prefix)) / costs.step - 1
            print(f"  draft step: {costs.draft_step / costs.step:.3f} plain steps; a layer draft pays when "
                  f"more than {min(layer, 1.0):.0%} of drafted tokens are accepted (k=1)"
                  + ("" if layer < 1 else ": never, here"))
        del model, spec
    if len(steps) > 1:
        fastest = min(steps, key=steps.get)
        others = ", ".join(f"{d} {steps[d] / steps[fastest]:.2f}x as long" for d in steps if d != fastest)
        print(f"fastest plain step here: {fastest} ({others}); "
              "selfspec's output is identical to model.generate's in that dtype too")
    return 0
