"""Kernel choices for passes on the CPU: the attention kernel and each linear layer's kernel, where this
machine runs them faster, measured on the model's own shapes.

`AttentionKernels` picks, by queries and cache entries, among sdpa as transformers calls it, `packed` (grouped
query heads folded into the query length) and `float32` (three plain operations). `LinearKernels` picks, by GEMM
rows, among `F.linear`, (W x^T)^T, oneDNN's matmul, `aten` (F.linear with oneDNN off) and, where asked for,
`packed` (oneDNN on a blocked copy of the weight, `PackedWeights`: the weights' bytes again).

A choice holds in the thread inside `cpu_kernels(...)`, for selfspec's own calls: layers selfspec computes use
`linear_function()` and `attention_function()`; transformers' modules run under `chosen_kernels(hidden)`, a
per-thread torch function mode. No function is swapped. One process-wide switch remains: `aten` turns oneDNN
off for its call, under a lock other selfspec calls take; another caller's GEMM may then run torch's own.

All compute the same sums in another order. This module does not know plans, caches or when a pass pays.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import threading
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .costs import fastest

_linear = torch.nn.functional.linear  # torch's F.linear: what "linear" runs
_sdpa = torch.nn.functional.scaled_dot_product_attention  # torch's sdpa

# GEMM row counts timed by `measure_linear_kernels`; a count in between takes the choice of the one below, and a
# count beyond the last (a long prefill) the last one's.
LINEAR_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256)
# Another kernel must beat transformers' `F.linear` by this fraction to be kept (timing noise).
KERNEL_MARGIN = 0.05
# What a linear layer may run as: transformers' F.linear (the BLAS's x W^T), (W x^T)^T, oneDNN's matmul,
# F.linear with oneDNN switched off (torch's own GEMM where torch would hand a 16-bit one to oneDNN), or oneDNN on
# a packed copy of the weight (only where the copies were made: `PackedWeights`).
LINEAR_KERNELS = ("linear", "transposed", "onednn", "aten", "packed")
COPYLESS_KERNELS = LINEAR_KERNELS[:4]  # the kernels that run on the weight as it is
# Attention options that change what is computed (a score cap, a position bias, attention sinks): a pass with
# any of them goes to transformers' own function.
CHANGED_ATTENTION = ("softcap", "position_bias", "s_aux", "sinks")


@dataclass(frozen=True)
class LinearKernels:
    """Which kernel the linear layers run for a GEMM of m rows: `kernels[i]` for m in [rows[i], rows[i + 1]),
    the last one's beyond; "linear" (transformers' `F.linear`) where nothing was measured.

    Where "packed" is chosen, `unpacked[i]` is the fastest kernel that runs on the weight as it is: what a weight
    with no packed copy in `packed` (a streamed layer, a head's, a weight changed since) runs instead.
    """

    rows: tuple[int, ...] = ()
    kernels: tuple[str, ...] = ()
    unpacked: tuple[str, ...] = ()  # () where no row count runs "packed"
    packed: "PackedWeights | None" = field(default=None, repr=False, compare=False)  # the copies "packed" reads
    # The kernel for m = 0 .. rows[-1], looked up on every linear call of a pass (no search there).
    by_rows: tuple[str, ...] = field(init=False, repr=False, compare=False)
    unpacked_by_rows: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if ("packed" in self.kernels) != bool(self.unpacked) or (self.unpacked and len(self.unpacked) != len(self.rows)):
            raise ValueError(f"a choice that runs 'packed' names the unpacked kernel for each row count: {self}")
        for name, kernels in (("by_rows", self.kernels), ("unpacked_by_rows", self.unpacked or self.kernels)):
            by_rows = []
            for m in range(self.rows[-1] + 1 if self.rows else 0):
                i = bisect.bisect_right(self.rows, m) - 1
                by_rows.append(kernels[i] if i >= 0 else "linear")
            object.__setattr__(self, name, tuple(by_rows))

    def __call__(self, m: int) -> str:
        return _by_rows(self.by_rows, m)

    def without_copy(self, m: int) -> str:
        """The kernel for m rows on a weight with no packed copy."""
        return _by_rows(self.unpacked_by_rows, m)

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
        data = {"rows": list(self.rows), "kernels": list(self.kernels)}
        return {**data, "unpacked": list(self.unpacked)} if self.unpacked else data

    @classmethod
    def from_dict(cls, data: dict) -> "LinearKernels":
        rows, kernels = tuple(int(m) for m in data["rows"]), tuple(str(k) for k in data["kernels"])
        unpacked = tuple(str(k) for k in data.get("unpacked", ()))
        if (len(rows) != len(kernels) or list(rows) != sorted(set(rows)) or not set(kernels) <= set(LINEAR_KERNELS)
                or not set(unpacked) <= set(COPYLESS_KERNELS)):
            raise ValueError(f"not a choice of linear kernels: {data}")
        return cls(rows, kernels, unpacked)


def _by_rows(by_rows: tuple[str, ...], m: int) -> str:
    """The kernel for m rows in a table by row count: the last one's beyond it, F.linear where it is empty."""
    return by_rows[m] if m < len(by_rows) else (by_rows[-1] if by_rows else "linear")


NO_CHANGE = LinearKernels()
KERNEL_NAMES = {"linear": "F.linear", "transposed": "(W x^T)^T", "onednn": "oneDNN", "aten": "F.linear, oneDNN off",
                "packed": "oneDNN on packed copies"}


def plain_tensor(weight) -> bool:
    """An ordinary dense float matrix (not quantized, not a tensor subclass)."""
    return (type(weight) in (torch.Tensor, nn.Parameter) and weight.dim() == 2 and weight.layout == torch.strided
            and weight.dtype.is_floating_point)


def plain_weight(module: nn.Module) -> bool:
    """A linear layer whose weight (and bias) is a `plain_tensor` held in place (not offloaded to the meta device
    between calls)."""
    return (isinstance(module, nn.Linear) and plain_tensor(module.weight)
            and all(p.device.type != "meta" for p in module.parameters()))


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
    Where the BLAS torch calls is slow on a CPU, this is the same sums in another order."""
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


class PackedWeights:
    """oneDNN's blocked copies of linear layers' weights (`torch.ops.mkldnn._reorder_linear_weight`), made once,
    by weight: what the "packed" kernel multiplies by, so that oneDNN does not reorder the weight at every call.
    A copy holds the weight's bytes again (`nbytes`). A weight changed in place or given other data since it was
    packed (a streamed layer's slot, a reloaded weight) has no copy any more: the unpacked kernel runs it."""

    def __init__(self, modules) -> None:
        # id -> (weight, (its version, its data's address) when packed, copy)
        self._copies: dict[int, tuple[torch.Tensor, tuple[int, int], torch.Tensor]] = {}
        usable: dict[torch.dtype, bool] = {}
        for module in modules:
            if not plain_weight(module) or (module.bias is not None and module.bias.dtype != module.weight.dtype):
                continue
            weight = module.weight
            if id(weight) in self._copies:  # one weight in two modules (tied)
                continue
            if weight.dtype not in usable:
                usable[weight.dtype] = onednn_usable(weight)
            if usable[weight.dtype] and weight.is_contiguous():
                with torch.no_grad():
                    copy = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
                self._copies[id(weight)] = (weight, (weight._version, weight.data_ptr()), copy)

    def get(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The packed copy of `weight` (this very tensor, its data neither changed nor moved since), or None."""
        entry = self._copies.get(id(weight))
        if entry is None or entry[0] is not weight or entry[1] != (weight._version, weight.data_ptr()):
            return None
        return entry[2]

    def __len__(self) -> int:
        return len(self._copies)

    @property
    def nbytes(self) -> int:
        """The copies' bytes: each packed weight's size again."""
        return sum(weight.numel() * weight.element_size() for weight, _, _ in self._copies.values())


def packed_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` by oneDNN on `packed`, the weight's `PackedWeights` copy: x `[..., in]` ->
    `[..., out_features]`. Inference only (no autograd)."""
    flat = x.reshape(-1, x.shape[-1]).contiguous()  # [m, in]
    out = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")  # [m, out]
    return out.view(*x.shape[:-1], out_features)


_switch = threading.Lock()  # held while a thread has oneDNN switched off (`aten_linear`)
_lock = threading.Lock()
_aten_threads = 0  # threads inside `cpu_kernels` whose choice runs `aten_linear` somewhere (under `_lock`)


def aten_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` with oneDNN switched off for the call: where torch would hand a 16-bit GEMM
    to oneDNN, its own GEMM runs it (the same sums in another order). The switch is process-wide: it is held
    under `_switch`, which `chosen_linear` in every other thread waits on (a call from outside selfspec does not)."""
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


def measure_linear_kernels(modules: list[nn.Module], *, repeats: int = 3,
                           packed: PackedWeights | None = None) -> LinearKernels:
    """Time every plain linear layer of `modules` with each kernel that runs here at each of `LINEAR_ROWS`
    rows (interleaved, the fastest of `repeats`); the fastest is kept where it beats `F.linear` by
    `KERNEL_MARGIN`. With `packed` (copies of these layers' weights), "packed" is timed too; the choice then
    holds the copies where some row count runs them."""
    linears = [m for m in modules if plain_weight(m)]
    if not linears:
        return NO_CHANGE
    device, dtype = linears[0].weight.device, linears[0].weight.dtype
    usable = {"onednn": onednn_usable(linears[0].weight), "aten": aten_differs(linears[0].weight),
              "packed": bool(packed) and all(packed.get(layer.weight) is not None for layer in linears)}
    kernels = [k for k in LINEAR_KERNELS if usable.get(k, True)]
    generator = torch.Generator().manual_seed(0)
    inputs = {m: {n: torch.randn(m, n, generator=generator).to(device, dtype)
                  for n in {int(layer.in_features) for layer in linears}} for m in LINEAR_ROWS}

    def all_layers(m: int, kernel: str) -> callable:
        if kernel == "packed":
            return lambda: [packed_linear(inputs[m][layer.in_features], packed.get(layer.weight), layer.out_features,
                                          layer.bias) for layer in linears]
        return lambda: [KERNELS[kernel](inputs[m][layer.in_features], layer.weight, layer.bias) for layer in linears]

    with torch.no_grad():
        times = fastest({(m, k): all_layers(m, k) for m in LINEAR_ROWS for k in kernels},
                        repeats=repeats, device=device)

    def best(m: int, among: list[str]) -> str:
        kernel = min(among, key=lambda k: times[m, k])
        return kernel if times[m, kernel] < times[m, "linear"] * (1 - KERNEL_MARGIN) else "linear"

    chosen = tuple(best(m, kernels) for m in LINEAR_ROWS)
    if "packed" not in chosen:
        return LinearKernels(LINEAR_ROWS, chosen)
    unpacked = tuple(best(m, [k for k in kernels if k != "packed"]) for m in LINEAR_ROWS)
    return LinearKernels(LINEAR_ROWS, chosen, unpacked, packed)


# --------------------------------------------------------------------------- this thread's choice

_state = threading.local()  # this thread's choice: .attention (AttentionKernels), .linear (LinearKernels)


def chosen_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, by the kernel this thread's `LinearKernels` chose for x's row count (on every linear call of
    a pass: the common case, F.linear, is decided first)."""
    choice = getattr(_state, "linear", NO_CHANGE)
    rows = x.numel() // x.shape[-1] if x.dim() >= 2 and x.shape[-1] else 0
    kernel = choice(rows) if rows else "linear"
    if kernel != "linear" and (x.device.type != "cpu" or x.dtype != weight.dtype or not plain_tensor(weight)):
        kernel = "linear"  # checked only when another kernel is chosen: most calls of a pass are F.linear's
    copy = None
    if kernel == "packed":  # the weight's packed copy, where it has one and oneDNN's op can take the call
        copy = choice.packed.get(weight) if choice.packed is not None else None
        if (copy is None or (bias is not None and bias.dtype != weight.dtype)
                or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
            kernel, copy = choice.without_copy(rows), None
    if kernel == "aten":
        return aten_linear(x, weight, bias)
    if _aten_threads:  # some thread may switch oneDNN off (`aten_linear`): not in the middle of this call
        with _switch:
            return run_linear(kernel, x, weight, bias, copy)
    return run_linear(kernel, x, weight, bias, copy)


def run_linear(kernel: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               copy: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` by `kernel` ("linear", "transposed", "onednn", or "packed" on the weight's packed `copy`;
    oneDNN's op has no backward: F.linear's then)."""
    if copy is not None:
        return packed_linear(x, copy, weight.shape[0], bias)
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

    Where sdpa's kernel is slow for few queries (bfloat16 on some CPUs) this is the same sums, in float32 as the
    kernel keeps them, in another order; it holds a `[b, kv_heads, groups * q, kv]` float32 score matrix.
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

    def changes(self, q: int) -> bool:
        """Whether some pass of q queries (over any number of entries) runs another kernel."""
        if not self.queries or q > self.queries[-1] * 2 - 1:
            return False
        return any(kernel != "sdpa" for kernel in self.kernels[max(bisect.bisect_right(self.queries, q) - 1, 0)])

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
    """transformers' "sdpa" attention function, by the kernel this thread's `AttentionKernels` chose for the
    pass's queries and cache entries (what `attention_function("sdpa", ...)` gives a layer selfspec computes).

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
        return _registry()["sdpa"](module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                   is_causal=is_causal, **kwargs)
    mask = None if attention_mask is None else attention_mask[:, :, :, : key.shape[2]]
    scale = d**-0.5 if scaling is None else scaling
    out = ATTENTION_FUNCTIONS[kernel](query, key, value, mask, scale)  # [b, heads, q, d]
    return out.transpose(1, 2).contiguous(), None  # [b, q, heads, d]


def chosen_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
                dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                enable_gqa: bool = False) -> torch.Tensor:
    """torch's `scaled_dot_product_attention`, by the kernel this thread's `AttentionKernels` chose for its
    queries and entries: what transformers' modules call under `chosen_kernels`.

    query `[b, heads, q, d]`, key and value `[b, kv_heads, kv, d]` (kv_heads = heads, or sharing by
    `enable_gqa`), no mask (not causal) or a bool mask `[b or 1, 1, q or 1, kv]` -> `[b, heads, q, d]`. Anything
    else (dropout, `is_causal`, a float mask, another device) goes to torch's own function.
    """
    choice = getattr(_state, "attention", NO_ATTENTION_CHANGE)
    kernel = "sdpa"
    if (choice and query.device.type == "cpu" and not dropout_p and not is_causal and query.dim() == key.dim() == 4
            and key.shape == value.shape and key.shape[0] == query.shape[0] and key.shape[-1] == query.shape[-1]
            and query.shape[1] % key.shape[1] == 0 and (enable_gqa or query.shape[1] == key.shape[1])):
        b, _, q, _ = query.shape
        mask = attn_mask
        if mask is None or (mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[0] in (1, b)
                            and mask.shape[1] == 1 and mask.shape[2] in (1, q) and mask.shape[3] == key.shape[2]):
            kernel = choice(q, key.shape[2])
    if kernel == "sdpa":
        return _sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                     enable_gqa=enable_gqa)
    if mask is not None and mask.shape[2] != q:
        mask = mask.expand(-1, -1, q, -1)  # one row for every query
    return ATTENTION_FUNCTIONS[kernel](query, key, value, mask, query.shape[-1] ** -0.5 if scale is None else scale)


@functools.cache
def _registry():
    """transformers' attention registry, imported on first use (its module loads much of transformers)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS


def linear_function():
    """What a layer selfspec computes calls for `F.linear`: `chosen_linear` where this thread chose linear kernels,
    else torch's own (looked up once per layer call)."""
    return chosen_linear if getattr(_state, "linear", NO_CHANGE) else _linear


def attention_function(implementation: str, default):
    """What a layer selfspec computes calls for transformers' attention `implementation` (`default`: its eager
    function): `chosen_attention` for "sdpa" where this thread chose attention kernels, else transformers' own."""
    if implementation == "sdpa" and getattr(_state, "attention", NO_ATTENTION_CHANGE):
        return chosen_attention
    return _registry().get_interface(implementation, default)


def _mode_linear(input, weight, bias=None):  # F.linear's parameter names
    return chosen_linear(input, weight, bias)


class _ChosenKernels(TorchFunctionMode):
    """`F.linear` and sdpa on this thread's choice; every other torch call as it is. A torch function mode is
    pushed on the entering thread's stack alone: no other thread sees it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is _linear:
            return _mode_linear(*args, **(kwargs or {}))
        if func is _sdpa:
            return chosen_sdpa(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def chosen_kernels(hidden: torch.Tensor):
    """The context for a call of transformers' modules on `hidden` `[..., q, d]`: in this thread, their `F.linear`
    and sdpa calls run the kernels chosen (`chosen_linear`, `chosen_sdpa`); nothing is entered where the thread
    chose nothing for a pass of this shape (every torch call in the mode pays a Python call)."""
    linear = getattr(_state, "linear", NO_CHANGE)
    attention = getattr(_state, "attention", NO_ATTENTION_CHANGE)
    if not (linear or attention) or hidden.dim() < 2 or not hidden.shape[-1]:
        return contextlib.nullcontext()
    if linear(hidden.numel() // hidden.shape[-1]) == "linear" and not attention.changes(hidden.shape[-2]):
        return contextlib.nullcontext()
    return _ChosenKernels()


@contextlib.contextmanager
def cpu_kernels(*, attention: AttentionKernels | None = None, linear: LinearKernels | None = None):
    """Within: this thread's passes use the attention (`attention`) and linear kernels (`linear`) chosen;
    None keeps the enclosing choice. Nests; restores the thread's choice. Nothing another thread runs changes."""
    global _aten_threads
    saved = (getattr(_state, "attention", NO_ATTENTION_CHANGE), getattr(_state, "linear", NO_CHANGE))
    chosen = (saved[0] if attention is None else attention, saved[1] if linear is None else linear)
    aten = "aten" in chosen[1].kernels
    if aten:
        with _lock:
            _aten_threads += 1
    _state.attention, _state.linear = chosen
    try:
        yield
    finally:
        _state.attention, _state.linear = saved
        if aten:
            with _lock:
                _aten_threads -= 1
