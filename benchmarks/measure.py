"""Time one method on one prompt, and measure its peak memory, honestly.

Time: `time.perf_counter()` around the `run` call only, under `torch.no_grad()`,
with `torch.cuda.synchronize()` before and after on CUDA. A streamer
(`FirstTokenClock`) that every method passes to its `generate` also notes
when the first new token came out, so the decode alone (the tokens after
the first, in the time after it) can be told from the prefill: a prompt
that ends after a few tokens is mostly prefill, and its tokens per second
say little about decoding. (transformers' `generate` copies each new token
to the host for a streamer; its loop waits for the device every step to
check its stopping criteria anyway.)

Memory, on CPU: the peak resident set size (RSS) of the process during the
call. Linux keeps a high-water mark (`VmHWM` in /proc/self/status); writing "5"
to /proc/self/clear_refs resets it to the current RSS, so we reset it just
before the call and read it just after. This is exact (the kernel tracks it)
and costs nothing during the call. `peak_increase` = peak - RSS before the
call: the memory the call itself needed beyond what the process already held.
In a timed run that understates the need, because the allocator keeps freed
memory from earlier calls; so the harness also runs every method once more,
untimed, after `give_back_freed()` (see `measure(trim=True)`), and reports
that pass's numbers. Where clear_refs is not available the numbers are None.

On CUDA: `torch.cuda.max_memory_allocated()` after `reset_peak_memory_stats()`,
so tensors only, not the allocator's reserve.

This module knows nothing about which method it runs.
"""

from __future__ import annotations

import gc
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from selfspec.heap import give_back_freed

from .methods import Method
from .workload import Prompt

STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")


@dataclass
class Row:
    """One method on one prompt."""

    method: str
    prompt_id: str
    category: str
    prompt_tokens: int
    new_tokens: int = 0
    seconds: float = 0.0
    verify_passes: int | None = None
    drafted: int | None = None
    accepted: int | None = None
    peak_bytes: int | None = None  # peak RSS (CPU) or peak allocated (CUDA) during the call
    peak_increase_bytes: int | None = None  # the peak minus the level just before the call
    output: list[int] = field(default_factory=list)  # the new tokens
    identical: bool | None = None  # filled in by the report, against the baseline
    first_difference: int | None = None  # index into `output` of the first token unlike the baseline's
    difference_gap: float | None = None  # the lower of the two tokens' logits below the top, relative to the row's max |logit|
    near_tie: bool | None = None  # both tokens within the dtype's rounding of the target's top logit
    error: str | None = None
    details: dict = field(default_factory=dict)
    first_token_seconds: float | None = None  # from the call's start to the first new token (`FirstTokenClock`)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    @property
    def decode_seconds(self) -> float | None:
        """The call's time after its first new token: the decode, prefill apart (None: not known)."""
        if self.first_token_seconds is None:
            return None
        return max(0.0, self.seconds - self.first_token_seconds)

    @property
    def decode_tokens_per_second(self) -> float | None:
        """New tokens after the first per second after it (None: not known, or no token after the first)."""
        decode = self.decode_seconds
        return (self.new_tokens - 1) / decode if decode and self.new_tokens > 1 else None


class FirstTokenClock:
    """A `generate` streamer that notes the time of the first new token and nothing else.

    `generate` (transformers' and selfspec's) puts the prompt first, then the
    new tokens; the second `put` is the first new token. On CUDA it waits for
    the device once, at that token, so the time is the token's, not its launch's.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.puts = 0
        self.at: float | None = None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.at = _now(self.device)

    def end(self) -> None:
        pass

    def since(self, start: float) -> float | None:
        """Seconds from `start` (a `time.perf_counter()` reading) to the first new token; None if none came."""
        return None if self.at is None else self.at - start


def measure(method: Method, prompt: Prompt, device: torch.device, *, trim: bool = False) -> Row:
    """Run `method` on `prompt` once; `trim` first returns the allocator's free memory to the OS.

    Timed runs do not trim (the pages a trim gives back would be faulted in again
    inside the timed call); the memory pass does, so its peak increase is the
    memory the call needs rather than what the allocator happened to hold already.
    """
    row = Row(method.name, prompt.prompt_id, prompt.category, prompt.length)
    gc.collect()
    if trim:
        give_back_freed(device)
    probe = MemoryProbe(device)
    try:
        probe.start()
        clock = FirstTokenClock(device)
        with torch.no_grad():
            start = _now(device)
            out, counts = method.run(prompt.input_ids, clock)
            row.seconds = _now(device) - start
        row.peak_bytes, row.peak_increase_bytes = probe.stop()
    except Exception as error:  # a failing method is recorded, the benchmark goes on
        row.error = f"{type(error).__name__}: {error}"
        row.details = {"traceback": traceback.format_exc(limit=6)}
        return row
    row.output = out[0, prompt.length :].tolist()
    row.new_tokens = len(row.output)
    row.first_token_seconds = clock.since(start)
    row.verify_passes, row.drafted, row.accepted = counts.verify_passes, counts.drafted, counts.accepted
    row.details = counts.details
    return row


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class MemoryProbe:
    """Peak memory of one call: the kernel's RSS high-water mark on CPU, the allocator's peak on CUDA."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.before: int | None = None

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.before = torch.cuda.memory_allocated(self.device)
        elif reset_rss_peak():
            self.before = rss_bytes()

    def stop(self) -> tuple[int | None, int | None]:
        if self.before is None:
            return None, None
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            peak = _status_bytes("VmHWM")
        return peak, None if peak is None else max(0, peak - self.before)


def reset_rss_peak() -> bool:
    """Reset the process's RSS high-water mark (Linux >= 4.0); False where that is not possible."""
    try:
        CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


def rss_bytes() -> int | None:
    return _status_bytes("VmRSS")


def _status_bytes(key: str) -> int | None:
    try:
        for line in STATUS.read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024  # the file says kB
    except OSError:
        pass
    return None
