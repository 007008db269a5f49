"""Batched generation (`selfspec/batch.py`): every row equals `model.generate` on its prompt alone.

- `generate()` on a left-padded batch, every architecture, float64: row i's
  new tokens are `model.generate`'s on prompt i alone, then padding as
  `model.generate` pads a batch (its shape too); plans without drafts,
  with n-gram drafts (prompts that repeat, so drafts are verified and some
  rejected), under the cost policy with a flat and a linear profile and on
  this machine's measured costs;
- EOS inside a draft, `max_new_tokens` reached inside a draft, stopping
  criteria and logits processors per row;
- a session that rows join and leave at round boundaries (continuous
  batching): each row still equals its prompt alone, whatever joined or
  left beside it, and the cache's rows move into place;
- the cost model: a linear profile drafts nothing, a flat one drafts; a
  draft must beat a plain step by the margin; a pass that is cheap at a
  short context and costly at a long one is drafted at the first only;
  measured batch tables time both contexts;
- bad input: right padding, a row of padding only, a streamer with a batch;
  a session warns where it runs otherwise than one sequence (the eager step,
  an auto plan's reference set).
Sampling per row is tested statistically in `test_sampling.py`.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import LogitsProcessorList, NoRepeatNGramLogitsProcessor

import selfspec
from selfspec.batch import BATCH_MARGIN
from selfspec.batch_draft import DraftRound
from selfspec.batch_generate import batch_costs
from selfspec.costs import PassCosts, RuntimeCosts
from selfspec.ngram import NgramIndex
from selfspec.testing import TINY_CONFIGS, make_feature_head, make_head, random_prompt, tiny_model

ARCHS = sorted(TINY_CONFIGS)
NGRAM = selfspec.DraftPlan(ngram=2, draft_length=4, policy="fixed")  # n-gram drafts only (no layers)
NGRAM_LAYERS = selfspec.DraftPlan(ngram=3, layers=(0,), draft_length=5)  # n-grams first, then layer 0
# n-gram chains, and trees of other continuations in the room a shorter chain leaves in the pass
NGRAM_TREES = selfspec.DraftPlan(ngram=2, tree=6, draft_length=4, policy="fixed")
NGRAM_LAYERS_TREES = selfspec.DraftPlan(ngram=2, layers=(0,), tree=6, draft_length=5)


def repetitive(length: int, seed: int) -> list[int]:
    """A prompt that repeats a short random phrase, so n-gram lookups find matches (some right, some not)."""
    phrase = random_prompt(max(2, length // 3), seed=seed)[0].tolist()
    return (phrase * 4)[:length]


def left_padded(prompts: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def alone(model, prompt: list[int], **kwargs) -> list[int]:
    """`model.generate`'s greedy new tokens after `prompt`, a batch of one."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, **kwargs)
    return out[0, len(prompt):].tolist()


def assert_rows_alone(model, spec, prompts: list[list[int]], **kwargs) -> torch.Tensor:
    ids, mask = left_padded(prompts)
    out = spec.generate(ids, attention_mask=mask, **kwargs)
    with torch.no_grad():
        batched = model.generate(ids, attention_mask=mask, do_sample=False, **kwargs)
    assert out.shape == batched.shape, (out.shape, batched.shape)
    assert torch.equal(out[:, : ids.shape[1]], ids)  # the prompt as given, padding included
    for i, prompt in enumerate(prompts):
        ref = alone(model, prompt, **kwargs)
        new = out[i, ids.shape[1]:].tolist()
        assert new[: len(ref)] == ref, f"row {i}"
        # after its end, the row is padded as model.generate pads this batch
        assert new[len(ref):] == batched[i, ids.shape[1] + len(ref):].tolist(), f"row {i}: padding {new}"
    return out


