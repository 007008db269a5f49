"""The harness's near-tie rule: which differences from the baseline are rounding, which are errors.

A stub target returns a chosen logit row at the first difference, so the rule
is tested on the exact cases it must separate: two tokens one bf16 step apart
at the top (a near-tie), a clear gap (an error), a flat row of small logits
(a near-tie: rounding scales with the row, not the logit), and an output that
stops early (never a near-tie).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from benchmarks import report
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
