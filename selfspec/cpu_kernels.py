"""Kernel choices for passes on the CPU: the attention kernel and the kernel each linear layer runs, each
where this machine runs it faster (measured here, on the model's own shapes).

Two things transformers leaves slow for the passes speculation makes (a few
tokens, or a few tokens on each of several rows), and one it leaves slow
everywhere on some CPUs:

- **The attention kernel** (`AttentionKernels`). transformers hands every
  pass to sdpa, K/V heads shared by `enable_gqa` (or copied, `repeat_kv`).
  On some CPUs that kernel is slow for few queries: in bfloat16 on an
  AVX512 CPU, one query over 1,024 cache entries of SmolLM2's heads took
  0.45 ms a layer, of Gemma 3 270M's 0.85 ms. Two others compute the same:
  `packed` folds the query heads that share a K/V head into its query
  length (`[b, kv_heads, groups * q, d]`, the mask repeated over the groups;
  one sdpa call over K/V as they are): 0.07 ms for both; and `float32` runs
  scores, softmax and sum as three plain operations in float32. Which wins
  depends on the dtype, the heads, the queries and the entries (packed lost
  to sdpa for 17 queries on Gemma's one K/V head, 0.84 against 0.58 ms), so
  `measure_attention_kernels` times each on the model's head shape for 1..32
  queries over 64..4,096 entries and keeps the fastest where it beats sdpa by 5%.
- **The linear layers' kernel** (`LinearKernels`). `F.linear(x, W)`
  computes x W^T with the BLAS torch was built with (MKL on x86). For a few
  rows of x that BLAS may be much faster at (W x^T)^T on some machines
  (AVX512 CPU, float32, SmolLM2's layers: 13 ms against 37 ms for 2 rows)
  and slower on others (the same CPU in bfloat16); and on some CPUs oneDNN's
  matmul, over the same weight in place, beats it at every row count (an
  AMD EPYC in float32: half the time, prefills included). And where torch
  hands a 16-bit GEMM to oneDNN, torch's own GEMM may stream the weights
  faster for one or two rows (`aten`: the same call with oneDNN switched
  off for it; an AMD EPYC with AVX512-BF16, SmolLM2 in bfloat16: a plain
  step 24 ms against 39 ms, while from 4 rows on oneDNN wins).
  `measure_linear_kernels` times each kernel that runs here on the model's
  own weights for row counts 1..256 and keeps the fastest where it beats
  `F.linear` by 5%.

Both are installed while a thread is inside `cpu_kernels(...)`: the
functions transformers calls (`torch.nn.functional.linear` and its "sdpa"
attention entry) are swapped process-wide while any thread is inside, and
dispatch on that thread's choice, so a call from elsewhere (another
thread's `model.generate`) runs the original functions. oneDNN's switch is
process-wide too: while a thread's `aten` call has it off, every other
linear call waits (they all pass through the swapped function), but another
thread's matmul outside a linear layer may then run torch's GEMM (the same
sums, rounded in another order). All compute the same sums in another
order, in the precision sdpa keeps them (float rounding apart; greedy
equality with `model.generate` is exact in float64).

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
# What a linear layer may run as: transformers' F.linear (the BLAS's x W^T), (W x^T)^T, oneDNN's matmul, or
# F.linear with oneDNN switched off (torch's own GEMM where torch would hand a 16-bit one to oneDNN).
LINEAR_KERNELS = ("linear", "transposed", "onednn", "aten")
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
KERNEL_NAMES = {"linear": "F.linear", "transposed": "(W x^T)^T", "onednn": "oneDNN", "aten": "F.linear, oneDNN off"}


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


_switch = threading.Lock()  # held while a thread has oneDNN switched off (`aten_linear`)
_aten_threads = 0  # threads inside `cpu_kernels` whose choice runs `aten_linear` somewhere (under `_lock`)


def aten_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` with oneDNN switched off for the call: where torch would hand a 16-bit GEMM
    to oneDNN, its own GEMM runs it (the same sums in another order). The switch is process-wide: it is held
    under `_switch`, which the swapped `F.linear` of every other thread waits on."""
    with _switch:
        was = torch._C._get_mkldnn_enabled()
        torch._C._set_mkldnn_enabled(False)
        try:
            return _linear(x, weight, bias)
        finally:
            torch._C._set_mkldnn_enabled(was)


def aten_differs(weight: torch.Tensor) -> bool:
    """Whether switching oneDNN off can change how F.linear runs for this weight: a 16-bit float on a CPU whose
    torch has oneDNN, switched on (float32 goes to the BLAS either way; timing it again would only add noise)."""
    return (weight.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float16)
            and torch.backends.mkldnn.is_available() and torch._C._get_mkldnn_enabled())


