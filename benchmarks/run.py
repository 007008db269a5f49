"""Benchmark selfspec against Hugging Face decoding: one process, the same prompts, methods interleaved.

    python -m benchmarks.run --quick                      # about two minutes on a quiet 2-core CPU
    python -m benchmarks.run                              # 5 Spec-Bench questions per category
    python -m benchmarks.run --model gemma3-270m --dtype float32 --per-category 2
    python -m benchmarks.run --variants bfloat16,bfloat16+int8,bfloat16+int4 --per-category 2  # quantized targets

See benchmarks/README.md for every option, the columns and how to read them.
Writes results/<time>-<model>-<dtype or variants>/{bench.json, table.md, chart.png}.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import tempfile
import time
import warnings
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

import torch
import transformers

import selfspec
from selfspec.offload import offload_layers
from selfspec.costs import cpu_capability, cpu_model
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
from benchmarks.variants import Variant, memory_summary, method_name, parse_variants, split_method_name
from benchmarks.workload import DEFAULT_DATA, Prompt, build_workload, has_chat_template
from selfspec.quant import QUANTIZE_CHOICES

REPO_ROOT = Path(__file__).resolve().parent.parent

QUICK = {
    "per_category": 1,
    "categories": "writing,translation,qa,math_reasoning",
    "max_new_tokens": 48,
    "methods": "hf-greedy,hf-early-exit,hf-prompt-lookup,selfspec-plain,selfspec-plan",
}
FULL = {"per_category": 5, "categories": None, "max_new_tokens": 128, "methods": None}
VARIANT_METHODS = "hf-greedy,selfspec-plain,selfspec-plan"  # the default methods of a run with --variants
WARMUP_TOKENS = 8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="a selfspec.load name or local path")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="activations and weights (default bfloat16)")
    p.add_argument("--quantize", choices=QUANTIZE_CHOICES,
                   help="quantize the linear layers weight-only after loading (selfspec.load(..., quantize=...))")
    p.add_argument("--variants", metavar="DTYPE[+int8|int4],...",
                   help="run every method on each of these weight variants, all interleaved in one loop; the first "
                        f"is the reference (default methods: {VARIANT_METHODS}); replaces --dtype and --quantize")
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
    p.add_argument("--plans-packed", action="store_true",
                   help="also run each --plans plan on packed weight copies, as 'plan:NAME+packed' "
                        "(`wrap(kernels=\"packed\")`)")
    p.add_argument("--early-exit-sweep", help="comma list of E for hf-early-exit (default: ~L/5, L/3, L/2)")
    p.add_argument("--sweep-prompts", type=int, default=3, help="prompts the early-exit sweep times (default 3)")
    p.add_argument("--costs", choices=["linear", "flat", "held"],
                   help="decide selfspec's draft lengths with this cost profile instead of the measured costs "
                        "(linear: q tokens cost q steps, as AVX2 bfloat16; flat: up to 16 cost one step, as a GPU); "
                        "the times are still this machine's. held: the measured costs, each plan's table measured "
                        "once and not refined by the rounds' timings (plan A/Bs: the plans price passes alike)")
    p.add_argument("--prompt-lookup", type=int, default=10, help="prompt_lookup_num_tokens (default 10)")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help=f"Spec-Bench questions (default {DEFAULT_DATA})")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "results", help="results folder (default results/)")
    p.add_argument("--quick", action="store_true", help="a 4-prompt, 48-token, 5-method run for a first look")
    p.add_argument("--verbose", action="store_true", help="keep transformers' warnings")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.variants:
        if args.dtype or args.quantize:
            p.error("--variants names each variant's dtype and quantization: drop --dtype and --quantize")
        try:
            args.variant_list = parse_variants(args.variants)
        except ValueError as error:
            p.error(str(error))
        if args.methods is None:
            args.methods = VARIANT_METHODS
    else:
        args.dtype = args.dtype or "bfloat16"
        args.variant_list = [Variant(args.dtype, args.quantize)]
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
    models, tokenizer = {}, None
    for variant in args.variant_list:  # the same checkpoint each time: one tokenizer serves all
        models[variant.name], tokenizer = selfspec.load(args.model, dtype=variant.dtype, device=device,
                                                        quantize=variant.quantize)
        if variant.offload_from is not None:  # the same weights, layers N.. on disk behind accelerate's hooks
            folder = tempfile.mkdtemp(prefix="selfspec-offload-")
            models[variant.name] = offload_layers(models[variant.name], variant.offload_from, folder=folder)
    model = models[args.variant_list[0].name]  # the reference: plan, early-exit sweep and header come from it
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

    methods, failed = [], {}
    for variant in args.variant_list:
        built, bad = build_methods(names, models[variant.name], args, plan, exit_layer, workload.prompts, device,
                                   variant=variant_label(args, variant))
        methods += built
        failed.update(bad)
    injected = {None: "", "held": "measured once per plan and held (not refined); "}.get(
        args.costs, f"profile {args.costs!r} injected; ")
    header["pass costs"] = injected + per_variant(methods, "costs", bool(args.variants))
    print(f"pass costs: {header['pass costs']}", flush=True)
    header["cpu kernels"] = per_variant(methods, "kernels", bool(args.variants))
    print(f"selfspec's kernels: {header['cpu kernels']}", flush=True)
    weights = variant_memory(args, models, plan, workload.prompts)
    for name, mem in weights.items():
        if "error" in mem:
            print(f"{name}: memory unknown: {mem['error']}", flush=True)
            continue
        print(f"{name}: weights {mem['weight_bytes'] / 2**20:.1f} MiB (embedding + LM head "
              f"{mem['embedding_bytes'] / 2**20:.1f}, the rest {mem['rest_bytes'] / 2**20:.1f}), KV cache "
              f"{mem['kv_cache_bytes'] / 2**20:.1f} MiB for {mem['context']} tokens", flush=True)
    rows = run_interleaved(methods, workload.prompts, device)
    memory = memory_pass(methods, workload.prompts, device)

    prompts = {p.prompt_id: p for p in workload.prompts}
    for variant in args.variant_list:  # each variant's outputs against its own model.generate
        label = variant_label(args, variant)
        group = [r for r in rows if label is None or split_method_name(r.method)[0] == label]
        baseline = method_name(label, BASELINE)
        report.compare_with_baseline(group, baseline)
        report.explain_differences(models[variant.name], group, prompts, variant.dtype, baseline)
    header["load average at end"] = load_average()
    reference = method_name(variant_label(args, args.variant_list[0]), BASELINE)
    summary = report.summarize(rows, [m.name for m in methods], workload.categories, reference, memory)
    variants = (report.summarize_variants(summary["overall"], list(weights), weights, BASELINE)
                if args.variants else None)
    descriptions = {m.name: m.description for m in methods}
    table = report.markdown(header, summary, rows, descriptions, failed, variants)
    extra = {"methods": {m.name: {"description": m.description, **m.settings} for m in methods},
             "failed_methods": failed, "early_exit_sweep": sweep,
             "memory_pass": {name: asdict(row) for name, row in memory.items()}, "weight_memory": weights}
    if variants:
        extra["variants"] = variants
    folder = write_outputs(args, header, summary, rows, extra, table, reference)
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


def variant_label(args: argparse.Namespace, variant: Variant) -> str | None:
    """The prefix of the variant's method names: its name in a run with --variants, none otherwise."""
    return variant.name if args.variants else None


