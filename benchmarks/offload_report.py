"""Speedup against the fraction of layers offloaded, from a `benchmarks.run` run with `+offloadN` variants.

    python -m benchmarks.run --variants bfloat16+offload22,bfloat16+offload15,bfloat16+offload8 \\
        --methods hf-greedy,selfspec-plain-hooks,selfspec-plain,selfspec-plan --per-category 1
    python -m benchmarks.offload_report results/<that run>          # offload.md and offload.png beside bench.json

Per variant (dtype and first offloaded layer) and method: the fraction of the
decoder layers offloaded, the median over prompts of each prompt's speed
against the variant's own `model.generate` (paired), the speed of all tokens
over all time against it, tokens per verify pass, and the offloaded bytes
read per new token. Each pass reads every offloaded layer once, so those
bytes are the offloaded bytes divided by tokens per pass. The plot draws the
paired median against the fraction offloaded, one line per dtype and method.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from .report import NO_MATPLOTLIB, pyplot, save_figure
from .variants import parse_variants, split_method_name

MIB = 2**20


def rows_by_method(bench: dict) -> dict[str, dict[str, float]]:
    """Per method, each prompt's tokens per second."""
    speeds: dict[str, dict[str, float]] = defaultdict(dict)
    for row in bench["rows"]:
        if row.get("error") is None and row.get("seconds"):
            speeds[row["method"]][row["prompt_id"]] = row["new_tokens"] / row["seconds"]
    return speeds


def offload_table(bench: dict, layers: int) -> list[dict]:
    """One entry per variant and selfspec or baseline method (see the module docstring)."""
    speeds = rows_by_method(bench)
    overall = bench["summary"]["overall"]
    weights = bench.get("weight_memory", {})
    entries = []
    for name in overall:
        variant_name, method = split_method_name(name)
        variant = parse_variants(variant_name)[0]
        if variant.offload_from is None:
            continue
        baseline = speeds.get(f"{variant_name}/hf-greedy", {})
        ratios = [speed / baseline[p] for p, speed in speeds[name].items() if p in baseline]
        base_total = overall.get(f"{variant_name}/hf-greedy", {}).get("tokens_per_second")
        offloaded = layers - variant.offload_from
        rest = weights.get(variant_name, {}).get("rest_bytes")  # the layers and norms: per layer, about rest / layers
        per_pass = rest * offloaded / layers if rest else None
        tokens_per_pass = overall[name].get("tokens_per_pass") or 1.0
        entries.append({
            "variant": variant_name, "dtype": variant.dtype, "method": method,
            "offloaded_fraction": offloaded / layers,
            "median_paired_speedup": statistics.median(ratios) if ratios else None,
            "speedup": overall[name]["tokens_per_second"] / base_total if base_total else None,
            "tokens_per_second": overall[name]["tokens_per_second"],
            "tokens_per_pass": tokens_per_pass,
            "streamed_mib_per_token": per_pass / tokens_per_pass / MIB if per_pass else None,
            "identical": f"{overall[name].get('identical', '-')}/{overall[name].get('compared', '-')}"
                         + (f" (+{overall[name]['near_ties']} near-tie)" if overall[name].get("near_ties") else ""),
        })
    return sorted(entries, key=lambda e: (e["dtype"], e["offloaded_fraction"], e["method"]))


def markdown(entries: list[dict], command: str) -> str:
    lines = [f"`{command}`", "",
             "| dtype | offloaded | method | tok/s | vs model.generate (all tokens) | median, paired | tokens/pass "
             "| offloaded MiB read per token | identical |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for e in entries:
        fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        lines.append(f"| {e['dtype']} | {e['offloaded_fraction']:.0%} | {e['method']} | {e['tokens_per_second']:.1f} "
                     f"| {fmt(e['speedup'], '.2f')}x | {fmt(e['median_paired_speedup'], '.2f')}x "
                     f"| {e['tokens_per_pass']:.2f} | {fmt(e['streamed_mib_per_token'], '.1f')} | {e['identical']} |")
    return "\n".join(lines) + "\n"


def plot(entries: list[dict], path: Path) -> str | None:
    """The paired median speedup against the fraction offloaded; None when drawn, else why not."""
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    lines: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
    for e in entries:
        if e["median_paired_speedup"] is not None:
            lines[(e["dtype"], e["method"])].append((e["offloaded_fraction"], e["median_paired_speedup"]))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (dtype, method), points in sorted(lines.items()):
        xs, ys = zip(*sorted(points))
        ax.plot([100 * x for x in xs], ys, marker="o", label=f"{method} ({dtype})")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel("decoder layers offloaded to disk (%)")
    ax.set_ylabel("speed / model.generate on the same placement\n(median over prompts, paired)")
    ax.legend(fontsize=8)
    save_figure(plt, fig, path)
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", type=Path, help="a benchmarks.run results folder (holding bench.json)")
    p.add_argument("--layers", type=int, default=30, help="the model's decoder layers (SmolLM2-135M: 30)")
    args = p.parse_args(argv)
    bench = json.loads((args.results / "bench.json").read_text())
    entries = offload_table(bench, args.layers)
    if not entries:
        print(f"{args.results}: no +offloadN variant in this run", file=sys.stderr)
        return 1
    text = markdown(entries, bench["header"]["command"])
    (args.results / "offload.md").write_text(text)
    print(text)
    why = plot(entries, args.results / "offload.png")
    print(why or f"plot: {args.results / 'offload.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
