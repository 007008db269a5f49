"""The harness's near-tie rule: which differences from the baseline are rounding, which are errors.

A stub target returns a chosen logit row at the first difference, so the rule
is tested on the exact cases it must separate: two tokens one bf16 step apart
at the top (a near-tie), a clear gap (an error), a flat row of small logits
(a near-tie: rounding scales with the row, not the logit), and an output that
stops early (never a near-tie).
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import torch

from benchmarks import report
import pytest

from benchmarks.measure import Row

VOCAB = 8


class StubTarget:
    """Returns `row` as the logits of the last position, whatever the input."""

    def __init__(self, row: list[float]) -> None:
        self.row = torch.tensor(row + [-20.0] * (VOCAB - len(row)))

    def __call__(self, ids: torch.Tensor):
        return SimpleNamespace(logits=self.row.expand(1, ids.shape[1], VOCAB))


def classify(row: list[float], output: list[int], baseline: list[int], dtype: str = "bfloat16") -> Row:
    prompt = SimpleNamespace(input_ids=torch.tensor([[3, 4, 5]]))
    rows = [Row("hf-greedy", "p", "c", 3, output=baseline), Row("method", "p", "c", 3, output=output)]
    report.compare_with_baseline(rows, "hf-greedy")
    report.explain_differences(StubTarget(row), rows, {"p": prompt}, dtype, "hf-greedy")
    return rows[1]


def test_one_bf16_step_at_the_top_is_a_near_tie():
    got = classify([16.875, 16.75, 16.75], output=[7, 0, 2], baseline=[7, 1, 1])
    assert got.first_difference == 1 and got.near_tie and got.difference_gap < 2**-5


def test_a_clear_gap_is_not_a_near_tie():
    got = classify([18.0, 16.0], output=[1, 1], baseline=[0, 0])
    assert got.first_difference == 0 and got.near_tie is False and got.difference_gap > 0.05


def test_a_flat_row_of_small_logits_is_scaled_by_the_row():
    got = classify([1.76, 1.60, 1.48], output=[1], baseline=[0])
    assert got.near_tie and abs(got.difference_gap - 0.16 / 20) < 1e-6


def test_an_output_that_stops_early_is_not_a_near_tie():
    got = classify([16.875, 16.75], output=[0, 1], baseline=[0, 1, 2, 3])
    assert got.identical is False and got.near_tie is False


def test_float32_bound_is_tighter():
    assert classify([16.875, 16.75], output=[1], baseline=[0], dtype="float32").near_tie is False


def test_table_counts_near_ties_beside_identical():
    rows = [Row("hf-greedy", "a", "c", 3, output=[1, 2], seconds=1.0, new_tokens=2),
            Row("m", "a", "c", 3, output=[1, 3], seconds=1.0, new_tokens=2, near_tie=True)]
    report.compare_with_baseline(rows, "hf-greedy")
    rows[1].near_tie = True
    summary = report.summarize(rows, ["hf-greedy", "m"], ["c"], "hf-greedy")
    table = report.markdown({}, summary, rows, {}, {})
    assert "| 0/1 (+1 near-tie) |" in table and "| 1/1 |" in table


def test_tokens_per_step_read_sums_over_prompts_and_reads_na_for_other_methods():
    rows = [Row("hf-greedy", p, "c", 3, output=[1], seconds=1.0, new_tokens=10) for p in "ab"]
    rows += [Row("selfspec-plan", "a", "c", 3, output=[1], seconds=1.0, new_tokens=10, details={"steps_read": 4.0}),
             Row("selfspec-plan", "b", "c", 3, output=[1], seconds=1.0, new_tokens=30, details={"steps_read": 16.0})]
    summary = report.summarize(rows, ["hf-greedy", "selfspec-plan"], ["c"], "hf-greedy")
    assert summary["overall"]["selfspec-plan"]["tokens_per_step_read"] == pytest.approx(40 / 20)
    assert summary["overall"]["hf-greedy"]["tokens_per_step_read"] is None
    table = report.markdown({}, summary, rows, {}, {})
    assert "| 2.00x | 1.00x | n/a | 2.00 | n/a |" in table and "| tokens/pass | tokens/step read |" in table


def _paired_rows(speeds: dict[str, list[float]], outputs: dict[str, list[list[int]]] | None = None) -> list[Row]:
    """Rows of methods over prompts p0, p1, ...: `speeds[method][i]` tok/s on prompt i (10 tokens each)."""
    rows = []
    for method, values in speeds.items():
        for i, tps in enumerate(values):
            output = (outputs or {}).get(method, [[1, 2]] * len(values))[i]
            rows.append(Row(method, f"p{i}", "c", 3, new_tokens=10, seconds=10 / tps, output=output))
    return rows


def test_the_paired_comparison_is_a_geometric_mean_of_per_prompt_ratios_with_its_interval():
    rows = _paired_rows({"selfspec-plan": [10, 20, 40, 10], "fast": [20, 40, 80, 20], "mixed": [20, 10, 40, 10]},
                        {"mixed": [[1, 2], [1, 2], [9], [1, 2]]})
    fast = report.paired_comparison(rows, "fast", "selfspec-plan")
    assert fast["prompts"] == 4 and abs(fast["ratio"] - 2.0) < 1e-12
    assert abs(fast["low"] - 2.0) < 1e-12 and abs(fast["high"] - 2.0) < 1e-12  # the same ratio on every prompt
    mixed = report.paired_comparison(rows, "mixed", "selfspec-plan")
    assert abs(mixed["ratio"] - 1.0) < 1e-12  # 2x, 0.5x, 1x, 1x: the prompts weigh alike, not by their time
    assert mixed["low"] < 1.0 < mixed["high"]
    # Prompt p2's text differs: the same-text mean is over p0, p1, p3 only.
    assert mixed["same_text_prompts"] == 3 and abs(mixed["same_text_ratio"] - 1.0) < 1e-12
    assert report.paired_comparison(rows, "mixed", "selfspec-plan") == mixed  # a fixed seed: the same interval
    summary = report.summarize(rows + _paired_rows({"hf-greedy": [5, 5, 5, 5]}),
                               ["hf-greedy", "selfspec-plan", "fast", "mixed"], ["c"], "hf-greedy")
    assert set(summary["paired"]["methods"]) == {"fast", "mixed"}
    table = report.markdown({}, summary, rows, {}, {})
    assert "## Paired with selfspec-plan" in table and "| fast | 2.000x | 2.00-2.00 | 4 | 2.000x | 2.00-2.00 | 4 |" in table


def test_decode_speed_leaves_the_prefill_out_of_the_paired_comparison():
    """Two methods that decode alike, one with a prompt that ended after 2 tokens: its tokens per second are
    mostly prefill and move the all-prompts mean; the decode mean sets it apart."""
    rows = []
    for method, prefill in (("selfspec-plan", 0.5), ("other", 0.5)):
        rows.append(Row(method, "p0", "c", 3, new_tokens=11, seconds=prefill + 1.0, first_token_seconds=prefill))
    rows.append(Row("selfspec-plan", "p1", "c", 3, new_tokens=2, seconds=0.6, first_token_seconds=0.5))
    rows.append(Row("other", "p1", "c", 3, new_tokens=11, seconds=1.5, first_token_seconds=0.5))  # 10 after the first
    paired = report.paired_comparison(rows, "other", "selfspec-plan")
    assert paired["ratio"] == pytest.approx(math.sqrt(1.0 * (11 / 1.5) / (2 / 0.6)))
    assert paired["decode_prompts"] == 2 and paired["decode_ratio"] == pytest.approx(1.0)  # 10 tok/s each
    assert report.aggregate([r for r in rows if r.method == "other"])["decode_tokens_per_second"] == pytest.approx(10)
    unknown = Row("hf-greedy", "p0", "c", 3, new_tokens=11, seconds=1.5)  # a run written before the clock
    assert unknown.decode_tokens_per_second is None and report.aggregate([unknown])["decode_tokens_per_second"] is None


def test_every_method_notes_its_first_token_and_keeps_its_output():
    """The harness's streamer sees the first new token of transformers' `generate` and of selfspec's alike."""
    from benchmarks.measure import FirstTokenClock, measure
    from benchmarks.methods import hf_method, selfspec_method
    from benchmarks.workload import Prompt
    from selfspec.testing import random_prompt, tiny_model
    import selfspec

    model = tiny_model("llama", torch.float32)
    prompt = Prompt("p", "c", "", random_prompt(12, seed=3))
    methods = [hf_method("hf-greedy", "", model, max_new_tokens=12),
               selfspec_method("selfspec-plan", "", model, selfspec.DraftPlan(exit_layer=1, draft_length=3),
                               max_new_tokens=12)]
    rows = [measure(method, prompt, torch.device("cpu")) for method in methods]
    for row in rows:
        assert row.error is None and row.new_tokens == 12
        assert 0 < row.first_token_seconds < row.seconds and row.decode_tokens_per_second > 0
    assert rows[0].output == rows[1].output
    clock = FirstTokenClock(torch.device("cpu"))
    clock.put(torch.tensor([[1, 2]]))
    assert clock.at is None  # the prompt is not a new token
    clock.put(torch.tensor([3]))
    assert clock.at is not None