@pytest.mark.parametrize("arch", ARCHS)
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_batch_rows_equal_each_prompt_alone(arch, data):
    model = tiny_model(arch, torch.float64)
    plan = data.draw(st.sampled_from([selfspec.DraftPlan.plain(), NGRAM, NGRAM_LAYERS, NGRAM_TREES, NGRAM_LAYERS_TREES]),
                     label="plan")
    costs = data.draw(st.sampled_from([None, "flat", "linear"]), label="costs")
    spec = selfspec.wrap(model, plan=plan, costs=costs)
    rows = data.draw(st.integers(2, 4), label="rows")
    prompts = [repetitive(data.draw(st.integers(2, 20)), seed=data.draw(st.integers(0, 999))) for _ in range(rows)]
    new = data.draw(st.integers(1, 24), label="max_new_tokens")
    assert_rows_alone(model, spec, prompts, max_new_tokens=new)
    stats = spec.last_stats
    assert len(stats.row_stats) == rows and stats.new_tokens == sum(s.new_tokens for s in stats.row_stats)
    assert stats.tokens_per_pass >= 1.0 - 1e-9


def scripted_continuations(references: list[list[int]], seed: int, vocab: int = 97):
    """An `NgramIndex.continuations` that proposes, for the row whose reference (prompt + greedy output) the
    tokens start, a random chain of random length first, then the reference's own continuation, then another
    random one: trees whose kept path runs through a branch, beside chains of other lengths."""
    rng = random.Random(seed)

    def continuations(self, tokens, *, budget, branches):
        full = next(r for r in references if r[: len(tokens)] == tokens)
        truth = full[len(tokens) : len(tokens) + budget]
        paths = [[rng.randrange(vocab) for _ in range(rng.randint(1, budget))], truth,
                 [rng.randrange(vocab) for _ in range(budget)]]
        return [path for path in paths if path][:branches], 2

    return continuations


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("plan", [NGRAM_TREES, NGRAM_LAYERS_TREES, "head", "features"],
                         ids=["ngram", "ngram+layers", "ngram+head", "ngram+features"])
def test_ngram_trees_fill_the_room_chains_leave_and_rows_stay_exact(arch, plan, monkeypatch, tmp_path):
    """A row whose n-gram chain is shorter than the batch's widest draft verifies its other continuations in
    that room, as a token tree (at other positions than its slots, seeing only its ancestors; the kept path's
    entries moved into place, an exit head's too): every row still equals `model.generate` on its prompt alone
    (float64), and the target kept tokens from branches."""
    model = tiny_model(arch, torch.float64)
    if plan == "head":  # the head's own cache row moves with the kept path, or its next drafts read stale entries
        head = make_head(model, tmp_path / "head", exit_layer=1, noise=0.05)
        plan = selfspec.DraftPlan(ngram=2, exit_layer=1, head=str(head), tree=6, draft_length=4, policy="fixed")
    if plan == "features":  # a node's head input is its parent's fused state; the row's next f, its kept path's
        head = make_feature_head(model, tmp_path / "features")
        plan = selfspec.DraftPlan(ngram=2, head=str(head), tree=6, draft_length=4, policy="fixed")
    prompts = [repetitive(n, seed=s) for n, s in ((14, 1), (9, 2), (5, 3))]
    references = [p + alone(model, p, max_new_tokens=24) for p in prompts]
    monkeypatch.setattr(NgramIndex, "continuations", scripted_continuations(references, seed=len(arch)))
    spec = selfspec.wrap(model, plan=plan, costs="flat")
    assert_rows_alone(model, spec, prompts, max_new_tokens=24)
    stats = spec.last_stats.row_stats
    assert sum(s.tree_rounds for s in stats) > 0 and sum(s.tree_accepted for s in stats) > 0, stats


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "gpt2"])
def test_a_feature_heads_cache_after_batched_trees_holds_what_the_targets_states_give(arch, monkeypatch, tmp_path):
    """Trees whose kept paths run through branches: after each round, a row's head entries equal the head run
    over (f at p - 1, token p) of its tokens in one pass, so a node's input was its parent's state, not the row
    before it, and the row's next draft starts from its kept path's last state."""
    from selfspec.registry import model_parts
    from selfspec.runner import LayerRunner

    model = tiny_model(arch, torch.float64)
    head_path = make_feature_head(model, tmp_path / "features", noise=0.2)
    plan = selfspec.DraftPlan(ngram=2, head=str(head_path), tree=6, draft_length=4, policy="fixed")
    prompts = [repetitive(14, seed=1), repetitive(9, seed=2)]
    references = [p + alone(model, p, max_new_tokens=40) for p in prompts]
    monkeypatch.setattr(NgramIndex, "continuations", scripted_continuations(references, seed=3))
    spec = selfspec.wrap(model, plan=plan, costs="flat")
    head = spec.head
    session = spec.batch_session()
    rows = [session.add(p, max_new_tokens=40) for p in prompts]
    checked = 0
    for _ in range(8):
        session.step()
        for i, row in enumerate(session.rows):
            length = session.runner.cache.lengths[i]
            tokens = row.out.tokens[:length]
            fresh = LayerRunner(model_parts(model), capacity=length, head=head)
            _, features = spec.passes.run_reading(fresh, fresh.embed(tokens, 0), 0)
            before = torch.cat([torch.zeros_like(features[:, :1]), features[:, :-1]], dim=1)
            fresh.run(head.inputs(fresh.embed(tokens, 0), before), [head.slot], 0)
            keys, _ = session.runner.cache.row_entries(i)[head.slot]  # [kv_heads, length, head_dim]
            expected, _ = fresh.cache.entries(head.slot)
            torch.testing.assert_close(keys, expected[0, :, :length], rtol=1e-6, atol=1e-8)
            torch.testing.assert_close(row.feature[0, 0], features[0, -1], rtol=1e-6, atol=1e-8)
            checked += 1
    assert checked and sum(r.stats.tree_rounds for r in rows) > 0 and sum(r.stats.tree_accepted for r in rows) > 0


