"""Quantized weights: quantize a loaded model, recognise quantized weights, read them back as floats.

A quantized model is the target as it is: the engine runs its layers through
the modules themselves, so a weight-only quantized linear layer (torchao's
tensor subclasses, bitsandbytes' `Linear8bitLt`/`Linear4bit`) runs in the
draft and the verify pass exactly as in `model.generate`. Floats are read
here for a draft vocabulary's K LM-head rows and an artifact's model identity
(`dense_rows`), and for an exit head, a float copy of a decoder layer built
beside the quantized target (`dense_copy`).

`quantize_model` is what `selfspec.load(..., quantize=...)` applies after
loading: torchao weight-only int8 or int4 in the device's kernel layout (CPU:
`Int4OpaqueTensor`; CUDA: the tinygemm layout, bfloat16 only). A tied LM head
stays tied and in float (quantizing it alone would copy the embedding).

This module does not know plans, caches or the decode loop.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import logging
from collections.abc import Iterator

import torch
from torch import nn

from .offload import shared_weight_maps

QUANTIZE_CHOICES = ("int8", "int4")
QUANT_EXTRA = "pip install 'selfspec[quant]'"
INT4_GROUP_SIZES = (128, 64, 32)  # the CPU kernel's group sizes, the coarsest that divides in_features first
INT4_ROW_MULTIPLE = 16  # the CPU int4 packing needs out_features divisible by 16
PLAIN_TYPES = (torch.Tensor, nn.Parameter)
# What importing torchao logs on a CPU machine, once, as warnings: its CUDA-only extensions did not load, and
# torch's notice that its Enum registrations are deprecated. Noise to a CPU user; every CLI error is one line.
IMPORT_NOISE_LOGGERS = ("torchao", "torch.utils._pytree")


@contextlib.contextmanager
def quiet_torchao_import() -> Iterator[None]:
    """Within the block, the loggers above report errors only (then their levels are restored).

    transformers imports torchao, when it is installed, the first time its
    modeling code is imported; `loading.py` does that inside this block.
    """
    loggers = [logging.getLogger(name) for name in IMPORT_NOISE_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


# --------------------------------------------------------------------------- recognising quantized weights


def is_quantized(tensor: torch.Tensor | None) -> bool:
    """A weight stored in a quantized form: a tensor subclass (torchao, bitsandbytes) or integer data."""
    if tensor is None:
        return False
    return type(tensor) not in PLAIN_TYPES or not (tensor.dtype.is_floating_point or tensor.dtype.is_complex)


def quantized_modules(model: nn.Module) -> dict[str, str]:
    """`{module name: weight kind}` of every module whose weight is quantized (kind: the tensor's class name)."""
    found = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and is_quantized(weight):
            found[name] = type(weight).__name__
    return found


def describe_quantization(model: nn.Module) -> str | None:
    """'Int8Tensor x 42' style summary of the quantized weights, or None for a model without any."""
    kinds: dict[str, int] = {}
    for kind in quantized_modules(model).values():
        kinds[kind] = kinds.get(kind, 0) + 1
    if not kinds:
        return None
    return ", ".join(f"{kind} x {count}" for kind, count in sorted(kinds.items()))


def has_own_dequantize(tensor: torch.Tensor) -> bool:
    """torchao's subclasses define `dequantize()`; `torch.Tensor.dequantize` is for torch's own qint tensors."""
    method = getattr(type(tensor), "dequantize", None)
    return method is not None and method is not torch.Tensor.dequantize


# --------------------------------------------------------------------------- reading weights back as floats


def dense_rows(module: nn.Module, ids: torch.Tensor, *, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of `module.weight` `[len(ids), in]` as plain floats in `dtype` (the weight itself when plain).

    A quantized weight is dequantized by its own `dequantize()` (torchao), else
    read through the module: a linear layer's output for the unit vectors is its
    weight's columns (bitsandbytes and any other module-level quantization).
    """
    weight = module.weight
    if not is_quantized(weight):
        return weight.detach()[ids]
    if has_own_dequantize(weight):
        return weight.detach().dequantize()[ids].to(dtype)
    return probe_rows(module, ids, dtype=dtype)


@torch.no_grad()
def probe_rows(module: nn.Module, ids: torch.Tensor, *, dtype: torch.dtype, chunk: int = 64) -> torch.Tensor:
    """Rows `ids` of a linear layer's weight read through its forward pass: W[:, j] = f(e_j) - f(0)."""
    weight = module.weight
    device = ids.device
    hidden = int(getattr(module, "in_features", 0) or weight.shape[-1])
    zero = module(torch.zeros(1, hidden, dtype=dtype, device=device)).to(dtype)  # [1, out]: the bias, if any
    columns = []
    for begin in range(0, hidden, chunk):
        eye = torch.eye(hidden, dtype=dtype, device=device)[begin : begin + chunk]  # [c, hidden]
        columns.append((module(eye).to(dtype) - zero)[:, ids])  # [c, K]
    return torch.cat(columns).T.contiguous()  # [K, hidden]


def dense_copy(layer: nn.Module, *, dtype: torch.dtype) -> nn.Module:
    """A copy of `layer` whose quantized weights are plain float parameters in `dtype`.

    A weight is dequantized by its own `dequantize()` (torchao's int8), or, in
    a plain `nn.Linear` whose weight is a kernel-packed subclass (torchao's CPU
    int4), read through the layer (`probe_rows`). Refused (ValueError) where
    the quantization lives in the module class (bitsandbytes' `Linear8bitLt`,
    `Linear4bit`): a float weight would not change what such a module computes.
    """
    copied = copy.deepcopy(layer, memo=shared_weight_maps(layer))  # an offloaded layer: its hooks' weights shared
    for module_name, module in copied.named_modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if not is_quantized(param):
                continue
            if has_own_dequantize(param):
                dense = param.detach().dequantize().to(dtype)
            elif type(module) is nn.Linear and name == "weight":
                rows = torch.arange(module.out_features, device=param.device)
                dense = probe_rows(module, rows, dtype=dtype)
            else:
                where = f"{module_name}.{name}" if module_name else name
                raise ValueError(
                    f"an exit head is a float copy of a decoder layer, but {where} is a {type(param).__name__} "
                    f"in a {type(module).__name__}, which cannot be turned back into a float layer; use a head with "
                    "a torchao-quantized model (selfspec.load(..., quantize=...)) or an unquantized one"
                )
            setattr(module, name, nn.Parameter(dense, requires_grad=False))
    return copied


# --------------------------------------------------------------------------- quantizing a loaded model


def check_quantize(quantize: str | None) -> str | None:
    """`quantize` if valid ('int8', 'int4' or None); else a ValueError naming the value and the choices."""
    if quantize is None or (isinstance(quantize, str) and quantize in QUANTIZE_CHOICES):
        return quantize
    raise ValueError(f"quantize={quantize!r} is not supported (valid: 'int8', 'int4' or None)")


def require_torchao(quantize: str):
    """The torchao package, or a one-line ImportError naming it and the extra that installs it."""
    try:
        return importlib.import_module("torchao")
    except ImportError:
        raise ImportError(
            f"quantize={quantize!r} needs the torchao package, which is not installed: {QUANT_EXTRA} "
            "(or pip install torchao)"
        ) from None


def check_quantize_options(quantize: str | None, *, dtype: torch.dtype, device: torch.device) -> str | None:
    """Everything `quantize_model` needs, checked before a model loads: the value, dtype, device and torchao."""
    if check_quantize(quantize) is None:
        return None
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"quantize={quantize!r} with dtype {dtype} is not supported (valid: float32 or bfloat16)")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"quantize={quantize!r} on device {device} is not supported (valid: cpu or cuda)")
    if quantize == "int4" and device.type == "cuda" and dtype != torch.bfloat16:
        raise ValueError(f"quantize='int4' on {device} needs dtype bfloat16 (the tinygemm kernel), got {dtype}")
    require_torchao(quantize)
    return quantize


