"""The CPU kernel choices (`cpu_kernels.py`, `kernel_choice.py`): the attention kernel (sdpa, packed grouped heads,
float32), and the linear layers' kernel (F.linear, transposed, oneDNN). Each computes what transformers computes, only
in selfspec's calls of the thread that chose it (no function is swapped), and greedy output stays token-identical to
`model.generate`."""

from __future__ import annotations

import contextlib
import dataclasses
import threading

import pytest
import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import selfspec
from selfspec import cpu_kernels
from selfspec.cpu_kernels import (ATTENTION_FUNCTIONS, ATTENTION_QUERIES, COPYLESS_KERNELS, LINEAR_KERNELS,
                                  LINEAR_ROWS, NO_ATTENTION_CHANGE, NO_CHANGE, AttentionKernels, LinearKernels,
                                  PackedWeights, chosen_attention, chosen_kernels, chosen_linear,
                                  measure_attention_kernels, measure_linear_kernels, onednn_linear, onednn_usable,
                                  packed_linear, sdpa_attention, transposed_linear)
from selfspec.testing import TINY_CONFIGS, random_prompt, tiny_model

ARCHS = sorted(TINY_CONFIGS)
EVERYWHERE = LinearKernels(LINEAR_ROWS, ("transposed",) * len(LINEAR_ROWS))
PACKED = AttentionKernels(ATTENTION_QUERIES, (64,), (("packed",),) * len(ATTENTION_QUERIES))


def untouched(linear, sdpa, sdpa_entry) -> None:
    """torch's and transformers' functions are those given, and no torch function mode is on in this thread."""
    assert torch.nn.functional.linear is linear and torch.nn.functional.scaled_dot_product_attention is sdpa
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_entry and not torch._C._is_torch_function_mode_enabled()


def test_a_choice_swaps_nothing_holds_in_selfspecs_calls_and_nests():
    originals = (torch.nn.functional.linear, torch.nn.functional.scaled_dot_product_attention,
                 ALL_ATTENTION_FUNCTIONS["sdpa"])
    linear, _, sdpa_entry = originals
    assert linear is not chosen_linear and sdpa_entry is not chosen_attention
    hidden = torch.zeros(1, 2, 8)
    with cpu_kernels.cpu_kernels(attention=PACKED, linear=EVERYWHERE):
        untouched(*originals)
        assert cpu_kernels.linear_function() is chosen_linear
        assert cpu_kernels.attention_function("sdpa", None) is chosen_attention
        assert cpu_kernels.attention_function("eager", sdpa_attention) is sdpa_attention  # not sdpa: as it was
        with chosen_kernels(hidden):  # transformers' modules' calls, in this thread alone
            assert torch._C._is_torch_function_mode_enabled()
        with cpu_kernels.cpu_kernels(attention=NO_ATTENTION_CHANGE):  # nested: the inner choice, then the outer
            assert not cpu_kernels._state.attention and cpu_kernels._state.linear is EVERYWHERE
            assert cpu_kernels.attention_function("sdpa", None) is sdpa_entry
        assert cpu_kernels._state.attention is PACKED
    untouched(*originals)
    assert cpu_kernels.linear_function() is linear and cpu_kernels.attention_function("sdpa", None) is sdpa_entry
    with cpu_kernels.cpu_kernels(attention=NO_ATTENTION_CHANGE, linear=NO_CHANGE):  # nothing chosen: nothing entered
        with chosen_kernels(hidden):
            untouched(*originals)
    only_some_rows = LinearKernels((1, 4), ("linear", "transposed"))
    with cpu_kernels.cpu_kernels(linear=only_some_rows), chosen_kernels(hidden):  # 2 rows: F.linear's anyway
        untouched(*originals)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # a layer selfspec computes; transformers' own module
