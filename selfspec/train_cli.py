"""`selfspec train-head` and `selfspec count-vocab`: make a model's exit head and draft vocabulary.

    selfspec train-head smollm2-135m-instruct --exit-layer 8 --data prompts.jsonl --out heads/smollm2-e8
    selfspec count-vocab smollm2-135m-instruct --data prompts.jsonl --out heads/smollm2-vocab

Both start from the same text: the model's own greedy answers to a prompt set
(`--data`, read as `selfspec tune` reads it; default: the built-in chat
prompts), plus any text file (`--text`). `train-head` writes the head
(`OUT.safetensors` + `OUT.json`), a plan that uses it (`OUT.plan.json`), the
training curve (`OUT.curve.png` with matplotlib) and, unless `--no-vocab`, a
draft vocabulary counted on the same answers (`OUT-vocab.*`). This module
parses and prints; the work is in `head_training.py`, `head.py`, `vocab.py`.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path


def _data_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="known model name (e.g. smollm2-135m-instruct) or a local model folder")
    parser.add_argument("--data", metavar="FILE", help="prompts (.jsonl / .json / one a line; 'spec-bench' finds "
                                                       "the Spec-Bench questions); default: the built-in prompts")
    parser.add_argument("--prompts", type=int, default=None, metavar="N", help="use the first N prompts (default: all)")
    parser.add_argument("--text", metavar="FILE", help="also learn from this text file (cut into sequences)")
    parser.add_argument("--new-tokens", type=int, default=128, help="answer length per prompt (default: 128)")
    parser.add_argument("--max-length", type=int, default=768, help="longest training sequence (default: 768)")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts generated at once (default: 8)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sequences", metavar="FILE", help="reuse the token sequences an earlier run saved "
                                                            "(OUT.sequences.json) instead of generating them")
    parser.add_argument("--out", required=True, help="output path without suffix")


def add_train_head_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    _data_arguments(parser)
    parser.add_argument("--exit-layer", type=int, required=True, metavar="E", help="the draft exits after layer E-1")
    parser.add_argument("--source-layer", type=int, default=None, help="layer the head is copied from (default: last)")
    parser.add_argument("--epochs", type=float, default=2.0)
    parser.add_argument("--minutes", type=float, default=25.0, help="training time budget (default: 25)")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--eval-fraction", type=float, default=0.1, help="sequences held out for agreement")
    parser.add_argument("--draft-length", type=int, default=4, help="k of the plan written beside the head")
    parser.add_argument("--no-vocab", action="store_true", help="do not count a draft vocabulary")
    return parser


def add_count_vocab_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    _data_arguments(parser)
    return parser


def _sequences(args, model, tokenizer) -> tuple[list[list[int]], list[list[int]], str]:
    """(training sequences, the parts to count for a vocabulary, a description of the source).

    Saved to `OUT.sequences.json`, which `--sequences` reads back (generating answers is the slow part).
    """
    if args.sequences:
        saved = json.loads(Path(args.sequences).read_text(encoding="utf-8"))
        return saved["sequences"], saved["answers"], saved["source"]
    sequences, answers, source = _generate_sequences(args, model, tokenizer)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    saved = {"source": source, "sequences": sequences, "answers": answers}
    (out.parent / f"{out.name}.sequences.json").write_text(json.dumps(saved), encoding="utf-8")
    return sequences, answers, source


def _generate_sequences(args, model, tokenizer) -> tuple[list[list[int]], list[list[int]], str]:
    from tqdm.auto import tqdm

    from .head_training import own_answers, text_sequences
    from .tune_cli import _data_path
    from .tuning import builtin_prompts, encode_prompts, read_prompts

    texts = read_prompts(_data_path(args.data), seed=args.seed) if args.data else builtin_prompts(seed=args.seed)
    texts = texts[: args.prompts] if args.prompts else texts
    prompts = [ids[-args.max_length // 2 :] for ids in encode_prompts(tokenizer, texts)]
    with tqdm(total=len(prompts), desc="own answers", unit="prompt", file=sys.stderr) as bar:
        sequences = own_answers(model, tokenizer, prompts, new_tokens=args.new_tokens, batch_size=args.batch_size,
                                progress=bar.update)
    answers = [seq[len(p):] for seq, p in zip(sequences, prompts)]
    source = f"{len(prompts)} prompts from {args.data or 'the built-in set'}, {args.new_tokens}-token greedy answers"
    if args.text:
        extra = text_sequences(tokenizer, Path(args.text).read_text(encoding="utf-8"), length=args.max_length)
        sequences += extra
        answers += extra
        source += f", and {args.text}"
    return [s[: args.max_length] for s in sequences], answers, source


def _load(args):
    import torch

    import selfspec
    from .registry import model_parts

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = selfspec.load(args.model, dtype="float32", device=args.device)
    return model, tokenizer, model_parts(model)


def run_count_vocab(args) -> int:
    from .vocab import count_tokens, save_vocab

    model, tokenizer, _, parts = _load(args)
    _, answers, source = _sequences(args, model, tokenizer)
    counts = count_tokens(answers, parts.lm_head.weight.shape[0])
    path = save_vocab(args.out, counts, model=model, parts=parts, source=source)
    print(f"draft vocabulary: {int((counts > 0).sum())} distinct tokens in {int(counts.sum())} counted; {path}")
    return 0


def run_train_head(args) -> int:
    import torch
    from tqdm.auto import tqdm

    from .head import ExitHead, save_head
    from .head_training import agreement, features, plot, train
    from .plan import DraftPlan
    from .vocab import count_tokens, save_vocab

    began = time.perf_counter()
    model, tokenizer, parts = _load(args)
    sequences, answers, source = _sequences(args, model, tokenizer)
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
