"""The projection `benchmarks/gpu_check.py` prints: round outcomes measured on a CPU, priced at GPU costs.

Checked on hand-computable cases, so the one figure the GPU run cannot
measure (a real model's speed there) is at least the right arithmetic.
"""

from __future__ import annotations

import json

import pytest

from benchmarks import gpu_check

FAST = gpu_check.FAST


def measured(draft: dict, verify: dict) -> dict:
    per_token = {"model.generate": 4.0, "HF static+compile": 1.0, f"selfspec plain {FAST}": 1.0}
    return {"SmolLM2-135M": {"layers": 30, "step": 1.0, "draft": draft, "verify": verify, "per_token": per_token}}


def write_profile(tmp_path, outcomes: dict, draft_layers: int) -> None:
    plan = {"plan": {}, "draft_layers": draft_layers, "exact_prefix": 0, "outcomes": outcomes, "tokens_per_pass": 0}
    (tmp_path / "acceptance_smollm2.json").write_text(json.dumps(
        {"command": "test", "prompts": "test", "plans": {"p": plan}}))


def test_all_accepted_free_drafts_flat_verify(tmp_path, monkeypatch, capsys):
    """k=4 always accepted, drafting free, verify = 1 step: 5 tokens per step, 5x HF static+compile."""
    monkeypatch.setattr(gpu_check, "DATA", tmp_path)
    write_profile(tmp_path, {"layers 4 4": 10}, draft_layers=1)
    gpu_check.projection(measured({1: 0.0, 29: 0.0}, {2: 1.0, 4: 1.0, 8: 1.0, 16: 1.0}))
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("PROJECTION p:"))
    assert "k=4 for layer rounds, 5.00 tokens per pass" in line and "5.00x HF static+compile" in line


def test_costly_drafts_project_plain_decoding(tmp_path, monkeypatch, capsys):
    """Each drafted token costs a full step and half are rejected: k=0 wins, the plain path's speed."""
    monkeypatch.setattr(gpu_check, "DATA", tmp_path)
    write_profile(tmp_path, {"layers 2 0": 5, "layers 2 1": 5}, draft_layers=29)
    gpu_check.projection(measured({1: 1.0, 29: 1.0}, {2: 1.0, 4: 1.0, 8: 1.0, 16: 1.0}))
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("PROJECTION p:"))
    assert "k=0 for layer rounds" in line and "1.00x HF static+compile" in line


def test_ngram_rounds_draft_for_free_and_widths_cost_their_bucket(tmp_path, monkeypatch, capsys):
    """n-gram k=3, 2 accepted: 3 tokens for a verify over 4 tokens (bucket 4, 1.5 steps): 2x.

    k=2 does as well (3 tokens, 3 wide: the same bucket) and ties go to the shorter draft.
    """
    monkeypatch.setattr(gpu_check, "DATA", tmp_path)
    write_profile(tmp_path, {"ngram 3 2": 4}, draft_layers=0)
    gpu_check.projection(measured({1: 1.0}, {2: 1.2, 4: 1.5, 8: 2.0, 16: 3.0}))
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("PROJECTION p:"))
    assert "k=2 for n-gram rounds" in line and "3.00 tokens per pass, 2.00x HF static+compile" in line


def test_verify_cost_uses_the_bucket():
    verify = {2: 1.1, 4: 1.2, 8: 1.3, 16: 1.4}
    assert [gpu_check.verify_cost(verify, q) for q in (1, 2, 3, 5, 9, 17)] == [1.0, 1.1, 1.2, 1.3, 1.4, 1.4]
    assert gpu_check.interpolate({1: 0.1, 29: 1.0}, 15) == pytest.approx(0.1 + 0.9 * 14 / 28)


def test_each_source_gets_its_own_length(tmp_path, monkeypatch, capsys):
    """n-gram rounds pay (free drafts, all kept), layer rounds do not (a drafted token costs a step, none kept)."""
    monkeypatch.setattr(gpu_check, "DATA", tmp_path)
    write_profile(tmp_path, {"ngram 4 4": 5, "layers 4 0": 5}, draft_layers=29)
    gpu_check.projection(measured({1: 1.0, 29: 1.0}, {2: 1.0, 4: 1.0, 8: 1.0, 16: 1.0}))
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("PROJECTION p:"))
    assert "k=4 for n-gram rounds, k=0 for layer rounds, 3.00 tokens per pass, 3.00x" in line


def write_passes(tmp_path, methods: dict) -> None:
    header = {"command": "test", "cpu capability": "test"}
    (tmp_path / "flat_passes_smollm2.json").write_text(json.dumps({"header": header, "methods": methods}))


def passes(tokens: int, widths: dict, steps_read: float, prompts: int = 1) -> dict:
    rounds = sum(widths.values())
    return {"prompts": prompts, "new_tokens": tokens, "rounds": rounds, "tokens_per_pass": tokens / (rounds + prompts),
            "steps_read": steps_read, "widths": {str(q): n for q, n in widths.items()}}


def test_pass_projection_prices_each_width_at_its_bucket_and_drafts_at_what_they_read(tmp_path, monkeypatch, capsys):
    """A tree plan: 9 rounds of 17 wide (bucket 32 at 1.5 steps) emitting 40 tokens with the prefill's: 40 / (1 +
    13.5) = 2.76x the plain path, x4 against model.generate. A layer plan: 10 rounds of 3 wide (bucket 4, 1.0)
    and 10 steps read beyond its passes, at 0.5 of a step per step read (a 15-of-30-layer draft costs 0.25): 31 /
    (1 + 10 + 5) = 1.94x."""
    monkeypatch.setattr(gpu_check, "DATA", tmp_path)
    write_passes(tmp_path, {"tree": passes(40, {17: 9}, steps_read=10.0),
                            "layers": passes(31, {3: 10}, steps_read=21.0)})
    gpu = measured({15: 0.25}, {2: 1.0, 4: 1.0, 8: 1.2, 16: 1.4, 32: 1.5})
    gpu["SmolLM2-135M"]["per_token"] = {"model.generate": 4.0, f"selfspec plain {FAST}": 1.0}
    gpu_check.pass_projection(gpu)
    lines = {line.split(":")[0]: line for line in capsys.readouterr().out.splitlines()}
    assert f"2.76x selfspec plain {FAST}, 11.03x model.generate" in lines["PASS PROJECTION tree"]
    assert f"1.94x selfspec plain {FAST}, 7.75x model.generate" in lines["PASS PROJECTION layers"]


def test_pass_profile_counts_verify_passes_by_width():
    from benchmarks.measure import Row
    from benchmarks.report import pass_profile

    def row(lengths, steps_read, tokens):
        details = {"drafted_lengths": lengths, "steps_read": steps_read}
        return Row("m", "p", "c", 5, output=[1], seconds=1.0, new_tokens=tokens, verify_passes=sum(lengths) + 1,
                   details=details)

    profile = pass_profile([row([2, 0, 3], 6.0, 9), row([1, 0, 0, 0, 4], 6.5, 12)])
    assert profile["widths"] == {"1": 3, "3": 3, "5": 4} and profile["rounds"] == 10 and profile["prompts"] == 2
    assert profile["tokens_per_pass"] == pytest.approx(21 / 12) and profile["steps_read"] == 12.5
    assert pass_profile([Row("hf-greedy", "p", "c", 5, output=[1], seconds=1.0, new_tokens=3)]) is None