def test_another_thread_mid_pass_sees_torch_and_transformers_functions_untouched(arch, monkeypatch):
    """While a pass runs on other kernels (stopped inside it, at its first transposed linear call), another
    thread finds `F.linear`, torch's sdpa and transformers' "sdpa" entry as they were, and its own calls of them
    run torch's and transformers' kernels, never the ones this thread chose."""
    originals = (torch.nn.functional.linear, torch.nn.functional.scaled_dot_product_attention,
                 ALL_ATTENTION_FUNCTIONS["sdpa"])
    ran, checked = [], []

    def other_thread() -> None:
        untouched(*originals)
        assert cpu_kernels.linear_function() is originals[0]
        assert cpu_kernels.attention_function("sdpa", None) is originals[2]
        generator = torch.Generator().manual_seed(0)
        torch.nn.functional.linear(torch.randn(3, 6, dtype=torch.float64, generator=generator),
                                   torch.randn(4, 6, dtype=torch.float64, generator=generator))
        module = torch.nn.Module()
        module.num_key_value_groups, module.is_causal, module.training = 2, True, False
        query, key, value, mask = _attention_inputs(4, 2, 1, 3, 9, masked=True)
        ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, mask, scaling=0.3)
        torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=True)
        checked.append(threading.current_thread().name)

    def mid_pass() -> None:
        if not checked:
            thread = threading.Thread(target=other_thread, name="other")
            thread.start()
            thread.join(30)
            assert checked == ["other"], "the other thread's checks failed (see its exception above)"

    for name in ("transposed_linear",):
        real = getattr(cpu_kernels, name)
        monkeypatch.setattr(cpu_kernels, name, lambda *a, _r=real: (ran.append(threading.current_thread().name),
                                                                    mid_pass(), _r(*a))[-1])
    real_packed = ATTENTION_FUNCTIONS["packed"]
    monkeypatch.setitem(ATTENTION_FUNCTIONS, "packed",
                        lambda *a: ran.append(threading.current_thread().name) or real_packed(*a))
    model = tiny_model(arch, dtype=torch.float64)
    spec = selfspec.wrap(model, plan=selfspec.DraftPlan(layers=(0, 1, 2), draft_length=3, policy="fixed"))
    spec.kernel_choice.linear_choices[torch.get_num_threads()] = EVERYWHERE
    spec.kernel_choice.attention_choices[torch.get_num_threads()] = PACKED
    prompt = random_prompt(9, seed=1)
    assert torch.equal(spec.generate(prompt, max_new_tokens=12), model.generate(prompt, do_sample=False,
                                                                                 max_new_tokens=12))
    main = threading.current_thread().name
    assert checked == ["other"] and set(ran) == {main}  # the pass ran its kernels; the other thread never did
    untouched(*originals)


def _attention_inputs(heads: int, kv_heads: int, rows: int, q: int, kv: int, *, masked: bool):
    generator = torch.Generator().manual_seed(heads * 100 + q)
    query = torch.randn(rows, heads, q, 8, dtype=torch.float64, generator=generator)
    key, value = (torch.randn(rows, kv_heads, kv, 8, dtype=torch.float64, generator=generator) for _ in "kv")
    if not masked:
        return query, key, value, None
    # A tree-like mask: every query sees the prefix, itself and a random half of the other new entries.
    mask = torch.rand(rows, 1, q, q, generator=generator) < 0.5
    mask |= torch.eye(q, dtype=torch.bool)
    return query, key, value, torch.cat([torch.ones(rows, 1, q, kv - q, dtype=torch.bool), mask], dim=-1)


