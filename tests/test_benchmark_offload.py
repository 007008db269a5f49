"""`benchmarks.offload_report`: speedups per placement are paired per prompt against the variant's own
`model.generate`, and offloaded bytes per token follow tokens per pass."""

from __future__ import annotations

import json

import pytest

from benchmarks import offload_report

MIB = 2**20


def bench() -> dict:
    """Two placements of a 10-layer model (layers 5.. and 2.. offloaded), two prompts, a baseline and one method."""
    speeds = {"bfloat16+offload5/hf-greedy": (10.0, 20.0), "bfloat16+offload5/selfspec-plan": (20.0, 30.0),
              "bfloat16+offload2/hf-greedy": (5.0, 10.0), "bfloat16+offload2/selfspec-plan": (20.0, 20.0)}
    rows = [{"method": m, "prompt_id": p, "new_tokens": 60, "seconds": 60 / speed, "error": None}
            for m, pair in speeds.items() for p, speed in zip(("a", "b"), pair)]
    overall = {m: {"tokens_per_second": sum(pair) / 2, "tokens_per_pass": 2.0 if "plan" in m else 1.0,
                   "identical": 2, "near_ties": 0, "compared": 2} for m, pair in speeds.items()}
    weights = {v: {"rest_bytes": 100 * MIB} for v in ("bfloat16+offload5", "bfloat16+offload2")}
    return {"header": {"command": "python -m benchmarks.run ..."}, "summary": {"overall": overall},
            "weight_memory": weights, "rows": rows}


def test_entries_pair_each_prompt_with_its_own_placements_baseline():
    entries = {(e["variant"], e["method"]): e for e in offload_report.offload_table(bench(), layers=10)}
    half = entries["bfloat16+offload5", "selfspec-plan"]
    assert half["offloaded_fraction"] == 0.5
    assert half["median_paired_speedup"] == pytest.approx((2.0 + 1.5) / 2)  # per prompt: 20/10 and 30/20
    assert half["speedup"] == pytest.approx(25.0 / 15.0)
    assert half["streamed_mib_per_token"] == pytest.approx(50.0 / 2.0)  # half the layers' bytes, two tokens a pass
    most = entries["bfloat16+offload2", "selfspec-plan"]
    assert most["offloaded_fraction"] == 0.8 and most["median_paired_speedup"] == pytest.approx((4.0 + 2.0) / 2)
    assert entries["bfloat16+offload2", "hf-greedy"]["streamed_mib_per_token"] == pytest.approx(80.0)


def test_the_report_writes_its_table_and_says_why_without_a_run(tmp_path, capsys):
    (tmp_path / "bench.json").write_text(json.dumps(bench()))
    assert offload_report.main([str(tmp_path), "--layers", "10"]) == 0
    table = (tmp_path / "offload.md").read_text()
    assert "| bfloat16 | 50% | selfspec-plan | 25.0 | 1.67x | 1.75x | 2.00 | 25.0 | 2/2 |" in table, table
    empty = bench()
    empty["summary"]["overall"] = {"bfloat16/hf-greedy": empty["summary"]["overall"]["bfloat16+offload5/hf-greedy"]}
    (tmp_path / "bench.json").write_text(json.dumps(empty))
    assert offload_report.main([str(tmp_path)]) == 1
    assert "no +offloadN variant" in capsys.readouterr().err
