"""`selfspec export-head MODEL HEAD --out DIR`: a feature head as an EAGLE-3 checkpoint for vLLM and SGLang.

    selfspec train-head smollm2-135m-instruct --feature --layout eagle3 --out heads/f
    selfspec export-head smollm2-135m-instruct heads/f.json --out eagle3-smollm2

The head must be of layout "eagle3" (`selfspec.eagle3`); the draft vocabulary
is the one it was trained over (its manifest names it) unless `--vocab` says
otherwise. What is written and which engine versions it follows:
`selfspec.training.eagle3_export`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from . import common

HELP = "write a feature head (layout eagle3) as an EAGLE-3 draft checkpoint that vLLM and SGLang load"
DTYPES = ("float32", "bfloat16", "float16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", type=common.text, help="the head's model: a known name or a local model folder")
    parser.add_argument("head", type=common.text, help="the feature head's manifest (HEAD.json)")
    parser.add_argument("--out", required=True, type=common.text, help="the folder to write")
    parser.add_argument("--vocab", type=common.text, default=None,
                        help="a draft vocabulary manifest (default: the one the head was trained over, else the "
                             "whole vocabulary)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="the weights' dtype (default: float32)")
    common.add_runtime_arguments(parser, dtype=None)  # how the model loads (in float32)


def trained_vocab(head_path: Path) -> Path | None:
    """The draft vocabulary a head's manifest says it was trained over, when that file is beside it."""
    try:
        settings = json.loads(head_path.read_text())
    except (OSError, ValueError):
        return None
    name = ((settings.get("training") or {}).get("draft_vocab") or {}).get("file")
    return head_path.parent / name if name and (head_path.parent / name).exists() else None


def run(args: argparse.Namespace) -> int:
    import torch

    from ..feature_head import artifact_kind, load_feature_head
    from ..training.eagle3_export import FOLLOWS, export_eagle3
    from ..vocab import load_vocab

    head_path = Path(args.head)
    if artifact_kind(head_path) != "feature_head":
        raise ValueError(f"{head_path} is not a feature head's manifest (kind 'feature_head')")
    model, _, parts = common.load_float32(args)
    head = load_feature_head(head_path, model=model, parts=parts)
    vocab_path = Path(args.vocab) if args.vocab else trained_vocab(head_path)
    ids = None if vocab_path is None else load_vocab(vocab_path, 0, model=model, parts=parts).ids
    folder = export_eagle3(head, parts, model.config, args.out, vocab_ids=ids, dtype=getattr(torch, args.dtype),
                           note={"head": head_path.name, "model": args.model,
                                 "draft_vocab": vocab_path.name if vocab_path else None})
    size = "all" if ids is None else str(int(ids.numel()))
    print(f"EAGLE-3 checkpoint: {folder} ({size} draft tokens, reads as layer ids "
          f"{[r + 1 for r in head.reads]}); follows {FOLLOWS}")
    return 0
