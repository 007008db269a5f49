"""Files trained or counted for one model: tensors in safetensors, a JSON manifest beside them.

An exit head (`head.py`) and a draft vocabulary (`vocab.py`) are each saved as
`NAME.safetensors` plus `NAME.json`. The manifest names the kind of artifact,
the tensor file, the model it belongs to and the artifact's own settings; a
plan refers to the manifest.

Model identity is what the manifest records and `load_artifact` checks: the
`model_type`, layer count, hidden size and vocabulary size, and a fingerprint
of the token embeddings (the first rows rounded to bfloat16, so the same
weights loaded in float32 or bfloat16 match). An artifact made for another
model is refused with an error that names both, and a tensor holding NaN or
infinity is refused (saved or loaded) naming its file.

This module does not know what the tensors mean.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from .parts import ModelParts, text_config
from .quant import dense_rows

ARTIFACT_FORMAT = "selfspec.artifact/1"
FINGERPRINT_ROWS = 64


def model_identity(model, parts: ModelParts) -> dict[str, Any]:
    """What identifies the weights an artifact was made for."""
    config = text_config(model.config)
    first = torch.arange(min(FINGERPRINT_ROWS, parts.embed.weight.shape[0]), device=parts.embed.weight.device)
    rows = dense_rows(parts.embed, first, dtype=parts.dtype).detach().to("cpu", torch.bfloat16).contiguous()
    digest = hashlib.sha256(rows.view(torch.int16).numpy().tobytes()).hexdigest()[:16]
    return {
        "model_type": getattr(config, "model_type", None),
        "num_layers": parts.num_layers,
        "hidden_size": int(parts.embed.weight.shape[1]),
        "vocab_size": int(parts.lm_head.weight.shape[0]),
        "embedding_fingerprint": digest,
    }


@dataclass(frozen=True)
class Artifact:
    kind: str  # "exit_head" or "draft_vocab"
    manifest: dict[str, Any]  # settings of the artifact and "model": the identity it was made for
    tensors: dict[str, torch.Tensor]
    path: Path  # the manifest


def save_artifact(
    path: str | os.PathLike, *, kind: str, model_id: dict[str, Any], settings: dict[str, Any],
    tensors: dict[str, torch.Tensor],
) -> Path:
    """Write `PATH.safetensors` and the manifest `PATH.json` (the suffix of `path` is replaced); returns the manifest."""
    manifest_path = Path(path).with_suffix(".json")
    tensor_path = manifest_path.with_suffix(".safetensors")
    check_finite(tensors, tensor_path)
    manifest_path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(tensor_path))
    manifest = {"format": ARTIFACT_FORMAT, "kind": kind, "tensors": tensor_path.name, "model": model_id, **settings}
    manifest_path.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return manifest_path


TensorHeader = dict[str, tuple[str, tuple[int, ...]]]  # name -> (safetensors dtype, e.g. "I64", shape)


def load_artifact(
    path: str | os.PathLike,
    *,
    kind: str,
    model_id: dict[str, Any] | None = None,
    check_manifest: Callable[[dict[str, Any]], None] | None = None,
    check_tensors: Callable[[dict[str, Any], TensorHeader], None] | None = None,
) -> Artifact:
    """Read an artifact's manifest and tensors; refuse another kind, or another model when `model_id` is given.

    Everything is validated before any tensor is read: the manifest (JSON
    object, format, kind, model, and `check_manifest(manifest)`), then the
    tensor file's header (names, dtypes and shapes, `check_tensors(manifest,
    header)`), so a hostile or damaged file is refused before it can make us
    allocate anything. The checks raise ValueError; the message gets the file's name.
    """
    manifest_path = Path(path)
    if manifest_path.suffix == ".safetensors":
        manifest_path = manifest_path.with_suffix(".json")
    if not manifest_path.is_file():
        raise FileNotFoundError(f"{kind} manifest not found: {manifest_path}")
    manifest = read_manifest(manifest_path)
    if manifest.get("format") != ARTIFACT_FORMAT or manifest.get("kind") != kind:
        raise ValueError(
            f"{manifest_path} is not a {kind} file (format {manifest.get('format')!r}, kind {manifest.get('kind')!r}; "
            f"expected {ARTIFACT_FORMAT!r}, {kind!r})"
        )
    if model_id is not None and manifest.get("model") != model_id:
        raise ValueError(
            f"{manifest_path} was made for another model: it records {manifest.get('model')}, "
            f"this model is {model_id}. Make a new one for this model (selfspec train-head / selfspec count-vocab)."
        )
    name = manifest.get("tensors")
    if not isinstance(name, str) or not name or Path(name).name != name:
        raise ValueError(f"{manifest_path}: 'tensors' must name a .safetensors file beside the manifest, got {name!r}")
    tensor_path = manifest_path.parent / name
    try:
        if check_manifest is not None:
            check_manifest(manifest)
        header = read_header(tensor_path)
        if check_tensors is not None:
            check_tensors(manifest, header)
    except ValueError as error:
        raise ValueError(f"{manifest_path}: {error}") from None
    try:
        tensors = load_file(str(tensor_path))
    except Exception as error:  # safetensors raises its own error type for a damaged file
        raise ValueError(f"{tensor_path} could not be read ({error}); the file is damaged: make it again") from None
    check_finite(tensors, tensor_path)
    return Artifact(kind, manifest, tensors, manifest_path)


def check_finite(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Every float value finite: a NaN or an infinity (a damaged file, a diverged training) is refused, naming it."""
    for name, tensor in sorted(tensors.items()):
        if tensor.is_floating_point():
            bad = int((~torch.isfinite(tensor)).sum())
            if bad:
                raise ValueError(f"{path}: tensor {name!r} is not finite ({bad} of {tensor.numel()} values are NaN "
                                 f"or infinite); the file is damaged or its training diverged: make it again")


def read_manifest(path: Path) -> dict[str, Any]:
    """A manifest's JSON object; ValueError naming the file if it is not one."""
    try:
        manifest = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(manifest, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(manifest).__name__}")
    return manifest


def read_header(path: Path) -> TensorHeader:
    """The names, dtypes and shapes in a .safetensors file, read from its header alone (nothing allocated).

    A file whose size does not match its header (truncated, or bytes appended) is refused here.
    """
    if not path.is_file():
        raise ValueError(f"tensor file not found: {path}")
    size = path.stat().st_size
    try:
        length, header = header_layout(path)
        result: TensorHeader = {}
        end = 0
        for key, entry in header.items():
            if key == "__metadata__":
                continue
            dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
            if not (isinstance(dtype, str) and isinstance(shape, list) and all(_is_count(n) for n in shape)
                    and isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(n) for n in offsets)):
                raise ValueError(f"bad header entry for {key!r}")
            result[key] = (dtype, tuple(shape))
            end = max(end, offsets[1])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not a readable .safetensors file ({error}); make it again") from None
    if 8 + length + end != size:
        raise ValueError(f"{path} is truncated or damaged: its header describes {8 + length + end} bytes, "
                         f"the file has {size}; make it again")
    return result


def header_layout(path: Path) -> tuple[int, dict]:
    """A .safetensors file's header as written: its length in bytes (the data starts at 8 + length) and its JSON
    object (per tensor: dtype, shape, data_offsets). ValueError where it cannot be one."""
    size = Path(path).stat().st_size
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        if size < 8 or length > size - 8:
            raise ValueError("header longer than the file")
        header = json.loads(f.read(length).decode("utf-8"))
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    return length, header


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