def quantize_model(model: nn.Module, quantize: str, *, dtype: torch.dtype, device: torch.device) -> str:
    """Quantize the linear layers of `model` in place, weight-only; returns a one-line description.

    int8: torchao `Int8WeightOnlyConfig` (per-row scales), any device.
    int4: torchao, group-wise; on CPU the CPU-packed layout (`PrototypeInt4WeightOnlyConfig`),
    on CUDA the tinygemm tile layout (bfloat16 only). A linear layer whose shape the int4 kernel
    cannot pack stays in float. A tied LM head stays tied (and in float).
    """
    if check_quantize_options(quantize, dtype=dtype, device=device) is None:
        raise ValueError("quantize=None: nothing to quantize (valid: 'int8' or 'int4')")
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    output = model.get_output_embeddings()
    tied = output is not None and output.weight is model.get_input_embeddings().weight

    def keep_float(module: nn.Module) -> bool:
        return tied and module is output

    if quantize == "int8":
        config = Int8WeightOnlyConfig(set_inductor_config=False)
        quantize_(model, config, filter_fn=lambda m, _name: isinstance(m, nn.Linear) and not keep_float(m))
    else:
        for group_size in INT4_GROUP_SIZES:  # one pass per group size: each layer gets the coarsest that fits
            config = int4_config(group_size, dtype=dtype, device=device)
            quantize_(model, config, filter_fn=lambda m, _name, g=group_size: int4_fits(m, g) and not keep_float(m))
    described = describe_quantization(model)
    if described is None:
        raise ValueError(f"quantize={quantize!r}: no linear layer of this model could be quantized")
    return f"torchao {quantize} weight-only ({described})"


def int4_fits(module: nn.Module, group_size: int) -> bool:
    """A float linear layer the int4 kernel packs with this group size, and no coarser one."""
    if not isinstance(module, nn.Linear) or is_quantized(module.weight):
        return False
    rows, columns = module.weight.shape
    if rows % INT4_ROW_MULTIPLE or columns % group_size:
        return False
    return group_size == max(g for g in INT4_GROUP_SIZES if columns % g == 0)


def int4_config(group_size: int, *, dtype: torch.dtype, device: torch.device):
    if device.type == "cpu":
        try:
            from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig
        except ImportError:
            version = getattr(importlib.import_module("torchao"), "__version__", "?")
            raise ImportError(f"quantize='int4' on CPU needs torchao >= 0.18 (its CPU int4 layout, "
                              f"PrototypeInt4WeightOnlyConfig); found torchao {version}: "
                              "pip install -U torchao") from None
        return PrototypeInt4WeightOnlyConfig(group_size=group_size, set_inductor_config=False)
    from torchao.quantization import Int4WeightOnlyConfig

    return Int4WeightOnlyConfig(group_size=group_size, int4_packing_format="tile_packed_to_4d",
                                set_inductor_config=False)