RECYCLED = selfspec.DraftPlan(recycle=True, tree=8, draft_length=4)  # recycled trees alone
NGRAM_RECYCLED = selfspec.DraftPlan(recycle=True, ngram=2, tree=10, draft_length=5)  # grown n-gram chains too
LAYERS_RECYCLED = selfspec.DraftPlan(recycle=True, ngram=2, layers=(0,), tree=10, draft_length=4)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("plan", [RECYCLED, NGRAM_RECYCLED, LAYERS_RECYCLED, "features"],
                         ids=["recycled", "ngram", "layers", "features"])
def test_recycled_trees_in_a_batch_keep_every_row_exact(arch, plan, tmp_path):
    """Each row grows the target's recorded next tokens into a tree (alone, or under its n-gram chain) and
    verifies it in the batch's pass: every row still equals `model.generate` on its prompt alone (float64),
    and recycled nodes were drafted and kept."""
    model = tiny_model(arch, torch.float64)
    if plan == "features":
        head = make_feature_head(model, tmp_path / "features")
        plan = selfspec.DraftPlan(recycle=True, ngram=2, head=str(head), tree=10, draft_length=4)
    spec = selfspec.wrap(model, plan=plan, costs="flat")
    prompts = [repetitive(14, seed=1), random_prompt(9, seed=2)[0].tolist(), repetitive(5, seed=3)]
    assert_rows_alone(model, spec, prompts, max_new_tokens=32)
    stats = spec.last_stats.row_stats
    assert sum(s.recycled_drafted for s in stats) > 0 and sum(s.recycled_accepted for s in stats) > 0, stats
    assert sum(s.tree_rounds for s in stats) > 0


def test_a_batch_of_one_recycles_as_one_sequence_does():
    """The recycling plan's draft reaches a batch session (what the server runs): a row alone in it drafts
    recycled nodes, and its text is the single sequence's."""
    model = tiny_model("llama", torch.float64)
    spec = selfspec.wrap(model, plan=NGRAM_RECYCLED, costs="flat")
    prompt = repetitive(12, seed=4)
    single = spec.generate(torch.tensor([prompt]), max_new_tokens=30)[0, 12:].tolist()
    assert spec.last_stats.recycled_drafted > 0
    session = spec.batch_session()
    row = session.add(prompt, max_new_tokens=30)
    while len(session):
        session.step()
    assert row.new_tokens == single
    assert row.stats.recycled_drafted > 0 and row.stats.recycled_accepted > 0, row.stats


