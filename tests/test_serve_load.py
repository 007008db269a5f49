"""benchmarks/serve_load.py: its arithmetic, and one small run end to end on a tiny random model.

The end-to-end run serves the tiny float64 Llama of test_serve.py three ways
(selfspec with a plan, selfspec plain, one `model.generate` per request) on
127.0.0.1 and loads each at concurrency 1 and 2: greedy outputs in float64 are
`model.generate`'s exactly, so every output must be identical.
"""

from __future__ import annotations

import math

import pytest
import torch

import selfspec
from benchmarks import serve_load
from benchmarks.serve_load import RequestResult, percentile, per_token_latency, summarize_level
from benchmarks.workload import Prompt
from selfspec.serving.generation import Tokenizer
from selfspec.testing import tiny_model
from test_serve import PLAN, tiny_tokenizer


# --------------------------------------------------------------------------- arithmetic


def test_percentile_interpolates_between_order_statistics():
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 5.0
    assert percentile(values, 99) == pytest.approx(4.96)
    assert percentile(values, 25) == 2.0
    assert percentile([1.0, 2.0], 50) == 1.5
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_per_token_latency_is_the_time_after_the_first_token_per_later_token():
    assert per_token_latency(2.0, 0.5, 4) == pytest.approx(0.5)
    assert per_token_latency(2.0, 0.5, 1) is None
    assert per_token_latency(None, 0.5, 4) is None and per_token_latency(2.0, None, 4) is None


def result(config="a", concurrency=1, index=0, prompt="p0", **fields) -> RequestResult:
    return RequestResult(config, concurrency, index, prompt, "cat", **fields)


def test_summarize_level_aggregates_over_the_level_and_skips_errors():
    results = [
        result(index=0, first_token=0.1, latency=1.1, completion_tokens=11, drafted=10, accepted=5, identical=True),
        result(index=1, first_token=0.3, latency=2.3, completion_tokens=21, drafted=10, accepted=10, identical=False),
        result(index=2, error="timed out", completion_tokens=99),
    ]
    s = summarize_level(results, wall_seconds=4.0)
    assert (s["requests"], s["errors"], s["completion_tokens"]) == (2, 1, 32)
    assert s["tokens_per_second"] == 8.0 and s["requests_per_second"] == 0.5
    assert s["ttft_p50"] == pytest.approx(0.2) and s["ttft_p99"] == pytest.approx(0.298)
    assert s["latency_p50"] == pytest.approx(1.7)
    assert s["per_token_p50"] == pytest.approx(0.1)  # 1.0 s / 10 and 2.0 s / 20
    assert s["acceptance_rate"] == 0.75
    assert (s["identical"], s["compared"]) == (1, 2)
    empty = summarize_level([], wall_seconds=0.0)
    assert empty["tokens_per_second"] is None and empty["ttft_p50"] is None and empty["acceptance_rate"] is None


def test_ratios_are_against_the_baseline_at_the_same_concurrency():
    levels = {"x": {1: {"tokens_per_second": 30.0}, 2: {"tokens_per_second": 10.0}},
              "base": {1: {"tokens_per_second": 15.0}, 2: {"tokens_per_second": None}}}
    serve_load.add_ratios(levels, "base")
    assert levels["x"][1]["vs_baseline"] == 2.0 and levels["base"][1]["vs_baseline"] == 1.0
    assert levels["x"][2]["vs_baseline"] is None


def test_outputs_are_compared_with_the_baselines_text_for_the_same_prompt():
    results = [
        result("base", 2, 0, "p0", text="hello"),
        result("base", 1, 1, "p1", text="world"),
        result("x", 1, 0, "p0", text="hello"),
        result("x", 2, 1, "p1", text="worlds"),
        result("x", 2, 2, "p2", text="alone"),  # the baseline never finished p2
        result("x", 1, 3, "p0", error="boom"),
    ]
    counts = serve_load.compare_outputs(results, "base")
    assert counts == {"identical": 3, "compared": 4, "without_reference": 1}
    assert [r.identical for r in results] == [True, True, True, False, None, None]


def test_interleave_takes_categories_in_turn_and_levels_parse():
    ids = torch.zeros(1, 1, dtype=torch.long)
    prompts = [Prompt(f"{c}{i}", c, "", ids) for c, n in (("a", 3), ("b", 1), ("c", 2)) for i in range(n)]
    assert [p.prompt_id for p in serve_load.interleave(prompts)] == ["a0", "b0", "c0", "a1", "c1", "a2"]
    assert serve_load.parse_levels("1,2, 4,8") == [1, 2, 4, 8]
    for bad in ("", "0,1", "1,1", "x"):
        with pytest.raises(ValueError):
            serve_load.parse_levels(bad)


