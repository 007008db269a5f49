"""The prefix cache (`selfspec/prefix_cache.py`): a later prompt that starts as an earlier sequence did reuses its
KV, in one sequence and in batch rows, with the target's output unchanged; the store keeps to its budget."""

from __future__ import annotations

import pytest
import torch

import selfspec
from selfspec.prefix_cache import PrefixCache
from selfspec.runner import LayerRunner
from selfspec.testing import TINY_CONFIGS, make_feature_head, random_prompt, tiny_model

NGRAM_LAYERS = selfspec.DraftPlan(ngram=3, layers=(0, 2), draft_length=4)


def entries(length: int, layers: int = 2, fill: float = 1.0) -> list:
    """Per layer keys and values `[1 head, length, 4]`: 32 bytes a position a layer in float64."""
    return [(torch.full((1, length, 2), fill, dtype=torch.float64),) * 2 for _ in range(layers)]


def greedy(model, ids: torch.Tensor, new: int) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, do_sample=False, max_new_tokens=new)


def test_the_store_keeps_to_its_budget_least_recently_used_out_first():
    store = PrefixCache(budget=3 * 10 * 64)  # three sequences of 10 positions (64 bytes a position)
    for i in range(3):
        store.add([i] * 10, entries(10, fill=i))
    assert len(store) == 3 and store.bytes == 3 * 640
    assert store.lookup([0] * 10 + [5])[0] == 10  # 0 is now the most recently used
    store.add([3] * 10, entries(10))
    assert [key[0] for key in store.store] == [2, 0, 3] and store.stats.evictions == 1 and store.bytes <= store.budget
    store.add([9] * 40, entries(40))  # larger than the whole budget: not kept, nothing evicted for it
    assert len(store) == 3 and store.stats.evictions == 1
    m, found = store.lookup([2] * 4)  # a prompt that is itself a prefix of a stored sequence: all but its last
    assert m == 3 and torch.equal(found[0][0][:, :m], torch.full((1, 3, 2), 2.0, dtype=torch.float64))
    store.add([2] * 12, entries(12, fill=7))  # extends a stored one: it replaces it
    assert (2,) * 10 not in store.store and (2,) * 12 in store.store
    assert store.lookup([8, 8])[0] == 0 and store.stats.hits == 2 and store.stats.lookups == 3


def test_a_stored_sequence_is_one_allocation_holding_copies():
    """Every layer's keys and values of a stored sequence live in one block (a dropped sequence frees one
    allocation, not scattered small ones), as copies of the positions given."""
    store = PrefixCache(budget=1 << 20)
    given = [(torch.arange(24.0).view(1, 12, 2) + 100 * i, -torch.arange(24.0).view(1, 12, 2) - 100 * i)
             for i in range(3)]
    store.add([1] * 10, [*given[:2], None, given[2]])
    held = store.store[(1,) * 10]
    assert held[2] is None and store.bytes == 3 * 2 * 10 * 2 * 4
    tensors = [t for pair in held if pair is not None for t in pair]
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
    for (k, v), (gk, gv) in zip([held[0], held[1], held[3]], given):
        assert torch.equal(k, gk[:, :10]) and torch.equal(v, gv[:, :10])
    given[0][0].zero_()  # copies: the caller's tensors may change afterwards
    assert held[0][0][0, 1, 0] == 2.0


def test_a_bad_budget_is_refused():
    model = tiny_model("llama", torch.float32)
    with pytest.raises(ValueError, match="not a size"):
        selfspec.wrap(model, prefix_cache="plenty")
    assert selfspec.wrap(model, prefix_cache=0).prefix is None and selfspec.wrap(model).prefix is None


@pytest.mark.parametrize("arch", sorted(TINY_CONFIGS))
def test_a_next_turn_reuses_the_last_and_equals_generate(arch):
    """Float64: exact. Turn 2 is turn 1's output and more; turn 3 a prompt that is a prefix of what is stored."""
    model = tiny_model(arch, torch.float64)
    spec = selfspec.wrap(model, plan=NGRAM_LAYERS, prefix_cache="8MiB")
    first = random_prompt(12, seed=1)
    one = spec.generate(first, max_new_tokens=16)
    assert spec.last_stats.cached_tokens == 0 and torch.equal(one, greedy(model, first, 16))
    second = torch.cat([one, random_prompt(5, seed=2)], dim=1)
    two = spec.generate(second, max_new_tokens=16)
    assert spec.last_stats.cached_tokens >= one.shape[1] - 1
    assert torch.equal(two, greedy(model, second, 16))
    third = second[:, :20]  # a prefix of a stored sequence
    assert torch.equal(spec.generate(third, max_new_tokens=10), greedy(model, third, 10))
    assert spec.last_stats.cached_tokens == 19


def test_reused_entries_equal_a_cold_prefills():
    model = tiny_model("qwen2", torch.float64)
    spec = selfspec.wrap(model, plan=selfspec.DraftPlan.plain(), prefix_cache="8MiB")
    out = spec.generate(random_prompt(10, seed=4), max_new_tokens=12)  # decoded entries, stored at the end
    (key, held), = spec.prefix.store.items()
    cold = LayerRunner(spec.parts, capacity=len(key))
    cold.run(cold.embed(list(key), 0), range(spec.parts.num_layers), 0)
    assert len(key) == out.shape[1] - 1  # every position but the last emitted token's
    for layer in range(spec.parts.num_layers):
        keys, values = cold.cache.entries(layer)
        torch.testing.assert_close(held[layer][0], keys[0])
        torch.testing.assert_close(held[layer][1], values[0])