@pytest.mark.parametrize("kernel", sorted(ATTENTION_FUNCTIONS))
@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 4), (4, 1)])
def test_every_attention_kernel_computes_what_sdpa_computes(kernel, heads, kv_heads):
    for rows, q, kv, masked in [(1, 1, 9, False), (1, 1, 9, True), (1, 5, 12, True), (2, 3, 7, True)]:
        query, key, value, mask = _attention_inputs(heads, kv_heads, rows, q, kv, masked=masked)
        expected = torch.nn.functional.scaled_dot_product_attention(
            query, key.repeat_interleave(heads // kv_heads, 1), value.repeat_interleave(heads // kv_heads, 1),
            attn_mask=mask, scale=0.3)  # [rows, heads, q, d]: K/V copied per query head, transformers' old way
        out = ATTENTION_FUNCTIONS[kernel](query, key, value, mask, 0.3)
        assert out.shape == expected.shape and out.dtype == torch.float64
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    query, key, value, _ = _attention_inputs(heads, kv_heads, 1, 1, 9, masked=False)
    low = ATTENTION_FUNCTIONS[kernel](*(t.bfloat16() for t in (query, key, value)), None, 0.3)
    assert low.dtype == torch.bfloat16  # the result in the pass's dtype, whatever it computed in
    torch.testing.assert_close(low.double(), sdpa_attention(query, key, value, None, 0.3), rtol=0, atol=0.05)


def test_the_attention_entry_runs_the_kernel_chosen_for_the_queries_and_entries_else_transformers(monkeypatch):
    ran = []
    for name in ATTENTION_FUNCTIONS:
        real = ATTENTION_FUNCTIONS[name]
        monkeypatch.setitem(ATTENTION_FUNCTIONS, name, lambda *a, _n=name, _r=real: ran.append(_n) or _r(*a))
    choice = AttentionKernels((1, 4), (64, 1024), (("packed", "float32"), ("sdpa", "float32")))
    assert [choice(q, kv) for q, kv in [(1, 10), (1, 64), (3, 1023), (1, 5000), (4, 64), (7, 2000), (8, 64)]] == [
        "packed", "packed", "packed", "float32", "sdpa", "float32", "sdpa"]  # 8 > twice the last query count
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal, module.training = 3, True, False
    with cpu_kernels.cpu_kernels(attention=choice):
        entry = cpu_kernels.attention_function("sdpa", None)  # what a layer selfspec computes calls

        def attend(q, kv, *, masked=True, **options):
            query, key, value, mask = _attention_inputs(6, 2, 1, q, kv, masked=masked)
            out, _ = entry(module, query, key, value, mask, scaling=0.3, **options)  # [1, q, heads, d]
            causal = torch.ones(q, kv, dtype=torch.bool).tril(kv - q)[None, None]  # what no mask means for q > 1
            expected = sdpa_attention(query, key, value, causal if mask is None else mask, 0.3).transpose(1, 2)
            torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
            return ran.pop() if ran else "transformers"

        assert attend(1, 9, masked=False) == "packed"
        assert attend(1, 2000) == "float32"
        assert attend(5, 80) == "transformers"  # sdpa chosen: transformers' own function
        assert attend(5, 2000) == "float32"
        assert attend(5, 5, masked=False) == "transformers"  # a causal pass with no mask: transformers' own
        assert attend(1, 9, softcap=None) == "packed"  # an option left unset changes nothing
    assert AttentionKernels.from_dict(choice.to_dict()) == choice
    assert choice.describe() == "1 query: packed from 64, float32 from 1024; 4 queries: float32 from 1024"
    assert not NO_ATTENTION_CHANGE and NO_ATTENTION_CHANGE(1, 100) == "sdpa"
    with pytest.raises(ValueError, match="not a choice of attention kernels"):
        AttentionKernels.from_dict({"queries": [1], "keys": [64], "kernels": [["flash"]]})


def test_transformers_modules_sdpa_calls_run_the_kernel_chosen_for_the_queries_and_entries_else_torchs(monkeypatch):
    """Under `chosen_kernels` (transformers' own modules), torch's sdpa as transformers calls it: K/V heads shared
    by `enable_gqa`, copied per query head, or a mask of one row for every query; anything else to torch's."""
    ran = []
    for name in ATTENTION_FUNCTIONS:
        real = ATTENTION_FUNCTIONS[name]
        monkeypatch.setitem(ATTENTION_FUNCTIONS, name, lambda *a, _n=name, _r=real: ran.append(_n) or _r(*a))
    choice = AttentionKernels((1, 4), (64, 1024), (("packed", "float32"), ("sdpa", "float32")))
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def attend(heads, kv_heads, q, kv, *, masked=True, one_row=False, **options):
        query, key, value, mask = _attention_inputs(heads, kv_heads, 1, q, kv, masked=masked)
        if one_row:
            mask = mask[:, :, :1]  # [1, 1, 1, kv]: broadcast over the queries
        options.setdefault("enable_gqa", heads != kv_heads)
        expected = sdpa(query, key, value, attn_mask=mask, scale=0.3, **options)
        with cpu_kernels.cpu_kernels(attention=choice), chosen_kernels(torch.zeros(1, q, 8)):
            out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=0.3,
                                                                   **options)
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
        return ran.pop() if ran else "torch"

    assert attend(6, 2, 1, 9, masked=False) == "packed"  # one query, K/V shared by enable_gqa
    assert attend(6, 2, 1, 2000, masked=False) == "float32"
    assert attend(6, 6, 3, 12) == "packed"  # K/V copied per query head (a mask: transformers' repeat_kv)
    assert attend(2, 2, 3, 12, one_row=True) == "packed"  # one query's grouped heads as queries
    assert attend(6, 2, 5, 2000) == "float32"
    assert attend(6, 2, 5, 80) == "torch"  # sdpa chosen: torch's own
    assert attend(6, 2, 3, 3, masked=False, is_causal=True) == "torch"  # causal: torch's own
    assert attend(6, 6, 1, 9, masked=False, dropout_p=0.0) == "packed"
    query, key, value, mask = _attention_inputs(6, 6, 1, 1, 9, masked=True)
    additive = torch.zeros(mask.shape, dtype=query.dtype).masked_fill(~mask, float("-inf"))
    with cpu_kernels.cpu_kernels(attention=choice):
        cpu_kernels.chosen_sdpa(query, key, value, attn_mask=additive, scale=0.3)  # a float mask: torch's own
    assert not ran


def test_measuring_times_every_attention_kernel_that_applies_on_the_heads_shape(monkeypatch):
    timed = []
    real = cpu_kernels.fastest
    monkeypatch.setattr(cpu_kernels, "fastest", lambda runs, **kw: timed.extend(runs) or real(runs, **kw))
    cpu = torch.device("cpu")
    choice = measure_attention_kernels(heads=4, kv_heads=2, head_dim=8, dtype=torch.float32, device=cpu,
                                       max_keys=300, repeats=1)
    assert choice.queries == ATTENTION_QUERIES and choice.keys == (64, 256)  # no more entries than the model holds
    assert {k for _, k in timed} == set(ATTENTION_FUNCTIONS)
    assert {shape for shape, _ in timed} == {(q, kv) for q in ATTENTION_QUERIES for kv in (64, 256)}
    timed.clear()
    measure_attention_kernels(heads=4, kv_heads=4, head_dim=8, dtype=torch.float32, device=cpu, max_keys=64,
                              repeats=1)
    assert {k for _, k in timed} == {"sdpa", "float32"}  # no grouped heads: nothing to fold
    with pytest.raises(ValueError, match="cannot share"):
        measure_attention_kernels(heads=4, kv_heads=3, head_dim=8, dtype=torch.float32, device=cpu)


