"""Hand memory the process freed back to the system.

Freed tensors stay in the process's heap (glibc's malloc keeps them for
later) or in PyTorch's CUDA caching allocator; the resident set then stays at
its high-water mark. `give_back_freed` returns them, after a burst that
allocated far more than what stays: loading a model into a budget, timing a
cost table on a scratch cache, a server's requests. `one_heap` keeps every
thread's allocations in one heap, so what one thread frees another reuses
(a process held to a memory budget). It imports nothing of selfspec, so any
module may call it.
"""

from __future__ import annotations

import ctypes
import gc

import torch


def give_back_freed(device: torch.device | str = "cpu") -> None:
    """Hand freed memory back to the system: glibc's `malloc_trim` on a CPU (freed tensors otherwise stay in
    the process's heap), the caching allocator's cache on CUDA. Costs milliseconds; call it when idle."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim this way
        pass


M_ARENA_MAX = -8  # glibc's mallopt parameter: how many heaps ("arenas") malloc may make for its threads


def one_heap() -> bool:
    """Let glibc's malloc keep one heap for all threads (`mallopt(M_ARENA_MAX, 1)`), process-wide, from now on.

    By default each thread that allocates at the same time as another gets a
    heap of its own (up to 8 per core). A pass's kernel threads and the
    stream's reader each keep what they freed for themselves, so a process
    holds several heaps' worth of freed pages at its peak. `selfspec.load`
    calls this when given a memory budget. False where the C library is not
    glibc (nothing changes)."""
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(M_ARENA_MAX, 1))
    except (OSError, AttributeError):
        return False
