"""The CPU kernel choices (`cpu_kernels.py`): grouped query heads folded into one attention call, and the linear
layers' kernel (F.linear, transposed, oneDNN). Each computes what transformers computes, only in the thread that
chose it, and greedy output stays token-identical to `model.generate`."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import selfspec
from selfspec import cpu_kernels
from selfspec.cpu_kernels import (LINEAR_KERNELS, LINEAR_ROWS, NO_CHANGE, LinearKernels, chosen_linear,
                                  measure_linear_kernels, onednn_linear, onednn_usable, packed_gqa_sdpa,
                                  transposed_linear)
from selfspec.testing import TINY_CONFIGS, random_prompt, tiny_model

ARCHS = sorted(TINY_CONFIGS)
EVERYWHERE = LinearKernels(LINEAR_ROWS, ("transposed",) * len(LINEAR_ROWS))


def test_the_functions_are_swapped_only_while_a_thread_is_inside():
    linear, sdpa_entry = torch.nn.functional.linear, ALL_ATTENTION_FUNCTIONS["sdpa"]
    assert linear is not chosen_linear and sdpa_entry is not packed_gqa_sdpa
    with cpu_kernels.cpu_kernels(attention=True, linear=EVERYWHERE):
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is packed_gqa_sdpa
        assert torch.nn.functional.linear is chosen_linear
        with cpu_kernels.cpu_kernels(attention=False):  # nested: the inner choice, then the outer one again
            assert not cpu_kernels._state.attention and cpu_kernels._state.linear is EVERYWHERE
        assert cpu_kernels._state.attention
    assert torch.nn.functional.linear is linear and ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_entry
    assert cpu_kernels._inside == 0
    with cpu_kernels.cpu_kernels(attention=False, linear=NO_CHANGE):  # nothing chosen (a GPU): nothing swapped
        assert torch.nn.functional.linear is linear and ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_entry


def test_wide_passes_fold_grouped_query_heads_into_one_kernel_call_and_compute_the_same(monkeypatch):
    """On the CPU a masked pass over several queries runs sdpa once over the K/V heads as they are, the query
    heads that share one folded into its query length (no copy of K/V per query head); a one-query pass as
    transformers runs it; the logits are those of transformers' copying path."""
    from selfspec.batch import BatchRunner

    model = tiny_model("llama", dtype=torch.float32)
    kv_heads, heads = model.config.num_key_value_heads, model.config.num_attention_heads
    groups = heads // kv_heads
    assert groups == 2  # grouped K/V heads
    parts = selfspec.wrap(model).parts
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, value, **kwargs):
        calls.append((query.shape[2], key.shape[1], kwargs.get("enable_gqa", False)))
        return sdpa(query, key, value, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)

    def logits(wide_kernel: bool) -> torch.Tensor:
        runner = BatchRunner(parts, capacity=32)
        runner.wide_pass_kernel = lambda q: wide_kernel and q > 1
        for prompt in ([5, 9, 2, 7], [3, 8]):  # rows at different lengths: the pass needs a mask
            row = runner.cache.add_row()
            runner.forward_rows(torch.tensor([prompt]), [0], slice(row, row + 1))
        calls.clear()  # a prefill goes unmasked, transformers' causal kernel
        step = runner.forward_rows(torch.tensor([[1], [4]]), [4, 2], slice(0, 2))  # [2, 1, vocab]
        return torch.cat([step, runner.forward_rows(torch.tensor([[6, 2, 11], [7, 7, 3]]), [5, 3], slice(0, 2))], 1)

    with torch.no_grad():
        copied = logits(False)
        assert (3, heads, False) in calls  # transformers' path: K/V copied once per query head
        calls.clear()
        packed = logits(True)
    # The 3-token pass: each K/V head's 2 query heads folded into 6 queries; the one-token pass as transformers
    # runs it, its query heads folded into 2 queries per K/V head. Neither copies K/V nor asks for enable_gqa.
    assert set(calls) == {(groups, kv_heads, False), (3 * groups, kv_heads, False)}
    torch.testing.assert_close(packed, copied, rtol=0, atol=1e-5)


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


