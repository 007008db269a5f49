"""Peak resident memory of a model loaded with a budget: does what stays resident fit it?

    python -m benchmarks.offload_memory --budget 150MiB            # SmolLM2, bf16: 18 of 30 layers offloaded
    python -m benchmarks.offload_memory --budget 150MiB --dtype float32 --new-tokens 64

Loads the model with `selfspec.load(..., max_memory=BUDGET,
budget_context=CONTEXT)`, wraps it with the default plan and generates from a
short chat prompt, then from a long one that fills the context the budget
keeps room for (a passage repeated, to summarise: CONTEXT - new tokens
tokens). It reports the process's resident set (RSS, from /proc/self/status)
at five points: after importing torch, transformers and the model's code and
loading its tokenizer (the baseline, not the model's), its peak while
loading, at rest after loading, and its peak while generating from each
prompt. The kernel's peak counter is reset between phases. The model's share
of a phase is its peak minus the baseline; the budget covers the weights and
a generation's working set for CONTEXT positions (the KV cache, a prefill's
activations, a verify pass's logits), not the library pages the passes
touch. The offload folder's files sit in the OS page
cache, which is not the process's memory: selfspec reads them with `preadv`
into its two slots and does not map them. The process's anonymous pages are
also reported alone (no shared library or file pages), their peak sampled
every 5 ms.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

import selfspec
from selfspec.costs import cpu_capability, cpu_model
from selfspec.loading import default_cache_dir
from selfspec.offload import BUDGET_CONTEXT, parse_bytes, place_for_budget

MIB = 2**20


def status_bytes(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS: now; VmHWM: the peak since the last reset)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> bool:
    """Reset the kernel's peak RSS counter to the current RSS (Linux: "5" to clear_refs); False where refused."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class AnonymousPeak:
    """The largest RssAnon (the process's private pages: no shared library or file pages) seen while in the
    `with` block, sampled every `interval` seconds: the kernel keeps no peak of it apart."""

    def __init__(self, interval: float = 0.005) -> None:
        self.interval, self.peak = interval, 0
        self.done = threading.Event()

    def _sample(self) -> None:
        while not self.done.is_set():
            self.peak = max(self.peak, status_bytes("RssAnon"))
            self.done.wait(self.interval)

    def __enter__(self) -> "AnonymousPeak":
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()
        self.peak = max(self.peak, status_bytes("RssAnon"))


PASSAGE = ("A heat pump moves heat from a cold place to a warm one. A refrigerant evaporates in the outdoor coil, "
           "taking in heat, and a compressor raises its pressure and temperature; in the indoor coil it condenses "
           "and gives the heat up, and an expansion valve lowers its pressure again before the next cycle. ")