def test_ngram_drafts_are_verified_and_some_rejected():
    model = tiny_model("llama", torch.float64)
    spec = selfspec.wrap(model, plan=NGRAM, costs="flat")  # drafting pays whatever this machine's timings
    prompts = [repetitive(18, seed=s) for s in range(4)]
    assert_rows_alone(model, spec, prompts, max_new_tokens=30)
    stats = spec.last_stats
    assert stats.drafted > 0 and 0 < stats.accepted < stats.drafted, (stats.drafted, stats.accepted)
    assert stats.passes < sum(s.verify_passes for s in stats.row_stats)  # rows shared passes
    assert stats.mean_batch > 1


def test_eos_and_max_new_tokens_inside_a_draft():
    model = tiny_model("qwen2", torch.float64)
    spec = selfspec.wrap(model, plan=NGRAM, costs="flat")
    prompts = [repetitive(15, seed=3), repetitive(9, seed=4), repetitive(4, seed=5)]
    free = [alone(model, p, max_new_tokens=30, eos_token_id=None) for p in prompts]
    eos = free[0][7]  # a token the first row emits: its row ends there, possibly inside a draft
    assert_rows_alone(model, spec, prompts, max_new_tokens=30, eos_token_id=eos)
    for new in (1, 2, 5, 13):
        assert_rows_alone(model, spec, prompts, max_new_tokens=new)


def test_logits_processors_apply_per_row():
    model = tiny_model("llama", torch.float64)
    spec = selfspec.wrap(model, plan=NGRAM, costs="flat")
    prompts = [repetitive(12, seed=7), repetitive(6, seed=8)]
    processors = LogitsProcessorList([NoRepeatNGramLogitsProcessor(3)])
    ids, mask = left_padded(prompts)
    out = spec.generate(ids, attention_mask=mask, max_new_tokens=16, logits_processor=processors)
    for i, prompt in enumerate(prompts):
        ref = alone(model, prompt, max_new_tokens=16, logits_processor=processors)
        assert out[i, ids.shape[1]:].tolist()[: len(ref)] == ref


def test_one_left_padded_prompt_runs_as_a_batch_of_one():
    model = tiny_model("mistral", torch.float64)
    spec = selfspec.wrap(model, plan=NGRAM)
    prompt = repetitive(10, seed=1)
    ids, mask = torch.tensor([[0, 0] + prompt]), torch.tensor([[0, 0] + [1] * 10])
    out = spec.generate(ids, attention_mask=mask, max_new_tokens=8)
    assert torch.equal(out[:, :12], ids) and out[0, 12:].tolist() == alone(model, prompt, max_new_tokens=8)
    assert isinstance(spec.last_stats, selfspec.BatchStats)


def test_rows_join_and_leave_at_round_boundaries():
    """Continuous batching: rows added between rounds, of other lengths and limits, each equal to its prompt alone."""
    model = tiny_model("gemma3_text", torch.float64)  # sliding windows and two rotary kinds
    spec = selfspec.wrap(model, plan=NGRAM, costs="flat")
    session = spec.batch_session()
    plan = [(repetitive(6, 1), 5), (repetitive(17, 2), 40), (repetitive(3, 3), 12), (repetitive(30, 4), 9),
            (repetitive(11, 5), 25), (repetitive(2, 6), 1)]
    rows, outputs = {}, {}
    for i, (prompt, new) in enumerate(plan):
        rows[i] = session.add(prompt, max_new_tokens=new, do_sample=False)
        for _ in range(i % 3):  # a few rounds between arrivals; some rows finish meanwhile
            session.step()
    while len(session):
        session.step()
    assert session.runner is None  # an empty batch holds no cache
    for i, (prompt, new) in enumerate(plan):
        outputs[i] = rows[i].new_tokens
        assert outputs[i] == alone(model, prompt, max_new_tokens=new), f"row {i}"
    assert session.stats.rounds < sum(len(v) for v in outputs.values())


def test_cache_grows_for_a_longer_row():
    model = tiny_model("llama", torch.float64)
    spec = selfspec.wrap(model, plan=NGRAM, costs="flat")
    session = spec.batch_session()
    short = session.add(repetitive(4, 1), max_new_tokens=3, do_sample=False)
    capacity = session.runner.cache.capacity
    long = session.add(repetitive(20, 2), max_new_tokens=60, do_sample=False)
    assert session.runner.cache.capacity > capacity
    while len(session):
        session.step()
    assert short.new_tokens == alone(model, repetitive(4, 1), max_new_tokens=3)
    assert long.new_tokens == alone(model, repetitive(20, 2), max_new_tokens=60)


