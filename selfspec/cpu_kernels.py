"""Kernel choices for passes on the CPU: grouped-query attention in one sdpa call, and the kernel each linear
layer runs, each where this machine runs it faster.

Two things transformers leaves slow for the passes speculation makes (a few
tokens, or a few tokens on each of several rows), and one it leaves slow
everywhere on some CPUs:

- **Attention over grouped K/V heads** (`packed_gqa_sdpa`). For a masked
  pass over q > 1 queries, transformers copies each K/V head once per query
  head it serves (`repeat_kv`). Here the query heads that share a K/V head
  are folded into its query length instead, `[b, kv_heads, groups * q, d]`,
  the mask repeated over the groups: one kernel call, K/V as they are. This
  is what transformers itself does for one query (`pack_gqa`). Measured
  (AVX512 CPU, SmolLM2's heads, 8 rows x 2 tokens at 256 entries): 0.23 ms a
  layer, against 0.44 with the kernel's own `enable_gqa`.
- **The linear layers' kernel** (`LinearKernels`). `F.linear(x, W)`
  computes x W^T with the BLAS torch was built with (MKL on x86). For a few
  rows of x that BLAS may be much faster at (W x^T)^T on some machines
  (AVX512 CPU, float32, SmolLM2's layers: 13 ms against 37 ms for 2 rows)
  and slower on others (the same CPU in bfloat16); and on some CPUs oneDNN's
  matmul, over the same weight in place, beats it at every row count (an
  AMD EPYC in float32: half the time, prefills included). `measure_linear_kernels`
  times each kernel that runs here on the model's own weights for row counts
  1..256 and keeps the fastest where it beats `F.linear` by 5%.

Both are installed while a thread is inside `cpu_kernels(...)`: the
functions transformers calls (`torch.nn.functional.linear` and its "sdpa"
attention entry) are swapped process-wide while any thread is inside, and
dispatch on that thread's choice, so a call from elsewhere (another
thread's `model.generate`) runs the original functions. Both compute the
same sums in another order (float rounding apart; greedy equality with
`model.generate` is exact in float64).

This module does not know plans, caches or when a pass is worth running.
"""

from __future__ import annotations

import bisect
import contextlib
import threading
from dataclasses import dataclass, field

import torch
from torch import nn

from .costs import fastest

_linear = torch.nn.functional.linear  # F.linear as this module found it: what "linear" runs, swapped or not

# GEMM row counts timed by `measure_linear_kernels`; a count in between takes the choice of the one below, and a
# count beyond the last (a long prefill) the last one's.
LINEAR_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256)
# Another kernel must beat transformers' `F.linear` by this fraction to be kept (timing noise).
KERNEL_MARGIN = 0.05
# What a linear layer may run as: transformers' F.linear (the BLAS's x W^T), (W x^T)^T, or oneDNN's matmul.
LINEAR_KERNELS = ("linear", "transposed", "onednn")
# Attention options that change what is computed (a score cap, a position bias, attention sinks): a pass with
# any of them goes to transformers' own function.
CHANGED_ATTENTION = ("softcap", "position_bias", "s_aux", "sinks")


@dataclass(frozen=True)
class LinearKernels:
    """Which kernel the linear layers run for a GEMM of m rows: `kernels[i]` for m in [rows[i], rows[i + 1]),
    the last one's beyond; "linear" (transformers' `F.linear`) where nothing was measured."""

    rows: tuple[int, ...] = ()
    kernels: tuple[str, ...] = ()
    # The kernel for m = 0 .. rows[-1], looked up on every linear call of a pass (no search there).
    by_rows: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_rows = []
        for m in range(self.rows[-1] + 1 if self.rows else 0):
            i = bisect.bisect_right(self.rows, m) - 1
            by_rows.append(self.kernels[i] if i >= 0 else "linear")
        object.__setattr__(self, "by_rows", tuple(by_rows))

    def __call__(self, m: int) -> str:
        by_rows = self.by_rows
        return by_rows[m] if m < len(by_rows) else (by_rows[-1] if by_rows else "linear")

    def __bool__(self) -> bool:  # some row count runs another kernel
        return any(kernel != "linear" for kernel in self.kernels)

    def describe(self) -> str:
        if not self:
            return "as transformers runs them"
        groups: dict[str, list[int]] = {}
        for m, kernel in zip(self.rows, self.kernels):
            groups.setdefault(kernel, []).append(m)
        return "; ".join(f"{KERNEL_NAMES[k]} at GEMM rows {','.join(map(str, ms))}" for k, ms in groups.items())

    def to_dict(self) -> dict:
        return {"rows": list(self.rows), "kernels": list(self.kernels)}

    @classmethod
    def from_dict(cls, data: dict) -> "LinearKernels":
        rows, kernels = tuple(int(m) for m in data["rows"]), tuple(str(k) for k in data["kernels"])
        if len(rows) != len(kernels) or list(rows) != sorted(set(rows)) or not set(kernels) <= set(LINEAR_KERNELS):
            raise ValueError(f"not a choice of linear kernels: {data}")
        return cls(rows, kernels)


