"""Offloaded layers streamed by selfspec: two slots on the execution device, the next layer loading while one computes.

accelerate loads an offloaded module's weights in a hook at every call, one
tensor at a time. A `LayerStream` does those loads for selfspec's own passes,
from where accelerate keeps the weights: the offload folder's or checkpoint's
files (read straight into place), or CPU tensors. It loads them into two
slots of one layer each. While layer i computes from one slot, the next
offloaded layer loads into the other: in a worker thread on the CPU, through
pinned buffers on a side CUDA stream on a GPU.

`LayerStream.weights_of(i)` is a context for one call of layer i. In the
calling thread, for that call only, the layer's parameters point at its slot
and its hooks stand aside, so the engine's direct layer call runs. Outside
selfspec's passes the model is accelerate's as before. As with accelerate's
hooks, another thread must not call the same model during a pass.

This module does not place layers (`offload.py`) or choose which layers a
pass runs (`runner.py`).
"""

from __future__ import annotations

import contextlib
import functools
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .artifacts import header_layout

# safetensors' dtype names (accelerate's `.dat` index names torch's own: "bfloat16", ...)
_SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
                       "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32,
                       "I64": torch.int64, "BOOL": torch.bool}


@dataclass(frozen=True)
class FileBytes:
    """A tensor's bytes in a file: `size` bytes at `offset` (accelerate's `.dat` files, or a safetensors file),
    stored as `dtype` (a checkpoint's may differ from the model's: converted after reading)."""

    path: str
    offset: int
    size: int
    dtype: torch.dtype


@dataclass(frozen=True)
class Weight:
    """One offloaded parameter: its module and name, shape and dtype, and where its values are read from."""

    module: nn.Module
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    source: FileBytes | torch.Tensor  # a file's bytes, or a tensor in CPU memory

    @property
    def nbytes(self) -> int:
        return _nbytes(self.shape, self.dtype)


def _nbytes(shape, dtype: torch.dtype) -> int:
    return int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()


def _hooks(module: nn.Module) -> list:
    """accelerate's hooks on `module` itself (a `SequentialHook` holds several)."""
    hook = module.__dict__.get("_hf_hook")
    if hook is None:
        return []
    return list(getattr(hook, "hooks", None) or [hook])


def offloaded_weights(layer: nn.Module, device: torch.device) -> list[Weight] | None:
    """Where accelerate keeps each of `layer`'s offloaded parameters; None when some cannot be read here (a
    buffer left on the meta device, a source of another kind, a hook that computes on another device than
    `device`): such a layer keeps accelerate's own loads."""
    weights = []
    for module in layer.modules():
        loading = [h for h in _hooks(module) if getattr(h, "offload", False)]
        if any(_device(h.execution_device) != device for h in loading):
            return None
        maps = [h.weights_map for h in loading if h.weights_map is not None]
        for name, parameter in module.named_parameters(recurse=False):
            if parameter.device.type != "meta":
                continue
            source = next((s for s in (_source(m, name) for m in maps) if s is not None), None)
            if source is None or not _fits(source, parameter):
                return None
            weights.append(Weight(module, name, tuple(parameter.shape), parameter.dtype, source))
        if any(b.device.type == "meta" for b in module.buffers(recurse=False)):
            return None
    return weights


def _device(where) -> torch.device:
    """accelerate's execution device (an int is a CUDA index) as a `torch.device`."""
    return torch.device("cuda", where) if isinstance(where, int) else torch.device(where)


def _fits(source: FileBytes | torch.Tensor, parameter: torch.Tensor) -> bool:
    """Whether `source` holds as many values as `parameter` (a tensor: its shape; a file: its bytes)."""
    if isinstance(source, torch.Tensor):
        return tuple(source.shape) == tuple(parameter.shape)
    return source.size == _nbytes(parameter.shape, source.dtype)


def _source(weights_map, name: str) -> FileBytes | torch.Tensor | None:
    """The file bytes or CPU tensor behind `weights_map[name]` (accelerate's `PrefixedDataset` over an
    `OffloadedWeightsLoader`), or None for a map of another kind."""
    loader, key = getattr(weights_map, "dataset", None), getattr(weights_map, "prefix", "") + name
    if isinstance(loader, dict):  # `accelerate.cpu_offload`: a state dict in CPU memory
        value = loader.get(key)
        return value if isinstance(value, torch.Tensor) and value.device.type == "cpu" else None
    if loader is None:
        return None
    state = getattr(loader, "state_dict", None) or {}
    if key in state:
        return state[key]
    info = (getattr(loader, "index", None) or {}).get(key)
    if info is None:
        return None
    if "safetensors_file" in info:
        return _safetensors_bytes(info["safetensors_file"], info.get("weight_name", key))
    path = os.path.join(loader.save_folder, f"{key}.dat")
    dtype = getattr(torch, str(info.get("dtype")), None)
    if not isinstance(dtype, torch.dtype) or not os.path.exists(path):
        return None
    size = _nbytes(info["shape"], dtype)
    return FileBytes(path, 0, size, dtype) if os.path.getsize(path) == size else None


