"""`layer_call`'s direct layers (`llama_layer`, `gemma_layer`, `phi3_layer`, `olmo2_layer`): a layer computed
from its parts is the layer's own forward, bit for bit (Llama, Mistral, Qwen 2, Qwen 3, Gemma 2, Gemma 3, Phi-3,
OLMo 2).

- float32, bfloat16 and float64, on the runner's passes (a prefill, a one-token step, a masked chain, a
  token tree, a batch's rows): logits and every cache entry equal (`torch.equal`) those of the layer's own
  forward (`decoder_layer`), with selfspec's CPU kernels in both;
- the direct path really runs for a plain Llama layer, also after transformers left its output-capturing
  hooks on it, and anything else (a hooked module, a layer in training mode, another architecture) runs
  the layer's own forward;
- those families' adapters use them.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import selfspec
import selfspec.layer_call as layer_call
from selfspec.batch import BatchRunner
from selfspec.runner import LayerRunner
from selfspec.testing import random_prompt, tiny_model
from selfspec.tree import TokenTree


def passes(parts) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The logits of a prefill, a step, a 3-token chain and a tree; then every layer's cache entries."""
    runner = LayerRunner(parts, capacity=48)
    prompt = random_prompt(12, seed=5)[0].tolist()
    layers = range(parts.num_layers)
    out = [runner.logits(runner.run(runner.embed(prompt, 0), layers, 0))]
    out.append(runner.logits(runner.run(runner.embed([7], 12), layers, 12)))
    out.append(runner.logits(runner.run(runner.embed([3, 9, 4], 13), layers, 13)))
    tree = TokenTree.from_paths([[5, 6], [5, 8, 2], [1]], max_nodes=8)
    out.append(runner.logits(runner.run(runner.embed([2, *tree.tokens], 16, tree), layers, 16, tree)))
    entries = [t for i in layers for t in runner.cache.entries(i)]
    return out, entries


DIRECT = [("llama", "llama_layer"), ("gemma3_text", "gemma_layer"), ("gemma3", "gemma_layer"),
          ("mistral", "llama_layer"), ("qwen2", "llama_layer"), ("qwen3", "llama_layer"), ("gemma2", "gemma_layer"),
          ("phi3", "phi3_layer"), ("olmo2", "olmo2_layer")]


@pytest.mark.parametrize("family,call", DIRECT)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_direct_layer_equals_the_layers_own_forward(family, call, dtype, monkeypatch):
    model = tiny_model(family, dtype)
    parts = selfspec.wrap(model, plan=selfspec.DraftPlan.plain()).parts
    assert parts.layer_call is getattr(layer_call, call)  # the adapter's choice
    own = dataclasses.replace(parts, layer_call=layer_call.decoder_layer)
    fallbacks = []
    real = layer_call.decoder_layer
    monkeypatch.setattr(layer_call, "decoder_layer", lambda *a, **k: fallbacks.append(1) or real(*a, **k))
    with torch.no_grad():
        direct_logits, direct_entries = passes(parts)
        assert not fallbacks  # every layer took the direct path
        own_logits, own_entries = passes(own)
    for ours, theirs in zip(direct_logits + direct_entries, own_logits + own_entries, strict=True):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("family,call", DIRECT[:2] + DIRECT[-1:])
def test_a_batchs_rows_run_the_direct_layer_alike(family, call):
    model = tiny_model(family, torch.float32)
    parts = selfspec.wrap(model).parts
    outs = []
    for call in (getattr(layer_call, call), layer_call.decoder_layer):
        runner = BatchRunner(dataclasses.replace(parts, layer_call=call), capacity=32)
        for prompt in ([5, 9, 2, 7], [3, 8]):
            row = runner.cache.add_row()
            runner.forward_rows(torch.tensor([prompt]), [0], slice(row, row + 1))
        with torch.no_grad():
            outs.append(runner.forward_rows(torch.tensor([[6, 2, 11], [7, 7, 3]]), [4, 2], slice(0, 2)))
    assert torch.equal(*outs)


