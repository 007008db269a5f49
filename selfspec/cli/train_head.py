"""`selfspec train-head MODEL --exit-layer E --out OUT`: train an exit head by self-distillation.

    selfspec train-head smollm2-135m-instruct --exit-layer 8 --data prompts.jsonl --out heads/smollm2-e8

The text is the model's own greedy answers to a prompt set (`--data`, read as
`selfspec tune` reads it; default: the built-in chat prompts), plus any text
file (`--text`); see `common.add_text_arguments`. It writes the head
(`OUT.safetensors` + `OUT.json`), a plan that uses it (`OUT.plan.json`), the
training curve (`OUT.curve.png` with matplotlib) and, unless `--no-vocab`, a
draft vocabulary counted on the same answers (`OUT-vocab.*`). Every argument
is checked against the model before any work. This module parses and prints;
the work is in `selfspec.training`, `selfspec.head` and `selfspec.vocab`.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from . import common
from ..plan import MAX_DRAFT_LENGTH

HELP = "train an exit head by self-distillation; writes the head, a plan and a draft vocabulary"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_text_arguments(parser)
    parser.add_argument("--exit-layer", type=common.integer(1), required=True, metavar="E",
                        help="the draft exits after layer E-1 (valid: 1..layers-1)")
    parser.add_argument("--source-layer", type=common.integer(0), default=None,
                        help="layer the head is copied from (default: last)")
    parser.add_argument("--epochs", type=common.number(0, open_low=True), default=2.0)
    parser.add_argument("--minutes", type=common.number(0, open_low=True), default=25.0,
                        help="training time budget (default: 25)")
    parser.add_argument("--lr", type=common.number(0, open_low=True), default=3e-4)
    parser.add_argument("--eval-fraction", type=common.number(0, 1, open_low=True, open_high=True), default=0.1,
                        help="sequences held out for agreement")
    parser.add_argument("--draft-length", type=common.integer(1, MAX_DRAFT_LENGTH), default=4,
                        help="k of the plan written beside the head")
    parser.add_argument("--no-vocab", action="store_true", help="do not count a draft vocabulary")


def check_against_model(args: argparse.Namespace, num_layers: int) -> None:
    """The layer options against the model's layer count (the rest were checked as they were parsed)."""
    for flag, value, low in (("--exit-layer", args.exit_layer, 1), ("--source-layer", args.source_layer, 0)):
        if value is not None and not low <= value <= num_layers - 1:
            raise ValueError(f"argument {flag}: {value} out of range for {args.model} "
                             f"({num_layers} layers; valid: {low}..{num_layers - 1})")


def run(args: argparse.Namespace) -> int:
    import torch
    from tqdm.auto import tqdm

    from ..head import ExitHead, save_head
    from ..plan import DraftPlan
    from ..training import agreement, features, plot, train
    from ..vocab import count_tokens, save_vocab

    began = time.perf_counter()
    inputs = common.read_text_inputs(args)
    model, tokenizer, parts = common.load_float32(args)
    check_against_model(args, parts.num_layers)
    text = common.training_text(args, inputs, model, tokenizer, parts)
    sequences, answers, source = text.sequences, text.answers, text.source
    if len(sequences) < 2:
        raise ValueError(f"{len(sequences)} training sequence from {source} (valid: at least 2, one to train on "
                         f"and one held out); give more prompts (--prompts, --data) or --text")
    generated = time.perf_counter() - began
    data = [features(parts, s, args.exit_layer)
            for s in tqdm(sequences, desc="target features", unit="seq", file=sys.stderr)]
    split = max(1, int(len(data) * args.eval_fraction))
    eval_data, train_data = data[:split], data[split:]
    head = ExitHead.from_model(parts, exit_layer=args.exit_layer, source_layer=args.source_layer)
    head.requires_grad_(True).train()
    print(f"selfspec train-head: {len(train_data)} training sequences ({sum(len(f.exit_states) for f in train_data)} "
          f"tokens), {len(eval_data)} held out; text in {generated:.0f} s", file=sys.stderr)
    with tqdm(total=int(args.epochs * len(train_data)), desc="training", unit="seq", file=sys.stderr) as bar:
        def step(loss: float) -> None:
            bar.update()
            bar.set_postfix(loss=f"{loss:.3f}")

        log = train(head, parts, train_data, eval_data, epochs=args.epochs,
                    minutes=args.minutes, lr=args.lr, seed=args.seed, progress=step)
    head.eval().requires_grad_(False)

    out = Path(args.out)
    command = shlex.join(["selfspec", "train-head", *sys.argv[2:]]) if sys.argv[1:2] == ["train-head"] else ""
    training = {"source": source, "command": command, "epochs": args.epochs, "lr": args.lr,
                "seconds": round(time.perf_counter() - began), **log.as_dict()}
    del training["steps"], training["losses"]
    training["final_loss"] = sum(log.losses[-20:]) / max(1, len(log.losses[-20:]))
    manifest = save_head(out, head, model=model, parts=parts, training=training)
    vocab = None
    if not args.no_vocab:
        counts = count_tokens(answers, parts.lm_head.weight.shape[0])
        vocab = save_vocab(out.parent / f"{out.name}-vocab", counts, model=model, parts=parts, source=source)
    plan = DraftPlan(exit_layer=args.exit_layer, head=manifest.name, draft_length=args.draft_length,
                     name=f"exit {args.exit_layer} + trained head")
    plan_path = out.parent / f"{out.name}.plan.json"
    plan.save(plan_path)
    curve = out.parent / f"{out.name}.curve.png"
    has_curve = plot(log, curve)
    with torch.no_grad():
        final = log.eval_agreement[-1] if log.eval_agreement else agreement(head, parts, eval_data)
    print(json.dumps({k: training[k] for k in ("seconds", "tokens", "exit_agreement", "final_loss")}))
    print(f"held-out top-1 agreement with the target: {final:.1%} with the head, "
          f"{log.exit_agreement:.1%} for the same exit without it")
    print(f"head: {manifest}; plan: {plan_path}" + (f"; vocabulary: {vocab}" if vocab else "")
          + (f"; curve: {curve}" if has_curve else ""))
    return 0