def test_the_cache_grows_in_blocks_as_rows_fill_it(monkeypatch):
    """A row is given room for a block of new tokens, not for max_new_tokens (a server's default is the whole
    context): rounds grow the cache as rows near its end, and every row still equals its prompt alone."""
    monkeypatch.setattr(selfspec.batch, "GROW_BLOCK", 4)
    model = tiny_model("gemma3_text", torch.float64)  # sliding windows: the rotary tables grow too
    session = selfspec.wrap(model, plan=NGRAM_LAYERS, costs="flat").batch_session()
    prompts = [repetitive(9, 1), repetitive(5, 2)]
    rows = [session.add(p, max_new_tokens=200, do_sample=False) for p in prompts]
    first = session.runner.cache.capacity
    assert first <= 9 + 4 + session.max_draft + 1  # a block, not 200 positions
    capacities = {first}
    while len(session):
        session.step()
        if session.runner is not None:
            capacities.add(session.runner.cache.capacity)
    assert len(capacities) > 2 and max(capacities) >= 9 + 200  # it grew, several times, to what the rows needed
    for prompt, row in zip(prompts, rows):
        assert row.new_tokens == alone(model, prompt, max_new_tokens=200)


def test_cost_model_decides_per_batch():
    model = tiny_model("llama", torch.float64)
    prompts = [repetitive(18, seed=s) for s in range(3)]
    ids, mask = left_padded(prompts)
    cost_plan = selfspec.DraftPlan(ngram=2, draft_length=4)
    linear = selfspec.wrap(model, plan=cost_plan, costs="linear")
    linear.generate(ids, attention_mask=mask, max_new_tokens=20)
    assert linear.last_stats.drafted == 0  # q tokens cost q steps: no copy pays
    flat = selfspec.wrap(model, plan=cost_plan, costs="flat")
    flat.generate(ids, attention_mask=mask, max_new_tokens=20)
    assert flat.last_stats.drafted > 0


