"""Weight variants of one model in one benchmark run: the same checkpoint in other dtypes or quantized.

`python -m benchmarks.run --variants bfloat16,bfloat16+int8,bfloat16+int4`
loads the model once per variant (`selfspec.load(..., dtype=DTYPE,
quantize=int8|int4)`) and runs every method on every variant, all interleaved
in one loop (`run.run_interleaved`). A method on a variant is named
`VARIANT/METHOD` (e.g. `bfloat16+int4/selfspec-plan`); `+offloadN` puts
layers N.. on disk (accelerate's dispatch, `selfspec.offload`). Each variant's outputs
are compared with its own `model.generate`, speeds with the first variant's
`model.generate` (the reference) and with the variant's own.

This module parses variants and names; it loads and times nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from selfspec.memory import MemoryReport
from selfspec.quant import QUANTIZE_CHOICES

DTYPES = ("float32", "bfloat16", "float16")
SEPARATOR = "/"  # between a variant and a method in a method's name


@dataclass(frozen=True)
class Variant:
    """One way to load the weights: the activations' dtype and, optionally, weight-only quantization."""

    dtype: str
    quantize: str | None = None
    offload_from: int | None = None  # layers from this one on are offloaded to disk (`selfspec.offload`)

    @property
    def name(self) -> str:
        return (self.dtype + (f"+{self.quantize}" if self.quantize else "")
                + (f"+offload{self.offload_from}" if self.offload_from is not None else ""))


def parse_variants(text: str) -> list[Variant]:
    """`"bfloat16,bfloat16+int8,bfloat16+int4"` -> variants, in order; a bad item raises ValueError in one line."""
    variants = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        dtype, *extras = item.split("+")
        if dtype not in DTYPES:
            raise ValueError(f"variant {item!r}: dtype {dtype!r} unknown (valid: {', '.join(DTYPES)})")
        quantize, offload_from = None, None
        for extra in extras:
            if extra.startswith("offload") and extra[7:].isdigit() and offload_from is None:
                offload_from = int(extra[7:])
            elif extra in QUANTIZE_CHOICES and quantize is None:
                quantize = extra
            else:
                valid = ", ".join(QUANTIZE_CHOICES)
                raise ValueError(f"variant {item!r}: {extra!r} unknown (valid: one quantization of {valid}, "
                                 f"and offloadN: layers N.. on disk)")
        variant = Variant(dtype, quantize, offload_from)
        if variant in variants:
            raise ValueError(f"variant {item!r} is listed twice")
        variants.append(variant)
    if not variants:
        raise ValueError(f"no variant in {text!r} (e.g. bfloat16,bfloat16+int8,bfloat16+int4)")
    return variants


def method_name(variant: str | None, method: str) -> str:
    """The name a method runs under: `VARIANT/METHOD`, or the method alone in a run without variants."""
    return method if variant is None else f"{variant}{SEPARATOR}{method}"


def split_method_name(name: str) -> tuple[str | None, str]:
    """`"bfloat16+int4/selfspec-plan"` -> ("bfloat16+int4", "selfspec-plan"); without a variant -> (None, name)."""
    variant, sep, method = name.partition(SEPARATOR)
    return (variant, method) if sep else (None, name)


def memory_summary(report: MemoryReport) -> dict:
    """What the variant tables show of `spec.memory()`: weights as the (tied) embedding and the rest, KV cache."""
    return {
        "weight_bytes": report.weight_bytes,
        "embedding_bytes": report.embedding_bytes,
        "rest_bytes": report.weight_bytes - report.embedding_bytes,
        "kv_cache_bytes": report.kv_cache_bytes,
        "context": report.context,
        "head_bytes": report.head_bytes,
        "vocab_bytes": report.vocab_bytes,
        "quantization": report.quantization,
    }