def test_transposed_linear_computes_what_linear_computes():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, dtype=torch.float64, generator=generator)
    weight = torch.randn(7, 5, dtype=torch.float64, generator=generator)
    bias = torch.randn(7, dtype=torch.float64, generator=generator)
    for b in (None, bias):
        out = transposed_linear(x, weight, b)
        assert out.shape == (2, 3, 7) and out.is_contiguous()
        torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, b), rtol=0, atol=1e-12)


def test_onednn_linear_computes_what_linear_computes_in_float32():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 40, generator=generator)
    weight = torch.randn(24, 40, generator=generator)
    bias = torch.randn(24, generator=generator)
    assert onednn_usable(weight)
    for b in (None, bias):
        out = onednn_linear(x, weight, b)
        assert out.shape == (2, 3, 24)
        torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, b), rtol=0, atol=1e-5)
    assert not onednn_usable(weight.double())  # oneDNN has no float64 matmul: never offered there
    assert not onednn_usable(weight.T)  # a weight it would have to copy


def test_packed_copies_compute_what_linear_computes_and_a_weight_changed_since_has_none():
    generator = torch.Generator().manual_seed(0)
    layers = [torch.nn.Linear(40, 24), torch.nn.Linear(40, 24, bias=False)]
    tied = torch.nn.Linear(40, 24, bias=False)
    tied.weight = layers[1].weight  # one weight in two modules: one copy
    packed = PackedWeights([*layers, tied, torch.nn.LayerNorm(40), torch.nn.Linear(3, 2).double()])
    assert len(packed) == 2 and packed.nbytes == 2 * 24 * 40 * 4  # float64 has no oneDNN matmul: not packed
    x = torch.randn(2, 3, 40, generator=generator)
    with torch.no_grad():
        for layer in layers:
            out = packed_linear(x, packed.get(layer.weight), 24, layer.bias)
            assert out.shape == (2, 3, 24)
            torch.testing.assert_close(out, layer(x), rtol=0, atol=1e-5)
        assert packed.get(torch.randn(24, 40)) is None  # a weight it never packed
        layers[0].weight.mul_(2)  # changed in place: the copy would be stale
    assert packed.get(layers[0].weight) is None and packed.get(layers[1].weight) is not None
    layers[1].weight.data = torch.zeros(24, 40)  # other data, as a streamed slot or a reload gives it
    assert packed.get(layers[1].weight) is None


def test_the_packed_kernel_runs_a_weights_copy_else_the_kernel_measured_without_copies(monkeypatch):
    ran = []
    for name in ("packed_linear", "transposed_linear"):
        real = getattr(cpu_kernels, name)
        monkeypatch.setattr(cpu_kernels, name, lambda *a, real=real, name=name: ran.append(name) or real(*a))
    layer, other = torch.nn.Linear(6, 5), torch.nn.Linear(6, 5)
    n = len(LINEAR_ROWS)
    choice = LinearKernels(LINEAR_ROWS, ("packed",) * n, ("transposed",) * n, PackedWeights([layer]))
    with cpu_kernels.cpu_kernels(linear=choice):
        linear = cpu_kernels.linear_function()
        with torch.no_grad():
            torch.testing.assert_close(linear(torch.ones(3, 6), layer.weight, layer.bias), layer(torch.ones(3, 6)))
            linear(torch.ones(3, 6), other.weight, other.bias)  # no copy: the unpacked kernel
        assert ran == ["packed_linear", "transposed_linear"]
        x = torch.randn(3, 6, requires_grad=True)
        linear(x, layer.weight).sum().backward()  # training: oneDNN's op has no backward
        assert ran[-1] == "transposed_linear" and x.grad is not None
    unattached = LinearKernels(LINEAR_ROWS, ("packed",) * n, ("transposed",) * n)  # read from disk, no copies
    ran.clear()
    with cpu_kernels.cpu_kernels(linear=unattached), torch.no_grad():
        cpu_kernels.linear_function()(torch.ones(2, 6), layer.weight)
    assert ran == ["transposed_linear"]


def test_onednn_is_chosen_only_where_it_can_run_and_autograd_goes_to_f_linear(monkeypatch):
    ran = []
    real = cpu_kernels.onednn_linear
    monkeypatch.setattr(cpu_kernels, "onednn_linear", lambda *a: ran.append(1) or real(*a))
    everywhere = LinearKernels(LINEAR_ROWS, ("onednn",) * len(LINEAR_ROWS))
    weight = torch.randn(5, 6)
    with cpu_kernels.cpu_kernels(linear=everywhere):
        linear = cpu_kernels.linear_function()  # what selfspec's calls run
        with torch.no_grad():
            linear(torch.randn(3, 6), weight)
        assert ran == [1]
        x = torch.randn(3, 6, requires_grad=True)
        out = linear(x, weight)  # training: oneDNN's op has no backward
        out.sum().backward()
        assert ran == [1] and x.grad is not None
        linear(torch.randn(3, 6, dtype=torch.float64), weight.double())  # no float64 oneDNN
        linear(torch.randn(3, 6), weight.T.contiguous().T)  # a strided weight
        assert ran == [1]