def test_a_paired_comparison_reads_a_finished_run_back(tmp_path, capsys):
    rows = _paired_rows({"selfspec-plan": [10, 20], "fast": [20, 40]})
    path = tmp_path / "bench.json"
    report.write_json(path, {}, {}, rows, {})
    assert report.main([str(path)]) == 0
    assert "| fast | 2.000x | 2.00-2.00 | 2 |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        report.main([str(path), "nothing"])


# --------------------------------------------------------------------------- weight variants (benchmarks.run --variants)

from benchmarks import quantized, run  # noqa: E402
from benchmarks.variants import (  # noqa: E402
    Variant,
    memory_summary,
    method_name,
    parse_variants,
    split_method_name,
)
from selfspec.memory import MemoryReport  # noqa: E402

MIB = 2**20


def test_variants_parse_in_order_with_their_quantization():
    got = parse_variants("bfloat16, bfloat16+int8,bfloat16+int4,float32,")
    assert [v.name for v in got] == ["bfloat16", "bfloat16+int8", "bfloat16+int4", "float32"]
    assert got[1] == Variant("bfloat16", "int8") and got[0].quantize is None
    offloaded = parse_variants("bfloat16+offload15,bfloat16+int8+offload3")
    assert offloaded == [Variant("bfloat16", None, 15), Variant("bfloat16", "int8", 3)]
    assert [v.name for v in offloaded] == ["bfloat16+offload15", "bfloat16+int8+offload3"]