def _safetensors_bytes(path: str, name: str) -> FileBytes | None:
    """A tensor's bytes in a safetensors file, from its header (read once per file and version)."""
    stat = os.stat(path)
    length, header = _layout(path, stat.st_mtime_ns, stat.st_size)
    entry = header.get(name) if header is not None else None
    if entry is None or entry.get("dtype") not in _SAFETENSORS_DTYPES:
        return None
    begin, end = entry["data_offsets"]
    return FileBytes(path, 8 + length + begin, end - begin, _SAFETENSORS_DTYPES[entry["dtype"]])


@functools.lru_cache(maxsize=16)
def _layout(path: str, mtime_ns: int, size: int) -> tuple[int, dict | None]:
    """`artifacts.header_layout` of one version of a file (its time and size in the key); (0, None) when it has
    no safetensors header."""
    try:
        return header_layout(Path(path))
    except (ValueError, UnicodeDecodeError):
        return 0, None


class LayerStream:
    """The offloaded layers a pass may run, streamed through two slots (see the module docstring).

    `layers`: the model's decoder layers; `device`: where they compute.
    Layers whose weights cannot be read here are left to accelerate.
    """

    SLOTS = 2

    def __init__(self, layers, device: torch.device) -> None:
        self.device = torch.device(device)
        self.weights: dict[int, list[Weight]] = {}
        self.hooked: dict[int, list[nn.Module]] = {}  # per streamed layer, its modules that carry a hook
        for i, layer in enumerate(layers):
            found = offloaded_weights(layer, self.device)
            if found:
                self.weights[i] = found
                self.hooked[i] = [m for m in layer.modules() if "_hf_hook" in m.__dict__]
        self.order = sorted(self.weights)  # the order a full pass runs them
        # Each layer's call starts loading the next in that order (the last, the first: the next pass's).
        self.following = {i: self.order[(k + 1) % len(self.order)] for k, i in enumerate(self.order)}
        self.slots: list[list[nn.Parameter] | None] = [None] * self.SLOTS  # per slot, one parameter per weight
        self.holding: list[int | None] = [None] * self.SLOTS  # the layer each slot holds (or is loading)
        self.loading: list[Future | None] = [None] * self.SLOTS
        self.last: int | None = None  # the slot the last call read
        self.bytes_read = 0  # bytes loaded since made (what streaming costs, per token, in the benchmarks)
        self.cuda = self.device.type == "cuda"
        self._worker: ThreadPoolExecutor | None = None
        self._copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._staging: list[list[torch.Tensor] | None] = [None] * self.SLOTS  # CUDA: pinned host buffers
        self._released: list = [None] * self.SLOTS  # CUDA: an event after the last call that read a slot

    def __contains__(self, layer: int) -> bool:
        return layer in self.weights

    def __bool__(self) -> bool:
        return bool(self.weights)

    def slot_bytes(self) -> int:
        """Bytes the slots take once filled: two of the largest streamed layer."""
        return self.SLOTS * max((sum(w.nbytes for w in ws) for ws in self.weights.values()), default=0)

    @contextlib.contextmanager
    def weights_of(self, layer: int):
        """Layer `layer`'s weights in place for one call (its hooks set aside); the next streamed layer loads
        into the other slot meanwhile."""
        slot = self._ready(layer)
        following = self.following[layer]
        if following not in self.holding:
            self._load(following, 1 - slot)
        saved = _swap_in(self.weights[layer], self.slots[slot], self.hooked[layer])
        try:
            yield
        finally:
            _swap_out(saved)
            self.last = slot
            if self.cuda:
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(self.device))
                self._released[slot] = event

    def _ready(self, layer: int) -> int:
        """The slot holding `layer`, loaded: a prefetched one, else loaded now into the slot not read last."""
        if layer in self.holding:
            slot = self.holding.index(layer)
        else:
            slot = 0 if self.last is None else 1 - self.last
            self._load(layer, slot)
        future = self.loading[slot]
        if future is not None:
            self.loading[slot] = None
            try:
                event = future.result()  # a worker's failure is raised here
            except BaseException:
                self.holding[slot] = None  # the slot holds no layer whole
                raise
            if event is not None:
                torch.cuda.current_stream(self.device).wait_event(event)
        return slot

    def _load(self, layer: int, slot: int) -> None:
        """Start loading `layer` into `slot` (once whatever was loading there is done)."""
        pending, self.loading[slot] = self.loading[slot], None
        self.holding[slot] = None
        if pending is not None:
            pending.result()
        weights = self.weights[layer]
        params = self.slots[slot]
        if params is None or [(p.shape, p.dtype) for p in params] != [(w.shape, w.dtype) for w in weights]:
            params = self.slots[slot] = [nn.Parameter(torch.empty(w.shape, dtype=w.dtype, device=self.device),
                                                      requires_grad=False) for w in weights]
            self._staging[slot] = None
        self.holding[slot] = layer
        self.bytes_read += sum(w.nbytes for w in weights)
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="selfspec-stream")
        self.loading[slot] = self._worker.submit(self._fill, slot, weights, params, self._released[slot])

    def _fill(self, slot: int, weights: list[Weight], params: list[nn.Parameter], released):
        """In the worker: read `weights` into `params`; on CUDA through pinned host buffers, returning the event
        after the copies."""
        with torch.no_grad():
            if not self.cuda:
                for w, p in zip(weights, params):
                    _read(w.source, p)
                return None
            if self._staging[slot] is None:
                self._staging[slot] = [torch.empty(w.shape, dtype=w.dtype, pin_memory=True) for w in weights]
            with torch.cuda.stream(self._copy_stream):
                if released is not None:  # the slot's last reader is done before it is overwritten
                    self._copy_stream.wait_event(released)
                for w, p, host in zip(weights, params, self._staging[slot]):
                    if isinstance(w.source, torch.Tensor) and w.source.is_pinned():
                        p.copy_(w.source, non_blocking=True)
                        continue
                    _read(w.source, host)
                    p.copy_(host, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self._copy_stream)
            done.synchronize()  # the pinned buffers are free before the next read into them
            return done