def long_prompt(tokenizer, tokens: int) -> torch.Tensor:
    """A chat prompt of `tokens` tokens `[1, tokens]`: a passage repeated, then a request to summarise it."""
    ask = tokenizer.apply_chat_template([{"role": "user", "content": "Summarise this."}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    passage = tokenizer(PASSAGE, return_tensors="pt")["input_ids"]
    body = passage.repeat(1, tokens // passage.shape[1] + 1)[:, :max(0, tokens - ask.shape[1])]
    return torch.cat([body, ask], dim=1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--budget", default="150MiB", help="max_memory for selfspec.load (a size)")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=BUDGET_CONTEXT,
                   help="budget_context for selfspec.load: positions the budget keeps a working set for")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    import transformers  # noqa: F401  (part of the baseline)

    budget = parse_bytes(args.budget)
    # The model's code (transformers' modeling module, accelerate) imported before the baseline: an empty copy,
    # as the placement builds one.
    folder = Path(args.model) if Path(args.model).is_dir() else default_cache_dir() / args.model
    tokenizer, placed = None, None
    if (folder / "config.json").exists():  # a known model converted once before: its cache folder
        placed = place_for_budget(folder, getattr(torch, args.dtype), budget, fast="cpu", slow="disk", context=args.context)
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder)  # not the model's memory either
    baseline = status_bytes("VmRSS")
    anon_base, file_base = status_bytes("RssAnon"), status_bytes("RssFile")
    resettable = reset_peak()
    with tempfile.TemporaryDirectory(prefix="selfspec-offload-") as offload_folder:
        model, loaded_tokenizer = selfspec.load(args.model, dtype=args.dtype, max_memory=budget,
                                                offload_folder=offload_folder, budget_context=args.context)
        tokenizer = tokenizer or loaded_tokenizer
        load_peak = status_bytes("VmHWM")
        spec = selfspec.wrap(model)
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Explain how a heat pump works."}],
                                               add_generation_prompt=True, return_tensors="pt", return_dict=True)
        ids = prompt["input_ids"]
        spec.generate(ids, max_new_tokens=4)  # cost tables measured (or loaded) and slots filled, before the count
        at_rest, anon_at_rest = status_bytes("VmRSS"), status_bytes("RssAnon")
        reset_peak()
        start = time.perf_counter()
        with AnonymousPeak() as anon_peak:
            spec.generate(ids, max_new_tokens=args.new_tokens)
        seconds = time.perf_counter() - start
        generate_peak = status_bytes("VmHWM")
        anon_after, file_after = status_bytes("RssAnon"), status_bytes("RssFile")
        report = spec.memory(context=ids.shape[1] + args.new_tokens)
        long_ids = long_prompt(tokenizer, args.context - args.new_tokens)
        reset_peak()
        with AnonymousPeak() as long_anon_peak:
            spec.generate(long_ids, max_new_tokens=args.new_tokens)
        long_peak = status_bytes("VmHWM")
    print(f"command: python -m benchmarks.offload_memory {shlex.join(sys.argv[1:] if argv is None else argv)}")
    print(f"machine: {cpu_model()}, {cpu_capability()}, {args.threads} threads; {args.model} {args.dtype}")
    print(report.summary())
    if placed is not None:
        print(f"budget context {args.context} positions: {placed.reserved_bytes / MIB:.1f} MiB kept for the working set")
    print(f"budget {budget / MIB:.1f} MiB; resident by spec.memory(): weights and slots "
          f"{(report.resident_bytes - report.kv_cache_bytes) / MIB:.1f} MiB, KV cache {report.kv_cache_bytes / MIB:.1f}"
          f" MiB")
    print(f"RSS baseline (torch, transformers, the model's code and tokenizer) {baseline / MIB:.1f} MiB" + ("" if resettable else
          " (peak counter not resettable here: peaks include everything before)"))
    for label, value in (("peak while loading", load_peak), ("at rest after loading", at_rest),
                         ("peak while generating", generate_peak),
                         (f"peak while generating from {long_ids.shape[1]} prompt tokens", long_peak)):
        print(f"  {label}: {value / MIB:.1f} MiB, model's share {(value - baseline) / MIB:.1f} MiB "
              f"({(value - baseline) / budget:.2f}x the budget)")
    print(f"  after generating: anonymous {anon_after / MIB:.1f} MiB, file-backed {file_after / MIB:.1f} MiB "
          f"(baseline {anon_base / MIB:.1f} and {file_base / MIB:.1f})")
    print(f"  anonymous pages alone (no library or file pages): at rest {(anon_at_rest - anon_base) / MIB:.1f} MiB "
          f"({(anon_at_rest - anon_base) / budget:.2f}x the budget), peak while generating, sampled every 5 ms, "
          f"{(anon_peak.peak - anon_base) / MIB:.1f} MiB ({(anon_peak.peak - anon_base) / budget:.2f}x); from "
          f"{long_ids.shape[1]} prompt tokens {(long_anon_peak.peak - anon_base) / MIB:.1f} MiB "
          f"({(long_anon_peak.peak - anon_base) / budget:.2f}x)")
    print(f"{args.new_tokens} new tokens in {seconds:.1f} s ({args.new_tokens / seconds:.1f} tok/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