def test_a_choice_covers_the_rows_between_its_measured_ones_and_the_last_one_beyond():
    choice = LinearKernels((1, 2, 4, 8), ("linear", "transposed", "onednn", "transposed"))
    assert [choice(m) for m in (1, 2, 3, 4, 7, 8, 64, 4096)] == [
        "linear", "transposed", "transposed", "onednn", "onednn", "transposed", "transposed", "transposed"]
    assert LinearKernels.from_dict(choice.to_dict()) == choice
    assert choice.describe() == "F.linear at GEMM rows 1; (W x^T)^T at GEMM rows 2,8; oneDNN at GEMM rows 4"
    assert not NO_CHANGE and NO_CHANGE(2) == "linear" and NO_CHANGE.describe() == "as transformers runs them"
    assert not LinearKernels((1, 2), ("linear", "linear"))
    with pytest.raises(ValueError, match="not a choice of linear kernels"):
        LinearKernels.from_dict({"rows": [4, 2], "kernels": ["transposed", "linear"]})
    with pytest.raises(ValueError, match="not a choice of linear kernels"):
        LinearKernels.from_dict({"rows": [1], "kernels": ["fast"]})
    packed = LinearKernels((1, 4), ("aten", "packed"), ("aten", "onednn"))
    assert [packed(m) for m in (1, 3, 4, 9)] == ["aten", "aten", "packed", "packed"]
    assert [packed.without_copy(m) for m in (1, 3, 4, 9)] == ["aten", "aten", "onednn", "onednn"]
    assert LinearKernels.from_dict(packed.to_dict()) == packed and packed.to_dict()["unpacked"] == ["aten", "onednn"]
    assert packed.describe() == "F.linear, oneDNN off at GEMM rows 1; oneDNN on packed copies at GEMM rows 4"
    with pytest.raises(ValueError, match="names the unpacked kernel for each row count"):
        LinearKernels((1, 4), ("aten", "packed"))
    with pytest.raises(ValueError, match="not a choice of linear kernels"):
        LinearKernels.from_dict({"rows": [1], "kernels": ["packed"], "unpacked": ["packed"]})


def linear_in_another_thread(x: torch.Tensor, weight: torch.Tensor, linear: LinearKernels = NO_CHANGE) -> None:
    """On a thread named "other" that chose `linear`, while this one waits (inside `cpu_kernels`, say): F.linear
    (x, weight) as selfspec's calls run it, and as torch's."""

    def run() -> None:
        with cpu_kernels.cpu_kernels(linear=linear):
            cpu_kernels.linear_function()(x, weight)
            torch.nn.functional.linear(x, weight)

    thread = threading.Thread(target=run, name="other")
    thread.start()
    thread.join(5)
    assert not thread.is_alive()


def test_only_the_thread_that_chose_a_kernel_runs_it(monkeypatch):
    taken = []
    real = cpu_kernels.transposed_linear
    monkeypatch.setattr(cpu_kernels, "transposed_linear",
                        lambda *a: taken.append(threading.current_thread().name) or real(*a))
    x, weight = torch.randn(4, 6), torch.randn(3, 6)
    with cpu_kernels.cpu_kernels(linear=EVERYWHERE):
        linear_in_another_thread(x, weight)
        cpu_kernels.linear_function()(x, weight)
        torch.nn.functional.linear(x, weight)  # torch's own, called directly: not selfspec's choice
    assert taken == [threading.current_thread().name]


def test_measuring_times_the_plain_linear_layers_with_every_kernel_that_runs(monkeypatch):
    model = tiny_model("llama", dtype=torch.float32)
    parts = selfspec.wrap(model).parts
    timed = []
    real = cpu_kernels.fastest
    monkeypatch.setattr(cpu_kernels, "fastest", lambda runs, **kw: timed.extend(runs) or real(runs, **kw))
    choice = measure_linear_kernels([*parts.layers.modules(), parts.lm_head], repeats=1)
    assert choice.rows == LINEAR_ROWS and set(choice.kernels) <= set(LINEAR_KERNELS)
    # oneDNN runs float32 here: timed with the others; switching it off changes nothing in float32 (the BLAS runs)
    assert {k for _, k in timed} == {"linear", "transposed", "onednn"}
    assert measure_linear_kernels([parts.norm]) is NO_CHANGE  # no linear layer to time
    timed.clear()
    double = tiny_model("llama", dtype=torch.float64)
    measure_linear_kernels(list(double.modules()), repeats=1)
    assert {k for _, k in timed} == {"linear", "transposed"}  # float64: no oneDNN
    timed.clear()
    half = tiny_model("llama", dtype=torch.bfloat16)
    measure_linear_kernels(list(half.modules()), repeats=1)
    assert {k for _, k in timed} == set(COPYLESS_KERNELS)  # bfloat16: torch hands it to oneDNN, or runs its own
    timed.clear()
    with onednn_switched_off():  # by the user: F.linear already runs torch's own
        measure_linear_kernels(list(half.modules()), repeats=1)
    assert {k for _, k in timed} == {"linear", "transposed", "onednn"}
    timed.clear()
    modules = [*parts.layers.modules(), parts.lm_head]
    packed = PackedWeights(modules)
    choice = measure_linear_kernels(modules, repeats=1, packed=packed)
    assert {k for _, k in timed} == {"linear", "transposed", "onednn", "packed"}
    assert (choice.packed is packed) == ("packed" in choice.kernels)  # the copies held only where they run
    assert set(choice.unpacked) <= set(COPYLESS_KERNELS)