def test_onednn_is_chosen_only_where_it_can_run_and_autograd_goes_to_f_linear(monkeypatch):
    ran = []
    real = cpu_kernels.onednn_linear
    monkeypatch.setattr(cpu_kernels, "onednn_linear", lambda *a: ran.append(1) or real(*a))
    everywhere = LinearKernels(LINEAR_ROWS, ("onednn",) * len(LINEAR_ROWS))
    weight = torch.randn(5, 6)
    with cpu_kernels.cpu_kernels(linear=everywhere):
        with torch.no_grad():
            torch.nn.functional.linear(torch.randn(3, 6), weight)
        assert ran == [1]
        x = torch.randn(3, 6, requires_grad=True)
        out = torch.nn.functional.linear(x, weight)  # training: oneDNN's op has no backward
        out.sum().backward()
        assert ran == [1] and x.grad is not None
        torch.nn.functional.linear(torch.randn(3, 6, dtype=torch.float64), weight.double())  # no float64 oneDNN
        torch.nn.functional.linear(torch.randn(3, 6), weight.T.contiguous().T)  # a strided weight
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


def test_only_the_thread_that_chose_a_kernel_runs_it(monkeypatch):
    taken = []
    real = cpu_kernels.transposed_linear
    monkeypatch.setattr(cpu_kernels, "transposed_linear",
                        lambda *a: taken.append(threading.current_thread().name) or real(*a))
    x, weight = torch.randn(4, 6), torch.randn(3, 6)
    inside, done = threading.Event(), threading.Event()

    def other() -> None:  # runs F.linear while the main thread is inside
        inside.wait(5)
        torch.nn.functional.linear(x, weight)
        done.set()

    thread = threading.Thread(target=other, name="other")
    thread.start()
    with cpu_kernels.cpu_kernels(linear=EVERYWHERE):
        inside.set()
        assert done.wait(5)
        torch.nn.functional.linear(x, weight)
    thread.join()
    assert taken == [threading.current_thread().name]


def test_measuring_times_the_plain_linear_layers_with_every_kernel_that_runs(monkeypatch):
    model = tiny_model("llama", dtype=torch.float32)
    parts = selfspec.wrap(model).parts
    timed = []
    real = cpu_kernels.fastest
    monkeypatch.setattr(cpu_kernels, "fastest", lambda runs, **kw: timed.extend(runs) or real(runs, **kw))
    choice = measure_linear_kernels([*parts.layers.modules(), parts.lm_head], repeats=1)
    assert choice.rows == LINEAR_ROWS and set(choice.kernels) <= set(LINEAR_KERNELS)
    assert {k for _, k in timed} == set(LINEAR_KERNELS)  # oneDNN runs float32 here: timed with the others
    assert measure_linear_kernels([parts.norm]) is NO_CHANGE  # no linear layer to time
    timed.clear()
    double = tiny_model("llama", dtype=torch.float64)
    measure_linear_kernels(list(double.modules()), repeats=1)
    assert {k for _, k in timed} == {"linear", "transposed"}  # float64: no oneDNN


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kernel", ["transposed", "onednn"])
def test_greedy_output_stays_equal_with_every_pass_on_another_linear_kernel(arch, kernel, monkeypatch):
    """Every linear layer of every pass (prefills included) transposed, in float64, or by oneDNN, in float32 (it
    has no float64), and the packed attention: greedy output token-identical to `model.generate`, one sequence
    (layer drafts and n-gram proposals) and a batch."""
    ran = []
    name = f"{kernel}_linear"
    real = getattr(cpu_kernels, name)
    monkeypatch.setattr(cpu_kernels, name, lambda *a: ran.append(1) or real(*a))
    model = tiny_model(arch, dtype=torch.float64 if kernel == "transposed" else torch.float32)
    num_layers = model.config.get_text_config().num_hidden_layers
    plan = selfspec.DraftPlan(layers=tuple(range(num_layers // 2)), draft_length=4, ngram=2, policy="fixed")
    spec = selfspec.wrap(model, plan=plan)
    choice = LinearKernels(LINEAR_ROWS, (kernel,) * len(LINEAR_ROWS))
    spec.linear_choices[torch.get_num_threads()] = choice
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


def test_the_kernels_are_measured_once_cached_apart_and_key_the_cost_tables(tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_COSTS_CACHE", str(tmp_path))
    model = tiny_model("llama", dtype=torch.float32)
    spec = selfspec.wrap(model)
    choice = spec.linear_kernels()
    assert choice.rows == LINEAR_ROWS and spec.linear_kernels() is choice  # once per thread count
    assert len(list((tmp_path / "kernels").glob("*.json"))) == 1 and not list(tmp_path.glob("*.json"))
    again = selfspec.wrap(model)
    assert again.linear_kernels() == choice  # read back from disk
    key = again._costs_key()
    other = "onednn" if choice(1) != "onednn" else "linear"
    again.linear_choices[torch.get_num_threads()] = LinearKernels((1,), (other,))
    assert again._costs_key() != key  # a table timed with other kernels is another table
