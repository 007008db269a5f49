"""What selfspec's CPU kernel choices (`selfspec/cpu_kernels.py`) change in a pass, measured side by side in one process.

    python -m benchmarks.cpu_kernels                       # SmolLM2, bfloat16 and float32, 2 threads
    python -m benchmarks.cpu_kernels --dtype float32 --rows 1,8 --widths 1,2,3,5 --context 256

For each dtype, rows r and width q: a full pass of the model over
`[r, q]` tokens at `--context` entries per row (`batch.BatchRunner`, what a
batch's verify pass runs; r = 1 is one sequence's verify pass), timed three
ways, interleaved, the median of `--repeats`:

- `transformers`: transformers' attention and `F.linear` as they are;
- `+attention`: the attention kernels measured for this machine (`measure_attention_kernels`);
- `+linear`: and the linear layers' kernels measured for this machine (`measure_linear_kernels`).

Prints the machine, the CPU capability, the thread count, the kernels
chosen, and the milliseconds and ratios per (r, q). Nothing is written.
"""

from __future__ import annotations

import argparse
import platform
import shlex
import statistics
import sys
import time
import warnings

import torch
import transformers

import selfspec
from benchmarks.run import print_header
from selfspec.batch import BatchRunner
from selfspec.costs import cpu_capability, cpu_model
from selfspec.cpu_kernels import NO_ATTENTION_CHANGE, NO_CHANGE, cpu_kernels

WAYS = ("transformers", "+attention", "+linear")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="a selfspec.load name or local path")
    p.add_argument("--dtype", default="bfloat16,float32", help="comma list of dtypes (default bfloat16,float32)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--rows", default="1,8", help="comma list of row counts (default 1,8)")
    p.add_argument("--widths", default="1,2,3,5", help="comma list of tokens per row (default 1,2,3,5)")
    p.add_argument("--context", type=int, default=256, help="entries each row holds before the pass (default 256)")
    p.add_argument("--repeats", type=int, default=9, help="timed runs per way and shape (default 9)")
    args = p.parse_args(argv)
    args.dtypes = args.dtype.split(",")
    args.row_counts = [int(r) for r in args.rows.split(",")]
    args.width_list = [int(q) for q in args.widths.split(",")]
    return args


def time_passes(spec, rows: int, widths: list[int], context: int, repeats: int) -> dict[tuple[int, str], float]:
    """Median seconds of a pass over [rows, q] at `context`, per (q, way), the ways interleaved."""
    runner = BatchRunner(spec.parts, capacity=context + max(widths))
    for _ in range(rows):
        runner.cache.add_row()
    linear_here, attention_here = spec.linear_kernels(), spec.attention_kernels()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, spec.parts.vocab_size, (rows, max(widths)), generator=generator)
    times: dict[tuple[int, str], list[float]] = {}
    with torch.no_grad():
        for i in range(repeats + 1):  # round 0 warms up
            for q in widths:
                for way in WAYS:
                    attention = attention_here if way != "transformers" else NO_ATTENTION_CHANGE
                    linear = linear_here if way == "+linear" else NO_CHANGE
                    start = time.perf_counter()
                    with cpu_kernels(linear=linear, attention=attention):
                        runner.forward_rows(ids[:, :q], [context] * rows, slice(0, rows))
                    if i:
                        times.setdefault((q, way), []).append(time.perf_counter() - start)
    return {key: statistics.median(values) for key, values in times.items()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", module="transformers")
    torch.set_num_threads(args.threads)
    given = sys.argv[1:] if argv is None else argv
    print_header({
        "command": shlex.join([sys.executable, "-m", "benchmarks.cpu_kernels", *given]),
        "machine": f"{platform.platform()}; {cpu_model()}",
        "cpu capability": cpu_capability(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "model": args.model,
        "pass": f"[rows, q] tokens at {args.context} entries per row; median of {args.repeats}, ways interleaved",
    })
    for dtype in args.dtypes:
        model, _ = selfspec.load(args.model, dtype=dtype)
        spec = selfspec.wrap(model)
        print(f"{dtype}: linear layers {spec.linear_kernels().describe()}")
        print(f"{dtype}: attention {spec.attention_kernels().describe()}")
        print("| rows | q | transformers ms | +attention ms | +linear ms | transformers / +linear |")
        print("|---:|---:|---:|---:|---:|---:|")
        for rows in args.row_counts:
            t = time_passes(spec, rows, args.width_list, args.context, args.repeats)
            for q in args.width_list:
                ms = [t[q, way] * 1e3 for way in WAYS]
                print(f"| {rows} | {q} | {ms[0]:.1f} | {ms[1]:.1f} | {ms[2]:.1f} | {ms[0] / ms[2]:.2f}x |", flush=True)
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