def _read(source: FileBytes | torch.Tensor, tensor: torch.Tensor) -> None:
    """`source`'s values into the CPU tensor `tensor`: copied from memory, or read from a file (through a buffer
    of the file's dtype where it stores another)."""
    if isinstance(source, torch.Tensor):
        tensor.copy_(source)
    elif source.dtype == tensor.dtype:
        _read_into(source, tensor)
    else:
        stored = torch.empty(tensor.shape, dtype=source.dtype)
        _read_into(source, stored)
        tensor.copy_(stored)


def _read_into(source: FileBytes, tensor: torch.Tensor) -> None:
    """`source`'s bytes into the CPU tensor `tensor` (contiguous), read by the OS straight into place."""
    view = memoryview(tensor.view(-1).view(torch.uint8).numpy())
    fd = os.open(source.path, os.O_RDONLY)
    try:
        done = 0
        while done < source.size:
            n = os.preadv(fd, [view[done:]], source.offset + done)
            if n <= 0:
                raise OSError(f"{source.path}: {source.size - done} bytes missing at offset {source.offset + done}")
            done += n
    finally:
        os.close(fd)


def _swap_in(weights: list[Weight], params: list[nn.Parameter], hooked: list[nn.Module]) -> tuple:
    """Point each weight's parameter at its slot and set the layer's hooks aside; what `_swap_out` restores."""
    parameters = [(w.module, w.name, w.module._parameters[w.name]) for w in weights]
    for w, p in zip(weights, params):
        w.module._parameters[w.name] = p
    hooks = [(m, m.__dict__.pop("_hf_hook"), m.__dict__.pop("forward", None)) for m in hooked]
    for module, _, _ in hooks:  # the forward accelerate wrapped (the class's, unless another wrapper came first)
        if "_old_forward" in module.__dict__:
            module.__dict__["forward"] = module.__dict__["_old_forward"]
    return parameters, hooks


def _swap_out(saved: tuple) -> None:
    parameters, hooks = saved
    for module, name, parameter in parameters:
        module._parameters[name] = parameter
    for module, hook, forward in hooks:
        module.__dict__["_hf_hook"] = hook
        if forward is not None:
            module.__dict__["forward"] = forward
        else:
            module.__dict__.pop("forward", None)
