"""`selfspec train-head MODEL (--feature | --exit-layer E) --out OUT`: train a head by self-distillation.

    selfspec train-head smollm2-135m-instruct --feature --data prompts.jsonl --out heads/smollm2-features
    selfspec train-head smollm2-135m-instruct --exit-layer 8 --data prompts.jsonl --out heads/smollm2-e8

`--feature` trains a feature head (`selfspec.feature_head`), unrolled over
`--unroll` draft steps; `--exit-layer E` an exit head (`selfspec.head`).
The text is the model's own greedy answers to a prompt set (`--data`, read as
`selfspec tune` reads it; default: the built-in chat prompts), plus any text
file (`--text`); see `common.add_text_arguments`. It writes the head
(`OUT.safetensors` + `OUT.json`), a plan that uses it (`OUT.plan.json`), the
training curve (`OUT.curve.png` with matplotlib) and, unless `--no-vocab`, a
draft vocabulary counted on the training answers (`OUT-vocab.*`; a feature
head learns to draft from it, and its plan uses it). Every argument is
checked against the model before any work. This module parses and prints;
the work is in `selfspec.training` and the head and vocabulary modules.
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

HELP = "train a feature or exit head by self-distillation; writes the head, a plan and a draft vocabulary"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_text_arguments(parser)
    kind = parser.add_mutually_exclusive_group(required=True)
    kind.add_argument("--feature", action="store_true",
                      help="a feature head: drafts from the target's states after --reads layers")
    kind.add_argument("--exit-layer", type=common.integer(1), metavar="E",
                      help="an exit head: the draft exits after layer E-1 (valid: 1..layers-1)")
    parser.add_argument("--reads", type=common.integer_list, default=None, metavar="I,J,K",
                        help="a feature head: the layers whose output it reads (default: a low, a middle, a high one)")
    parser.add_argument("--layout", choices=["joined", "eagle3"], default="joined",
                        help="a feature head: 'joined' (any family) or 'eagle3' (EAGLE-3's layer; Llama-structured "
                             "families; `selfspec export-head` writes it for vLLM and SGLang) (default: joined)")
    parser.add_argument("--unroll", type=common.integer(2, 8), default=4,
                        help="a feature head: draft steps trained on, the first from the target's states (default: 4)")
    parser.add_argument("--positions", type=common.integer(1), default=128,
                        help="a feature head: positions per sequence the loss scores (default: 128)")
    parser.add_argument("--source-layer", type=common.integer(0), default=None,
                        help="layer the head is copied from (default: last)")
    parser.add_argument("--epochs", type=common.number(0, open_low=True), default=2.0)
    parser.add_argument("--minutes", type=common.number(0, open_low=True), default=25.0,
                        help="training time budget (default: 25)")
    parser.add_argument("--lr", type=common.number(0, open_low=True), default=3e-4)
    parser.add_argument("--eval-fraction", type=common.number(0, 1, open_low=True, open_high=True), default=0.1,
                        help="sequences held out for agreement")
    parser.add_argument("--draft-length", type=common.integer(1, MAX_DRAFT_LENGTH), default=None,
                        help="k of the plan written beside the head (default: 8 for a feature head, behind "
                             "n-gram and recycled trees; 4 for an exit head)")
    parser.add_argument("--no-vocab", action="store_true", help="do not count a draft vocabulary")


def check_against_model(args: argparse.Namespace, num_layers: int) -> None:
    """The layer options against the model's layer count (the rest were checked as they were parsed)."""
    for flag, value, low in (("--exit-layer", args.exit_layer, 1), ("--source-layer", args.source_layer, 0)):
        if value is not None and not low <= value <= num_layers - 1:
            raise ValueError(f"argument {flag}: {value} out of range for {args.model} "
                             f"({num_layers} layers; valid: {low}..{num_layers - 1})")
    if args.reads is not None and (not args.feature or any(not 0 <= i < num_layers for i in args.reads)
                                   or list(args.reads) != sorted(set(args.reads))):
        raise ValueError(f"argument --reads: {','.join(map(str, args.reads))} is not for {args.model} "
                         f"(valid with --feature: increasing layer indices in 0..{num_layers - 1})")