def per_variant(methods: list[Method], setting: str, with_variants: bool) -> str:
    """A setting of the selfspec methods (the pass costs, the CPU kernels: a quantized model has its own), the
    first method's per variant and kernel choice (packed copies have their own): one line, or one per group;
    "-" when none has it."""
    found = {}
    for m in methods:
        if setting in m.settings:
            labels = [split_method_name(m.name)[0] if with_variants else None,
                      "packed copies" if m.settings.get("kernel choice") == "packed" else None]
            found.setdefault(", ".join(label for label in labels if label), m.settings[setting])
    if not found:
        return "-"
    return " | ".join(f"{group}: {value}" if group else value for group, value in found.items())


def variant_memory(args, models: dict, plan, prompts: list[Prompt]) -> dict[str, dict]:
    """Per variant, `spec.memory()` for the longest prompt + max new tokens, split as the variant tables show it."""
    context = max(p.length for p in prompts) + args.max_new_tokens
    result = {}
    for variant in args.variant_list:
        try:
            spec = selfspec.wrap(models[variant.name], plan=plan or selfspec.DraftPlan.plain())
            result[variant.name] = memory_summary(spec.memory(context=context))
        except Exception as error:  # e.g. an architecture selfspec has no adapter for: the hf-* methods still run
            result[variant.name] = {"error": f"{type(error).__name__}: {error}"}
    return result


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
    if args.plans_packed:
        names += [f"plan:{name}{PACKED}" for name in extra_plans(args)]
    return [BASELINE] + [n for n in names if n != BASELINE]  # the baseline always runs, first


PACKED = "+packed"  # the suffix of an extra plan's method on packed weight copies


def extra_plans(args: argparse.Namespace) -> dict[str, Path]:
    """`--plans NAME=PLAN.json` options as {NAME: path}."""
    plans = {}
    for item in args.plans:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--plans takes NAME=PLAN.json, got {item!r}")
        plans[name] = Path(path)
    return plans