def test_rows_that_share_a_prefix_reuse_it_together():
    model = tiny_model("gemma3_text", torch.float64)  # sliding windows
    spec = selfspec.wrap(model, plan=NGRAM_LAYERS, prefix_cache="8MiB")
    history = spec.generate(random_prompt(14, seed=5), max_new_tokens=10)[0].tolist()
    session = spec.batch_session()
    prompts = [history + [7, 8], history + [9], history[:-3]]
    rows = [session.add(p, max_new_tokens=12, do_sample=False) for p in prompts]
    while len(session):
        session.step()
    assert [row.stats.cached_tokens for row in rows] == [len(history) - 1, len(history) - 1, len(history) - 4]
    for prompt, row in zip(prompts, rows):
        assert row.new_tokens == greedy(model, torch.tensor([prompt]), 12)[0, len(prompt):].tolist()
    assert spec.prefix.lookup(prompts[0] + row.new_tokens)[0] > len(history)  # the rows were stored back


def test_a_shared_prefix_under_other_sampling_settings_samples_as_a_cold_start():
    """The KV does not depend on how a row samples: a seeded sample from a reused prefix is the one a wrapper
    without the cache draws."""
    model = tiny_model("llama", torch.float64)
    history = random_prompt(16, seed=6)
    warm = selfspec.wrap(model, plan=NGRAM_LAYERS, prefix_cache="8MiB")
    cold = selfspec.wrap(model, plan=NGRAM_LAYERS)
    warm.generate(history, max_new_tokens=6)
    prompt = torch.cat([history, random_prompt(3, seed=7)], dim=1)
    for options in ({"temperature": 0.7}, {"temperature": 1.5, "top_p": 0.8}, {"top_k": 5}):
        torch.manual_seed(11)
        got = warm.generate(prompt, do_sample=True, max_new_tokens=14, **options)
        assert warm.last_stats.cached_tokens >= history.shape[1] - 1, options
        torch.manual_seed(11)
        assert torch.equal(got, cold.generate(prompt, do_sample=True, max_new_tokens=14, **options)), options


def test_a_feature_head_prefills_whole(tmp_path):
    """Its first entry after a stored prefix would need the target's state there: no reuse, same output."""
    model = tiny_model("llama", torch.float64)
    plan = selfspec.DraftPlan(head=str(make_feature_head(model, tmp_path / "head")), draft_length=3)
    spec = selfspec.wrap(model, plan=plan, prefix_cache="8MiB")
    first = spec.generate(random_prompt(9, seed=8), max_new_tokens=8)
    prompt = torch.cat([first, random_prompt(2, seed=9)], dim=1)
    assert torch.equal(spec.generate(prompt, max_new_tokens=8), greedy(model, prompt, 8))
    assert spec.last_stats.cached_tokens == 0


@pytest.mark.parametrize("batched", [False, True], ids=["one sequence", "a batch row"])
def test_a_prefill_that_fails_midway_stores_nothing(batched, monkeypatch):
    """A prefill that raises after its first layer wrote its entries leaves no entry in the store, and the next
    call runs exact from a clean store."""
    model = tiny_model("llama", torch.float64)
    spec = selfspec.wrap(model, plan=NGRAM_LAYERS, prefix_cache="8MiB")
    prompt = random_prompt(12, seed=8)
    run_layers = LayerRunner.run_layers

    def failing(self, hidden, layers, **kwargs):
        if hidden.shape[1] == prompt.shape[1]:  # the prefill: one layer, then the failure
            run_layers(self, hidden, list(layers)[:1], **kwargs)
            raise RuntimeError("out of memory (simulated)")
        return run_layers(self, hidden, layers, **kwargs)

    monkeypatch.setattr(LayerRunner, "run_layers", failing)
    with pytest.raises(RuntimeError, match="simulated"):
        if batched:
            spec.batch_session().add(prompt[0].tolist(), max_new_tokens=8)
        else:
            spec.generate(prompt, max_new_tokens=8)
    assert len(spec.prefix) == 0 and spec.prefix.bytes == 0
    monkeypatch.setattr(LayerRunner, "run_layers", run_layers)
    assert torch.equal(spec.generate(prompt, max_new_tokens=8), greedy(model, prompt, 8))
    assert spec.last_stats.cached_tokens == 0


def test_a_row_stopped_early_stores_only_what_it_wrote():
    """A row stopped by its criteria (a server's cancelled request) stores exactly its valid entries: a later
    prompt that continues it reuses them and equals a cold call."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class StopAfter(StoppingCriteria):
        def __init__(self, length: int) -> None:
            self.length = length

        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)

    model = tiny_model("llama", torch.float64)
    spec = selfspec.wrap(model, plan=NGRAM_LAYERS, prefix_cache="8MiB")
    prompt = random_prompt(10, seed=9)[0].tolist()
    session = spec.batch_session()
    row = session.add(prompt, max_new_tokens=40, stopping_criteria=StoppingCriteriaList([StopAfter(15)]))
    while len(session):
        session.step()
    written = prompt + row.new_tokens
    (key, held), = spec.prefix.store.items()
    assert list(key) == written[:-1] and all(k.shape[1] == len(key) for k, _ in held)
    later = torch.tensor([written + [3, 4]])
    assert torch.equal(spec.generate(later, max_new_tokens=10), greedy(model, later, 10))
    assert spec.last_stats.cached_tokens == len(key)
