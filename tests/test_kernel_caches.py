"""A process that runs GEMMs of ever new shapes (a server prefilling prompts of every length) keeps a flat heap
once `bound_kernel_caches` bounds oneDNN's and ideep's kernel caches (each keeps 1,024 shapes by default)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

PROBE = textwrap.dedent("""
    import ctypes, sys
    import torch
    from selfspec.heap import give_back_freed
    from selfspec.memory import bound_kernel_caches
    if sys.argv[1] == "bounded":
        bound_kernel_caches(16)
    torch.set_num_threads(1)

    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                   "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = Info
    weight = torch.randn(1536, 576, dtype=torch.bfloat16)
    def in_use(rows):
        for m in rows:
            torch.nn.functional.linear(torch.randn(m, 576, dtype=torch.bfloat16), weight)
        give_back_freed()
        return libc.mallinfo2().uordblks
    start = in_use(range(1, 40))
    print((in_use(range(40, 400)) - start) / 2**20)
""")


def heap_growth(mode: str) -> float:
    """MiB of heap in use gained over 360 new GEMM shapes, in a fresh process."""
    done = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return float(done.stdout.split()[-1])


def test_bounded_kernel_caches_keep_the_heap_flat_over_new_shapes():
    bounded, unbounded = heap_growth("bounded"), heap_growth("unbounded")
    assert bounded < 8, (bounded, unbounded)
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():  # torch runs bf16 GEMMs through oneDNN: unbounded, they grow
        assert unbounded > 50, (bounded, unbounded)
    else:  # no oneDNN GEMMs: neither grows
        assert bounded <= unbounded + 2, (bounded, unbounded)