def test_anything_but_a_plain_llama_layer_runs_its_own_forward(monkeypatch):
    model = tiny_model("llama", torch.float32)
    parts = selfspec.wrap(model).parts
    seen = []
    real = layer_call.decoder_layer
    monkeypatch.setattr(layer_call, "decoder_layer", lambda layer, *a, **k: seen.append(layer) or real(layer, *a, **k))
    with torch.no_grad():
        passes(parts)  # the layers' classes are checked once, here
    assert not seen
    hooked = parts.layers[1].mlp.up_proj
    handle = hooked.register_forward_hook(lambda module, args, out: None)  # a hook registered later still counts
    with torch.no_grad():
        passes(parts)
    assert set(map(id, seen)) == {id(parts.layers[1])}  # only the hooked layer
    handle.remove()
    seen.clear()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, out: None)
    with torch.no_grad():
        passes(parts)
    handle.remove()
    assert len(seen) == 4 * parts.num_layers  # a global hook: every layer of the 4 passes runs its own forward
    seen.clear()
    parts.layers[0].train()
    with torch.no_grad():
        passes(parts)
    assert set(map(id, seen)) == {id(parts.layers[0])}  # training mode: the layer's own forward
    parts.layers[0].eval()
    llama = layer_call._family_of(parts.layers[0])
    gemma = tiny_model("gemma3_text", torch.float32).model.layers[0]
    qwen = tiny_model("qwen3", torch.float32).model.layers[0]
    gpt2 = tiny_model("gpt2", torch.float32).transformer.h[0]
    assert layer_call._family_of(gpt2) is None  # a family without a direct call: its own forward, always
    cpu = torch.device("cpu")
    assert not layer_call._plain(gemma, llama, cpu) and not layer_call._plain(qwen, llama, cpu)  # another family
    assert layer_call._plain(gemma, layer_call._family_of(gemma), cpu)
    assert layer_call._plain(qwen, layer_call._family_of(qwen), cpu)


def test_the_hooks_transformers_leaves_after_hidden_states_keep_the_direct_layer(monkeypatch):
    """transformers leaves output-capturing hooks on a model's layers once it was asked for hidden states; they
    record only inside its own forward, so selfspec's direct layer still runs, with the same output."""
    import copy

    model = copy.deepcopy(tiny_model("llama", torch.float32))  # the hooks stay: not on the shared tiny model
    prompt = torch.tensor([[5, 9, 2, 7, 3, 8]])
    spec = selfspec.wrap(model)
    before = spec.generate(prompt, max_new_tokens=12)
    with torch.no_grad():
        states = model(prompt, output_hidden_states=True).hidden_states
    assert len(states) == model.config.num_hidden_layers + 1
    assert any(layer._forward_hooks for layer in spec.parts.layers)  # left there by transformers
    seen = []
    real = layer_call.decoder_layer
    monkeypatch.setattr(layer_call, "decoder_layer", lambda layer, *a, **k: seen.append(layer) or real(layer, *a, **k))
    assert torch.equal(spec.generate(prompt, max_new_tokens=12), before) and not seen
    with torch.no_grad():  # and transformers' own capture still works after selfspec's calls
        again = model(prompt, output_hidden_states=True).hidden_states
    assert all(torch.equal(a, b) for a, b in zip(states, again))


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "gemma2", "mistral", "qwen3", "phi3", "olmo2"])
def test_greedy_generation_with_the_direct_layer_equals_generate(family):
    model = tiny_model(family, torch.float64)
    prompt = random_prompt(20, seed=2)
    ref = model.generate(prompt, do_sample=False, max_new_tokens=40)
    for plan in (selfspec.DraftPlan.plain(), selfspec.DraftPlan(layers=[0, 2], draft_length=4),
                 selfspec.DraftPlan(recycle=True, ngram=2, tree=10, layers=[1, 3], draft_length=4)):
        out = selfspec.wrap(model, plan=plan, costs="flat").generate(prompt, max_new_tokens=40)
        assert torch.equal(out, ref), plan
