"""Kernel choices for passes on the CPU: grouped-query attention in one sdpa call, and the linear layers' GEMM
orientation, each where this machine runs it faster.

Two things transformers leaves slow for the passes speculation makes (a few
tokens, or a few tokens on each of several rows):

- **Attention over grouped K/V heads** (`packed_gqa_sdpa`). For a masked
  pass over q > 1 queries, transformers copies each K/V head once per query
  head it serves (`repeat_kv`). Here the query heads that share a K/V head
  are folded into its query length instead, `[b, kv_heads, groups * q, d]`,
  the mask repeated over the groups: one kernel call, K/V as they are. This
  is what transformers itself does for one query (`pack_gqa`). Measured
  (AVX512 CPU, SmolLM2's heads, 8 rows x 2 tokens at 256 entries): 0.23 ms a
  layer, against 0.44 with the kernel's own `enable_gqa`.
- **The linear layers' orientation** (`LinearOrientation`). `F.linear(x, W)`
  computes x W^T. For a few rows of x, the BLAS may be much faster at
  (W x^T)^T on some machines (AVX512 CPU, float32, SmolLM2's layers: 13 ms
  against 37 ms for 2 rows) and slower on others (the same CPU in bfloat16).
  `measure_linear_orientation` times both on the model's own weights for
  row counts 1..64 and keeps the transposed one where it is faster; larger
  passes (prefills) always run as transformers runs them.

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
from dataclasses import dataclass

import torch
from torch import nn

from .costs import fastest

# GEMM row counts timed by `measure_linear_orientation`; a count in between takes the decision of the one below.
LINEAR_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
# The transposed orientation must beat the usual one by this fraction to be kept (timing noise).
ORIENTATION_MARGIN = 0.05
# Attention options that change what is computed (a score cap, a position bias, attention sinks): a pass with
# any of them goes to transformers' own function.
CHANGED_ATTENTION = ("softcap", "position_bias", "s_aux", "sinks")


@dataclass(frozen=True)
class LinearOrientation:
    """For which GEMM row counts the linear layers run as (W x^T)^T: `transposed[i]` for rows in
    [rows[i], rows[i + 1]); none beyond `LINEAR_ROWS[-1]`."""

    rows: tuple[int, ...] = ()
    transposed: tuple[bool, ...] = ()

    def __call__(self, m: int) -> bool:
        if not self.rows or m > LINEAR_ROWS[-1]:
            return False
        i = bisect.bisect_right(self.rows, m) - 1
        return i >= 0 and self.transposed[i]

    def __bool__(self) -> bool:
        return any(self.transposed)

    def describe(self) -> str:
        kept = [m for m, t in zip(self.rows, self.transposed) if t]
        return f"transposed at GEMM rows {','.join(map(str, kept))}" if kept else "as transformers runs them"

    def to_dict(self) -> dict:
        return {"rows": list(self.rows), "transposed": list(self.transposed)}

    @classmethod
    def from_dict(cls, data: dict) -> "LinearOrientation":
        rows, transposed = tuple(int(m) for m in data["rows"]), tuple(bool(t) for t in data["transposed"])
        if len(rows) != len(transposed) or list(rows) != sorted(rows):
            raise ValueError(f"not a linear orientation: {data}")
        return cls(rows, transposed)


NO_CHANGE = LinearOrientation()


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


def measure_linear_orientation(modules: list[nn.Module], *, repeats: int = 3) -> LinearOrientation:
    """Time every plain linear layer of `modules` both ways at each of `LINEAR_ROWS` rows (interleaved, the
    fastest of `repeats`); the transposed way is kept where it is `ORIENTATION_MARGIN` faster."""
    linears = [m for m in modules if plain_weight(m)]
    if not linears:
        return NO_CHANGE
    device, dtype = linears[0].weight.device, linears[0].weight.dtype
    generator = torch.Generator().manual_seed(0)
    inputs = {m: {n: torch.randn(m, n, generator=generator).to(device, dtype)
                  for n in {int(layer.in_features) for layer in linears}} for m in LINEAR_ROWS}

    def all_layers(m: int, kernel) -> callable:
        return lambda: [kernel(inputs[m][layer.in_features], layer.weight, layer.bias) for layer in linears]

    with torch.no_grad():
        times = fastest({(m, t): all_layers(m, transposed_linear if t else _linear)
                         for m in LINEAR_ROWS for t in (False, True)}, repeats=repeats, device=device)
    return LinearOrientation(LINEAR_ROWS, tuple(times[m, True] < times[m, False] * (1 - ORIENTATION_MARGIN)
                                                 for m in LINEAR_ROWS))


# --------------------------------------------------------------------------- the swapped functions

_linear = torch.nn.functional.linear  # the functions in place when this module was imported
_state = threading.local()  # this thread's choice: .attention (bool), .linear (LinearOrientation)
_lock = threading.Lock()
_inside = 0  # threads inside `cpu_kernels` (the functions are swapped while > 0)
_attention_before: tuple[bool, object] = (False, None)  # the "sdpa" entry's local override before the swap
_attention_original = None  # the "sdpa" function in effect before the swap: what a plain pass calls


def oriented_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, transposed where this thread's `LinearOrientation` says so for x's row count."""
    orientation = getattr(_state, "linear", NO_CHANGE)
    if (orientation and x.dim() >= 2 and x.device.type == "cpu" and x.dtype == weight.dtype and plain_tensor(weight)
            and orientation(x.numel() // max(1, x.shape[-1]))):
        return transposed_linear(x, weight, bias)
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
def cpu_kernels(*, attention: bool | None = None, linear: LinearOrientation | None = None):
    """Within: this thread's passes use the packed attention (`attention`) and linear orientation (`linear`);
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
            torch.nn.functional.linear = oriented_linear
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
