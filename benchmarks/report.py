"""From rows to results: compare with the baseline, aggregate, and write JSON, markdown and a chart.

Aggregates are ratios of totals, as Spec-Bench reports them: tokens/s = all new
tokens / all seconds; speedup = a method's tokens/s / the baseline's tokens/s
over the same prompts in the same run; tokens per pass = new tokens / full
forward passes; acceptance = accepted / drafted. A number a method cannot know
is None ("n/a" in the table), never a guess. Rows that failed are left out of
the aggregates and listed under errors.

This module times nothing; it runs the target only in `explain_differences`,
after the timed runs, to tell rounding near-ties from real differences.
"""

from __future__ import annotations

import json
import math
import random
import statistics
from dataclasses import asdict
from pathlib import Path

import torch

from .measure import Row
from .variants import method_name, split_method_name

MIB = 1024 * 1024


# --------------------------------------------------------------------------- comparison


def compare_with_baseline(rows: list[Row], baseline: str) -> None:
    """Set `identical` and `first_difference` on every row that has a baseline row for its prompt."""
    reference = {r.prompt_id: r.output for r in rows if r.method == baseline and r.error is None}
    for row in rows:
        if row.error is not None or row.prompt_id not in reference:
            continue
        ref = reference[row.prompt_id]
        row.identical = row.output == ref
        if not row.identical:
            row.first_difference = next(
                (i for i, (a, b) in enumerate(zip(row.output, ref)) if a != b), min(len(row.output), len(ref))
            )


# Relative logit gap below which two greedy choices are a rounding near-tie: a few units in the
# last place of the dtype (bf16 has 8 significant bits, fp16 11, fp32 24).
NEAR_TIE = {"bfloat16": 2**-5, "float16": 2**-8, "float32": 1e-3}


def explain_differences(model, rows: list[Row], prompts: dict, dtype: str, baseline: str) -> None:
    """For every output unlike the baseline's, how close the two tokens were for the target.

    The target runs once more (untimed) over the prompt and the baseline's tokens
    before the first difference, in the benchmark's dtype. The gap is how far
    the lower of the two tokens (the method's and the baseline's) is below the
    target's top logit there, relative to the row's largest |logit| (rounding
    errors in a logit scale with the sums that make it, not with the logit:
    a flat row of small logits is a near-tie at a small absolute gap). A difference is
    a near-tie when that gap is under `NEAR_TIE`: both tokens are within
    rounding of the top, so two correct implementations that round differently
    (a batched verify pass against one-token steps) can pick either.
    """
    reference = {r.prompt_id: r.output for r in rows if r.method == baseline and r.error is None}
    bound = NEAR_TIE.get(dtype, 1e-3)
    for row in rows:
        if row.identical is not False or row.first_difference is None:
            continue
        ref, first = reference[row.prompt_id], row.first_difference
        if first >= min(len(ref), len(row.output)):
            row.near_tie = False  # one output stopped early: not a choice between two tokens
            continue
        prompt = prompts[row.prompt_id].input_ids
        ids = torch.cat([prompt, torch.tensor([ref[:first]], dtype=prompt.dtype, device=prompt.device)], dim=1)
        with torch.no_grad():
            logits = model(ids).logits[0, -1].float()  # [vocab]
        top = float(logits.max())
        lower = min(float(logits[row.output[first]]), float(logits[ref[first]]))
        row.difference_gap = (top - lower) / max(1.0, float(logits.abs().max()))
        row.near_tie = row.difference_gap < bound


# --------------------------------------------------------------------------- aggregation


