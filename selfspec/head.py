"""A trained exit head: one decoder layer that turns the state after layer E into a draft.

An early-exit draft runs layers 0..E-1, then the head, then the model's own
final norm and LM head (shared, frozen). The head is a copy of one of the
model's decoder layers (by default the last), trained by `training/distill.py`
to match the target's next-token distribution. It is layer N (the model's
layer count) of the one shared cache, so its entries are cropped with the
target's; the engine keeps them for every verified token
(`TargetPasses.fill_head`).

Saved as an artifact (`artifacts.py`): float32 weights and a manifest (model
identity, exit layer, source layer, shape); a head made for another model is
refused. Beside a quantized target the head is a float copy (`quant.py`).

This module does not train the head and does not decide when it runs.
"""

from __future__ import annotations

import os

from torch import nn

from .parts import ModelParts
from .offload import resident_copy
from .quant import dense_copy
from .artifacts import load_artifact, model_identity, save_artifact

KIND = "exit_head"


class ExitHead(nn.Module):
    """One decoder layer run after layer `exit_layer - 1`; its cache slot is `slot` (= the model's layer count)."""

    def __init__(self, layer: nn.Module, *, exit_layer: int, source_layer: int, slot: int) -> None:
        super().__init__()
        self.layer = layer
        self.exit_layer = exit_layer
        self.source_layer = source_layer
        self.slot = slot
        for module in layer.modules():  # the head's attention reads and writes its own cache slot
            if hasattr(module, "layer_idx"):
                module.layer_idx = slot

    @classmethod
    def from_model(cls, parts: ModelParts, *, exit_layer: int, source_layer: int | None = None) -> "ExitHead":
        """A new head initialised as a copy of layer `source_layer` (default: the last layer)."""
        n = parts.num_layers
        if not 1 <= exit_layer < n:
            raise ValueError(f"exit_layer={exit_layer} out of range for a head (valid: 1..{n - 1})")
        source = n - 1 if source_layer is None else source_layer
        if not 0 <= source < n:
            raise ValueError(f"source_layer={source} out of range (valid: 0..{n - 1})")
        layer = dense_copy(parts.layers[source], dtype=parts.dtype)  # a plain deepcopy for a float model
        layer = resident_copy(layer, parts.embed.weight.device)  # without accelerate's hooks, if offloaded
        return cls(layer, exit_layer=exit_layer, source_layer=source, slot=n)

    def shape(self) -> dict:
        return {
            "layer_class": type(self.layer).__name__,
            "parameters": sum(p.numel() for p in self.layer.parameters()),
        }


def save_head(path: str | os.PathLike, head: ExitHead, *, model, parts: ModelParts, training: dict) -> os.PathLike:
    """Save `head` (float32 weights) and its manifest; returns the manifest path."""
    return save_artifact(
        path,
        kind=KIND,
        model_id=model_identity(model, parts),
        settings={"exit_layer": head.exit_layer, "source_layer": head.source_layer, "shape": head.shape(),
                  "training": training},
        tensors={k: v.float() for k, v in head.layer.state_dict().items()},
    )


FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


def check_head_manifest(manifest: dict, num_layers: int) -> None:
    """`exit_layer` in 1..N-1 and `source_layer` in 0..N-1, integers both."""
    for key, low, high in (("exit_layer", 1, num_layers - 1), ("source_layer", 0, num_layers - 1)):
        if key not in manifest:
            raise ValueError(f"the manifest has no {key!r} (valid: an integer in {low}..{high})")
        value = manifest[key]
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise ValueError(f"{key}={value!r} out of range for this model of {num_layers} layers "
                             f"(valid: an integer in {low}..{high})")


def check_head_header(header: dict, layer: nn.Module) -> None:
    """The tensor file holds exactly the layer's weights, each a float tensor of the layer's shape."""
    expected = {name: tuple(t.shape) for name, t in layer.state_dict().items()}
    missing, unexpected = sorted(set(expected) - set(header)), sorted(set(header) - set(expected))
    if missing or unexpected:
        raise ValueError(f"head weights do not fit this model's layer (missing {missing}, unexpected {unexpected})")
    for name, (dtype, shape) in header.items():
        if dtype not in FLOAT_DTYPES or shape != expected[name]:
            raise ValueError(f"head tensor {name!r} is {dtype} of shape {list(shape)} "
                             f"(valid: a float tensor of shape {list(expected[name])})")


def load_head(path: str | os.PathLike, *, model, parts: ModelParts) -> ExitHead:
    """A saved head, in the model's dtype and on its device; refused if made for another model."""
    built: list[ExitHead] = []

    def check_tensors(manifest: dict, header: dict) -> None:
        # The head is built first (a float layer even beside a quantized target), then its file checked against it.
        built.append(ExitHead.from_model(parts, exit_layer=manifest["exit_layer"],
                                         source_layer=manifest["source_layer"]))
        check_head_header(header, built[0].layer)

    artifact = load_artifact(
        path, kind=KIND, model_id=model_identity(model, parts),
        check_manifest=lambda manifest: check_head_manifest(manifest, parts.num_layers),
        check_tensors=check_tensors,
    )
    head = built[0]
    missing, unexpected = head.layer.load_state_dict(artifact.tensors, strict=False)
    if missing or unexpected:
        raise ValueError(f"{artifact.path}: head weights do not fit this model's layer "
                         f"(missing {sorted(missing)}, unexpected {sorted(unexpected)})")
    weight = parts.lm_head.weight
    head.to(device=weight.device, dtype=weight.dtype)
    head.eval().requires_grad_(False)
    return head