@pytest.mark.parametrize("text, message", [
    ("bf16", "dtype 'bf16' unknown"),
    ("bfloat16+int3", "'int3' unknown"),
    ("bfloat16+", "'' unknown"),
    ("bfloat16+offloadx", "'offloadx' unknown"),
    ("bfloat16+int8+int4", "'int4' unknown"),
    ("bfloat16,bfloat16", "listed twice"),
    (" , ", "no variant"),
])
def test_a_bad_variant_is_refused_in_one_line(text, message):
    with pytest.raises(ValueError, match=message):
        parse_variants(text)


def test_method_names_carry_their_variant():
    assert method_name("bfloat16+int4", "selfspec-plan") == "bfloat16+int4/selfspec-plan"
    assert method_name(None, "plan:x") == "plan:x"
    assert split_method_name("bfloat16+int4/plan:x") == ("bfloat16+int4", "plan:x")
    assert split_method_name("hf-greedy") == (None, "hf-greedy")


def test_run_options_for_variants():
    args = run.parse_args(["--variants", "bfloat16,bfloat16+int4"])
    assert [v.name for v in args.variant_list] == ["bfloat16", "bfloat16+int4"]
    assert args.methods == run.VARIANT_METHODS and args.per_category == 5
    single = run.parse_args(["--quantize", "int8"])
    assert single.variant_list == [Variant("bfloat16", "int8")] and single.methods is None
    assert run.parse_args([]).variant_list == [Variant("bfloat16", None)]
    for bad in (["--variants", "bfloat16", "--dtype", "float32"], ["--variants", "bfloat16+int9"]):
        with pytest.raises(SystemExit):
            run.parse_args(bad)