KERNELS = {"linear": _linear, "transposed": transposed_linear, "onednn": onednn_linear, "aten": aten_linear}


def measure_linear_kernels(modules: list[nn.Module], *, repeats: int = 3) -> LinearKernels:
    """Time every plain linear layer of `modules` with each kernel that runs here at each of `LINEAR_ROWS`
    rows (interleaved, the fastest of `repeats`); the fastest is kept where it beats `F.linear` by
    `KERNEL_MARGIN`."""
    linears = [m for m in modules if plain_weight(m)]
    if not linears:
        return NO_CHANGE
    device, dtype = linears[0].weight.device, linears[0].weight.dtype
    usable = {"onednn": onednn_usable(linears[0].weight), "aten": aten_differs(linears[0].weight)}
    kernels = [k for k in LINEAR_KERNELS if usable.get(k, True)]
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

_state = threading.local()  # this thread's choice: .attention (AttentionKernels), .linear (LinearKernels)
_lock = threading.Lock()
_inside = 0  # threads inside `cpu_kernels` (the functions are swapped while > 0)
_attention_before: tuple[bool, object] = (False, None)  # the "sdpa" entry's local override before the swap
_attention_original = None  # the "sdpa" function in effect before the swap: what a plain pass calls


def chosen_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, by the kernel this thread's `LinearKernels` chose for x's row count (on every linear call of
    a pass: the common case, F.linear, is decided first)."""
    choice = getattr(_state, "linear", NO_CHANGE)
    kernel = choice(x.numel() // x.shape[-1]) if x.dim() >= 2 and x.shape[-1] else "linear"
    if kernel != "linear" and (x.device.type != "cpu" or x.dtype != weight.dtype or not plain_tensor(weight)):
        kernel = "linear"  # checked only when another kernel is chosen: most calls of a pass are F.linear's
    if kernel == "aten":
        return aten_linear(x, weight, bias)
    if _aten_threads:  # some thread may switch oneDNN off (`aten_linear`): not in the middle of this call
        with _switch:
            return run_linear(kernel, x, weight, bias)
    return run_linear(kernel, x, weight, bias)


def run_linear(kernel: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear` by `kernel` ("linear", "transposed" or "onednn"; oneDNN's op has no backward: F.linear's then)."""
    if kernel == "transposed":
        return transposed_linear(x, weight, bias)
    if (kernel == "onednn" and weight.dtype in ONEDNN_DTYPES and weight.is_contiguous()
            and (bias is None or bias.dtype == weight.dtype)
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return onednn_linear(x, weight, bias)
    return _linear(x, weight, bias)


def fold_grouped_heads(query: torch.Tensor, mask: torch.Tensor | None, kv_heads: int):
    """Query heads that share a K/V head folded into its query length: query `[b, heads, q, d]` ->
    `[b, kv_heads, groups * q, d]` (row g * q + t: query t of head (kv, g); head h reads K/V head h // groups),
    and a mask `[b or 1, 1, q, kv]` repeated over the groups -> `[b or 1, 1, groups * q, kv]`."""
    b, heads, q, d = query.shape
    groups = heads // kv_heads
    folded = query.reshape(b, kv_heads, groups * q, d)
    if mask is not None:
        mask = mask[:, :, None].expand(-1, -1, groups, -1, -1).reshape(mask.shape[0], 1, groups * q, -1)
    return folded, mask


def sdpa_attention(query, key, value, mask, scale) -> torch.Tensor:
    """The kernel transformers' "sdpa" attention calls (K/V heads shared by `enable_gqa`): query
    `[b, heads, q, d]`, key and value `[b, kv_heads, kv, d]`, a bool mask `[b or 1, 1, q, kv]` or None ->
    `[b, heads, q, d]`. What the others are timed and checked against."""
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale,
                                                            enable_gqa=key.shape[1] != query.shape[1])


def packed_attention(query, key, value, mask, scale) -> torch.Tensor:
    """sdpa with grouped query heads folded into the query length (`fold_grouped_heads`): one kernel call over
    K/V as they are. Same arguments and result as `sdpa_attention`."""
    b, heads, q, d = query.shape
    folded, mask = fold_grouped_heads(query, mask, key.shape[1])
    out = torch.nn.functional.scaled_dot_product_attention(folded, key, value, attn_mask=mask, scale=scale)
    return out.reshape(b, heads, q, d)


