"""A feature head: one decoder layer that drafts from the target's own hidden states (EAGLE-3's idea).

The head fuses the target's states after a few layers (`reads`: a low, a
middle and a high one by default) into one state f (`fuse`), takes it with
the next token's embedding through one decoder layer, and the target's
final norm and LM head (or a draft vocabulary) score it. Later draft steps
take the head's own output: a drafted token costs one layer and the LM head.

Two layouts. "joined" (any family): `join` maps f and the embedding, each
RMS-normalised (a deep state is hundreds of times an embedding's scale),
into a copy of one of the target's layers. "eagle3" (Llama-structured
families): EAGLE-3's layer (`eagle3.py`) on the raw f, exported to vLLM and
SGLang by `selfspec export-head`.

Position p's input is (f at p - 1, token p), f at -1 zero; layer N of
the one cache. Only its first draft step reads the target's state, so
after a verify pass the passes rewrite its entries for the kept tokens from
the target's states (`passes.py`).

Saved as an artifact (kind `feature_head`). Not here: training
(`training/feature_distill.py`), when it drafts.
"""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.nn import functional as F

from .artifacts import load_artifact, model_identity, save_artifact
from .eagle3 import Eagle3Layer
from .offload import resident_copy
from .head import check_head_header
from .parts import ModelParts
from .quant import dense_copy

KIND = "feature_head"
TOKEN_SHARE = 0.1  # a new head's join: the token's normalised embedding, at this fraction of f's size
INPUTS = "rms-normed"  # how `fuse` and `join` see their inputs; a head saved without it was trained otherwise
LAYOUTS = ("joined", "eagle3")


def _normed(x: torch.Tensor) -> torch.Tensor:
    """`x` `[.., hidden]` scaled to unit root-mean-square over its last dimension (computed in float32)."""
    return F.rms_norm(x.float(), (x.shape[-1],), eps=1e-6).to(x.dtype)