def aggregate(rows: list[Row]) -> dict:
    """The totals and ratios of one group of rows (one method, maybe one category)."""
    ok = [r for r in rows if r.error is None]
    tokens = sum(r.new_tokens for r in ok)
    seconds = sum(r.seconds for r in ok)
    compared = [r for r in ok if r.identical is not None]
    return {
        "prompts": len(ok),
        "errors": len(rows) - len(ok),
        "new_tokens": tokens,
        "seconds": seconds,
        "tokens_per_second": tokens / seconds if seconds else None,
        "decode_tokens_per_second": _decode_rate(ok),
        "median_tokens_per_second": statistics.median(r.tokens_per_second for r in ok) if ok else None,
        "tokens_per_pass": _ratio(ok, "new_tokens", "verify_passes"),
        "acceptance_rate": _ratio(ok, "accepted", "drafted"),
        "tokens_per_step_read": _tokens_per_step_read(ok),
        "draft_ms_per_token": _draft_ms_per_token(ok),
        "identical": sum(1 for r in compared if r.identical),
        "near_ties": sum(1 for r in compared if r.near_tie),
        "compared": len(compared),
        "timed_peak_bytes": max((r.peak_bytes for r in ok if r.peak_bytes is not None), default=None),
    }


def _decode_rate(rows: list[Row]) -> float | None:
    """New tokens after the first over the time after it, summed over `rows` (None where a row's is not known)."""
    if not rows or any(r.decode_seconds is None for r in rows):
        return None
    seconds = sum(r.decode_seconds for r in rows)
    return sum(max(0, r.new_tokens - 1) for r in rows) / seconds if seconds else None


def _tokens_per_step_read(rows: list[Row]) -> float | None:
    """selfspec's new tokens per plain step of weights read (`GenerationStats.steps_read`): its speed over plain
    decoding where a pass costs what it reads (a projection, machine-free); None for others."""
    if not rows or any(not r.details.get("steps_read") for r in rows):
        return None
    return sum(r.new_tokens for r in rows) / sum(r.details["steps_read"] for r in rows)


def pass_profile(rows: list[Row]) -> dict | None:
    """What a selfspec method's passes were, to project its speed under other pass costs (`benchmarks.gpu_check`):
    new tokens, verify passes by width (drafted nodes + 1; the prefill apart) and plain steps of weights read
    (the prefill's, the verify passes' and the layer drafts'). None for methods without those stats."""
    ok = [r for r in rows if r.error is None]
    if not ok or any("drafted_lengths" not in r.details or not r.details.get("steps_read") for r in ok):
        return None
    widths: dict[int, int] = {}
    for r in ok:
        for drafted, rounds in enumerate(r.details["drafted_lengths"]):
            if rounds:
                widths[drafted + 1] = widths.get(drafted + 1, 0) + rounds
    tokens = sum(r.new_tokens for r in ok)
    return {"prompts": len(ok), "new_tokens": tokens, "rounds": sum(widths.values()),
            "tokens_per_pass": tokens / (sum(widths.values()) + len(ok)),
            "steps_read": sum(r.details["steps_read"] for r in ok),
            "widths": {str(q): widths[q] for q in sorted(widths)}}


def _draft_ms_per_token(rows: list[Row]) -> float | None:
    """selfspec's draft time per drafted token (n-gram copies included), from its stats; None for others."""
    if not rows or any("draft_seconds" not in r.details for r in rows):
        return None
    drafted = sum(r.drafted or 0 for r in rows)
    return 1000 * sum(r.details["draft_seconds"] for r in rows) / drafted if drafted else None


def _ratio(rows: list[Row], top: str, bottom: str) -> float | None:
    if not rows or any(getattr(r, bottom) is None or getattr(r, top) is None for r in rows):
        return None
    denominator = sum(getattr(r, bottom) for r in rows)
    return sum(getattr(r, top) for r in rows) / denominator if denominator else None


def summarize(
    rows: list[Row], methods: list[str], categories: list[str], baseline: str, memory: dict[str, Row] | None = None
) -> dict:
    """Per method, and per category x method, with speedups against `baseline`.

    `memory`: per method, the row of the untimed memory pass; its peak and
    increase become the method's `memory_peak_bytes` and `memory_increase_bytes`.
    """
    overall = {m: aggregate([r for r in rows if r.method == m]) for m in methods}
    for m, stats in overall.items():
        row = (memory or {}).get(m)
        stats["memory_peak_bytes"] = row.peak_bytes if row else None
        stats["memory_increase_bytes"] = row.peak_increase_bytes if row else None
    by_category = {
        c: {m: aggregate([r for r in rows if r.method == m and r.category == c]) for m in methods} for c in categories
    }
    for group in [overall, *by_category.values()]:
        base = group.get(baseline, {}).get("tokens_per_second")
        for stats in group.values():
            tps = stats["tokens_per_second"]
            stats["speedup"] = tps / base if tps and base else None
    _add_per_prompt_speedups(rows, overall, baseline)
    summary = {"overall": overall, "by_category": by_category}
    reference = PAIRED_REFERENCE if PAIRED_REFERENCE in methods else None
    others = [m for m in methods if m not in (reference, baseline)]
    if reference and others:
        summary["paired"] = {"reference": reference,
                             "methods": {m: paired_comparison(rows, m, reference) for m in others}}
    return summary