def run(args: argparse.Namespace) -> int:
    from ..vocab import count_tokens, save_vocab

    began = time.perf_counter()
    inputs = common.read_text_inputs(args)
    model, tokenizer, parts = common.load_float32(args)
    check_against_model(args, parts.num_layers)
    if args.feature and args.layout == "eagle3":
        from ..eagle3 import llama_structure_problem

        copied = parts.num_layers - 1 if args.source_layer is None else args.source_layer
        problem = llama_structure_problem(parts.layers[copied])
        if problem is not None:
            raise ValueError(f"argument --layout eagle3: {args.model}'s layer {copied} is not Llama-structured: "
                             f"{problem}; use --layout joined")
    text = common.training_text(args, inputs, model, tokenizer, parts)
    sequences, answers, source = text.sequences, text.answers, text.source
    if len(sequences) < 2:
        raise ValueError(f"{len(sequences)} training sequence from {source} (valid: at least 2, one to train on "
                         f"and one held out); give more prompts (--prompts, --data) or --text")
    print(f"selfspec train-head: {len(sequences)} sequences; text in {time.perf_counter() - began:.0f} s",
          file=sys.stderr)
    out = Path(args.out)
    command = shlex.join(["selfspec", "train-head", *sys.argv[2:]]) if sys.argv[1:2] == ["train-head"] else ""
    training = {"source": source, "command": command, "epochs": args.epochs, "lr": args.lr}
    vocab = None
    if not args.no_vocab:  # counted on the training answers: the held-out ones stay unseen
        counts = count_tokens(answers[_held_out(args, len(answers)):], parts.lm_head.weight.shape[0])
        vocab = save_vocab(out.parent / f"{out.name}-vocab", counts, model=model, parts=parts, source=source)
    if args.feature:
        manifest, plan, summary = train_feature_head(args, model, parts, sequences, answers, training, began, vocab)
    else:
        manifest, plan, summary = train_exit_head(args, model, parts, sequences, training, began)
    plan_path = out.parent / f"{out.name}.plan.json"
    plan.save(plan_path)
    print(summary)
    print(f"head: {manifest}; plan: {plan_path}" + (f"; vocabulary: {vocab}" if vocab else ""))
    return 0


def _held_out(args: argparse.Namespace, count: int) -> int:
    """How many of the first sequences are held out: `--eval-fraction` of them, at least one."""
    return max(1, int(count * args.eval_fraction))


def _split(args: argparse.Namespace, data: list) -> tuple[list, list]:
    """(held out, training)."""
    split = _held_out(args, len(data))
    return data[:split], data[split:]


def _bar(total: int):
    from tqdm.auto import tqdm

    bar = tqdm(total=total, desc="training", unit="seq", file=sys.stderr)

    def step(loss: float) -> None:
        bar.update()
        bar.set_postfix(loss=f"{loss:.3f}")

    return bar, step