def test_the_quantized_shortcut_adds_only_what_is_not_given():
    argv = quantized.with_defaults(["--threads", "1", "--max-new-tokens=8"])
    args = run.parse_args(argv)
    assert [v.name for v in args.variant_list] == ["bfloat16", "bfloat16+int8", "bfloat16+int4"]
    assert (args.per_category, args.max_new_tokens, args.threads) == (2, 8, 1)
    assert args.methods == "hf-greedy,selfspec-plain,selfspec-plan"
    assert "--variants" not in quantized.with_defaults(["--dtype", "float32"])


def _memory(weights: float, embedding: float, kv: float, quantization=None) -> dict:
    return memory_summary(MemoryReport(int(weights * MIB), int(embedding * MIB), int(kv * MIB), 600, 0, 0,
                                       quantization))


def _variant_rows() -> list[Row]:
    """Two prompts, two variants, two methods each; int4's selfspec-plan differs from its own generate once."""
    rows = []
    for variant, base_s, plan_s in (("bfloat16", 1.0, 0.5), ("bfloat16+int4", 0.5, 0.4)):
        for pid in ("a", "b"):
            rows.append(Row(f"{variant}/hf-greedy", pid, "c", 3, new_tokens=10, seconds=base_s, verify_passes=10,
                            output=[1, 2]))
            rows.append(Row(f"{variant}/selfspec-plan", pid, "c", 3, new_tokens=10, seconds=plan_s, verify_passes=5,
                            drafted=8, accepted=5, output=[1, 3] if (variant, pid) == ("bfloat16+int4", "b") else [1, 2]))
    for variant in ("bfloat16", "bfloat16+int4"):
        group = [r for r in rows if r.method.startswith(variant + "/")]
        report.compare_with_baseline(group, f"{variant}/hf-greedy")
    return rows


def test_variant_summary_against_the_reference_and_its_own_generate():
    rows = _variant_rows()
    names = [f"{v}/{m}" for v in ("bfloat16", "bfloat16+int4") for m in ("hf-greedy", "selfspec-plan")]
    summary = report.summarize(rows, names, ["c"], "bfloat16/hf-greedy")
    memory = {"bfloat16": _memory(256.0, 54.0, 11.0), "bfloat16+int4": _memory(110.0, 54.0, 11.0, "int4")}
    got = report.summarize_variants(summary["overall"], ["bfloat16", "bfloat16+int4"], memory, "hf-greedy")
    int4 = got["variants"]["bfloat16+int4"]
    assert got["reference"] == "bfloat16"
    assert int4["memory"]["rest_bytes"] == 56 * MIB
    assert int4["memory"]["weight_vs_reference"] == pytest.approx(110 / 256)
    assert int4["memory"]["kv_cache_vs_reference"] == pytest.approx(1.0)  # KV cache unchanged by weights
    assert int4["methods"]["hf-greedy"]["vs_reference"] == pytest.approx(2.0)  # 20 vs 10 tok/s
    assert int4["methods"]["selfspec-plan"]["vs_own"] == pytest.approx(0.5 / 0.4)
    assert int4["methods"]["selfspec-plan"]["vs_reference"] == pytest.approx(25 / 10)
    assert int4["methods"]["selfspec-plan"]["acceptance_rate"] == pytest.approx(5 / 8)
    assert int4["methods"]["selfspec-plan"]["tokens_per_pass"] == pytest.approx(2.0)
    assert (int4["methods"]["selfspec-plan"]["identical"], int4["methods"]["selfspec-plan"]["compared"]) == (1, 2)
    assert got["variants"]["bfloat16"]["methods"]["selfspec-plan"]["identical"] == 2

    table = report.markdown({}, summary, rows, {}, {}, got)
    assert "## Per variant: memory" in table and "## Per variant: speed" in table
    assert "| bfloat16+int4 | int4 | 110.0 (0.43x) | 54.0 | 56.0 | 11.0 (1.00x) | 0.0 |" in table
    assert "| bfloat16+int4 | selfspec-plan | 25.0 | 2.50x | 1.25x | 62.5% | 2.00 | 1/2 |" in table
    assert table.index("## Per method") < table.index("## Per variant") < table.index("## Speedup per category")