NO_CHANGE = LinearKernels()
KERNEL_NAMES = {"linear": "F.linear", "transposed": "(W x^T)^T", "onednn": "oneDNN"}


def plain_tensor(weight) -> bool:
    """An ordinary dense float matrix (not quantized, not a tensor subclass)."""
    return (type(weight) in (torch.Tensor, nn.Parameter) and weight.dim() == 2 and weight.layout == torch.strided
            and weight.dtype.is_floating_point)


def plain_weight(module: nn.Module) -> bool:
    """A linear layer whose weight is a `plain_tensor`."""
    return isinstance(module, nn.Linear) and plain_tensor(module.weight)


def transposed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` computed as (W x^T)^T: x `[..., in]`, weight `[out, in]` -> `[..., out]`."""
    flat = x.reshape(-1, x.shape[-1])  # [m, in]
    out = torch.mm(weight, flat.T).T.contiguous()  # [m, out]
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.shape[0])


ONEDNN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what its matmul takes (not float64)


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` by oneDNN's matmul over the weight as it is (no packed copy kept): x `[..., in]`,
    weight `[out, in]` -> `[..., out]`. Inference only (no autograd); float32 and 16-bit floats, not float64.

    Where the BLAS torch calls is slow for this CPU (MKL on an AMD EPYC, float32: half oneDNN's speed at every
    row count, measured), this is the same sums in another order.
    """
    flat = x.reshape(-1, x.shape[-1]).contiguous()  # [m, in]
    out = torch.ops.mkldnn._linear_pointwise(flat, weight, bias, "none", [], "")  # [m, out]
    return out.view(*x.shape[:-1], weight.shape[0])


def onednn_usable(weight: torch.Tensor) -> bool:
    """oneDNN's matmul runs for this weight's dtype here and computes what `F.linear` computes (rounding apart)."""
    if not (torch.backends.mkldnn.is_available() and weight.device.type == "cpu" and weight.is_contiguous()
            and weight.dtype in ONEDNN_DTYPES):
        return False
    x = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
    try:
        out = onednn_linear(x, weight)
    except (RuntimeError, AttributeError, NotImplementedError):  # not built in, or not on this CPU
        return False
    reference = _linear(x.double(), weight.double())  # [3, out]
    tolerance = 8 * torch.finfo(weight.dtype).eps * x.shape[1] ** 0.5
    return bool((out.double() - reference).abs().max() <= tolerance * reference.abs().max().clamp_min(1e-30))


KERNELS = {"linear": _linear, "transposed": transposed_linear, "onednn": onednn_linear}


def measure_linear_kernels(modules: list[nn.Module], *, repeats: int = 3) -> LinearKernels:
    """Time every plain linear layer of `modules` with each kernel that runs here at each of `LINEAR_ROWS`
    rows (interleaved, the fastest of `repeats`); the fastest is kept where it beats `F.linear` by
    `KERNEL_MARGIN`."""
    linears = [m for m in modules if plain_weight(m)]
    if not linears:
        return NO_CHANGE
    device, dtype = linears[0].weight.device, linears[0].weight.dtype
    kernels = [k for k in LINEAR_KERNELS if k != "onednn" or onednn_usable(linears[0].weight)]
    generator = torch.Generator().manual_seed(0)
    inputs = {m: {n: torch.randn(m, n, generator=generator).to(device, dtype)
                  for n in {int(layer.in_features) for layer in linears}} for m in LINEAR_ROWS}

    def all_layers(m: int, kernel) -> callable:
        return lambda: [kernel(inputs[m][layer.in_features], layer.weight, layer.bias) for layer in linears]

    with torch.no_grad():
        times = fastest({(m, k): all_layers(m, KERNELS[k]) for m in LINEAR_ROWS for k in kernels},
                        repeats=repeats, device=device)

    def best(m: int) -> str:
        kernel = min(kernels, key=lambda k: times[m, k])
        return kernel if times[m, kernel] < times[m, "linear"] * (1 - KERNEL_MARGIN) else "linear"

    return LinearKernels(LINEAR_ROWS, tuple(best(m) for m in LINEAR_ROWS))


# --------------------------------------------------------------------------- the swapped functions

_state = threading.local()  # this thread's choice: .attention (bool), .linear (LinearKernels)
_lock = threading.Lock()
_inside = 0  # threads inside `cpu_kernels` (the functions are swapped while > 0)
_attention_before: tuple[bool, object] = (False, None)  # the "sdpa" entry's local override before the swap
_attention_original = None  # the "sdpa" function in effect before the swap: what a plain pass calls


def chosen_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, by the kernel this thread's `LinearKernels` chose for x's row count (on every linear call of
    a pass: the common case, F.linear, is decided first)."""
    choice = getattr(_state, "linear", NO_CHANGE)
    kernel = choice(x.numel() // x.shape[-1]) if x.dim() >= 2 and x.shape[-1] else "linear"
    if kernel == "linear" or x.device.type != "cpu" or x.dtype != weight.dtype or not plain_tensor(weight):
        return _linear(x, weight, bias)
    if kernel == "transposed":
        return transposed_linear(x, weight, bias)
    if (weight.dtype in ONEDNN_DTYPES and weight.is_contiguous() and (bias is None or bias.dtype == weight.dtype)
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return onednn_linear(x, weight, bias)
    return _linear(x, weight, bias)


def packed_gqa_sdpa(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                    is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention, with the query heads that share a K/V head folded into its query length.

    query `[b, heads, q, d]`, key and value `[b, kv_heads, kv, d]`, a mask
    `[b or 1, 1, q, kv]`; head h reads K/V head h // groups. Only for this
    thread's passes inside `cpu_kernels(attention=True)`; anything else (no
    mask, one query, no grouped heads, dropout, options that change the
    scores) goes to transformers' function unchanged.
    """
    groups = getattr(module, "num_key_value_groups", 1)
    b, heads, q, d = query.shape
    plain = (not getattr(_state, "attention", False) or groups <= 1 or q == 1 or attention_mask is None or dropout
             or attention_mask.dim() != 4 or attention_mask.shape[1] != 1 or key.shape[1] * groups != heads
             or any(kwargs.get(option) is not None for option in CHANGED_ATTENTION))
    if plain:
        return _attention_original(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                   is_causal=is_causal, **kwargs)
    kv_heads = key.shape[1]
    packed = query.reshape(b, kv_heads, groups * q, d)  # row g * q + t: query t of head (kv, g)
    mask = attention_mask[:, :, None].expand(-1, -1, groups, -1, -1).reshape(attention_mask.shape[0], 1,
                                                                            groups * q, -1)  # [b, 1, groups*q, kv]
    out = torch.nn.functional.scaled_dot_product_attention(packed, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(b, heads, q, d).transpose(1, 2).contiguous(), None  # [b, q, heads, d]


@contextlib.contextmanager
def cpu_kernels(*, attention: bool | None = None, linear: LinearKernels | None = None):
    """Within: this thread's passes use the packed attention (`attention`) and linear kernels (`linear`);
    None keeps the enclosing choice. Nests; restores the thread's choice and, when the last thread leaves,
    the original functions. Choosing nothing swaps nothing."""
    global _inside, _attention_before, _attention_original
    # Imported here: transformers' modeling_utils loads its quantization back ends (and their warnings) on import.
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    saved = (getattr(_state, "attention", False), getattr(_state, "linear", NO_CHANGE))
    chosen = (saved[0] if attention is None else attention, saved[1] if linear is None else linear)
    if not chosen[0] and not chosen[1]:  # nothing to change (a GPU, say): transformers' functions, not swapped
        _state.attention, _state.linear = chosen
        try:
            yield
        finally:
            _state.attention, _state.linear = saved
        return
    with _lock:
        if _inside == 0:
            local = ALL_ATTENTION_FUNCTIONS._local_mapping
            _attention_before = ("sdpa" in local, local.get("sdpa"))
            _attention_original = ALL_ATTENTION_FUNCTIONS["sdpa"]
            ALL_ATTENTION_FUNCTIONS["sdpa"] = packed_gqa_sdpa
            torch.nn.functional.linear = chosen_linear
        _inside += 1
    _state.attention, _state.linear = chosen
    try:
        yield
    finally:
        _state.attention, _state.linear = saved
        with _lock:
            _inside -= 1
            if _inside == 0:
                torch.nn.functional.linear = _linear
                had, entry = _attention_before
                if had:
                    ALL_ATTENTION_FUNCTIONS["sdpa"] = entry
                else:
                    del ALL_ATTENTION_FUNCTIONS["sdpa"]