def _add_per_prompt_speedups(rows: list[Row], overall: dict, baseline: str) -> None:
    """Median over prompts of (baseline seconds / method seconds), a check on the ratio of totals."""
    base = {r.prompt_id: r for r in rows if r.method == baseline and r.error is None}
    for method, stats in overall.items():
        ratios = [
            base[r.prompt_id].seconds / r.seconds
            for r in rows
            if r.method == method and r.error is None and r.prompt_id in base and r.seconds
        ]
        stats["median_prompt_speedup"] = statistics.median(ratios) if ratios else None


# What the other methods are paired with, prompt by prompt (`paired_comparison`): the adapter's plan.
PAIRED_REFERENCE = "selfspec-plan"
BOOTSTRAP_SAMPLES = 4000


def paired_comparison(rows: list[Row], method: str, reference: str) -> dict:
    """`method` against `reference`, prompt by prompt: the geometric mean of (its tok/s / the reference's tok/s)
    with a 95% bootstrap interval over prompts, over every prompt both ran and over those where both wrote
    the same text (the same work: at a rounding near-tie two lossless methods can write different texts, one
    longer or easier to draft than the other); and the same over every prompt of decode tokens per second,
    the prefill apart (`decode_`: a prompt that ends after a few tokens is mostly prefill).

    A ratio of totals lets a few long prompts speak for all and moves with
    the machine's drift between runs; pairing each prompt with itself, in
    the same interleaved run, removes what the prompts share. The interval
    is a percentile bootstrap with a fixed seed (the same rows give the same
    interval).
    """
    mine = {r.prompt_id: r for r in rows if r.method == method and r.error is None and r.seconds}
    theirs = {r.prompt_id: r for r in rows if r.method == reference and r.error is None and r.seconds}
    shared = sorted(set(mine) & set(theirs))
    logs = [math.log(mine[p].tokens_per_second / theirs[p].tokens_per_second) for p in shared]
    same = [x for p, x in zip(shared, logs) if mine[p].output == theirs[p].output]
    decode = [math.log(mine[p].decode_tokens_per_second / theirs[p].decode_tokens_per_second) for p in shared
              if mine[p].decode_tokens_per_second and theirs[p].decode_tokens_per_second]
    return {"prompts": len(logs), **_geometric(logs), "same_text_prompts": len(same),
            **{f"same_text_{k}": v for k, v in _geometric(same).items()},
            "decode_prompts": len(decode), **{f"decode_{k}": v for k, v in _geometric(decode).items()}}


def _geometric(logs: list[float]) -> dict:
    """Geometric mean of exp(logs) and its 95% percentile-bootstrap interval (None where it cannot be had)."""
    if not logs:
        return {"ratio": None, "low": None, "high": None}
    draw = random.Random(0)
    means = sorted(statistics.fmean(draw.choices(logs, k=len(logs))) for _ in range(BOOTSTRAP_SAMPLES))
    low, high = means[int(0.025 * BOOTSTRAP_SAMPLES)], means[int(0.975 * BOOTSTRAP_SAMPLES) - 1]
    if len(logs) < 2:
        low = high = None
    return {"ratio": math.exp(statistics.fmean(logs)), "low": None if low is None else math.exp(low),
            "high": None if high is None else math.exp(high)}