def test_measured_batch_costs(tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_COSTS_CACHE", str(tmp_path))
    model = tiny_model("llama", torch.float32)
    spec = selfspec.wrap(model, plan=NGRAM_LAYERS)
    runtime = batch_costs(spec, 3, True)
    table = runtime.table
    assert table.max_width == NGRAM_LAYERS.draft_length + 1 and "3 rows" in table.machine
    assert all(b >= a for a, b in zip(table.verify, table.verify[1:]))
    assert list(tmp_path.glob("*.json"))  # cached on disk
    assert batch_costs(spec, 3, True).table is table  # and in memory
    assert not runtime.learn  # reproducible: the rounds' timings do not refine it
    refining = selfspec.wrap(model, plan=NGRAM_LAYERS, reproducible=False)
    assert batch_costs(refining, 3, True).learn and batch_costs(refining, 3, True) is batch_costs(refining, 3, True)
    assert table.long_context == 1024 and len(table.verify_long) == table.max_width  # and at a long context


def cut(session, costs: RuntimeCosts, proposals: list[tuple[list[int], int]]) -> tuple[int, float]:
    """The session's common cut of these n-gram proposals (tokens, match length), at `costs.context`."""
    n = len(proposals)
    batch = DraftRound([None] * n, [costs.context or 0] * n, [8] * n, session.acceptance, lambda: costs,
                       scale=session.calibration.ratio)
    for draft, (tokens, match) in zip(batch.drafts, proposals):
        if tokens:
            draft.source, draft.tokens = "ngram", tokens
            draft.odds = [session.acceptance.ngram_token(match, j + 1) for j in range(len(tokens))]
    return batch.length()


def test_a_batch_drafts_only_past_the_margin_and_prices_the_longest_rows_context():
    session = selfspec.wrap(tiny_model("llama", torch.float32), plan=NGRAM_LAYERS).batch_session()
    prior = NGRAM_LAYERS.target_acceptance  # 0.8: what an unseen match length is predicted at
    free = RuntimeCosts(PassCosts((1.0,) * 6, 0.0, 4), learn=False)  # wider passes cost nothing more
    one = [([7], 3)] + [([], 0)] * 9  # 10 rows, one with a one-token proposal: +8% tokens per pass
    two = [([7], 3)] * 2 + [([], 0)] * 8  # +16%
    assert prior / 10 < BATCH_MARGIN < 2 * prior / 10
    assert cut(session, free, one)[0] == 0 and cut(session, free, two) == (1, 2 * prior)
    # Wider passes nearly free at 48 entries, three times a plain step at 1,024 and beyond.
    table = PassCosts((1.0,) + (1.05,) * 5, 0.0, 4, context=48, verify_long=(1.0,) + (3.0,) * 5, long_context=1024)
    costs = RuntimeCosts(table, learn=False)
    rows = [([7, 8, 9], 3)] * 4
    costs.context = 60
    assert cut(session, costs, rows)[0] == 3
    costs.context = 1500
    assert cut(session, costs, rows)[0] == 0
    # Chosen drafts that brought half the tokens predicted: the same two proposals no longer pay.
    session.calibration.observe(predicted=40.0, realized=20.0)
    assert session.calibration.ratio == pytest.approx(24 / 44)
    assert cut(session, free, two)[0] == 0


def test_recycled_nodes_are_priced_after_the_chain_they_grow():
    """A row's cut counts its chain's tokens first, then its recycled nodes' gains; a pass that is dear past
    two tokens keeps the chain alone, a free one takes the nodes too."""
    session = selfspec.wrap(tiny_model("llama", torch.float32), plan=NGRAM_RECYCLED).batch_session()

    def priced(costs, gains):
        batch = DraftRound([None] * 2, [0, 0], [8, 8], session.acceptance, lambda: costs)
        batch.drafts[0].source, batch.drafts[0].tokens, batch.drafts[0].odds = "ngram", [7], [0.9]
        batch.drafts[0].gains = gains
        batch.drafts[1].source, batch.drafts[1].gains = "recycled", gains
        return batch.length()

    free = RuntimeCosts(PassCosts((1.0,) * 6, 0.0, 4), learn=False)
    assert priced(free, [0.5, 0.25]) == (3, pytest.approx(0.9 + 0.5 + 0.25 + 0.5 + 0.25))
    dear = RuntimeCosts(PassCosts((1.0, 1.0, 3.0, 3.0, 3.0, 3.0), 0.0, 4), learn=False)
    assert priced(dear, [0.5, 0.25]) == (1, pytest.approx(0.9 + 0.5))
    assert priced(free, [])[0] == 1  # no gains: the chain alone
    row = DraftRound([None], [0], [8], session.acceptance, lambda: free).drafts[0]
    row.tokens, row.odds, row.gains = [7], [0.9], [0.5, 0.25]
    assert [row.nodes(k) for k in (0, 1, 2, 3, 4)] == [0, 1, 2, 3, 3]  # nodes verified at each cut


def test_a_batch_prices_layer_tree_levels_by_their_width_and_drafted_nodes_as_drafted():
    """After a row's layer tree is drafted, its nodes past the chain cost no further draft pass; before the next
    level, that level is priced as a pass over its nodes (`RuntimeCosts.draft(width)`)."""
    session = selfspec.wrap(tiny_model("llama", torch.float32), plan=NGRAM_LAYERS).batch_session()
    costs = RuntimeCosts(PassCosts((1.0, 1.0, 2.0, 2.0, 2.0, 2.0), 0.5, 4), learn=False)  # 3 wide: 2 steps

    def drafted(gains):  # two levels drafted: a pass over the last token (0.5 s), one over three nodes (1.0 s)
        batch = DraftRound([None], [0], [8], session.acceptance, lambda: costs)
        batch.pass_widths, batch.next_width = [1, 3], 3
        row = batch.drafts[0]
        row.source, row.tokens, row.odds, row.gains = "layers", [7, 8], [0.9, 0.9], gains
        return batch

    # The cut at 4 verifies the chain and both other nodes in one pass, for no more drafting: 3.61 / 3.5 s.
    assert drafted([0.6, 0.3]).length() == (4, pytest.approx(0.9 + 0.81 + 0.6 + 0.3))
    # A third level over three nodes (1.0 s) does not pay: 3.44 / 4.5 s against 2.71 / 3.5 s; over one, it does.
    batch = drafted([])
    assert batch.length([[0.9]])[0] == 2
    batch.next_width = 1
    assert batch.length([[0.9]])[0] == 3


def test_bad_batches_get_clear_errors():
    model = tiny_model("llama", torch.float64)
    spec = selfspec.wrap(model, plan=NGRAM)
    ids = torch.tensor([[5, 6, 7, 0], [5, 6, 7, 8]])
    with pytest.raises(ValueError, match=r"attention_mask row 0 has padding that is not all on the left.*left"):
        spec.generate(ids, attention_mask=torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]), max_new_tokens=3)
    with pytest.raises(ValueError, match=r"attention_mask row 1 has no token"):
        spec.generate(ids, attention_mask=torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0]]), max_new_tokens=3)
    with pytest.raises(ValueError, match=r"row 1, position 3.*out of range"):
        spec.generate(torch.tensor([[5, 6, 7, 8], [5, 6, 7, 999]]), max_new_tokens=3)
    from transformers import TextStreamer

    with pytest.raises(ValueError, match=r"a streamer takes one sequence; this batch has 2"):
        spec.generate(ids, streamer=TextStreamer(None), max_new_tokens=3)