def build_methods(names, model, args, plan, exit_layer, prompts, device,
                  variant: str | None = None) -> tuple[list[Method], dict[str, str]]:
    """Build and warm up every method (one short generation each); a method that fails is left out.

    `variant`: the methods are named `VARIANT/METHOD` (a run with --variants).
    """
    methods, failed = [], {}
    warm_prompt = min(prompts, key=lambda p: p.length)
    options = dict(model=model, plan=plan, early_exit=exit_layer, prompt_lookup=args.prompt_lookup, costs=args.costs)
    plan_files = extra_plans(args)
    for short in names:
        name = method_name(variant, short)
        if plan is None and short.startswith("selfspec-"):
            failed[name] = "no selfspec plan for this model (see the header's plan line)"
            continue
        try:
            if short.startswith("plan:"):
                packed = short.endswith(PACKED)
                extra = selfspec.DraftPlan.load(plan_files[short[len("plan:"):len(short) - len(PACKED) * packed]])
                base = "selfspec-plan-packed" if packed else "selfspec-plan"
                warm_up = build_method(base, max_new_tokens=WARMUP_TOKENS, **{**options, "plan": extra})
                method = build_method(base, max_new_tokens=args.max_new_tokens, **{**options, "plan": extra})
                method.name = warm_up.name = name
                copies = ", packed weight copies" if packed else ""
                method.description = f"selfspec{copies}: {method.settings['describe']}"
            else:
                warm_up = build_method(short, max_new_tokens=WARMUP_TOKENS, **options)
                method = build_method(short, max_new_tokens=args.max_new_tokens, **options)
                method.name = warm_up.name = name
        except Exception as error:  # e.g. llama-cpp without llama-cpp-python: one line, the run goes on
            failed[name] = f"{type(error).__name__}: {error}"
            print(f"skipped {name}: {failed[name]}", flush=True)
            continue
        warm = measure(warm_up, warm_prompt, device)
        print(f"warm-up {name}: {warm.error or 'ok'} ({warm.seconds:.1f} s)", flush=True)
        method.settings["warm_up_seconds"] = round(warm.seconds, 2)  # compile and capture time show here
        if warm.error:
            failed[name] = warm.error
        else:
            methods.append(method)
    baseline = method_name(variant, BASELINE)
    if baseline in failed:
        raise SystemExit(f"the baseline {baseline} failed: {failed[baseline]}")
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
    header = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.platform()}; {cpu_model()}; {os.cpu_count()} CPUs",
        "cpu capability": cpu_capability(),
        "device": str(torch.cuda.get_device_name()) if args.device.startswith("cuda") else "cpu",
        "load average at start": load_average(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "selfspec": selfspec.__version__,
        "model": f"{args.model} ({type(model).__name__}, {num_layers(model)} layers)",
        "dtype": ", ".join(dict.fromkeys(v.dtype for v in args.variant_list)),
        "weights": weights_line(args),
        "threads": torch.get_num_threads(),
        "prompts": f"{len(workload.prompts)} in {len(workload.categories)} categories; {workload.source}"
        + ("; FALLBACK: Spec-Bench file absent" if workload.fallback else ""),
        "prompt format": "chat template, first turn" if chat else "raw question text (no chat template)",
        "max new tokens": args.max_new_tokens,
        "plan": f"{plan.describe(num_layers(model)) if plan else '-'} ({plan_note})",
        "early exit E": "(chosen below)",
        "quick": args.quick,
    }
    if args.argv != sys.argv[1:]:  # run through another script (benchmarks.quantized): what this harness was given
        header = {"command": header["command"], "arguments": shlex.join(args.argv),
                  **{k: v for k, v in header.items() if k != "command"}}
    return header


def weights_line(args) -> str:
    """The header's weights: as loaded, quantized, or the list of variants with the reference first."""
    if args.variants:
        names = ", ".join(v.name for v in args.variant_list)
        return (f"variants {names} (DTYPE: activations and float weights; +int8/+int4: torchao weight-only; "
                f"reference {args.variant_list[0].name}); each variant's methods run as VARIANT/METHOD")
    variant = args.variant_list[0]
    return f"{variant.quantize} weight-only (torchao), activations {variant.dtype}" if variant.quantize else args.dtype


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


def write_outputs(args, header, summary, rows, extra, table, baseline: str = BASELINE) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    label = "_".join(v.name for v in args.variant_list)
    folder = args.out / f"{stamp}-{Path(str(args.model)).name}-{label}"
    folder.mkdir(parents=True, exist_ok=True)
    report.write_json(folder / "bench.json", header, summary, rows, extra)
    (folder / "table.md").write_text(table, encoding="utf-8")
    title = f"{args.model} {label}, {args.threads} threads, {args.max_new_tokens} new tokens"
    why_not = report.write_chart(folder / "chart.png", summary, baseline, title)
    if why_not:
        print(f"no chart: {why_not}")
    return folder


if __name__ == "__main__":
    raise SystemExit(main())