def summarize_variants(overall: dict, variants: list[str], memory: dict[str, dict], baseline: str) -> dict:
    """Per variant: its `spec.memory()` split, and per method its median tok/s against two `model.generate`s.

    `overall`: `summarize(...)["overall"]`, methods named `VARIANT/METHOD`;
    `memory`: per variant, `variants.memory_summary(spec.memory(...))`. The
    first variant is the reference: weights and KV cache are also given as a
    fraction of its own, and speeds as a ratio of medians to its
    `model.generate` ("vs reference") beside the ratio to the variant's own
    (`vs own`). `identical` counts against the variant's own `model.generate`.
    """
    reference = variants[0]
    ref_memory = memory.get(reference) or {}
    ref_speed = (overall.get(method_name(reference, baseline)) or {}).get("median_tokens_per_second")
    result = {}
    for variant in variants:
        mem = dict(memory.get(variant) or {})
        for key in ("weight_bytes", "kv_cache_bytes"):
            mine, theirs = mem.get(key), ref_memory.get(key)
            mem[key.replace("_bytes", "_vs_reference")] = mine / theirs if mine is not None and theirs else None
        own_speed = (overall.get(method_name(variant, baseline)) or {}).get("median_tokens_per_second")
        methods = {}
        for name, stats in overall.items():
            owner, method = split_method_name(name)
            if owner != variant:
                continue
            speed = stats["median_tokens_per_second"]
            methods[method] = {
                "median_tokens_per_second": speed,
                "vs_reference": speed / ref_speed if speed and ref_speed else None,
                "vs_own": speed / own_speed if speed and own_speed else None,
                "acceptance_rate": stats["acceptance_rate"],
                "tokens_per_pass": stats["tokens_per_pass"],
                "identical": stats["identical"],
                "near_ties": stats["near_ties"],
                "compared": stats["compared"],
                "errors": stats["errors"],
            }
        result[variant] = {"memory": mem, "methods": methods}
    return {"reference": reference, "baseline": baseline, "variants": result}


# --------------------------------------------------------------------------- markdown