def test_the_session_learns_acceptance_from_every_row():
    """A joining row is priced with what the session's rows taught: the shared estimates moved off the prior."""
    model = tiny_model("llama", torch.float64)
    session = selfspec.wrap(model, plan=NGRAM, costs="flat").batch_session()
    session.add(repetitive(18, seed=1), max_new_tokens=30, do_sample=False)
    session.add(repetitive(12, seed=3), max_new_tokens=30, do_sample=False)
    while len(session):
        session.step()
    seen = [rate for rate in session.acceptance.ngram.values() if rate.seen > 0]
    assert seen and any(rate.estimate(NGRAM.target_acceptance, 2.0) != pytest.approx(NGRAM.target_acceptance)
                        for rate in seen)


def test_a_batch_that_never_drafts_still_learns_its_copies():
    """Where no copy pays (q tokens cost q steps), every round is a plain step; the token each row's pass emits
    still judges the first token of the row's proposal, so the estimates follow the traffic."""
    model = tiny_model("llama", torch.float64)
    session = selfspec.wrap(model, plan=selfspec.DraftPlan(ngram=2, draft_length=4), costs="linear").batch_session()
    rows = [session.add(repetitive(18, seed=s), max_new_tokens=24, do_sample=False) for s in (1, 3)]
    while len(session):
        session.step()
    assert all(row.stats.drafted == 0 for row in rows)
    judged = {(match, bucket): rate for (match, bucket), rate in session.acceptance.ngram_cells.items() if rate.seen}
    assert judged and all(bucket == 0 for _, bucket in judged)  # the first token of a proposal, and only it
    assert sum(rate.seen for rate in judged.values()) == pytest.approx(
        sum(rate.seen for rate in session.acceptance.ngram.values()))


def test_a_batch_says_where_it_runs_otherwise_than_one_sequence():
    """A batch runs the eager step and drafts with an auto plan's reference layer set: `batch_session` warns so,
    naming what one sequence would do, and is silent where a batch does what one sequence does."""
    import warnings

    model = tiny_model("llama")
    with pytest.warns(UserWarning, match=r"eager step, not step='static'"):
        selfspec.wrap(model, plan=selfspec.DraftPlan(ngram=2), step="static").batch_session()
    with pytest.warns(UserWarning, match=r"reference layer set \[0, 1, 2\], not a set chosen per context"):
        selfspec.wrap(model, plan="auto", costs="flat").batch_session()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        selfspec.wrap(model, plan=selfspec.DraftPlan(layers=(0, 2), tree=8, draft_length=3),
                      costs="flat").batch_session()
    assert not [w for w in caught if "a batch" in str(w.message)]  # layer trees: as one sequence