def test_a_measured_choice_holds_the_copies_where_packed_wins_and_names_the_kernel_without_them(monkeypatch):
    model = tiny_model("llama", dtype=torch.float32)
    parts = selfspec.wrap(model).parts
    modules = [*parts.layers.modules(), parts.lm_head]
    # Timings where the packed copies win from 4 rows on, and (W x^T)^T is the best of the rest from 8.
    fake = {"linear": 10.0, "transposed": 9.0, "onednn": 9.8, "packed": 1.0}
    monkeypatch.setattr(cpu_kernels, "fastest", lambda runs, **kw: {
        (m, k): (fake[k] if (k != "packed" or m >= 4) and (k != "transposed" or m >= 8) else 20.0)
        for m, k in runs})
    packed = PackedWeights(modules)
    choice = measure_linear_kernels(modules, repeats=1, packed=packed)
    assert choice.packed is packed and [choice(m) for m in (1, 3, 4, 64)] == ["linear", "linear", "packed", "packed"]
    assert [choice.without_copy(m) for m in (4, 8, 64)] == ["linear", "transposed", "transposed"]


@contextlib.contextmanager
def onednn_switched_off():
    """oneDNN off, as `torch.backends.mkldnn.flags(enabled=False)` would (without its TF32 warning)."""
    was = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(was)