def float32_attention(query, key, value, mask, scale) -> torch.Tensor:
    """Attention as three plain operations (scores, softmax, weighted sum), all in float32 or wider whatever the
    dtype, grouped heads folded (`fold_grouped_heads`). Same arguments and result as `sdpa_attention`.

    Where sdpa's kernel is slow for few queries (bfloat16 on some CPUs: one query over 1,024 entries of SmolLM2's
    heads, 0.45 ms against 0.08, measured on an AVX512 CPU) this is the same sums, in float32 as the kernel keeps
    them, in another order; it holds a `[b, kv_heads, groups * q, kv]` float32 score matrix while it runs.
    """
    b, heads, q, d = query.shape
    folded, mask = fold_grouped_heads(query, mask, key.shape[1])
    wide = torch.promote_types(query.dtype, torch.float32)  # float64 stays float64
    scores = torch.matmul(folded.to(wide), key.to(wide).transpose(-1, -2)) * scale  # [b, kv_heads, groups*q, kv]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), value.to(wide))  # [b, kv_heads, groups*q, d]
    return out.to(query.dtype).reshape(b, heads, q, d)


ATTENTION_FUNCTIONS = {"sdpa": sdpa_attention, "packed": packed_attention, "float32": float32_attention}


@dataclass(frozen=True)
class AttentionKernels:
    """Which attention kernel a pass of q queries over kv cache entries runs: `kernels[i][j]` for q in
    [queries[i], queries[i + 1]) and kv in [keys[j], keys[j + 1]) (the first key count's below it, the last
    one's beyond); "sdpa" (transformers' own function) for more queries than the last measured count, and
    where nothing was measured."""

    queries: tuple[int, ...] = ()
    keys: tuple[int, ...] = ()
    kernels: tuple[tuple[str, ...], ...] = ()  # [len(queries)][len(keys)]

    def __call__(self, q: int, kv: int) -> str:
        if not self.queries or q > self.queries[-1] * 2 - 1:
            return "sdpa"
        i = max(bisect.bisect_right(self.queries, q) - 1, 0)
        j = max(bisect.bisect_right(self.keys, kv) - 1, 0)
        return self.kernels[i][j]

    def __bool__(self) -> bool:  # some pass runs another kernel
        return any(kernel != "sdpa" for row in self.kernels for kernel in row)

    def describe(self) -> str:
        """Per query count, the kernel from each entry count on: "1 query: packed from 64; 4: float32 from 1024"."""
        if not self:
            return "as transformers runs it"
        lines = []
        for q, row in zip(self.queries, self.kernels):
            runs = [f"{kernel} from {kv}" for j, (kv, kernel) in enumerate(zip(self.keys, row))
                    if kernel != (row[j - 1] if j else "sdpa")]
            if runs:
                lines.append(f"{q} quer{'y' if q == 1 else 'ies'}: {', '.join(runs)}")
        return "; ".join(lines)

    def to_dict(self) -> dict:
        return {"queries": list(self.queries), "keys": list(self.keys), "kernels": [list(r) for r in self.kernels]}

    @classmethod
    def from_dict(cls, data: dict) -> "AttentionKernels":
        queries, keys = tuple(int(q) for q in data["queries"]), tuple(int(k) for k in data["keys"])
        kernels = tuple(tuple(str(k) for k in row) for row in data["kernels"])
        if (list(queries) != sorted(set(queries)) or list(keys) != sorted(set(keys)) or len(kernels) != len(queries)
                or any(len(row) != len(keys) or not set(row) <= set(ATTENTION_FUNCTIONS) for row in kernels)):
            raise ValueError(f"not a choice of attention kernels: {data}")
        return cls(queries, keys, kernels)


NO_ATTENTION_CHANGE = AttentionKernels()
# The passes `measure_attention_kernels` times: query counts (one token, a chain or a tree; more than twice the
# last go to sdpa) by cache entries (a choice covers the entries up to the next count).
ATTENTION_QUERIES = (1, 2, 4, 8, 16, 32)
ATTENTION_KEYS = (64, 256, 1024, 4096)


