"""SmolLM2 in float and quantized weights on Spec-Bench: `benchmarks.run --variants` with the quantized run's defaults.

    python -m benchmarks.quantized                      # the issue's run: 26 prompts, 128 tokens, bf16 / int8 / int4
    python -m benchmarks.quantized --threads 1 --per-category 1 --max-new-tokens 48 --variants bfloat16,bfloat16+int4

The same as

    python -m benchmarks.run --variants bfloat16,bfloat16+int8,bfloat16+int4 \\
        --methods hf-greedy,selfspec-plain,selfspec-plan --per-category 2 --max-new-tokens 128

with any of those options (and every other option of `benchmarks.run`) given
here instead. Every variant is loaded once (`selfspec.load(..., quantize=...)`)
and every method runs on every variant, all interleaved in one loop (the
harness's, `benchmarks.run.run_interleaved`). Prints and writes, per variant:
weight memory split into the tied embedding and the rest, and the KV cache
(`spec.memory()`); median tokens/s of `model.generate`, selfspec's plain path
and its default plan, against the first variant's `model.generate` and the
variant's own; acceptance, tokens per pass, and whether the outputs equal the
variant's own `model.generate`. See benchmarks/README.md.
"""

from __future__ import annotations

import sys

from benchmarks import run

DEFAULTS = {
    "--variants": "bfloat16,bfloat16+int8,bfloat16+int4",
    "--methods": "hf-greedy,selfspec-plain,selfspec-plan",
    "--per-category": "2",
    "--max-new-tokens": "128",
}


def with_defaults(argv: list[str]) -> list[str]:
    """`argv` with each option of `DEFAULTS` it does not give (as `--opt v` or `--opt=v`) added.

    With `--dtype` or `--quantize` (one variant) no `--variants` is added.
    """
    given = {arg.split("=", 1)[0] for arg in argv if arg.startswith("--")}
    if given & {"--dtype", "--quantize"}:
        given.add("--variants")
    added = [item for option, value in DEFAULTS.items() if option not in given for item in (option, value)]
    return added + list(argv)


def main(argv: list[str] | None = None) -> int:
    return run.main(with_defaults(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    raise SystemExit(main())
