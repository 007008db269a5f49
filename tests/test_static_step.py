"""The static step (`step="static"`): fixed shapes, device positions, one read back per round.

- float64 output equals `model.generate` token for token on every
  architecture (windowed ones with a window shorter than the prompt), for
  every plan kind: layer subsets, early exits, an exit head, a draft
  vocabulary, n-gram proposals, the cost policy, the plain path; prompts
  shorter and longer than a padded bucket and than the span step;
- logits processors and stopping criteria act as in plain decoding;
- a round reads the device back once (the count is checked);
- the widths a pass runs at are the buckets, and errors are clear.

The hypothesis property test in `test_greedy_equivalence.py` draws the step
too, and `test_sampling.py` runs the sampling statistics on this step.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor, StoppingCriteria, StoppingCriteriaList

import selfspec
import selfspec.static
from plan_strategies import assert_same
from selfspec.static import StaticRunner, bucket, largest_bucket
from selfspec.testing import TINY_CONFIGS, has_window, make_head, make_vocab, random_prompt, tiny_model

ARCHS = sorted(TINY_CONFIGS)
WINDOW = 8


def model_for(arch: str):
    return tiny_model(arch, torch.float64, window=WINDOW if has_window(arch) else None)


def plan_kinds(model, folder) -> dict[str, selfspec.DraftPlan | None]:
    head = str(make_head(model, folder / "head", exit_layer=2, noise=0.05))
    vocab = str(make_vocab(model, folder / "vocab"))
    return {
        "exit 2, k=4": selfspec.DraftPlan(exit_layer=2, draft_length=4, policy="fixed"),
        "layers 0,1,3,5, k=9": selfspec.DraftPlan(layers=[0, 1, 3, 5], draft_length=9, policy="fixed"),
        "layers 1,4 (no exact prefix)": selfspec.DraftPlan(layers=[1, 4], draft_length=3, policy="fixed"),
        "head at 2": selfspec.DraftPlan(exit_layer=2, head=head, draft_length=3, policy="fixed"),
        "head + vocab + n-grams": selfspec.DraftPlan(exit_layer=2, head=head, draft_vocab=vocab, draft_vocab_size=20,
                                                     draft_length=4, ngram=2, policy="fixed"),
        "n-grams only": selfspec.DraftPlan(draft_length=6, ngram=1, policy="fixed"),
        "cost policy": selfspec.DraftPlan(exit_layer=3, draft_length=5),
        "adaptive": selfspec.DraftPlan(layers=[0, 2, 4], draft_length=6, adaptive=True, threshold=0.4, policy="fixed"),
        "plain": selfspec.DraftPlan.plain(),
    }


@pytest.mark.parametrize("arch", ARCHS)
def test_static_step_equals_generate_for_every_plan_kind(arch, tmp_path):
    model = model_for(arch)
    for i, (name, plan) in enumerate(plan_kinds(model, tmp_path).items()):
        for length, new in ((3, 40), (70, 30)):  # under and over a bucket and the span step
            prompt = random_prompt(length, seed=i)
            ref = model.generate(prompt, do_sample=False, max_new_tokens=new)
            spec = selfspec.wrap(model, plan=plan, step="static", costs="flat")
            assert_same(spec.generate(prompt, max_new_tokens=new), ref, f"{name}, prompt {length}")
            assert spec.last_stats.step == "static"
            if plan.drafts and plan.layers != (1, 4):
                assert spec.last_stats.drafted > 0


def test_static_step_drafts_and_emits_as_the_eager_step():
    """Same plan, fixed k: the rounds are the same, so the counts are too."""
    model = model_for("llama")
    plan = selfspec.DraftPlan(exit_layer=3, draft_length=4, policy="fixed")
    prompt = random_prompt(12, seed=3)
    stats = {}
    for step in ("eager", "static"):
        spec = selfspec.wrap(model, plan=plan, step=step)
        spec.generate(prompt, max_new_tokens=50)
        stats[step] = spec.last_stats
    for field in ("new_tokens", "rounds", "drafted", "accepted", "accepted_lengths", "drafted_lengths"):
        assert getattr(stats["static"], field) == getattr(stats["eager"], field), field


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "gpt2"])
def test_processors_and_stopping_criteria_on_the_static_step(arch):
    model = model_for(arch)
    prompt = random_prompt(9, seed=5)
    plan = selfspec.DraftPlan(exit_layer=3, draft_length=5, policy="fixed", ngram=2)
    processors = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.3)])
    ref = model.generate(prompt, do_sample=False, max_new_tokens=40, logits_processor=processors)
    spec = selfspec.wrap(model, plan=plan, step="static")
    assert_same(spec.generate(prompt, max_new_tokens=40, logits_processor=processors), ref, plan)

    stop_at = int(ref[0, prompt.shape[1] + 17])

    class StopAt(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return input_ids[:, -1] == stop_at

    criteria = StoppingCriteriaList([StopAt()])
    ref_stop = model.generate(prompt, do_sample=False, max_new_tokens=40, stopping_criteria=criteria,
                              logits_processor=processors)
    out = spec.generate(prompt, max_new_tokens=40, stopping_criteria=criteria, logits_processor=processors)
    assert_same(out, ref_stop, plan)


class ReadCounter:
    """Counts reads from a tensor to the host (`tolist`, `item`, `int()`, `float()`, `bool()`)."""

    METHODS = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__")

    def __init__(self, monkeypatch) -> None:
        self.count = 0
        for name in self.METHODS:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self.counting(original))

    def counting(self, original):
        def read(tensor, *args, **kwargs):
            self.count += 1
            return original(tensor, *args, **kwargs)

        return read


@pytest.mark.parametrize("plan", [
    selfspec.DraftPlan(exit_layer=3, draft_length=4, policy="fixed"),
    selfspec.DraftPlan(exit_layer=3, draft_length=4),  # the cost policy, with confidences to learn from
    selfspec.DraftPlan(layers=[0, 1, 4], draft_length=5, policy="fixed", ngram=2),
], ids=["fixed", "cost", "ngram"])
def test_one_read_back_per_round(monkeypatch, plan):
    model = model_for("llama")
    prompt = random_prompt(10, seed=2)
    spec = selfspec.wrap(model, plan=plan, step="static", costs="flat")
    spec.generate(prompt, max_new_tokens=5)  # wrapping and settings read a few things once; count a longer run
    counter = ReadCounter(monkeypatch)
    spec.generate(prompt, max_new_tokens=40)
    reads = counter.count
    monkeypatch.undo()
    rounds = spec.last_stats.rounds
    assert rounds > 5 and spec.last_stats.drafted > 0
    setup = 6  # the prompt, the settings, the prefill's first token
    assert reads <= rounds + setup, f"{reads} reads back for {rounds} rounds"


def test_eager_step_reads_back_per_drafted_token(monkeypatch):
    """The counter above can fail: the eager step reads each drafted token back."""
    model = model_for("llama")
    prompt = random_prompt(10, seed=2)
    spec = selfspec.wrap(model, plan=selfspec.DraftPlan(exit_layer=3, draft_length=4, policy="fixed"), step="eager")
    spec.generate(prompt, max_new_tokens=5)
    counter = ReadCounter(monkeypatch)
    spec.generate(prompt, max_new_tokens=40)
    reads = counter.count
    monkeypatch.undo()
    assert reads > spec.last_stats.rounds + spec.last_stats.drafted


def test_bucketed_cost_tables_step_up_to_the_next_measured_width():
    from selfspec.costs import interpolate

    measured = {1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0}
    assert interpolate(measured, 8, step_up=True) == (1.0, 2.0, 4.0, 4.0, 8.0, 8.0, 8.0, 8.0)
    assert interpolate(measured, 8) == (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0)


def test_buckets():
    assert [bucket(q, 16) for q in (1, 2, 3, 4, 5, 8, 9, 16, 17, 40)] == [1, 2, 4, 4, 8, 8, 16, 16, 17, 40]
    assert largest_bucket(5) == 16 and largest_bucket(17) == 32


def test_padded_pass_writes_past_the_valid_length_and_keeps_lengths():
    model = model_for("llama")
    spec = selfspec.wrap(model, plan=selfspec.DraftPlan.plain())
    runner = StaticRunner(spec.parts, capacity=40, max_width=5)
    hidden = runner.run(runner.embed(list(range(10)), 0), range(6), 0)  # [1, 10, hidden], bucket 16
    assert hidden.shape[1] == 10
    assert runner.cache.lengths[:6] == [10] * 6
    out = runner.run(runner.embed([3, 4, 5], 10), range(6), 10)  # bucket 4
    assert out.shape[1] == 3 and runner.cache.lengths[0] == 13
    with pytest.raises(RuntimeError, match="overflow"):
        runner.run(runner.embed(list(range(30)), 13), range(6), 13)


def test_step_errors():
    model = model_for("llama")
    with pytest.raises(ValueError, match=r"step='fast' is not a way to run a pass \(valid: 'auto', 'eager'"):
        selfspec.wrap(model, step="fast")
    with pytest.raises(ValueError, match="step='graphs' needs the model on a CUDA device; it is on cpu"):
        selfspec.wrap(model, step="graphs")
    assert selfspec.wrap(model).step == "eager"  # auto on a CPU


def test_static_costs_are_measured_on_the_static_step():
    model = model_for("qwen2")
    spec = selfspec.wrap(model, plan=selfspec.DraftPlan(exit_layer=2, draft_length=6), step="static")
    costs = spec.measure_costs(cached=False, repeats=1)
    assert len(costs.verify) == 7 and costs.draft_step > 0
    # Widths 1, 2, 4 and 7 were timed; a pass over 3 runs at 4, over 5 or 6 at 8 (as 7 does).
    assert costs.verify[2] == costs.verify[3] and costs.verify[4] == costs.verify[5] == costs.verify[6]
    assert spec.cost_tables.key() != selfspec.wrap(model, plan=spec.plan, step="eager").cost_tables.key()
    spec.generate(random_prompt(8), max_new_tokens=20)
    assert spec.last_stats.costs and spec.last_stats.step == "static"
    assert "step: static" in str(spec.last_stats)


class ReplayingBackend:
    """Stands in for CUDA on a CPU: a "graph" is the recorded function, run again on its buffers at each replay.

    A real graph replays the captured kernels on whatever its input buffers
    hold; so does this, which is what the runner's bookkeeping relies on.
    """

    replays = 0

    def __init__(self, device) -> None:
        self.device = device

    def warm_up(self):
        return contextlib.nullcontext()

    def record(self, fn):
        output = fn()
        backend = self

        class Graph:
            def replay(self) -> None:
                ReplayingBackend.replays += 1
                output.copy_(fn())

        return Graph(), output

    def synchronize(self) -> None:
        pass


class FailingBackend(ReplayingBackend):
    def record(self, fn):
        raise RuntimeError("operation not permitted when stream is capturing\nmore detail")


def graphed(model, plan, monkeypatch, backend=ReplayingBackend):
    monkeypatch.setattr(selfspec.static, "CudaGraphBackend", backend)
    spec = selfspec.wrap(model, plan=plan, step="static", costs="flat")
    spec.step = "graphs"  # what wrap chooses on CUDA; the backend above stands in for the device
    return spec


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "gpt2"])
def test_graphed_runner_replays_equal_generate(arch, tmp_path, monkeypatch):
    model = model_for(arch)
    kinds = plan_kinds(model, tmp_path)
    for name in ("head + vocab + n-grams", "cost policy", "layers 0,1,3,5, k=9", "plain"):
        spec = graphed(model, kinds[name], monkeypatch)
        ReplayingBackend.replays = 0
        for length, new in ((5, 40), (70, 30), (6, 25)):
            prompt = random_prompt(length, seed=length)
            ref = model.generate(prompt, do_sample=False, max_new_tokens=new)
            assert_same(spec.generate(prompt, max_new_tokens=new), ref, f"{name}, prompt {length}")
            assert spec.last_stats.step.startswith("CUDA graphs ("), spec.last_stats.step
        assert ReplayingBackend.replays > 20
        # The graphs stay with the wrapped model: the same call again captures nothing new.
        kept = spec.graphed
        assert_same(spec.generate(prompt, max_new_tokens=new), ref, f"{name}, again")
        assert spec.graphed is kept and spec.last_stats.capture_seconds == 0.0
        spec.generate(random_prompt(200, seed=1), max_new_tokens=56)  # a longer one recaptures at a larger capacity
        assert spec.graphed is not kept and spec.graphed.valid_capacity % 256 == 0
        spec.release()
        assert spec.graphed is None


def test_captured_passes_attend_to_a_power_of_two_span_not_the_whole_kept_cache(tmp_path, monkeypatch):
    """A graphed runner kept after a long generation does not make short ones attend to its whole capacity."""
    monkeypatch.setattr(selfspec.static, "CAPTURED_SPAN_MIN", 32)
    model = model_for("gemma3_text")  # sliding-window layers: the window's mask inside a span
    spec = graphed(model, plan_kinds(model, tmp_path)["cost policy"], monkeypatch)
    spans = []
    real_record = ReplayingBackend.record

    def record(backend, fn):  # the span each capture runs at
        graph, output = real_record(backend, fn)
        spans.append(spec.graphed.cache.span)
        return graph, output

    monkeypatch.setattr(ReplayingBackend, "record", record)
    long_prompt = random_prompt(150, seed=2)
    ref = model.generate(long_prompt, do_sample=False, max_new_tokens=40)
    assert_same(spec.generate(long_prompt, max_new_tokens=40), ref, "long")
    capacity = spec.graphed.cache.capacity
    assert capacity >= 256 and set(spans) <= {256, capacity}, (spans, capacity)
    spans.clear()
    for length in (5, 20):
        prompt = random_prompt(length, seed=length)
        ref = model.generate(prompt, do_sample=False, max_new_tokens=30)
        assert_same(spec.generate(prompt, max_new_tokens=30), ref, f"short, prompt {length}")
    assert spans and set(spans) <= {32, 64}, spans  # not the kept capacity
    assert {key[3] for key in spec.graphed.graphs} >= {32, 64, 256}, sorted(spec.graphed.graphs)
    runner = spec.graphed
    assert [runner.captured_span(end) for end in (1, 32, 33, 64, 65, 10**6)] == [32, 32, 64, 64, 128, capacity]


def test_a_pass_that_cannot_be_captured_turns_graphs_off_with_the_reason(monkeypatch):
    model = model_for("llama")
    plan = selfspec.DraftPlan(exit_layer=3, draft_length=4, policy="fixed")
    spec = graphed(model, plan, monkeypatch, backend=FailingBackend)
    prompt = random_prompt(9, seed=4)
    ref = model.generate(prompt, do_sample=False, max_new_tokens=30)
    assert_same(spec.generate(prompt, max_new_tokens=30), ref, plan)
    assert spec.last_stats.step == "static, CUDA graphs off (RuntimeError: operation not permitted when stream is capturing)"


@pytest.mark.parametrize("arch", ["llama", "mistral", "gpt2"])
def test_graphed_tree_passes_are_captured_and_replayed(arch, monkeypatch):
    """A tree pass is captured per width; replays take each tree's positions and visibility as inputs."""
    model = model_for(arch)
    plan = selfspec.DraftPlan(ngram=1, tree=12, draft_length=5, policy="fixed")
    spec = graphed(model, plan, monkeypatch)
    trees = 0
    for seed in (3, 4, 5):
        base = random_prompt(6, seed=seed)[0].tolist()
        prompt = torch.tensor([base + [base[0], base[1], 7] + base + [base[0], base[1], 9, 3] + base[:3]])
        ref = model.generate(prompt, do_sample=False, max_new_tokens=40)
        assert_same(spec.generate(prompt, max_new_tokens=40), ref, f"{arch}, seed {seed}")
        trees += spec.last_stats.tree_rounds
    assert trees > 3 and any(key[2] for key in spec.graphed.graphs), sorted(spec.graphed.graphs)