def measure_attention_kernels(*, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                              device: torch.device, max_keys: int | None = None,
                              repeats: int = 3) -> AttentionKernels:
    """Time every attention kernel that applies (`packed` only with grouped K/V heads) on this shape, at each
    of `ATTENTION_QUERIES` x `ATTENTION_KEYS` (up to `max_keys`), a causal mask for several queries, interleaved,
    the fastest of `repeats`; another kernel is kept where it beats sdpa by `KERNEL_MARGIN`."""
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads cannot share {kv_heads} K/V heads")
    kernels = [k for k in ATTENTION_FUNCTIONS if k != "packed" or heads > kv_heads]
    keys = tuple(k for k in ATTENTION_KEYS if max_keys is None or k <= max_keys) or ATTENTION_KEYS[:1]
    generator = torch.Generator().manual_seed(0)
    scale = head_dim ** -0.5

    def tensors(q: int, kv: int):
        query = torch.randn(1, heads, q, head_dim, generator=generator).to(device, dtype)
        key, value = (torch.randn(1, kv_heads, kv, head_dim, generator=generator).to(device, dtype) for _ in "kv")
        # The last q entries are the queries' own: each sees the prefix and the ones before it.
        mask = None if q == 1 else torch.ones(q, kv, dtype=torch.bool, device=device).tril(kv - q)[None, None]
        return query, key, value, mask

    inputs = {(q, kv): tensors(q, kv) for q in ATTENTION_QUERIES for kv in keys}

    def run(shape, kernel):
        return lambda: ATTENTION_FUNCTIONS[kernel](*inputs[shape], scale)

    with torch.no_grad():
        times = fastest({(shape, k): run(shape, k) for shape in inputs for k in kernels}, repeats=repeats,
                        device=device)

    def best(shape) -> str:
        kernel = min(kernels, key=lambda k: times[shape, k])
        return kernel if times[shape, kernel] < times[shape, "sdpa"] * (1 - KERNEL_MARGIN) else "sdpa"

    return AttentionKernels(ATTENTION_QUERIES, keys,
                            tuple(tuple(best((q, kv)) for kv in keys) for q in ATTENTION_QUERIES))


def chosen_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention entry, by the kernel this thread's `AttentionKernels` chose for the pass's
    queries and cache entries.

    query `[b, heads, q, d]`, key and value `[b, kv_heads, kv, d]`, a bool
    mask `[b or 1, 1, q, kv]` or None; returns `[b, q, heads, d]`, as
    transformers' function does. Anything the others do not compute alike
    (a causal pass with no mask, a mask of another kind, dropout, options
    that change the scores, another device) goes to transformers' function.
    """
    choice = getattr(_state, "attention", NO_ATTENTION_CHANGE)
    b, heads, q, d = query.shape
    kernel = "sdpa"
    if choice and query.device.type == "cpu" and not dropout and heads % key.shape[1] == 0:
        if (attention_mask is None and q == 1) or (attention_mask is not None and attention_mask.dtype == torch.bool
                                                   and attention_mask.dim() == 4 and attention_mask.shape[1] == 1):
            if not any(kwargs.get(option) is not None for option in CHANGED_ATTENTION):
                kernel = choice(q, key.shape[2])
    if kernel == "sdpa":
        return _attention_original(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                   is_causal=is_causal, **kwargs)
    mask = None if attention_mask is None else attention_mask[:, :, :, : key.shape[2]]
    scale = d**-0.5 if scaling is None else scaling
    out = ATTENTION_FUNCTIONS[kernel](query, key, value, mask, scale)  # [b, heads, q, d]
    return out.transpose(1, 2).contiguous(), None  # [b, q, heads, d]


@contextlib.contextmanager
def cpu_kernels(*, attention: AttentionKernels | None = None, linear: LinearKernels | None = None):
    """Within: this thread's passes use the attention (`attention`) and linear kernels (`linear`) chosen;
    None keeps the enclosing choice. Nests; restores the thread's choice and, when the last thread leaves,
    the original functions. Choosing nothing swaps nothing."""
    global _inside, _attention_before, _attention_original, _aten_threads
    # Imported here: transformers' modeling_utils loads its quantization back ends (and their warnings) on import.
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    saved = (getattr(_state, "attention", NO_ATTENTION_CHANGE), getattr(_state, "linear", NO_CHANGE))
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
            ALL_ATTENTION_FUNCTIONS["sdpa"] = chosen_attention
            torch.nn.functional.linear = chosen_linear
        _inside += 1
        aten = "aten" in chosen[1].kernels
        _aten_threads += aten
    _state.attention, _state.linear = chosen
    try:
        yield
    finally:
        _state.attention, _state.linear = saved
        with _lock:
            _inside -= 1
            _aten_threads -= aten
            if _inside == 0:
                torch.nn.functional.linear = _linear
                had, entry = _attention_before
                if had:
                    ALL_ATTENTION_FUNCTIONS["sdpa"] = entry
                else:
                    del ALL_ATTENTION_FUNCTIONS["sdpa"]
