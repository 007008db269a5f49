"""Self-distillation of an exit head: features come from the target, training lowers KL(p || q).

On a tiny random model the head (a copy of the last layer) is trained on the
target's own labels for a few dozen steps: the loss must fall and the held-out
top-1 agreement must beat the untrained copy, the model must be left as it
was, and the trained head must load into a lossless plan. The command-line
tool is exercised end to end on SmolLM2 in `test_smollm2_real.py` (slow).
"""

from __future__ import annotations

import torch

import selfspec
from plan_strategies import assert_same
from selfspec.registry import adapter_for
from selfspec.head import ExitHead, save_head
from selfspec.training import agreement, features, train
from selfspec.testing import random_prompt, tiny_model


def test_training_lowers_kl_and_raises_agreement(tmp_path):
    model = tiny_model("llama", torch.float32)
    adapter = adapter_for(model)
    parts = adapter.bind(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    # The target labels its own greedy continuations of random prompts.
    sequences = [model.generate(random_prompt(6, seed=s), do_sample=False, max_new_tokens=26)[0].tolist()
                 for s in range(64)]
    data = [features(parts, seq, exit_layer=2) for seq in sequences]
    assert data[0].exit_states.shape == (32, 32) and data[0].final_normed.shape == (32, 32)
    train_data, eval_data = data[8:], data[:8]
    head = ExitHead.from_model(parts, exit_layer=2).float().requires_grad_(True)
    untrained = agreement(head, parts, eval_data)
    log = train(head, parts, train_data, eval_data, epochs=4, minutes=5, lr=1e-2, eval_every=50)
    early, late = sum(log.losses[:10]) / 10, sum(log.losses[-10:]) / 10
    assert late < 0.8 * early, (early, late)
    assert log.eval_agreement[-1] > max(untrained, log.exit_agreement) + 0.05, (untrained, log.exit_agreement, log.eval_agreement)
    for k, v in model.state_dict().items():  # the target is frozen and unchanged
        assert torch.equal(v, before[k]), k

    path = save_head(tmp_path / "head", head.requires_grad_(False), model=model, parts=parts, training=log.as_dict())
    plan = selfspec.DraftPlan(exit_layer=2, head=str(path), draft_length=4, policy="fixed")
    spec = selfspec.wrap(model, plan=plan)
    prompt = random_prompt(8, seed=99)
    out = spec.generate(prompt, max_new_tokens=30)
    assert_same(out, model.generate(prompt, do_sample=False, max_new_tokens=30), plan)