def train_feature_head(args, model, parts, sequences, answers, training: dict, began: float, vocab: Path | None):
    """Train, save and describe a feature head: (manifest path, its plan, a summary to print). With a draft
    vocabulary (`vocab`, its manifest), the head learns to draft from its counted tokens, and its plan uses it."""
    from tqdm.auto import tqdm

    from ..feature_head import FeatureHead, default_reads, save_feature_head
    from ..plan import DraftPlan
    from ..training.feature_distill import answer_start, plot_agreement, state_scale, target_states, train_features
    from ..vocab import load_vocab

    ids = None if vocab is None else load_vocab(vocab, 0, model=model, parts=parts).ids  # [K]: every counted token
    reads = default_reads(parts.num_layers) if args.reads is None else tuple(args.reads)
    starts = [answer_start(s, a) for s, a in zip(sequences, answers)]  # agreement is measured on the answers
    data = [target_states(parts, s, reads, start)
            for s, start in tqdm(list(zip(sequences, starts)), desc="target states", unit="seq", file=sys.stderr)]
    eval_data, train_data = _split(args, data)
    head = FeatureHead.from_model(parts, reads=reads, source_layer=args.source_layer, scale=state_scale(train_data),
                                  layout=args.layout)
    head.requires_grad_(True).train()
    bar, step = _bar(int(args.epochs * len(train_data)))
    with bar:
        log = train_features(head, parts, train_data, eval_data, steps=args.unroll, epochs=args.epochs,
                             minutes=args.minutes, lr=args.lr, positions=args.positions, seed=args.seed,
                             ids=ids, progress=step)
    head.eval().requires_grad_(False)
    out = Path(args.out)
    training.update(layout=args.layout, unroll=args.unroll, positions=args.positions,
                    seconds=round(time.perf_counter() - began), tokens=log.tokens,
                    training_seconds=round(log.seconds), steps=len(log.steps),
                    eval_steps=log.eval_steps, eval_agreement=log.eval_agreement, eval_chain=log.eval_chain,
                    final_loss=sum(log.losses[-20:]) / max(1, len(log.losses[-20:])))
    if ids is not None:
        training["draft_vocab"] = {"file": Path(vocab).name, "tokens": int(ids.numel())}
    manifest = save_feature_head(out, head, model=model, parts=parts, training=training)
    plot_agreement(log, out.parent / f"{out.name}.curve.png")
    # Behind what costs no pass (n-gram and recycled trees, as an offloaded model's default): in every measured
    # run that beat the head alone (benchmarks/RESULTS.md, 2026-12-07).
    plan = DraftPlan.resident_plan(head=manifest.name, draft_length=args.draft_length or 8,
                                   name="feature head behind n-grams and recycled trees",
                                   draft_vocab=None if vocab is None else Path(vocab).name)
    per_position = ", ".join(f"{a:.1%}" for a in log.eval_agreement[-1])
    return manifest, plan, (f"{json.dumps({k: training[k] for k in ('seconds', 'tokens', 'final_loss')})}\n"
                            f"held-out top-1 agreement per draft position (answer positions): {per_position}; "
                            f"mean accepted chain of {args.unroll}: {log.eval_chain[-1]:.2f}")


def train_exit_head(args, model, parts, sequences, training: dict, began: float):
    """Train, save and describe an exit head: (manifest path, its plan, a summary to print)."""
    from tqdm.auto import tqdm

    from ..head import ExitHead, save_head
    from ..plan import DraftPlan
    from ..training import features, plot, train

    data = [features(parts, s, args.exit_layer)
            for s in tqdm(sequences, desc="target features", unit="seq", file=sys.stderr)]
    eval_data, train_data = _split(args, data)
    head = ExitHead.from_model(parts, exit_layer=args.exit_layer, source_layer=args.source_layer)
    head.requires_grad_(True).train()
    bar, step = _bar(int(args.epochs * len(train_data)))
    with bar:
        log = train(head, parts, train_data, eval_data, epochs=args.epochs,
                    minutes=args.minutes, lr=args.lr, seed=args.seed, progress=step)
    head.eval().requires_grad_(False)
    out = Path(args.out)
    training.update(log.as_dict())  # its "seconds": the training's
    del training["steps"], training["losses"]
    training["final_loss"] = sum(log.losses[-20:]) / max(1, len(log.losses[-20:]))
    manifest = save_head(out, head, model=model, parts=parts, training=training)
    plot(log, out.parent / f"{out.name}.curve.png")
    plan = DraftPlan(exit_layer=args.exit_layer, head=manifest.name, draft_length=args.draft_length or 4,
                     name=f"exit {args.exit_layer} + trained head")
    final = log.eval_agreement[-1]
    return manifest, plan, (f"{json.dumps({k: training[k] for k in ('seconds', 'tokens', 'exit_agreement', 'final_loss')})}\n"
                            f"held-out top-1 agreement with the target: {final:.1%} with the head, "
                            f"{log.exit_agreement:.1%} for the same exit without it")
