"""Offloaded models (`selfspec.offload`): wrap a model accelerate dispatched with layers on disk, and get the
target's output; drafts read resident weights only; `load(max_memory=)` places by a budget; clear errors."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest
import torch

import selfspec
from selfspec.cli import main
from selfspec.offload import (BUDGET_CONTEXT, budget_device_map, describe_layers, layers_path, offload_layers,
                              parse_bytes, place_for_budget, working_set_bytes)
from selfspec.registry import adapter_for
from selfspec.testing import TINY_CONFIGS, random_prompt, save_tiny_llama, tiny_model

WORDS = ["[UNK]", "[PAD]"] + [f"w{i}" for i in range(62)]


def offloaded(model, tmp_path: Path, first_offloaded: int):
    """A copy of `model` (tiny models are shared between tests) dispatched by accelerate: layers from
    `first_offloaded` on disk, the rest in CPU memory."""
    model = copy.deepcopy(model)
    assert model.get_submodule(layers_path(model)) is adapter_for(model).bind(model).layers
    return offload_layers(model, first_offloaded, folder=tmp_path / "offload")


def half_offloaded(arch: str, tmp_path: Path):
    """A float64 tiny model of `arch` with its second half of layers on disk, a prompt, the target's greedy
    continuation of it (24 tokens) and the layer count."""
    model = tiny_model(arch, torch.float64)
    prompt = random_prompt(10, seed=3)
    expected = model.generate(prompt, do_sample=False, max_new_tokens=24)
    n = adapter_for(model).bind(model).num_layers
    return offloaded(model, tmp_path, n // 2), prompt, expected, n


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "hooks"])
def test_packed_copies_serve_the_resident_layers_and_the_offloaded_run_without(stream, tmp_path, monkeypatch):
    """`kernels="packed"` on a half-offloaded float32 model, packed chosen at every row count: the resident
    weights run their copies, the offloaded ones (their data moves in for each pass) the unpacked kernel; greedy
    output stays the target's."""
    from selfspec import cpu_kernels
    from selfspec.cpu_kernels import LINEAR_ROWS, LinearKernels, PackedWeights

    model = tiny_model("llama", torch.float32)
    prompt = random_prompt(10, seed=3)
    expected = model.generate(prompt, do_sample=False, max_new_tokens=24)
    model = offloaded(model, tmp_path, 1)
    spec = selfspec.wrap(model, plan=selfspec.DraftPlan(ngram=2, draft_length=3, policy="fixed"),
                         offload_stream=stream, kernels="packed")
    copies = PackedWeights([*spec.parts.layers.modules(), spec.parts.lm_head])
    assert copies and all(copies.get(p) is None for p in spec.parts.layers[1].parameters())  # not the offloaded
    n = len(LINEAR_ROWS)
    spec.kernel_choice.linear_choices[torch.get_num_threads()] = LinearKernels(LINEAR_ROWS, ("packed",) * n,
                                                                               ("linear",) * n, copies)
    ran = []
    real = cpu_kernels.packed_linear
    monkeypatch.setattr(cpu_kernels, "packed_linear", lambda *a: ran.append(1) or real(*a))
    assert torch.equal(spec.generate(prompt, max_new_tokens=24), expected)
    assert ran


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "hooks"])
@pytest.mark.parametrize("arch", sorted(TINY_CONFIGS))
def test_an_offloaded_model_gives_the_targets_greedy_output(arch, stream, tmp_path):
    """Streamed by selfspec (`streaming.py`, the default) or loaded by accelerate's hooks at every call."""
    model, prompt, expected, n = half_offloaded(arch, tmp_path)
    spec = selfspec.wrap(model, offload_stream=stream)
    assert spec.offloaded == tuple(range(n // 2, n))
    assert (spec.parts.stream.order if stream else spec.parts.stream) == (list(spec.offloaded) if stream else None)
    assert spec.plan.layers is None and not spec.plan.auto and spec.plan.ngram and spec.plan.recycle  # resident drafts
    assert torch.equal(spec.generate(prompt, max_new_tokens=24), expected)
    with pytest.warns(UserWarning, match=rf"draft runs offloaded layers \({describe_layers(spec.offloaded)}\)"):
        layered = selfspec.wrap(model, plan=selfspec.DraftPlan(layers=list(range(n)), draft_length=3,
                                                               policy="fixed"), offload_stream=stream)
    assert torch.equal(layered.generate(prompt, max_new_tokens=24), expected)


def test_sampling_from_an_offloaded_model_is_the_resident_models_sample(tmp_path):
    """The same seed gives the same sample as the resident model wrapped with the same plan (whose sampling the
    statistical tests cover): offloading changes where weights wait, not what is computed. Both decide with one
    cost table (each measures its own by default, and other draft lengths draw other random numbers)."""
    model = tiny_model("llama", torch.float64)
    prompt = random_prompt(8, seed=1)
    plan = selfspec.DraftPlan.resident_plan()
    moved = offloaded(model, tmp_path, 2)
    for step in ("eager", "static"):
        torch.manual_seed(7)
        resident = selfspec.wrap(model, plan=plan, costs="flat", step=step).generate(
            prompt, do_sample=True, temperature=1.3, max_new_tokens=30)
        spec = selfspec.wrap(moved, plan=plan, costs="flat", step=step)
        torch.manual_seed(7)
        assert torch.equal(spec.generate(prompt, do_sample=True, temperature=1.3, max_new_tokens=30), resident), step


def test_offloaded_layers_are_reported_and_graphs_refused(tmp_path, monkeypatch):
    model = offloaded(tiny_model("llama", torch.float32), tmp_path, 3)
    spec = selfspec.wrap(model)
    line = spec.memory(context=64).summary()
    assert "offloaded: layers 3-5" in line, line
    assert spec.step == "eager"
    monkeypatch.setattr(type(spec.parts), "device", property(lambda parts: torch.device("cuda")))  # as on a GPU
    with pytest.raises(ValueError, match=r"step='graphs' needs every layer's weights in place; layers 3-5"):
        spec._resolve_step("graphs")
    assert spec._resolve_step("auto") == "eager" and spec._resolve_step("static") == "static"
    monkeypatch.undo()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a resident model: no warning for a layer plan
        selfspec.wrap(tiny_model("llama", torch.float32), plan=selfspec.DraftPlan(layers=[0, 1], draft_length=2))


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "hooks"])
@pytest.mark.parametrize("arch", ["gemma3_text", "gpt2", "llama", "qwen3"])
def test_the_static_step_runs_an_offloaded_model_exactly(arch, stream, tmp_path):
    """Fixed shapes over weights that move in for each pass: the default plan and a layer draft, greedy."""
    model, prompt, expected, n = half_offloaded(arch, tmp_path)
    layered = selfspec.DraftPlan(layers=list(range(n // 2)), draft_length=3, policy="fixed")
    for plan in (None, layered):
        spec = selfspec.wrap(model, step="static", offload_stream=stream, **({"plan": plan} if plan else {}))
        assert spec.step == "static" and type(spec.runner_for(64)).__name__ == "StaticRunner"
        assert torch.equal(spec.generate(prompt, max_new_tokens=24), expected), (arch, stream, plan)
        assert (spec.last_stats.streamed_bytes > 0) == stream  # selfspec read the weights, or the hooks did


def test_a_budget_places_embeddings_and_head_first_then_layers_in_order():
    sizes = {"embed": 100, "lm_head": 100, "norm": 4, "l.0": 50, "l.1": 50, "l.2": 50, "l.3": 50}
    layers = ["l.0", "l.1", "l.2", "l.3"]
    # Room for two layer slots (the stream's, `streaming.py`) is kept once any layer is offloaded.
    placed = budget_device_map(sizes, layers, budget=360, fast="cpu", slow="disk")
    assert placed.device_map == {"embed": "cpu", "lm_head": "cpu", "norm": "cpu", "l.0": "cpu", "l.1": "disk",
                                 "l.2": "disk", "l.3": "disk"}
    assert placed.offloaded_layers == (1, 2, 3) and placed.resident_bytes == 354 and placed.offloaded_bytes == 150
    # Every layer fits: no slots.
    assert budget_device_map(sizes, layers, budget=404, fast="cpu", slow="disk").offloaded_layers == ()
    assert budget_device_map(sizes, layers, budget=10**6, fast="cuda:0", slow="cpu").offloaded_layers == ()
    with pytest.raises(ValueError, match=r"budget of 203 bytes .* under the 204 bytes .* must stay resident"):
        budget_device_map(sizes, layers, budget=203, fast="cpu", slow="disk")
    with pytest.raises(ValueError, match=r"budget of 303 bytes .* under the 304 bytes .* two layer slots"):
        budget_device_map(sizes, layers, budget=303, fast="cpu", slow="disk")
    # A reserve for the working set is kept first: the same placement takes that much more.
    kept = budget_device_map(sizes, layers, budget=360 + 1000, fast="cpu", slow="disk", reserve=1000)
    assert kept.device_map == placed.device_map and kept.resident_bytes == 354 and kept.reserved_bytes == 1000
    with pytest.raises(ValueError, match=r"under the 1204 bytes .* working set of 1000 bytes"):
        budget_device_map(sizes, layers, budget=1203, fast="cpu", slow="disk", reserve=1000)


def test_the_working_set_a_budget_keeps_grows_with_the_context():
    """The KV cache term is what `spec.memory()` counts for the context; the rest is a prefill's activations
    and a verify pass's logits, in the dtype."""
    from selfspec.memory import kv_cache_bytes

    model = tiny_model("llama", torch.float32)
    parts = selfspec.wrap(model, plan=selfspec.DraftPlan.plain()).parts
    config = model.config
    sizes = [working_set_bytes(config, torch.float32, n) for n in (0, 100, 200)]
    assert 0 < sizes[0] < sizes[1] < sizes[2] and sizes[2] - sizes[1] == sizes[1] - sizes[0]  # linear in context
    per_token = sizes[1] - sizes[0]
    kv = kv_cache_bytes(parts, config, context=100) // 100
    assert per_token > kv  # the KV cache and the prefill's activations
    assert working_set_bytes(config, torch.bfloat16, 100) < sizes[1]  # 2-byte activations


def test_sizes_parse_and_bad_ones_are_refused():
    assert parse_bytes("300MiB") == 300 * 2**20 and parse_bytes("1.5GB") == 1_500_000_000
    assert parse_bytes(4096) == 4096 and parse_bytes("0") == 0
    for bad in ("lots", "12 parsecs", "-3MB", -1):
        with pytest.raises(ValueError, match="size|negative"):
            parse_bytes(bad)
    assert describe_layers((3, 5, 6, 7)) == "3, 5-7"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A random 4-layer Llama with a word-level tokenizer."""
    path = tmp_path_factory.mktemp("tiny-offload")
    save_tiny_llama(path, WORDS, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                    tie_word_embeddings=False)
    return path


def test_load_with_a_budget_offloads_the_last_layers_and_keeps_the_output(folder, tmp_path, monkeypatch):
    import selfspec.loading

    reference, _ = selfspec.load(str(folder))
    whole = sum(p.numel() * p.element_size() for p in reference.parameters())
    reserve = working_set_bytes(reference.config, torch.float32, BUDGET_CONTEXT)
    budget = whole + reserve - 1  # not everything fits: one layer stays beside the two slots layers stream through
    heaps = []
    monkeypatch.setattr(selfspec.loading, "one_heap", lambda: heaps.append(1) or True)
    model, _ = selfspec.load(str(folder), max_memory=budget, offload_folder=tmp_path / "off")
    assert heaps == [1]  # a budget on the CPU: one malloc heap for every thread
    assert model.hf_device_map["model.layers.0"] == "cpu" and model.hf_device_map["model.layers.1"] == "disk"
    spec = selfspec.wrap(model)
    assert spec.offloaded == (1, 2, 3) and spec.parts.stream.order == [1, 2, 3]  # selfspec streams them
    prompt = torch.tensor([[2, 3, 4, 5, 6, 7, 2, 3]])
    assert torch.equal(spec.generate(prompt, max_new_tokens=16),
                       reference.generate(prompt, do_sample=False, max_new_tokens=16))
    with pytest.raises(ValueError, match="must stay resident"):
        selfspec.load(str(folder), max_memory=1024)
    with pytest.raises(ValueError, match=r"a generation's working set of"):
        selfspec.load(str(folder), max_memory=whole)  # the weights fit, their working set does not
    with pytest.raises(ValueError, match="budget_context"):
        selfspec.load(str(folder), max_memory=budget, budget_context=-1)
    with pytest.raises(ValueError, match="not a size"):
        selfspec.load(str(folder), max_memory="a lot")
    with pytest.raises(ValueError, match="quantize= and offloading"):
        selfspec.load(str(folder), max_memory="1GiB", quantize="int8")


def test_a_checkpoint_stored_in_another_dtype_streams_converted(folder, tmp_path, monkeypatch):
    """Loaded in bfloat16 from a float32 checkpoint, offloaded layers are read from its file and converted."""
    reference, _ = selfspec.load(str(folder), dtype="bfloat16")
    layer = sum(p.numel() * p.element_size() for p in reference.model.layers[0].parameters())
    whole = sum(p.numel() * p.element_size() for p in reference.parameters())
    reserve = working_set_bytes(reference.config, torch.bfloat16, BUDGET_CONTEXT)
    budget = whole - 2 * layer + 1024 + reserve  # the working set, the rest and the two slots: no layer stays
    model, _ = selfspec.load(str(folder), dtype="bfloat16", max_memory=budget, offload_folder=tmp_path / "off")
    spec = selfspec.wrap(model, costs="flat")
    assert spec.parts.stream.order == [0, 1, 2, 3]
    assert {w.source.dtype for ws in spec.parts.stream.weights.values() for w in ws
            if not isinstance(w.source, torch.Tensor)} == {torch.float32}  # the checkpoint's own file
    loads = count_hook_loads(monkeypatch)
    prompt = torch.tensor([[2, 3, 4, 5, 6, 7, 2, 3]])
    plain = selfspec.wrap(reference, plan=selfspec.DraftPlan.plain(), kernels="transformers")
    expected = plain.generate(prompt, max_new_tokens=12)
    assert torch.equal(selfspec.wrap(model, plan=selfspec.DraftPlan.plain(), kernels="transformers",
                                     costs="flat").generate(prompt, max_new_tokens=12), expected)
    assert loads[0] == 0


def test_generate_cli_takes_a_memory_budget(folder, tmp_path, capsys):
    from selfspec.cli import common

    assert common.BUDGET_CONTEXT == BUDGET_CONTEXT  # the CLI names it without importing torch
    assert main(["generate", "--model", str(folder), "--max-memory", "200KiB", "--budget-context", "16",
                 "--offload-folder", str(tmp_path / "off"), "--max-new-tokens", "6", "w1 w2 w3"]) == 0
    out = capsys.readouterr().out
    assert "offloaded: layers" in out, out
    code = main(["generate", "--model", str(folder), "--max-memory", "100KiB", "w1"])  # a working set of 1024
    assert code != 0 and "working set of" in capsys.readouterr().err
    code = main(["generate", "--model", str(folder), "--max-memory", "lots", "w1"])
    assert code == 2 and "--max-memory" in capsys.readouterr().err


def test_heads_copied_from_offloaded_layers_draft_from_their_own_weights(tmp_path):
    """A head's layer is a copy of one of the target's; copied from an offloaded layer, it holds that layer's
    weights itself (no hook, nothing on the meta device), and the original stays offloaded."""
    from selfspec.testing import make_feature_head, make_head

    model = tiny_model("llama", torch.float64)
    prompt = random_prompt(9, seed=2)
    expected = model.generate(prompt, do_sample=False, max_new_tokens=20)
    feature = make_feature_head(model, tmp_path / "feature")  # copied from the last layer: offloaded below
    exit_head = make_head(model, tmp_path / "exit", exit_layer=2, source_layer=5)
    model = offloaded(model, tmp_path, 3)
    for plan in (selfspec.DraftPlan(head=str(feature), draft_length=3),
                 selfspec.DraftPlan(exit_layer=2, head=str(exit_head), draft_length=3)):
        spec = selfspec.wrap(model, plan=plan)
        layer = spec.head.layer
        assert not any(hasattr(m, "_hf_hook") for m in layer.modules())
        assert all(p.device.type == "cpu" for p in layer.parameters())
        assert torch.equal(spec.generate(prompt, max_new_tokens=20), expected)
    assert spec.offloaded == (3, 4, 5) and model.model.layers[5].mlp.up_proj.weight.device.type == "meta"


def test_an_offloaded_model_keeps_cost_tables_of_its_own(tmp_path):
    """Its passes load weights every time: they cost other times than the resident model's."""
    model = tiny_model("llama", torch.float32)
    resident = selfspec.wrap(model, plan=selfspec.DraftPlan.resident_plan())
    moved = selfspec.wrap(offloaded(model, tmp_path, 4), plan=selfspec.DraftPlan.resident_plan())
    assert moved.cost_tables.key() != resident.cost_tables.key()


def test_a_tied_lm_head_counts_once_in_a_budget(tmp_path):
    save_tiny_llama(tmp_path, WORDS, hidden_size=32, intermediate_size=64, num_hidden_layers=4)  # tied
    model, _ = selfspec.load(str(tmp_path))
    layer = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    embedding = model.model.embed_tokens.weight.numel() * 4
    reserve = working_set_bytes(model.config, torch.float32, 64)
    budget = embedding + 4 * layer - 1 + reserve
    placed = place_for_budget(tmp_path, torch.float32, budget, fast="cpu", slow="disk", context=64)
    assert placed.offloaded_layers == (1, 2, 3), placed.device_map  # one layer beside the two slots
    assert placed.reserved_bytes == reserve and placed.resident_bytes + reserve <= budget


def count_hook_loads(monkeypatch) -> list[int]:
    """A counter of accelerate's weight loads (`AlignDevicesHook.pre_forward` calls)."""
    from accelerate.hooks import AlignDevicesHook

    calls = [0]
    original = AlignDevicesHook.pre_forward

    def counted(self, *args, **kwargs):
        calls[0] += bool(self.offload)  # a hook that loads weights (others move inputs between devices)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(AlignDevicesHook, "pre_forward", counted)
    return calls


def test_selfspec_streams_offloaded_layers_and_leaves_the_model_as_accelerate_made_it(tmp_path, monkeypatch):
    """No hook loads a weight in selfspec's passes; each verify pass reads each offloaded layer once (the next
    pass's first one is read ahead); afterwards the layers are offloaded again and `model.generate` is unchanged."""
    model = tiny_model("llama", torch.float64)
    prompt = random_prompt(10, seed=4)
    expected = model.generate(prompt, do_sample=False, max_new_tokens=20)
    model = offloaded(model, tmp_path, 2)
    spec = selfspec.wrap(model, costs="flat")
    stream = spec.parts.stream
    hooked = {name: m.__dict__["_hf_hook"] for name, m in model.named_modules() if "_hf_hook" in m.__dict__}
    loads = count_hook_loads(monkeypatch)
    assert torch.equal(spec.generate(prompt, max_new_tokens=20), expected)
    assert loads[0] == 0
    per_pass = sum(p.numel() * p.element_size() for i in (2, 3, 4, 5) for p in model.model.layers[i].parameters())
    passes = spec.last_stats.verify_passes
    assert passes * per_pass <= stream.bytes_read <= passes * per_pass + stream.slot_bytes()
    assert spec.last_stats.streamed_bytes == stream.bytes_read  # the stats report what was streamed
    assert "offloaded layers streamed:" in str(spec.last_stats)
    assert stream.holding[0] is not None and set(stream.holding) <= {2, 3, 4, 5}
    assert all(p.device.type == "meta" for i in (2, 3, 4, 5) for p in model.model.layers[i].parameters())
    assert hooked == {name: m.__dict__["_hf_hook"] for name, m in model.named_modules() if "_hf_hook" in m.__dict__}
    assert any(name.startswith("model.layers.3.") for name in hooked)
    assert torch.equal(model.generate(prompt, do_sample=False, max_new_tokens=20), expected)
    assert loads[0] > 0  # model.generate still loads through accelerate's hooks
    line = spec.memory(context=64).summary()
    assert "streamed through two slots of" in line and "resident" in line, line


def test_weights_accelerate_holds_in_cpu_memory_stream_too(tmp_path, monkeypatch):
    """`accelerate.cpu_offload` keeps a state dict in CPU memory (a GPU's "cpu" tier): selfspec copies from it."""
    from accelerate import cpu_offload

    model = tiny_model("qwen2", torch.float64)
    prompt = random_prompt(9, seed=5)
    expected = model.generate(prompt, do_sample=False, max_new_tokens=20)
    model = copy.deepcopy(model)
    for layer in model.model.layers[1:]:
        cpu_offload(layer, execution_device=torch.device("cpu"))
    spec = selfspec.wrap(model)
    assert spec.parts.stream.order == list(range(1, len(model.model.layers)))
    loads = count_hook_loads(monkeypatch)
    assert torch.equal(spec.generate(prompt, max_new_tokens=20), expected) and loads[0] == 0


def test_a_layer_selfspec_cannot_read_stays_with_accelerates_hooks(tmp_path, monkeypatch):
    from selfspec import streaming

    model = tiny_model("llama", torch.float64)
    prompt = random_prompt(10, seed=6)
    expected = model.generate(prompt, do_sample=False, max_new_tokens=16)
    model = offloaded(model, tmp_path, 3)
    unreadable = model.model.layers[4].mlp.up_proj
    original = streaming.offloaded_weights
    monkeypatch.setattr(streaming, "offloaded_weights",
                        lambda layer, device: None if unreadable in layer.modules() else original(layer, device))
    spec = selfspec.wrap(model)
    assert spec.parts.stream.order == [3, 5]
    assert torch.equal(spec.generate(prompt, max_new_tokens=16), expected)
    # A layer whose hooks compute on another device than the stream's is left to them too.
    assert original(model.model.layers[3], torch.device("cpu"))
    assert original(model.model.layers[3], torch.device("cuda", 0)) is None


def test_a_failed_read_is_raised_in_the_pass(tmp_path):
    model = offloaded(tiny_model("llama", torch.float32), tmp_path, 4)
    spec = selfspec.wrap(model, costs="flat")
    weight = spec.parts.stream.weights[5][0].source
    with open(weight.path, "r+b") as f:
        f.truncate(weight.size // 2)
    with pytest.raises(OSError, match="bytes missing"):
        spec.generate(random_prompt(6, seed=1), max_new_tokens=8)
    assert 5 not in spec.parts.stream.holding  # a slot half read holds no layer: a later pass reads it again


def test_a_batch_of_rows_streams_the_offloaded_layers(tmp_path, monkeypatch):
    """`batch_session` (what `selfspec serve` runs) passes through the same layer loop: rows of an offloaded
    model equal `model.generate` alone, and no hook loads a weight."""
    model = tiny_model("gemma3_text", torch.float64)
    prompts = [random_prompt(9, seed=s)[0].tolist() for s in (1, 2, 3)]
    expected = [model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=18)[0, len(p):].tolist()
                for p in prompts]
    spec = selfspec.wrap(offloaded(model, tmp_path, 2), costs="flat")
    loads = count_hook_loads(monkeypatch)
    session = spec.batch_session()
    rows = [session.add(p, max_new_tokens=18) for p in prompts]
    while len(session):
        session.step()
    assert [row.new_tokens for row in rows] == expected
    assert loads[0] == 0 and spec.parts.stream.bytes_read > 0
    assert session.stats.streamed_bytes == spec.parts.stream.bytes_read  # the session's stats say what it read


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "hooks"])
def test_resident_layers_of_a_dispatched_model_run_the_direct_call(stream, tmp_path, monkeypatch):
    """accelerate leaves an `AlignDevicesHook` on every resident layer that only keeps it on its device: those
    layers run selfspec's direct call (`layer_call._inert`). A layer a hook loads runs its own forward, and a
    streamed one the direct call with its hooks set aside. Greedy output stays the target's."""
    from accelerate.hooks import AlignDevicesHook, SequentialHook

    import selfspec.layer_call as layer_call

    model, prompt, expected, n = half_offloaded("llama", tmp_path)
    spec = selfspec.wrap(model, offload_stream=stream, costs="flat")
    assert "_hf_hook" in spec.parts.layers[0].__dict__  # accelerate's, on a resident layer
    own = []
    real = layer_call.decoder_layer
    monkeypatch.setattr(layer_call, "decoder_layer", lambda layer, *a, **k: own.append(layer) or real(layer, *a, **k))
    assert torch.equal(spec.generate(prompt, max_new_tokens=24), expected)
    ran_own = {i for i, layer in enumerate(spec.parts.layers) if any(layer is o for o in own)}
    assert ran_own == (set() if stream else set(range(n // 2, n)))  # hooks mode: the hook loads them
    cpu = torch.device("cpu")
    assert layer_call._inert(None, cpu) and layer_call._inert(AlignDevicesHook(execution_device="cpu"), cpu)
    assert not layer_call._inert(AlignDevicesHook(execution_device="cpu", offload=True), cpu)  # loads weights
    assert not layer_call._inert(AlignDevicesHook(execution_device=0), cpu)  # would move the inputs to a GPU
    assert not layer_call._inert(SequentialHook(AlignDevicesHook(execution_device="cpu")), cpu)
    assert layer_call._inert(AlignDevicesHook(execution_device=0), torch.device("cuda", 0))
