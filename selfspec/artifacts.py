"""Files trained or counted for one model: tensors in safetensors, a JSON manifest beside them.

An exit head (`head.py`) and a draft vocabulary (`vocab.py`) are each saved as
`NAME.safetensors` plus `NAME.json`. The manifest names the kind of artifact,
the tensor file, the model it belongs to and the artifact's own settings; a
plan refers to the manifest.

Model identity is what the manifest records and `load_artifact` checks: the
`model_type`, layer count, hidden size and vocabulary size, and a fingerprint
of the token embeddings (the first rows rounded to bfloat16, so the same
weights loaded in float32 or bfloat16 match). An artifact made for another
model is refused with an error that names both.

This module does not know what the tensors mean.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from .adapter import ModelParts, text_config

ARTIFACT_FORMAT = "selfspec.artifact/1"
FINGERPRINT_ROWS = 64


def model_identity(model, parts: ModelParts) -> dict[str, Any]:
    """What identifies the weights an artifact was made for."""
    config = text_config(model.config)
    rows = parts.embed.weight[:FINGERPRINT_ROWS].detach().to("cpu", torch.bfloat16).contiguous()
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
    manifest_path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(tensor_path))
    manifest = {"format": ARTIFACT_FORMAT, "kind": kind, "tensors": tensor_path.name, "model": model_id, **settings}
    manifest_path.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return manifest_path


def load_artifact(path: str | os.PathLike, *, kind: str, model_id: dict[str, Any] | None = None) -> Artifact:
    """Read an artifact's manifest and tensors; refuse another kind, or another model when `model_id` is given."""
    manifest_path = Path(path)
    if manifest_path.suffix == ".safetensors":
        manifest_path = manifest_path.with_suffix(".json")
    if not manifest_path.is_file():
        raise FileNotFoundError(f"{kind} manifest not found: {manifest_path}")
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
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
    tensors = load_file(str(manifest_path.parent / manifest["tensors"]))
    return Artifact(kind, manifest, tensors, manifest_path)
