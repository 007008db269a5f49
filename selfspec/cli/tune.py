"""`selfspec tune MODEL`: search a fast draft plan for a model and write it as a plan JSON.

    selfspec tune smollm2-135m-instruct --dtype bfloat16 --threads 1 --out plan.json
    selfspec generate --model smollm2-135m-instruct --dtype bfloat16 --plan plan.json "Hello"

`run` builds a `TuneConfig` from the options, runs the search
(`selfspec.tuning.tune`), prints the tables and writes three files: the plan
(`--out`), a report with every candidate, the cost model, the Pareto front and
the timed runs (`<out>.tune.json`), and the acceptance-versus-cost plot
(`<out>.front.png`, when matplotlib is installed). This module parses and
prints; it does no tuning of its own.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from . import common
from ..tuning.layer_search import OPTIMIZERS, OPTUNA_SAMPLERS
from ..tuning.pipeline import SEARCH_PROXIES, TuneConfig

HELP = "search a fast draft plan for a model; writes a plan JSON"


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    integer = common.integer
    parser.add_argument("model", type=common.text,
                        help="known model name (e.g. smollm2-135m-instruct) or a local model folder")
    parser.add_argument("--dtype", default="float32", choices=common.DTYPES,
                        help="tune for this dtype; costs differ by dtype, so tune for the one you run "
                             "(default: float32)")
    common.add_runtime_arguments(parser, dtype=None)
    parser.add_argument("--prompts", type=integer(1), default=10, metavar="N", help="calibration prompts (default: 10)")
    parser.add_argument("--heldout", type=integer(0), default=5, metavar="M",
                        help="further prompts for the timed confirmation (default: 5)")
    parser.add_argument("--data", metavar="FILE", type=common.prompt_file,
                        help="prompts: a .jsonl (Spec-Bench rows, or a prompt/text field), a .json list or a text "
                             "file with one prompt a line; 'spec-bench' finds the Spec-Bench questions "
                             "($SELFSPEC_SPEC_BENCH or ../shared/data/). Default: the built-in chat prompts")
    parser.add_argument("--max-new-tokens", type=integer(2), default=48,
                        help="tokens generated per prompt (default: 48)")
    parser.add_argument("--budget", type=integer(1), default=200, help="layer sets the proxy scores (default: 200)")
    parser.add_argument("--optimizer", default="greedy", choices=OPTIMIZERS,
                        help="greedy layer dropping + local moves (default), random search, or optuna (needs optuna)")
    parser.add_argument("--optuna-sampler", default="tpe", choices=OPTUNA_SAMPLERS,
                        help="with --optimizer optuna: TPE on proxy speedup, or NSGA-II on (acceptance, draft cost)")
    parser.add_argument("--search-proxy", default="target", choices=SEARCH_PROXIES,
                        help="proxy for the search: round starts only (fast, exact for k=1; default) or the exact "
                             "replay of the engine's rounds (slower)")
    parser.add_argument("--rescore", type=integer(0), default=24, metavar="N",
                        help="re-score the N best layer sets and the Pareto front with the exact proxy (default: 24)")
    parser.add_argument("--confirm", type=integer(0), default=3, metavar="N",
                        help="time the N best plans by proxy against plain decoding (default: 3)")
    parser.add_argument("--confirm-repeats", type=integer(1), default=1, help="timed passes over the held-out prompts")
    parser.add_argument("--proxy-check", type=integer(0), default=6, metavar="N",
                        help="also run N plans for real on calibration prompts to measure the proxy's error (0: skip)")
    parser.add_argument("--proxy-check-prompts", type=integer(1), default=4)
    parser.add_argument("--max-draft-length", type=integer(1), default=8, help="longest draft considered (default: 8)")
    parser.add_argument("--skip-ends", action="store_true",
                        help="let layer-skip plans drop the first and last layer too (default: keep them)")
    parser.add_argument("--no-default", action="store_true", help="do not time the adapter's current plan")
    parser.add_argument("--trees", type=tree_budgets, default=(),
                        help="comma list of node budgets: also time the best plan with n-gram lookup first, as "
                             "chains (0) or token trees of that many nodes (e.g. 0,8,16; default: none)")
    parser.add_argument("--recycle", action="store_true",
                        help="with --trees: also time each tree budget with recycled trees (the target's own past "
                             "predictions, recycle=True)")
    parser.add_argument("--out", type=common.text, help="plan JSON path (default: <model>-<dtype>-plan.json)")
    parser.add_argument("--no-plot", action="store_true", help="do not write the PNG plot")
    parser.add_argument("--seed", type=integer(0), default=0)
    parser.add_argument("--quiet", action="store_true", help="no progress bars or messages on stderr")
    return parser


def tune_config(args: argparse.Namespace) -> TuneConfig:
    """The search's options from the command line's (the flags without a `TuneConfig` field are the CLI's own)."""
    return TuneConfig(
        max_new_tokens=args.max_new_tokens, budget=args.budget, optimizer=args.optimizer,
        optuna_sampler=args.optuna_sampler, search_proxy=args.search_proxy, rescore=args.rescore,
        confirm=args.confirm, confirm_repeats=args.confirm_repeats, proxy_check=args.proxy_check,
        proxy_check_prompts=args.proxy_check_prompts, max_draft_length=args.max_draft_length,
        keep_ends=not args.skip_ends, seed=args.seed, include_default=not args.no_default,
        name=f"{Path(str(args.model)).name}-{args.dtype}-tuned", trees=args.trees,
        recycle=args.recycle,
    )


def tree_budgets(text: str) -> tuple[int, ...]:
    """`--trees 0,8,16` as node budgets 0..64."""
    try:
        budgets = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        budgets = ()
    if not budgets or any(not 0 <= b <= 64 for b in budgets):
        raise argparse.ArgumentTypeError(f"expected a comma list of node budgets 0..64 like 0,8,16, got {text!r}")
    return budgets


def run(args: argparse.Namespace) -> int:
    import torch

    import selfspec
    from ..prompts import encode_prompts
    from ..tuning import adapter_entry, tune

    config = tune_config(args)
    texts = common.prompt_texts(args.data, seed=args.seed)  # a bad prompt file fails before the model loads
    common.set_threads(args.threads)
    progress = not args.quiet
    began = time.perf_counter()
    model, tokenizer = selfspec.load(args.model, dtype=args.dtype, device=args.device, progress=progress,
                                     verify=args.verify, quantize=args.quantize)

    wanted = args.prompts + args.heldout
    if len(texts) < wanted:
        _say(progress, f"only {len(texts)} prompts for {args.prompts} calibration + {args.heldout} held-out; "
                       f"the confirmation reuses calibration prompts")
    ids = encode_prompts(tokenizer, texts[:wanted])
    calibration, heldout = ids[: args.prompts], ids[args.prompts : wanted] or ids[: args.prompts]

    result = tune(model, prompts=calibration, heldout=heldout, config=config, progress=progress)
    seconds = time.perf_counter() - began
    command = format_command(args)
    result.settings.update(command=command, model=str(args.model), seconds=seconds)

    out = Path(args.out or f"{Path(str(args.model)).name}-{args.dtype}-plan.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    result.best_plan.save(out)
    report = out.with_suffix(".tune.json")
    result.save(report)
    plot = None
    if not args.no_plot:
        plot = out.with_suffix(".front.png")
        if not result.plot(plot, title=f"{args.model} ({args.dtype}): acceptance against draft cost"):
            plot = None

    print(f"# selfspec tune {args.model} ({args.dtype}, {torch.get_num_threads()} threads)\n")
    print(f"command: `{command}`  ")
    print(f"runtime: {seconds:.0f} s ({', '.join(f'{k} {v:.0f} s' for k, v in result.timings.items())})  ")
    print(f"cost model: {result.cost_model.summary()}  ")
    if result.proxy_check is not None:
        print(f"{result.proxy_check.summary()}  ")
    print()
    print(result.table())
    print()
    if result.best is not None:
        verdict = "faster than" if result.best.speedup > 1 else "NOT faster than"
        print(f"best plan: {result.best.speedup:.2f}x the plain path on held-out prompts ({verdict} plain decoding "
              f"on this machine, {args.dtype})")
    print(f"\nplan written to {out}:\n{result.best_plan.to_json()}\n")
    print(f"report: {report}" + (f"; plot: {plot}" if plot else " (no plot: matplotlib is not installed or --no-plot)"))
    print("\nadapter entry (adapters/<family>.toml), if this plan should become the model's default:\n")
    print(adapter_entry(result.best_plan, model.config, command=command))
    return 0


def format_command(args: argparse.Namespace) -> str:
    """The `selfspec tune` command line that reproduces `args` (options at their defaults left out)."""
    defaults = vars(add_arguments(argparse.ArgumentParser()).parse_args([str(args.model)]))
    words = ["selfspec", "tune", str(args.model)]
    for key, value in vars(args).items():
        if key not in defaults or key == "model" or value == defaults[key]:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            words.append(flag)
        elif isinstance(value, tuple):
            words += [flag, ",".join(map(str, value))]
        elif value not in (False, None):
            words += [flag, str(value)]
    return shlex.join(words)


def _say(progress: bool, message: str) -> None:
    if progress:
        print(f"selfspec tune: {message}", file=sys.stderr)