def test_a_variant_without_memory_reads_na():
    rows = _variant_rows()
    names = sorted({r.method for r in rows})
    summary = report.summarize(rows, names, ["c"], "bfloat16/hf-greedy")
    got = report.summarize_variants(summary["overall"], ["bfloat16", "bfloat16+int4"],
                                    {"bfloat16": {"error": "no adapter"}, "bfloat16+int4": _memory(110, 54, 11)},
                                    "hf-greedy")
    assert got["variants"]["bfloat16+int4"]["memory"]["weight_vs_reference"] is None
    assert "| bfloat16 | n/a | n/a | n/a | n/a | n/a | n/a |" in report.variant_lines(got)


def test_every_method_shows_its_memory_pass_peak():
    rows = [Row(m, "a", "c", 3, output=[1], seconds=1.0, new_tokens=1) for m in ("hf-greedy", "x", "y")]
    memory = {m: Row(m, "a", "c", 3, peak_bytes=(300 + i) * MIB, peak_increase_bytes=(10 + i) * MIB)
              for i, m in enumerate(("hf-greedy", "x", "y"))}
    report.compare_with_baseline(rows, "hf-greedy")
    summary = report.summarize(rows, ["hf-greedy", "x", "y"], ["c"], "hf-greedy", memory)
    table = report.markdown({}, summary, rows, {}, {})
    per_method = table.split("## Per method", 1)[1].split("## Speedup", 1)[0]  # the part the harness prints
    assert "peak MiB | working MiB" in per_method
    for i, m in enumerate(("hf-greedy", "x", "y")):
        assert f"| {300 + i} | {10 + i} |" in per_method.split(f"| {m} |", 1)[1].splitlines()[0]


def test_held_costs_are_measured_once_per_plan_and_never_refined(tmp_path, monkeypatch):
    """`--costs held`: every method of one plan is handed the one table measured for it, and an injected table
    is what the rounds price passes with, after the last prompt as before the first; a plan that decides
    without a table gets none."""
    from benchmarks.methods import HELD, selfspec_method
    from selfspec.costs import PassCosts
    from selfspec.testing import random_prompt, tiny_model
    import selfspec

    monkeypatch.setenv("SELFSPEC_COSTS_CACHE", str(tmp_path))
    wrapped = []
    original = selfspec.wrap

    def recording_wrap(model, **options):
        spec = original(model, **options)
        wrapped.append((options.get("costs"), spec))
        return spec

    monkeypatch.setattr(selfspec, "wrap", recording_wrap)
    model = tiny_model("llama", torch.float32)
    plan = selfspec.DraftPlan(exit_layer=1, draft_length=3)
    methods = [selfspec_method("selfspec-plan", "", model, plan, max_new_tokens=n, costs=HELD) for n in (4, 12)]
    handed = [costs for costs, _ in wrapped if costs is not None]
    assert len(handed) == 2 and isinstance(handed[0], PassCosts) and handed[0] is handed[1]
    spec = wrapped[-1][1]
    for seed in range(3):
        output, counts = methods[1].run(random_prompt(12, seed=seed))
        assert output.shape[1] == 24 and counts.verify_passes > 0
    assert spec.costs is handed[0] and not spec.cost_tables.measured  # no table of the rounds' own, to refine
    wrapped.clear()
    selfspec_method("selfspec-fixed", "", model, dataclasses.replace(plan, policy="fixed"), max_new_tokens=12,
                    costs=HELD)
    assert [costs for costs, _ in wrapped] == [None]


def test_the_header_gives_each_variant_and_kernel_choice_its_own_costs_and_kernels():
    from benchmarks.methods import Method

    def method(name: str, costs: str, choice: str = "measured") -> Method:
        return Method(name, "", lambda *a: None, settings={"costs": costs, "kernel choice": choice})

    plain = [method("selfspec-plan", "A"), method("plan:x", "B"), method("selfspec-plan-packed", "C", "packed"),
             Method("hf-greedy", "", lambda *a: None)]
    assert run.per_variant(plain, "costs", False) == "A | packed copies: C"  # the first of each group
    variants = [method("bfloat16/selfspec-plan", "A"), method("bfloat16+int8/selfspec-plan", "D"),
                method("bfloat16/selfspec-plan-packed", "C", "packed")]
    assert run.per_variant(variants, "costs", True) == "bfloat16: A | bfloat16+int8: D | bfloat16, packed copies: C"
    assert run.per_variant(plain[3:], "costs", False) == "-"