def default_reads(num_layers: int) -> tuple[int, ...]:
    """A low, a middle and a high layer whose output the head reads (fewer for a model of under 3 layers)."""
    picks = (min(2, num_layers - 1), num_layers // 2, max(0, num_layers - 3))
    return tuple(sorted(set(picks)))


class FeatureHead(nn.Module):
    """fuse `[.., len(reads) * hidden] -> [.., hidden]`, then `layer`: joined, after join `[.., 2 * hidden] ->
    [.., hidden]`; eagle3, on the embedding and f side by side `[.., 2 * hidden]`."""

    exit_layer = None  # it runs none of the target's layers when drafting

    def __init__(self, layer: nn.Module, *, reads: tuple[int, ...], source_layer: int, slot: int, hidden: int,
                 layout: str = "joined") -> None:
        super().__init__()
        if layout not in LAYOUTS:
            raise ValueError(f"layout={layout!r} is not a feature-head layout (valid: {', '.join(LAYOUTS)})")
        self.layer = layer
        self.reads = tuple(reads)
        self.source_layer = source_layer
        self.slot = slot
        self.layout = layout
        self.fuse = nn.Linear(len(self.reads) * hidden, hidden, bias=False)
        self.join = nn.Linear(2 * hidden, hidden, bias=False) if layout == "joined" else None
        for module in layer.modules():  # its attention reads and writes the cache's slot N
            if hasattr(module, "layer_idx"):
                module.layer_idx = slot

    @classmethod
    def from_model(cls, parts: ModelParts, *, reads: tuple[int, ...] | None = None,
                   source_layer: int | None = None, scale: float = 1.0, layout: str = "joined") -> "FeatureHead":
        """A new head: its layer a copy of `source_layer` (default: the last), fuse taking the highest read state.
        Joined: join adds a tenth of the token's embedding to it, times `scale` (training passes the read states'
        typical root-mean-square, so the copied layer starts on inputs of the size it was made for). EAGLE-3:
        the attention sees the token at a tenth of f's weight (`eagle3.Eagle3Layer`); f keeps its own size."""
        n = parts.num_layers
        reads = default_reads(n) if reads is None else tuple(reads)
        if not reads or any(not isinstance(i, int) or not 0 <= i < n for i in reads) or list(reads) != sorted(set(reads)):
            raise ValueError(f"reads={list(reads)} must be increasing layer indices in 0..{n - 1}")
        source = n - 1 if source_layer is None else source_layer
        if not 0 <= source < n:
            raise ValueError(f"source_layer={source} out of range (valid: 0..{n - 1})")
        hidden = parts.embed.weight.shape[1]
        layer = resident_copy(dense_copy(parts.layers[source], dtype=parts.dtype), parts.embed.weight.device)
        if layout == "eagle3":
            layer = Eagle3Layer(layer, token_share=TOKEN_SHARE)
        head = cls(layer, reads=reads, source_layer=source, slot=n, hidden=hidden, layout=layout)
        with torch.no_grad():
            eye = torch.eye(hidden)
            head.fuse.weight.zero_()
            head.fuse.weight[:, -hidden:] = eye
            if head.join is not None:
                head.join.weight.copy_(scale * torch.cat([TOKEN_SHARE * eye, eye], dim=1))
        return head.to(device=parts.embed.weight.device, dtype=parts.dtype)

    def fused(self, states: list[torch.Tensor]) -> torch.Tensor:
        """f `[.., hidden]` from the target's states after each read layer, each `[.., hidden]`."""
        if self.join is None:  # EAGLE-3 fuses the raw states
            return self.fuse(torch.cat(states, dim=-1))
        return self.fuse(torch.cat([_normed(s) for s in states], dim=-1))

    def inputs(self, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """The layer's input: token embeddings `[.., hidden]` joined with the preceding states `[.., hidden]`
        (`[.., hidden]`), or, EAGLE-3, beside them (`[.., 2 * hidden]`)."""
        if self.join is None:
            return torch.cat([embeds, features], dim=-1)
        return self.join(torch.cat([_normed(embeds), _normed(features)], dim=-1))

    def shape(self) -> dict:
        return {"layer_class": type(self.layer).__name__, "layout": self.layout,
                "parameters": sum(p.numel() for p in self.parameters())}


def save_feature_head(path: str | os.PathLike, head: FeatureHead, *, model, parts: ModelParts,
                      training: dict) -> os.PathLike:
    """Save `head` (float32 weights) and its manifest; returns the manifest path."""
    return save_artifact(
        path, kind=KIND, model_id=model_identity(model, parts),
        settings={"reads": list(head.reads), "source_layer": head.source_layer, "inputs": INPUTS,
                  "layout": head.layout,
                  "shape": head.shape(), "training": training},
        tensors={k: v.float() for k, v in head.state_dict().items()},
    )


def check_feature_manifest(manifest: dict, num_layers: int) -> None:
    """`reads`: increasing layer indices in 0..N-1; `source_layer` in 0..N-1; inputs normalised as this version's."""
    if manifest.get("inputs") != INPUTS:
        raise ValueError(f"inputs={manifest.get('inputs')!r}: this feature head was trained by an older selfspec, "
                         f"whose head read unnormalised states (this one needs {INPUTS!r}); train it again")
    reads = manifest.get("reads")
    if (not isinstance(reads, list) or not reads or reads != sorted(set(reads))
            or any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < num_layers for i in reads)):
        raise ValueError(f"reads={reads!r} out of range for this model of {num_layers} layers "
                         f"(valid: increasing integers in 0..{num_layers - 1})")
    if manifest.get("layout", "joined") not in LAYOUTS:
        raise ValueError(f"layout={manifest.get('layout')!r} is not a feature-head layout "
                         f"(valid: {', '.join(LAYOUTS)})")
    source = manifest.get("source_layer")
    if not isinstance(source, int) or isinstance(source, bool) or not 0 <= source < num_layers:
        raise ValueError(f"source_layer={source!r} out of range (valid: an integer in 0..{num_layers - 1})")


def load_feature_head(path: str | os.PathLike, *, model, parts: ModelParts) -> FeatureHead:
    """A saved feature head, in the model's dtype and on its device; refused if made for another model."""
    built: list[FeatureHead] = []

    def check_tensors(manifest: dict, header: dict) -> None:
        built.append(FeatureHead.from_model(parts, reads=tuple(manifest["reads"]),
                                            source_layer=manifest["source_layer"],
                                            layout=manifest.get("layout", "joined")))
        check_head_header(header, built[0])

    artifact = load_artifact(path, kind=KIND, model_id=model_identity(model, parts),
                             check_manifest=lambda manifest: check_feature_manifest(manifest, parts.num_layers),
                             check_tensors=check_tensors)
    head = built[0]
    head.load_state_dict(artifact.tensors)
    head.to(device=parts.lm_head.weight.device, dtype=parts.lm_head.weight.dtype)
    return head.eval().requires_grad_(False)


def artifact_kind(path: str | os.PathLike) -> str | None:
    """The `kind` a head manifest names ("exit_head" or "feature_head"), or None when unreadable."""
    import json

    try:
        with open(path) as f:
            return json.load(f).get("kind")
    except (OSError, ValueError, AttributeError):
        return None