def _num(value, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def _mib(value) -> str:
    return "n/a" if value is None else f"{value / MIB:.0f}"


def markdown(
    header: dict, summary: dict, rows: list[Row], descriptions: dict[str, str], failed: dict[str, str],
    variants: dict | None = None,
) -> str:
    lines = ["# selfspec benchmark", ""]
    lines += [f"- **{key}**: {value}" for key, value in header.items() if not isinstance(value, (dict, list))]
    lines += ["", "## Per method", ""]
    lines += [
        "| method | tok/s | decode tok/s | speedup | median prompt speedup | tokens/pass | tokens/step read | "
        "acceptance | draft ms/token | identical | peak MiB | working MiB | what it runs |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for method, s in summary["overall"].items():
        lines.append(
            f"| {method} | {_num(s['tokens_per_second'], '.1f')} | {_num(s['decode_tokens_per_second'], '.1f')} | "
            f"{_num(s['speedup'], '.2f')}x | "
            f"{_num(s['median_prompt_speedup'], '.2f')}x | {_num(s['tokens_per_pass'], '.2f')} | "
            f"{_num(s['tokens_per_step_read'], '.2f')} | "
            f"{_num(s['acceptance_rate'], '.1%')} | {_num(s['draft_ms_per_token'], '.1f')} | {_identical(s)} | "
            f"{_mib(s['memory_peak_bytes'])} | {_mib(s['memory_increase_bytes'])} | {descriptions.get(method, '')} |"
        )
    lines += ["", "decode tok/s: the tokens after the first in the time after it (the prefill apart).",
              "", "tokens/step read: new tokens per plain step of weights the passes read (layers, LM head, draft "
              "vocabulary rows; selfspec only): the speed over plain decoding on a machine where a pass costs what "
              "it reads, wide or narrow. A projection, not a timing."]
    if variants:
        lines += variant_lines(variants)
    methods = list(summary["overall"])
    lines += ["", "## Speedup per category", ""]
    lines += ["| category | " + " | ".join(methods) + " |", "|---|" + "---:|" * len(methods)]
    for category, group in summary["by_category"].items():
        cells = [_num(group[m]["speedup"], ".2f") for m in methods]
        lines.append(f"| {category} | " + " | ".join(cells) + " |")
    lines += _paired_lines(summary.get("paired"))
    lines += _difference_lines(rows) + _error_lines(rows, failed)
    return "\n".join(lines) + "\n"


def _times(value) -> str:
    return "" if value is None else f" ({value:.2f}x)"


def variant_lines(variants: dict) -> list[str]:
    """Two tables of `summarize_variants`: memory per variant, then speed per variant and method."""
    reference, baseline = variants["reference"], variants["baseline"]
    items = variants["variants"]
    context = next((v["memory"].get("context") for v in items.values() if v["memory"].get("context")), None)
    lines = ["", "## Per variant: memory", "",
             f"`spec.memory(context={context})` (longest prompt + max new tokens) of each variant's plan; "
             f"in brackets, the fraction of the reference variant's ({reference}).", "",
             "| variant | quantized | weights MiB | of which embedding + LM head (tied: once) | the rest | "
             f"KV cache MiB ({context} tokens) | plan extras MiB |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for variant, item in items.items():
        m = item["memory"]
        if "weight_bytes" not in m:
            lines.append(f"| {variant} | n/a | n/a | n/a | n/a | n/a | n/a |")
            continue
        extras = (m.get("head_bytes") or 0) + (m.get("vocab_bytes") or 0)
        lines.append(
            f"| {variant} | {m.get('quantization') or '-'} | "
            f"{m['weight_bytes'] / MIB:.1f}{_times(m['weight_vs_reference'])} | "
            f"{m['embedding_bytes'] / MIB:.1f} | {m['rest_bytes'] / MIB:.1f} | "
            f"{m['kv_cache_bytes'] / MIB:.1f}{_times(m['kv_cache_vs_reference'])} | {extras / MIB:.1f} |"
        )
    lines += ["", "## Per variant: speed", "",
              f"Median over prompts of each run's tok/s; `vs reference`: that median / the median of "
              f"{method_name(reference, baseline)}; `vs own`: / the median of the variant's own {baseline}. "
              f"`identical`: outputs equal to the variant's own {baseline} (greedy).", "",
              "| variant | method | median tok/s | vs reference | vs own | acceptance | tokens/pass | identical |",
              "|---|---|---:|---:|---:|---:|---:|---:|"]
    for variant, item in items.items():
        for method, s in item["methods"].items():
            lines.append(
                f"| {variant} | {method} | {_num(s['median_tokens_per_second'], '.1f')} | "
                f"{_num(s['vs_reference'], '.2f')}x | {_num(s['vs_own'], '.2f')}x | "
                f"{_num(s['acceptance_rate'], '.1%')} | "
                f"{_num(s['tokens_per_pass'], '.2f')} | {_identical(s)} |"
            )
    return lines


def _paired_lines(paired: dict | None) -> list[str]:
    if not paired:
        return []
    lines = ["", f"## Paired with {paired['reference']}, prompt by prompt", "",
             "Geometric mean over prompts of (method tok/s / reference tok/s), the same run, 95% bootstrap interval; "
             "then over the prompts where both wrote the same text; then over every prompt, of decode tok/s "
             "(the tokens after the first in the time after it: the prefill apart).", "",
             "| method | vs reference | 95% interval | prompts | same text: vs reference | 95% interval | prompts | "
             "decode: vs reference | 95% interval | prompts |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def cells(c: dict, prefix: str = "") -> str:
        ratio, low, high = c[prefix + "ratio"], c[prefix + "low"], c[prefix + "high"]
        span = "n/a" if low is None else f"{low:.2f}-{high:.2f}"
        return f"{_num(ratio, '.3f')}x | {span} | {c[prefix + 'prompts']}"

    for method, c in paired["methods"].items():
        lines.append(f"| {method} | {cells(c)} | {cells(c, 'same_text_')} | {cells(c, 'decode_')} |")
    return lines


def _identical(s: dict) -> str:
    ties = f" (+{s['near_ties']} near-tie)" if s.get("near_ties") else ""
    return f"{s['identical']}/{s['compared']}{ties}"


def _difference_lines(rows: list[Row]) -> list[str]:
    differing = [r for r in rows if r.identical is False]
    if not differing:
        return []
    lines = ["", "## Outputs unlike the baseline's", "",
             "The gap: how far the lower of the two tokens' logits is below the target's top logit at the first "
             "difference, relative to the row's largest |logit|; a near-tie has a gap within the dtype's rounding.", "",
             "| method | prompt | category | first differing token | gap | near-tie |", "|---|---|---|---:|---:|---|"]
    lines += [f"| {r.method} | {r.prompt_id} | {r.category} | {r.first_difference} | {_num(r.difference_gap, '.1e')} "
              f"| {'yes' if r.near_tie else 'NO'} |" for r in differing]
    return lines


def _error_lines(rows: list[Row], failed: dict[str, str]) -> list[str]:
    lines = [f"- {name} could not run: {error}" for name, error in failed.items()]
    lines += [f"- {r.method} on {r.prompt_id}: {r.error}" for r in rows if r.error is not None]
    return ["", "## Errors", ""] + lines if lines else []


# --------------------------------------------------------------------------- files


def write_json(path: Path, header: dict, summary: dict, rows: list[Row], extra: dict) -> None:
    data = {"header": header, "summary": summary, **extra, "rows": [asdict(r) for r in rows]}
    path.write_text(json.dumps(data, indent=1, default=str) + "\n", encoding="utf-8")


NO_MATPLOTLIB = "matplotlib is not installed (pip install matplotlib)"


def pyplot():
    """matplotlib's pyplot on its file-only backend, or None where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_figure(plt, fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_chart(path: Path, summary: dict, baseline: str, title: str) -> str | None:
    """A grouped bar chart of speedup per category per method; returns why not, if not written."""
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    methods = [m for m in summary["overall"] if m != baseline]
    groups = {**summary["by_category"], "all": summary["overall"]}
    width = 0.8 / max(1, len(methods))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(groups) + 2), 4.5))
    for i, method in enumerate(methods):
        xs = [g + (i - (len(methods) - 1) / 2) * width for g in range(len(groups))]
        ys = [group[method]["speedup"] or 0.0 for group in groups.values()]
        ax.bar(xs, ys, width, label=method)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(groups)), list(groups), rotation=30, ha="right")
    ax.set_ylabel(f"speedup over {baseline}")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    save_figure(plt, fig, path)
    return None


# --------------------------------------------------------------------------- reading a run back


def main(argv: list[str] | None = None) -> int:
    """`python -m benchmarks.report results/RUN/bench.json [REFERENCE]`: the paired comparison of a finished run
    (`paired_comparison`), against REFERENCE (default: the adapter's plan, `selfspec-plan`)."""
    import argparse

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("bench", type=Path, help="a run's bench.json")
    p.add_argument("reference", nargs="?", default=PAIRED_REFERENCE, help=f"default {PAIRED_REFERENCE}")
    p.add_argument("--passes-out", type=Path, help="also write each selfspec method's passes by width here "
                   "(`pass_profile`; what `benchmarks.gpu_check` projects GPU speeds from)")
    args = p.parse_args(argv)
    data = json.loads(args.bench.read_text(encoding="utf-8"))
    rows = [Row(**row) for row in data["rows"]]
    methods = list(dict.fromkeys(r.method for r in rows))
    if args.passes_out:
        profiles = {m: pass_profile([r for r in rows if r.method == m]) for m in methods}
        header = {k: data["header"].get(k) for k in ("command", "date", "machine", "cpu capability", "model", "dtype",
                                                      "prompts", "max new tokens", "pass costs")}
        described = {m: data["methods"].get(m, {}).get("describe") for m in profiles if profiles[m]}
        args.passes_out.write_text(json.dumps({
            "what": "per method: verify passes by width and weights read, measured on a CPU (see header)",
            "header": header, "describe": described,
            "methods": {m: profile for m, profile in profiles.items() if profile}}, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {args.passes_out}")
    if args.reference not in methods:
        p.error(f"{args.reference!r} did not run here (methods: {', '.join(methods)})")
    paired = {"reference": args.reference, "methods": {m: paired_comparison(rows, m, args.reference)
                                                       for m in methods if m != args.reference}}
    print("\n".join(_paired_lines(paired)).strip())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