def test_blocks_split_the_requests_in_order_and_nearly_evenly():
    assert serve_load.block_sizes(16, 2) == [(0, 8), (8, 8)]
    assert serve_load.block_sizes(10, 3) == [(0, 3), (3, 4), (7, 3)]
    assert serve_load.block_sizes(2, 5) == [(0, 1), (1, 1)]  # no empty block
    assert serve_load.block_sizes(7, 1) == [(0, 7)]


# --------------------------------------------------------------------------- end to end


def test_generate_engine_refuses_a_batch():
    engine = serve_load.GenerateEngine(selfspec.wrap(tiny_model("llama"), plan=PLAN), Tokenizer(tiny_tokenizer()))
    with pytest.raises(RuntimeError, match="max_batch=1"):
        engine.session(2)


def test_a_small_run_serves_three_ways_and_reports_every_level():
    model, tokenizer = tiny_model("llama"), tiny_tokenizer()
    texts = ["w1 w2 w3", "w4 w5", "w6 w7 w8 w9"]
    prompts = [Prompt(f"p{i}", f"c{i % 2}", text, torch.zeros(1, 1, dtype=torch.long)) for i, text in enumerate(texts)]
    lines = []
    result = serve_load.benchmark(model, tokenizer, prompts, levels=[1, 2], requests=4, max_tokens=6, plan=PLAN,
                                  request_timeout=30, time_limit=60, blocks=2, log=lines.append)
    assert not result["time_limit_hit"]
    assert [r["error"] for r in result["requests"] if r["error"]] == []
    assert len(result["requests"]) == 3 * 2 * 4
    for name in serve_load.CONFIGS:  # two blocks per level, each request index once per server and level
        for concurrency in (1, 2):
            assert sorted(r["index"] for r in result["requests"]
                          if r["config"] == name and r["concurrency"] == concurrency) == [0, 1, 2, 3]
    for concurrency in (1, 2):
        per_block = result["plan_vs_plain"][concurrency]
        assert len(per_block["blocks"]) == 2 and per_block["median"] > 0
    assert result["outputs"] == {"identical": 24, "compared": 24, "without_reference": 0}
    for name in serve_load.CONFIGS:
        for concurrency in (1, 2):
            s = result["levels"][name][concurrency]
            assert (s["requests"], s["errors"], s["completion_tokens"]) == (4, 0, 24)  # no EOS: max_tokens each
            assert s["tokens_per_second"] > 0 and s["vs_baseline"] > 0
            assert 0 < s["ttft_p50"] <= s["ttft_p99"] <= s["latency_p99"]
            assert s["per_token_p50"] is not None and s["identical"] == s["compared"] == 4
    assert result["levels"]["hf-generate"][1]["vs_baseline"] == 1.0
    assert result["levels"]["hf-generate"][1]["acceptance_rate"] is None  # model.generate drafts nothing
    assert any(line.startswith("warm-up hf-generate: ok") for line in lines)
    table = serve_load.markdown({"model": "tiny"}, result)
    assert table.count("| hf-generate |") == 2 and "24/24 identical" in table
    assert "The plan over drafting off, per block" in table
    assert not math.isnan(result["levels"]["selfspec-plain"][2]["latency_p50"])


def test_the_multi_turn_mode_reuses_the_prefix_on_later_turns_with_the_same_answers(tmp_path):
    """`serve_load --multi-turn`'s run: the cached server takes every later turn's history from its prefix cache,
    the other server none, and in float64 their answers are the same."""
    import json

    from benchmarks import serve_multi_turn

    data = tmp_path / "questions.jsonl"
    article = " ".join(f"w{10 + i % 80}" for i in range(200))
    data.write_text(json.dumps({"category": "summarization", "question_id": 1, "turns": [article]}) + "\n")
    lines = []
    results = serve_multi_turn.run(tiny_model("llama"), tiny_tokenizer(), plan=PLAN, documents=[40], turns=3,
                                   max_tokens=5, max_batch=4, request_timeout=30, data=data, log=lines.append)
    turns = results[40]["turns"]
    assert [t["turn"] for t in turns] == [1, 2, 3] and results[40]["same"] == 3
    assert turns[0]["cached_tokens"] < 5  # at most the chat template's opening, shared with the warm-up request
    for before, turn in zip(turns, turns[1:]):
        assert before["prompt_tokens"] < turn["cached_tokens"] < turn["prompt_tokens"]
        assert turn["cached_tokens_no_cache"] == 0
    assert results[40]["ttft_ratio_later_median"] > 0 and any("turns 2+" in line for line in lines)
