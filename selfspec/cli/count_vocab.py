"""`selfspec count-vocab MODEL --out OUT`: count a draft vocabulary on the model's own answers.

    selfspec count-vocab smollm2-135m-instruct --data prompts.jsonl --out heads/smollm2-vocab

The text is what `selfspec train-head` learns from (`common.add_text_arguments`);
the counts are written as `OUT.json` + `OUT.safetensors` (`selfspec.vocab`).
"""

from __future__ import annotations

import argparse

from . import common

HELP = "count a draft vocabulary on the model's own answers"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_text_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from ..vocab import count_tokens, save_vocab

    inputs = common.read_text_inputs(args)
    model, tokenizer, parts = common.load_float32(args)
    text = common.training_text(args, inputs, model, tokenizer, parts)
    counts = count_tokens(text.answers, parts.lm_head.weight.shape[0])
    path = save_vocab(args.out, counts, model=model, parts=parts, source=text.source)
    print(f"draft vocabulary: {int((counts > 0).sum())} distinct tokens in {int(counts.sum())} counted; {path}")
    return 0
