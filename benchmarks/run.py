"""Benchmark selfspec against Hugging Face decoding: one process, the same prompts, methods interleaved.

    python -m benchmarks.run --quick                      # about two minutes on a quiet 2-core CPU
    python -m benchmarks.run                              # 5 Spec-Bench questions per category
    python -m benchmarks.run --model gemma3-270m --dtype float32 --per-category 2

See benchmarks/README.md for every option, the columns and how to read them.
Writes results/<time>-<model>-<dtype>/{bench.json, table.md, chart.png}.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import time
import warnings
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

import torch
import transformers

import selfspec
from selfspec.costs import cpu_model
from benchmarks import report
from benchmarks.measure import Row, measure
from benchmarks.methods import (
    ALL_METHODS,
    BASELINE,
    Method,
    build_method,
    default_methods,
    early_exit_candidates,
    num_layers,
)
from benchmarks.workload import DEFAULT_DATA, Prompt, build_workload, has_chat_template

REPO_ROOT = Path(__file__).resolve().parent.parent

QUICK = {
    "per_category": 1,
    "categories": "writing,translation,qa,math_reasoning",
    "max_new_tokens": 48,
    "methods": "hf-greedy,hf-early-exit,hf-prompt-lookup,selfspec-plain,selfspec-plan",
}
FULL = {"per_category": 5, "categories": None, "max_new_tokens": 128, "methods": None}
WARMUP_TOKENS = 8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="a selfspec.load name or local path")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--per-category", type=int, help="questions drawn per category (default 5; --quick: 1)")
    p.add_argument("--categories", help="comma list of categories, in this order (default all; --quick: 4)")
    p.add_argument("--max-new-tokens", type=int, help="tokens per answer (default 128; --quick: 48)")
    p.add_argument("--seed", type=int, default=0, help="seed of the question draw (default 0)")
    p.add_argument("--methods", help=f"comma list from {', '.join(ALL_METHODS)} (default: all that apply)")
    p.add_argument("--plan", type=Path, help="selfspec plan JSON for selfspec-plan (default: the adapter's plan)")
    p.add_argument("--plans", action="append", default=[], metavar="NAME=PLAN.json",
                   help="also run selfspec with this plan as method 'plan:NAME' (repeatable; for ablations)")
    p.add_argument("--early-exit-sweep", help="comma list of E for hf-early-exit (default: ~L/5, L/3, L/2)")
    p.add_argument("--sweep-prompts", type=int, default=3, help="prompts the early-exit sweep times (default 3)")
    p.add_argument("--costs", choices=["linear", "flat"],
                   help="decide selfspec's draft lengths with this cost profile instead of the measured costs "
                        "(linear: q tokens cost q steps, as AVX2 bfloat16; flat: up to 16 cost one step, as a GPU); "
                        "the times are still this machine's")
    p.add_argument("--prompt-lookup", type=int, default=10, help="prompt_lookup_num_tokens (default 10)")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help=f"Spec-Bench questions (default {DEFAULT_DATA})")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "results", help="results folder (default results/)")
    p.add_argument("--quick", action="store_true", help="a 4-prompt, 48-token, 5-method run for a first look")
    p.add_argument("--verbose", action="store_true", help="keep transformers' warnings")
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.verbose:
        transformers.logging.set_verbosity_error()
        warnings.filterwarnings("ignore", module="transformers")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model, tokenizer = selfspec.load(args.model, dtype=args.dtype, device=device)
    chat = has_chat_template(tokenizer)
    categories = args.categories.split(",") if args.categories else None
    workload = build_workload(
        tokenizer, data_path=args.data, per_category=args.per_category, seed=args.seed,
        use_chat_template=chat, categories=categories, device=str(device),
    )
    plan, plan_note = resolve_plan(model, args.plan)
    names = method_names(args, plan)
    header = make_header(args, model, workload, plan, plan_note, chat)
    busy = busy_warning(device)
    if busy:
        header["warning"] = busy
    print_header(header)
    exit_layer, sweep = choose_early_exit(model, args, plan, names, workload.prompts, device)
    header["early exit E"] = exit_layer if "hf-early-exit" in names else "-"
    print(f"hf-early-exit: E={header['early exit E']}" + ("" if sweep["swept"] else " (no sweep)"), flush=True)

    methods, failed = build_methods(names, model, args, plan, exit_layer, workload.prompts, device)
    costs = next((m.settings["costs"] for m in methods if "costs" in m.settings), None)
    header["pass costs"] = (f"profile {args.costs!r} injected; " if args.costs else "") + (costs or "-")
    print(f"pass costs: {header['pass costs']}", flush=True)
    rows = run_interleaved(methods, workload.prompts, device)
    memory = memory_pass(methods, workload.prompts, device)

    report.compare_with_baseline(rows, BASELINE)
    report.explain_differences(model, rows, {p.prompt_id: p for p in workload.prompts}, args.dtype, BASELINE)
    header["load average at end"] = load_average()
    summary = report.summarize(rows, [m.name for m in methods], workload.categories, BASELINE, memory)
    descriptions = {m.name: m.description for m in methods}
    table = report.markdown(header, summary, rows, descriptions, failed)
    extra = {"methods": {m.name: {"description": m.description, **m.settings} for m in methods},
             "failed_methods": failed, "early_exit_sweep": sweep,
             "memory_pass": {name: asdict(row) for name, row in memory.items()}}
    folder = write_outputs(args, header, summary, rows, extra, table)
    print("\n" + table.split("## Per method", 1)[1].strip())
    print(f"\nresults in {folder}")
    return 0


def run_interleaved(methods: list[Method], prompts: list[Prompt], device: torch.device) -> list[Row]:
    """For each prompt, every method once, the order rotated by one per prompt so drift hits all alike."""
    rows = []
    for i, prompt in enumerate(prompts):
        shift = i % len(methods)
        for method in methods[shift:] + methods[:shift]:
            rows.append(measure(method, prompt, device))
        done = {r.method: r for r in rows[-len(methods):]}
        speeds = "  ".join(f"{m.name} {_speed(done[m.name])}" for m in methods)
        print(f"[{i + 1}/{len(prompts)}] {prompt.category}/{prompt.prompt_id} ({prompt.length} tok): {speeds}",
              flush=True)
    return rows


def memory_pass(methods: list[Method], prompts: list[Prompt], device: torch.device) -> dict[str, Row]:
    """Each method once more, untimed, on the longest prompt, with freed memory returned to the OS first."""
    longest = max(prompts, key=lambda p: p.length)
    return {m.name: measure(m, longest, device, trim=True) for m in methods}


def _speed(row: Row) -> str:
    return "ERROR" if row.error else f"{row.tokens_per_second:.1f}"


# --------------------------------------------------------------------------- setup


def resolve_plan(model, path: Path | None) -> tuple[selfspec.DraftPlan | None, str]:
    """The plan for selfspec-plan, and where it came from (or why there is none)."""
    try:
        if path is not None:
            return selfspec.DraftPlan.load(path), f"from {path}"
        return selfspec.wrap(model).plan, "the adapter's plan for this model"
    except Exception as error:  # e.g. an architecture selfspec has no adapter for
        return None, f"none: {type(error).__name__}: {error}"


def method_names(args: argparse.Namespace, plan) -> list[str]:
    if args.methods:
        names = [n.strip() for n in args.methods.split(",") if n.strip()]
    else:
        names = default_methods(plan, args.device)
    unknown = [n for n in names if n not in ALL_METHODS]
    if unknown:
        raise SystemExit(f"unknown method(s) {unknown}; valid: {', '.join(ALL_METHODS)}")
    names += [f"plan:{name}" for name in extra_plans(args)]
    return [BASELINE] + [n for n in names if n != BASELINE]  # the baseline always runs, first


def extra_plans(args: argparse.Namespace) -> dict[str, Path]:
    """`--plans NAME=PLAN.json` options as {NAME: path}."""
    plans = {}
    for item in args.plans:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--plans takes NAME=PLAN.json, got {item!r}")
        plans[name] = Path(path)
    return plans


def build_methods(names, model, args, plan, exit_layer, prompts, device) -> tuple[list[Method], dict[str, str]]:
    """Build and warm up every method (one short generation each); a method that fails is left out."""
    methods, failed = [], {}
    warm_prompt = min(prompts, key=lambda p: p.length)
    options = dict(model=model, plan=plan, early_exit=exit_layer, prompt_lookup=args.prompt_lookup, costs=args.costs)
    plan_files = extra_plans(args)
    for name in names:
        if plan is None and name.startswith("selfspec-"):
            failed[name] = "no selfspec plan for this model (see the header's plan line)"
            continue
        try:
            if name.startswith("plan:"):
                extra = selfspec.DraftPlan.load(plan_files[name[len("plan:"):]])
                warm_up = build_method("selfspec-plan", max_new_tokens=WARMUP_TOKENS, **{**options, "plan": extra})
                method = build_method("selfspec-plan", max_new_tokens=args.max_new_tokens, **{**options, "plan": extra})
                method.name = warm_up.name = name
                method.description = f"selfspec: {method.settings['describe']}"
            else:
                warm_up = build_method(name, max_new_tokens=WARMUP_TOKENS, **options)
                method = build_method(name, max_new_tokens=args.max_new_tokens, **options)
        except Exception as error:
            failed[name] = f"{type(error).__name__}: {error}"
            continue
        warm = measure(warm_up, warm_prompt, device)
        print(f"warm-up {name}: {warm.error or 'ok'} ({warm.seconds:.1f} s)", flush=True)
        method.settings["warm_up_seconds"] = round(warm.seconds, 2)  # compile and capture time show here
        if warm.error:
            failed[name] = warm.error
        else:
            methods.append(method)
    if BASELINE in failed:
        raise SystemExit(f"the baseline {BASELINE} failed: {failed[BASELINE]}")
    return methods, failed


def choose_early_exit(model, args, plan, names, prompts, device) -> tuple[int, dict]:
    """Pick E for hf-early-exit: the fastest of the sweep on the first few prompts (no sweep for one E)."""
    layers = num_layers(model)
    if args.early_exit_sweep:
        candidates = [int(e) for e in args.early_exit_sweep.split(",")]
    elif args.quick:  # no sweep: the plan's exit layer when it has one, else a third of the depth
        candidates = [plan.exit_layer if plan is not None and plan.exit_layer else max(1, round(layers / 3))]
    else:
        candidates = early_exit_candidates(layers)
    bad = [e for e in candidates if not 1 <= e < layers]
    if bad:
        raise SystemExit(f"early exit layer(s) {bad} out of range for {layers} layers (valid: 1..{layers - 1})")
    if len(candidates) == 1 or "hf-early-exit" not in names:
        return candidates[0], {"candidates": candidates, "swept": False}
    timing = {}
    for e in candidates:
        method = build_method("hf-early-exit", model, max_new_tokens=args.max_new_tokens, plan=plan,
                              early_exit=e, prompt_lookup=args.prompt_lookup)
        measure(method, prompts[0], device)  # warm-up
        runs = [measure(method, p, device) for p in prompts[: args.sweep_prompts]]
        tokens, seconds = sum(r.new_tokens for r in runs), sum(r.seconds for r in runs)
        timing[e] = tokens / seconds if seconds and not any(r.error for r in runs) else 0.0
        print(f"early-exit sweep: E={e}: {timing[e]:.1f} tok/s", flush=True)
    best = max(timing, key=timing.get)
    return best, {"candidates": candidates, "swept": True, "prompts": args.sweep_prompts,
                  "tokens_per_second": timing, "chosen": best}


# --------------------------------------------------------------------------- header and files


def make_header(args, model, workload, plan, plan_note, chat) -> dict:
    return {
        "command": shlex.join([sys.executable, *sys.argv]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.platform()}; {cpu_model()}; {os.cpu_count()} CPUs",
        "cpu capability": torch.backends.cpu.get_cpu_capability(),
        "device": str(torch.cuda.get_device_name()) if args.device.startswith("cuda") else "cpu",
        "load average at start": load_average(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "selfspec": selfspec.__version__,
        "model": f"{args.model} ({type(model).__name__}, {num_layers(model)} layers)",
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "prompts": f"{len(workload.prompts)} in {len(workload.categories)} categories; {workload.source}"
        + ("; FALLBACK: Spec-Bench file absent" if workload.fallback else ""),
        "prompt format": "chat template, first turn" if chat else "raw question text (no chat template)",
        "max new tokens": args.max_new_tokens,
        "plan": f"{plan.describe(num_layers(model)) if plan else '-'} ({plan_note})",
        "early exit E": "(chosen below)",
        "quick": args.quick,
    }


def print_header(header: dict) -> None:
    width = max(len(k) for k in header)
    for key, value in header.items():
        print(f"{key:>{width}}: {value}")
    print(flush=True)


def busy_warning(device: torch.device) -> str | None:
    """A note when other processes keep the CPU busy: timings are then noisy and unfair (see README)."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return None
    if device.type == "cpu" and load > 0.5:
        return (f"the 1-minute load average is {load:.2f} before this run started: other processes use the CPU, "
                "so timings will be noisy, worst for the methods that launch many small kernels (the drafts)")
    return None


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def write_outputs(args, header, summary, rows, extra, table) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    folder = args.out / f"{stamp}-{Path(str(args.model)).name}-{args.dtype}"
    folder.mkdir(parents=True, exist_ok=True)
    report.write_json(folder / "bench.json", header, summary, rows, extra)
    (folder / "table.md").write_text(table, encoding="utf-8")
    title = f"{args.model} {args.dtype}, {args.threads} threads, {args.max_new_tokens} new tokens"
    why_not = report.write_chart(folder / "chart.png", summary, BASELINE, title)
    if why_not:
        print(f"no chart: {why_not}")
    return folder


if __name__ == "__main__":
    raise SystemExit(main())