def test_aten_switches_onednn_off_for_its_call_alone_and_other_threads_wait(monkeypatch):
    """`aten` runs F.linear with oneDNN off and puts the switch back as it was (the one process-wide switch left);
    another thread's chosen F.linear, while a thread may switch it, runs under the same lock, so never in the
    middle of that call."""
    seen = []
    real = cpu_kernels._linear

    def recording(*args):
        seen.append((threading.current_thread().name, torch._C._get_mkldnn_enabled(), cpu_kernels._switch.locked()))
        return real(*args)

    monkeypatch.setattr(cpu_kernels, "_linear", recording)
    x, weight = torch.randn(1, 6, dtype=torch.bfloat16), torch.randn(3, 6, dtype=torch.bfloat16)
    with cpu_kernels.cpu_kernels(linear=LinearKernels((1,), ("aten",))):
        cpu_kernels.linear_function()(x, weight)
        linear_in_another_thread(x, weight, LinearKernels((1, 2), ("linear", "transposed")))  # F.linear at 1 row
    main = threading.current_thread().name
    assert seen == [(main, False, True), ("other", True, True)]  # torch's own F.linear call: not recorded
    assert torch._C._get_mkldnn_enabled() and not cpu_kernels._aten_threads
    seen.clear()
    with onednn_switched_off():
        cpu_kernels.aten_linear(x, weight)
        assert not torch._C._get_mkldnn_enabled()  # put back as the caller had it
    assert seen == [(main, False, True)] and torch.nn.functional.linear is not cpu_kernels.chosen_linear


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kernel", ["transposed", "onednn", "aten", "packed"])
def test_greedy_output_stays_equal_with_every_pass_on_another_linear_kernel(arch, kernel, monkeypatch):
    """Every linear layer of every pass (prefills included) transposed or with oneDNN off, in float64, or by
    oneDNN (on the weight or a packed copy), in float32 (it has no float64), with the attention kernels measured
    here: greedy output token-identical to `model.generate`, one sequence (layer drafts and n-gram proposals)
    and a batch."""
    ran = []
    name = f"{kernel}_linear"
    real = getattr(cpu_kernels, name)
    monkeypatch.setattr(cpu_kernels, name, lambda *a: ran.append(1) or real(*a))
    model = tiny_model(arch, dtype=torch.float32 if kernel in ("onednn", "packed") else torch.float64)
    num_layers = model.config.get_text_config().num_hidden_layers
    plan = selfspec.DraftPlan(layers=tuple(range(num_layers // 2)), draft_length=4, ngram=2, policy="fixed")
    spec = selfspec.wrap(model, plan=plan)
    n = len(LINEAR_ROWS)
    if kernel == "packed":  # every layer's weight and the LM head's packed
        copies = PackedWeights([*spec.parts.layers.modules(), spec.parts.lm_head])
        choice = LinearKernels(LINEAR_ROWS, (kernel,) * n, ("linear",) * n, copies)
    else:
        choice = LinearKernels(LINEAR_ROWS, (kernel,) * n)
    spec.kernel_choice.linear_choices[torch.get_num_threads()] = choice
    prompts = [random_prompt(n, seed=n) for n in (7, 12)]
    for prompt in prompts:
        ref = model.generate(prompt, do_sample=False, max_new_tokens=24)
        assert torch.equal(spec.generate(prompt, max_new_tokens=24), ref)
    session = spec.batch_session()
    assert session.linear is choice
    rows = [session.add(p[0].tolist(), max_new_tokens=24, do_sample=False) for p in prompts]
    while len(session):
        session.step()
    for row, prompt in zip(rows, prompts):
        ref = model.generate(prompt, do_sample=False, max_new_tokens=24)
        assert row.new_tokens == ref[0, prompt.shape[1]:].tolist()
    assert ran  # the passes did run on that kernel


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "qwen3"])
def test_the_static_step_runs_the_packed_copies_and_stays_exact(arch, monkeypatch):
    """`step="static"` with packed copies at every row count (float32), an early exit and n-gram trees: greedy
    output token-identical to `model.generate`."""
    ran = []
    real = cpu_kernels.packed_linear
    monkeypatch.setattr(cpu_kernels, "packed_linear", lambda *a: ran.append(1) or real(*a))
    model = tiny_model(arch, dtype=torch.float32)
    num_layers = model.config.get_text_config().num_hidden_layers
    n = len(LINEAR_ROWS)
    for plan in (selfspec.DraftPlan(exit_layer=num_layers // 2, draft_length=4, ngram=2, policy="fixed"),
                 selfspec.DraftPlan(ngram=2, tree=6, recycle=True, draft_length=4, policy="fixed")):
        spec = selfspec.wrap(model, plan=plan, step="static", kernels="packed")
        copies = PackedWeights([*spec.parts.layers.modules(), spec.parts.lm_head])
        spec.kernel_choice.linear_choices[torch.get_num_threads()] = LinearKernels(LINEAR_ROWS, ("packed",) * n,
                                                                                   ("linear",) * n, copies)
        for seed, length in ((1, 7), (2, 15)):
            prompt = random_prompt(length, seed=seed)
            ref = model.generate(prompt, do_sample=False, max_new_tokens=24)
            assert torch.equal(spec.generate(prompt, max_new_tokens=24), ref)
            assert spec.last_stats.step == "static"
    assert ran


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kernel", ["packed", "float32"])
def test_greedy_output_stays_equal_with_every_pass_on_another_attention_kernel(arch, kernel, monkeypatch):
    """Every attention call the kernel can take (one query, or a mask: chains, trees, batches) on `kernel`, in
    float64: greedy output token-identical to `model.generate`, one sequence (layer drafts as trees, n-gram
    proposals) and a batch."""
    ran = []
    real = ATTENTION_FUNCTIONS[kernel]
    monkeypatch.setitem(ATTENTION_FUNCTIONS, kernel, lambda *a: ran.append(1) or real(*a))
    model = tiny_model(arch, dtype=torch.float64)
    num_layers = model.config.get_text_config().num_hidden_layers
    plan = selfspec.DraftPlan(layers=tuple(range(num_layers // 2)), draft_length=4, ngram=2, tree=6, policy="fixed")
    spec = selfspec.wrap(model, plan=plan)
    choice = AttentionKernels(ATTENTION_QUERIES, (1,), ((kernel,),) * len(ATTENTION_QUERIES))
    spec.kernel_choice.attention_choices[torch.get_num_threads()] = choice
    prompts = [random_prompt(n, seed=n) for n in (7, 12)]
    for prompt in prompts:
        ref = model.generate(prompt, do_sample=False, max_new_tokens=24)
        assert torch.equal(spec.generate(prompt, max_new_tokens=24), ref)
    if spec.parts.attn_implementation != "sdpa":  # an eager-only model (Gemma 2's capped scores): never swapped
        assert spec.attention_kernels() is NO_ATTENTION_CHANGE and not ran
        return
    assert ran  # the passes did run on that kernel
    session = spec.batch_session()
    assert session.attention is choice
    rows = [session.add(p[0].tolist(), max_new_tokens=24, do_sample=False) for p in prompts]
    while len(session):
        session.step()
    for row, prompt in zip(rows, prompts):
        ref = model.generate(prompt, do_sample=False, max_new_tokens=24)
        assert row.new_tokens == ref[0, prompt.shape[1]:].tolist()


def test_the_kernels_are_measured_once_cached_apart_and_key_the_cost_tables(tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_COSTS_CACHE", str(tmp_path))
    model = tiny_model("llama", dtype=torch.float32)
    spec = selfspec.wrap(model)
    choice = spec.linear_kernels()
    assert choice.rows == LINEAR_ROWS and spec.linear_kernels() is choice  # once per thread count
    assert len(list((tmp_path / "kernels").glob("*.json"))) == 1 and not list(tmp_path.glob("*.json"))
    again = selfspec.wrap(model)
    assert again.linear_kernels() == choice  # read back from disk
    key = again.cost_tables.key()
    other = "onednn" if choice(1) != "onednn" else "linear"
    again.kernel_choice.linear_choices[torch.get_num_threads()] = LinearKernels((1,), (other,))
    assert again.cost_tables.key() != key  # a table timed with other kernels is another table
    attention = spec.attention_kernels()
    assert attention.queries == ATTENTION_QUERIES and spec.attention_kernels() is attention
    assert len(list((tmp_path / "kernels").glob("*.json"))) == 2  # the attention's choice beside the linear's
    assert selfspec.wrap(model).attention_kernels() == attention  # read back from disk
    key = again.cost_tables.key()
    other = "float32" if attention(1, 64) != "float32" else "sdpa"
    again.kernel_choice.attention_choices[torch.get_num_threads()] = AttentionKernels((1,), (64,), ((other,),))
    assert again.cost_tables.key() != key


def test_kernels_transformers_runs_transformers_own_functions_and_a_bad_choice_is_refused(tmp_path, monkeypatch):
    """`wrap(kernels="transformers")` measures nothing and swaps nothing: drafting off then computes exactly what
    `model.generate` computes. Any other value is a clear error."""
    monkeypatch.setenv("SELFSPEC_COSTS_CACHE", str(tmp_path))
    model = tiny_model("llama", dtype=torch.float32)
    spec = selfspec.wrap(model, plan=selfspec.DraftPlan.plain(), kernels="transformers")
    assert spec.linear_kernels() is NO_CHANGE and spec.attention_kernels() is NO_ATTENTION_CHANGE
    prompt = random_prompt(9, seed=3)
    assert torch.equal(spec.generate(prompt, max_new_tokens=12), model.generate(prompt, do_sample=False,
                                                                                 max_new_tokens=12))
    assert not (tmp_path / "kernels").exists()  # nothing was measured
    assert selfspec.wrap(model).kernel_choice.choice == "measured"
    with pytest.raises(ValueError, match="kernels must be one of 'measured', 'packed', 'transformers', got 'fast'"):
        selfspec.wrap(model, kernels="fast")


def test_kernels_packed_keeps_the_copies_only_where_they_win_counts_them_and_caches_its_choice_apart(tmp_path,
                                                                                                    monkeypatch):
    monkeypatch.setenv("SELFSPEC_COSTS_CACHE", str(tmp_path))
    model = tiny_model("llama", dtype=torch.float32)
    measured = selfspec.wrap(model).linear_kernels()
    n = len(LINEAR_ROWS)
    wins = LinearKernels(LINEAR_ROWS, ("linear",) + ("packed",) * (n - 1), ("linear",) * n)
    monkeypatch.setattr(selfspec.kernel_choice, "measure_linear_kernels",
                        lambda modules, packed=None: dataclasses.replace(wins, packed=packed))
    spec = selfspec.wrap(model, kernels="packed")
    choice = spec.linear_kernels()
    weights = [m.weight for m in [*spec.parts.layers.modules(), spec.parts.lm_head]
               if isinstance(m, torch.nn.Linear)]
    assert choice == wins and choice.packed is not None and all(choice.packed.get(w) is not None for w in weights)
    assert spec.memory(context=16).packed_bytes == choice.packed.nbytes > 0
    assert "packed weight copies" in spec.memory(context=16).summary()
    assert len(list((tmp_path / "kernels").glob("*.json"))) == 2  # apart from the measured kernels' choice
    again = selfspec.wrap(model, kernels="packed").linear_kernels()  # read from disk: copies made here
    assert again == wins and again.packed is not None and again.packed is not choice.packed
    prompt = random_prompt(9, seed=3)
    assert torch.equal(spec.generate(prompt, max_new_tokens=12), model.generate(prompt, do_sample=False,
                                                                                 max_new_tokens=12))
    assert selfspec.wrap(model).linear_kernels() == measured and selfspec.wrap(model).memory(context=16).packed_bytes == 0
    with pytest.warns(UserWarning, match="an int8-quantized model runs its own kernels, nothing is packed"):
        selfspec.kernel_choice.KernelChoice(model, spec.parts, quantization="int8", choice="packed")
    monkeypatch.setattr(selfspec.kernel_choice, "measure_linear_kernels", lambda modules, packed=None: NO_CHANGE)
    monkeypatch.setenv("SELFSPEC_COSTS_CACHE", str(tmp_path / "other"))
    loses = selfspec.wrap(model, kernels="packed")
    assert loses.linear_kernels() is NO_CHANGE and loses.kernel_choice._packed is None  # the copies went
    assert loses.memory(context=16).packed_bytes == 0
