"""Head training by self-distillation, on the engine's public parts.

    parts = selfspec.wrap(model).parts
    sequences = own_answers(model, tokenizer, prompts, new_tokens=128, batch_size=8)
    data = [features(parts, s, exit_layer=8) for s in sequences]
    head = ExitHead.from_model(parts, exit_layer=8)
    log = train(head, parts, data[8:], data[:8], epochs=2, minutes=25, lr=3e-4)

`text` makes the training text, `distill` the exit-head features, the loss and
the training loop; `feature_distill` trains feature heads, unrolled on their
own states. `selfspec train-head` (`selfspec.cli.train_head`) runs them.
"""

from __future__ import annotations

from .distill import Features, TrainingLog, agreement, features, plot, train
from .text import TrainingText, own_answers, text_sequences

__all__ = ["Features", "TrainingLog", "TrainingText", "agreement", "features", "own_answers", "plot",
           "text_sequences", "train"]
