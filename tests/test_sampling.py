"""Sampling is lossless: self-speculative samples are distributed exactly as the target's.

What is tested
--------------
1. `accept_sampling` alone: the first emitted token (the drafted token if
   accepted, else the recovered one) is distributed as p, for several (p, q)
   pairs, including q = 0 where p > 0, p = 0 where q > 0, one-hot drafts and
   p == q; a multi-round loop on a synthetic Markov chain (k = 3) checks the
   joint law of several emitted tokens (rows i > 0, residuals at i > 0, bonus
   tokens). Two deliberately wrong rules must FAIL the same check (power).
   Token trees: recursive rejection over a tree's children keeps the law of
   the first two emitted tokens; a rule that forgets to remove the rejected
   children from the residual fails it.
2. End to end on a tiny random float64 Llama: the joint law of the first four
   new tokens from `selfspec` sampling matches the exact law computed from
   the model's own full forward passes (with temperature, top-k and top-p
   applied through transformers' warpers). Token 1 comes from the prefill;
   tokens 2-4 come from drafted/verified rounds (accepted, recovered, bonus).
   Plans: early exit, layer subsets, an exit head, and a head with a draft
   vocabulary of 6 of the 16 tokens (q is zero outside it, p is not), and
   n-gram token trees (a prompt where every token has two successors), a
   head's draft grown as a tree (a pass per level over its likeliest nodes,
   with temperature and top-p), an auto plan
   whose layers are re-chosen every round, and recycled trees (grown from
   the target's probabilities recorded earlier in the same generation).
   An engine that always accepts the draft must fail the same check.
   A batch of two rows of other lengths (`batch.py`; n-gram drafts, layer
   drafts, a head with a draft vocabulary, n-gram trees in the room
   shorter chains leave): each row's first four tokens follow its own exact
   law; always-accept, and a tree rule that keeps the first path, fail it.
3. Seeded runs reproduce exactly (explicit generator; global seed).
4. Plain sampling (draft_length=0) and drafted sampling both run.

The statistical check and its false-failure probability
-------------------------------------------------------
`assert_distribution(counts, p)` uses a per-cell Chernoff bound, which is
exact for every N (no asymptotic chi-square approximation): for each cell i
with empirical frequency a_i = counts_i / N and exact probability p_i,

    P(N * KL(a_i || p_i) >= c and a_i >= p_i) <= exp(-c)   (same for a_i <= p_i)

where KL is the Bernoulli KL divergence, so with a union bound over the V
cells, P(max_i N * KL(a_i || p_i) >= c) <= 2 V exp(-c). We take
c = ln(2 V / DELTA), so each check falsely fails with probability at most
DELTA = 1e-7, whatever the number of cells. A cell with p_i = 0 that is ever
observed gives KL = inf: an impossible token fails the check outright.

This file runs CHECKS_IN_FILE = 264 such checks on samples whose law is the
reference law (test 1: 6 pairs for each of the two implementations of the
rule, the host one and the device one of the static step, + 4 Markov-chain
checks + 1 token-tree check + 7 checks that the wrong-rule harnesses produce
the wrong rules' own exact laws; test 2: 13 cases x 8, three of them on the
static step; + 16 checks of a batch's two rows for each of 5 batch plans (one of them layer trees), for
batched n-gram trees and for batched recycled trees), so over random seeds the whole file would falsely
fail with probability at most 264 * 1e-7 = 2.6e-5. All seeds are fixed, so the outcome is
deterministic anyway.

Power (a wrong sampler must fail): in test 1 a wrong rule is only run on
pairs where its exact law deviates from p by more than 3 detection radii in
some cell, so its statistic there would have to fall ~2 radii short of its
own mean for a false pass (by the same Chernoff bound, roughly exp(-4c) with
c ~ 19, i.e. negligible). The end-to-end power check (always-accept engine,
400 runs) fails the check with the fixed seed by a margin of ~2x the
threshold on the token-2 and token-3 marginals; it is a demonstration at
small N, not a bound. The end-to-end check is sized for gross errors (a
detection radius of ~0.05-0.06 per cell at N = 1,000), plus any impossible
token (outside top-k / top-p), which fails at any N.
"""

from __future__ import annotations

import bisect
import collections
import copy
import itertools
import math
import random

import pytest
import torch
import transformers
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import selfspec
import selfspec.engine
import selfspec.rounds
import selfspec.auto_layers
from selfspec.acceptance import Verdict, accept_sampling, accept_sampling_on_device, sample
from selfspec.ngram import NgramIndex
from selfspec.stats import GenerationStats
from selfspec.testing import make_feature_head, make_head, make_vocab
from selfspec.tree import TokenTree, accept_tree_sampling, accept_tree_sampling_on_device

DELTA = 1e-7  # false-failure probability bound of one `assert_distribution` check
CHECKS_IN_FILE = 264  # checks on correct samplers; total false-failure bound CHECKS_IN_FILE * DELTA


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors: one intra-op thread is several times faster than two on a shared 2-core box."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# -- the statistical check -------------------------------------------------------------------


def kl_bernoulli(a: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """KL(Bernoulli(a) || Bernoulli(p)) elementwise, float64, with 0 log 0 = 0 and inf where a>0, p=0."""
    a, p = a.double(), p.double()

    def term(x, y):
        out = torch.where(x > 0, x * (torch.log(x) - torch.log(y)), torch.zeros_like(x))
        return torch.where((x > 0) & (y <= 0), torch.full_like(x, math.inf), out)

    return term(a, p) + term(1 - a, 1 - p)


def distribution_statistic(counts: torch.Tensor, p: torch.Tensor) -> tuple[float, float]:
    """(max_i N KL(a_i || p_i), threshold c = ln(2V / DELTA)); the check passes iff statistic < c."""
    counts, p = counts.flatten().double(), p.flatten().double()
    n = counts.sum()
    stat = float((n * kl_bernoulli(counts / n, p.clamp(0, 1))).max())
    return stat, math.log(2 * p.numel() / DELTA)


def passes(counts: torch.Tensor, p: torch.Tensor) -> bool:
    stat, threshold = distribution_statistic(counts, p)
    return stat < threshold


def assert_distribution(counts: torch.Tensor, p: torch.Tensor, what: str) -> None:
    """Fails with probability <= DELTA when `counts` are N iid draws from `p` (see module docstring)."""
    assert abs(float(p.sum()) - 1) < 1e-9, f"{what}: reference does not sum to 1"
    stat, threshold = distribution_statistic(counts, p)
    n = int(counts.sum())
    worst = int((n * kl_bernoulli(counts.flatten().double() / n, p.flatten().double())).argmax())
    assert stat < threshold, (
        f"{what}: observed law differs from the exact one (max N*KL = {stat:.1f} >= {threshold:.1f}; "
        f"worst cell {worst}: observed {int(counts.flatten()[worst])}/{n} = "
        f"{float(counts.flatten()[worst]) / n:.4f}, expected {float(p.flatten()[worst]):.4f})"
    )


def detection_radius(p: torch.Tensor, n: int) -> torch.Tensor:
    """Roughly the smallest per-cell deviation |a_i - p_i| the check detects at n draws."""
    c = math.log(2 * p.numel() / DELTA)
    return torch.sqrt(2 * c * p * (1 - p) / n) + c / n


# -- 1. accept_sampling alone ----------------------------------------------------------------

V_UNIT = 8
N_UNIT = 20_000


def _pairs() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(2024)

    def dirichlet(alpha: float) -> torch.Tensor:
        x = torch._standard_gamma(torch.full((V_UNIT,), alpha, dtype=torch.float64), generator=g)
        return x / x.sum()

    def zero(x: torch.Tensor, where: list[int]) -> torch.Tensor:
        x = x.clone()
        x[where] = 0
        return x / x.sum()

    p_shared = dirichlet(1.0)
    one_hot = torch.zeros(V_UNIT, dtype=torch.float64)
    one_hot[6] = 1
    return {
        "random": (dirichlet(1.0), dirichlet(1.0)),
        "peaked": (dirichlet(0.3), dirichlet(0.3)),
        "q zero where p>0": (dirichlet(1.0), zero(dirichlet(1.0), [0, 1, 2])),
        "p zero where q>0, and q zero where p>0": (
            zero(dirichlet(1.0), [0, 1, 2, 3]),
            zero(dirichlet(1.0), [5, 6, 7]),
        ),
        "one-hot draft": (dirichlet(1.0), one_hot),
        "p == q": (p_shared, p_shared.clone()),
    }


PAIRS = _pairs()


def always_accept(draft_tokens, draft_probs, target_probs, generator=None) -> Verdict:
    """WRONG rule: keep every drafted token (emits q, not p)."""
    k = len(draft_tokens)
    return Verdict(k, sample(target_probs[k], generator))


def resample_from_p(draft_tokens, draft_probs, target_probs, generator=None) -> Verdict:
    """WRONG rule: the right acceptance test, but on rejection sample from p instead of max(0, p - q)."""
    for i, x in enumerate(draft_tokens):
        u = float(torch.rand(1, generator=generator, dtype=torch.float64))
        if u * float(draft_probs[i, x]) > float(target_probs[i, x]):
            return Verdict(i, sample(target_probs[i], generator))
    return Verdict(len(draft_tokens), sample(target_probs[len(draft_tokens)], generator))


def first_token_counts(rule, p: torch.Tensor, q: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """Counts of the first emitted token over n single-token rounds: draft x ~ q, then `rule`."""
    g = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(q, n, replacement=True, generator=g).tolist()
    draft_probs = q[None]  # [1, V]
    bonus = torch.full_like(p, 1 / len(p))  # row k: the bonus law; never the first token when k=1
    target_probs = torch.stack([p, bonus])  # [2, V]
    counts = [0] * len(p)
    for x in drafts:
        verdict = rule([x], draft_probs, target_probs, g)
        counts[x if verdict.accepted else verdict.next_token] += 1
    return torch.tensor(counts)


def accept_sampling_device_rule(draft_tokens, draft_probs, target_probs, generator=None) -> Verdict:
    """The static step's rule (`accept_sampling_on_device`), read back as a `Verdict`."""
    accepted, next_token = accept_sampling_on_device(torch.tensor(draft_tokens, dtype=torch.long), draft_probs,
                                                     target_probs, generator)
    return Verdict(int(accepted), int(next_token))


@pytest.mark.parametrize("rule", [accept_sampling, accept_sampling_device_rule], ids=["host", "device"])
@pytest.mark.parametrize("name", list(PAIRS))
def test_accept_sampling_first_token_follows_p(name, rule):
    """12 checks (one per pair and rule) at DELTA = 1e-7 each, N = 20,000 rounds per pair."""
    p, q = PAIRS[name]
    counts = first_token_counts(rule, p, q, N_UNIT, seed=1)
    assert_distribution(counts, p, f"accept_sampling, pair {name!r}")


def _wrong_law(rule, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The exact law of the first token under a wrong rule."""
    if rule is always_accept:
        return q
    beta = torch.minimum(p, q).sum()  # acceptance probability
    return torch.minimum(p, q) + (1 - beta) * p


@pytest.mark.parametrize("rule", [always_accept, resample_from_p], ids=lambda r: r.__name__)
def test_wrong_rules_fail_the_same_check(rule):
    """Power: a wrong rule fails the check on the first 3 pairs where its exact law is > 3 detection radii from p.

    Those same samples must pass the check against the wrong rule's own exact law (3 checks per rule).
    """
    tested = 0
    for name, (p, q) in PAIRS.items():
        wrong = _wrong_law(rule, p, q)
        if not bool(((wrong - p).abs() > 3 * detection_radius(p, N_UNIT)).any()):
            continue  # e.g. p == q: the wrong rule is right there
        if tested == 3:
            break  # three pairs make the point; keep the file fast
        tested += 1
        counts = first_token_counts(rule, p, q, N_UNIT, seed=1)
        assert not passes(counts, p), f"{rule.__name__} on pair {name!r} passed the check: the test has no power"
        assert passes(counts, wrong), f"{rule.__name__} on pair {name!r}: harness does not produce the wrong law"
    assert tested >= 3, f"{rule.__name__}: too few pairs far enough from p to show power ({tested})"


def test_accept_sampling_multi_round_markov_chain():
    """Speculative loop with k=3 on a Markov chain: the joint law of 3 emitted tokens is the target's.

    Target p(.|prev) and draft q(.|prev) are random transition tables over V=4 tokens (q has zeros
    where p has not and vice versa); each round drafts 3 tokens from q, calls `accept_sampling` with
    the conditional rows, emits accepted + next token; this exercises rows i > 0, residuals at
    i > 0 and bonus tokens. 4 checks (joint of 64 cells, 3 marginals) at DELTA = 1e-7, N = 8,000.
    """
    v, k, length, n = 4, 3, 3, 8_000
    g = torch.Generator().manual_seed(7)
    P = torch._standard_gamma(torch.full((v, v), 0.7, dtype=torch.float64), generator=g)
    Q = torch._standard_gamma(torch.full((v, v), 0.7, dtype=torch.float64), generator=g)
    P[0, 3] = 0
    Q[1, 2] = Q[2, 0] = 0
    P, Q = P / P.sum(-1, keepdim=True), Q / Q.sum(-1, keepdim=True)
    start = 1
    # draft tokens by inverse CDF on uniforms drawn up front (cheaper than a multinomial call each)
    cdfs = Q.cumsum(-1).tolist()
    last = [max(j for j in range(v) if Q[a, j] > 0) for a in range(v)]
    uniforms = iter(torch.rand(n * length * k, generator=g, dtype=torch.float64).tolist())
    seen = collections.Counter()
    for _ in range(n):
        out = [start]
        while len(out) <= length:
            drafts = []
            for _ in range(k):
                prev = drafts[-1] if drafts else out[-1]
                drafts.append(min(bisect.bisect_right(cdfs[prev], next(uniforms)), last[prev]))
            prevs = [out[-1]] + drafts
            verdict = accept_sampling(drafts, Q[prevs[:k]], P[prevs], g)
            out += drafts[: verdict.accepted] + [verdict.next_token]
        seen[tuple(out[1 : length + 1])] += 1
    counts = torch.zeros((v,) * length, dtype=torch.long)
    for key, c in seen.items():
        counts[key] = c
    exact = P[start][:, None, None] * P[:, :, None] * P[None, :, :]  # p(t1) p(t2|t1) p(t3|t2)
    assert_distribution(counts, exact, "Markov chain, joint of 3 tokens")
    for i in range(length):
        dims = tuple(d for d in range(length) if d != i)
        assert_distribution(counts.sum(dims), exact.sum(dims), f"Markov chain, marginal of token {i + 1}")


def tree_round_counts(rule, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts of the first two emitted tokens over n tree rounds on a Markov chain, and their exact law.

    The tree (V = 6, root token 0): children 2, 5, 1 of the root; 3 and 0 under the 2; 4 under the 5.
    Row r of p is the chain's transition row of row r's token.
    """
    v = 6
    g = torch.Generator().manual_seed(seed)
    P = torch._standard_gamma(torch.full((v, v), 0.8, dtype=torch.float64), generator=g)
    P[0, 4] = 0  # an impossible token after the root's
    P = P / P.sum(-1, keepdim=True)
    tree = TokenTree(tokens=(2, 5, 1, 3, 0, 4), parents=(-1, -1, -1, 0, 0, 1))
    target_probs = P[[0, *tree.tokens]]  # [n+1, V]
    seen = collections.Counter()
    for _ in range(n):
        path, next_token = rule(tree, target_probs, g)
        emitted = tree.path_tokens(path) + [next_token]
        if len(emitted) < 2:  # nothing kept: the second token would come from the next round
            emitted.append(int(torch.multinomial(P[emitted[0]], 1, generator=g)))
        seen[tuple(emitted[:2])] += 1
    counts = torch.zeros(v, v, dtype=torch.long)
    for key, c in seen.items():
        counts[key] = c
    return counts, P[0][:, None] * P  # p(t1 | 0) p(t2 | t1)


def resample_without_removing_children(tree, target_probs, generator=None):
    """WRONG rule: the right path, but the next token drawn from p itself, the rejected children left in."""
    kept, _ = accept_tree_sampling_on_device(tree, target_probs, generator)
    path = [node for node, keep in enumerate(kept.tolist()) if keep]
    row = path[-1] + 1 if path else 0
    return path, int(torch.multinomial(target_probs[row].float(), 1, generator=generator))


def test_accept_tree_sampling_keeps_the_target_law():
    """Recursive rejection over a tree's children: the first two emitted tokens follow p (1 check, N = 20,000);
    a rule that does not remove the rejected children fails the same check (power) and passes against
    its own law (1 check)."""
    counts, exact = tree_round_counts(accept_tree_sampling, N_UNIT, seed=3)
    assert counts[0, 4] == 0
    assert_distribution(counts, exact, "accept_tree_sampling, first two tokens")
    wrong, _ = tree_round_counts(resample_without_removing_children, N_UNIT, seed=3)
    assert not passes(wrong, exact), "the wrong tree rule passed the check: the test has no power"
    assert passes(wrong, wrong_tree_law(exact)), "the harness does not produce the wrong rule's own law"


def wrong_tree_law(exact: torch.Tensor) -> torch.Tensor:
    """The law of the first two tokens under `resample_without_removing_children`, on `tree_round_counts`' tree.

    The path is kept as by the right rule (a child c is chosen with p(c)); at the row where it stops
    (with probability 1 - its children's mass) the next token is drawn from the whole row.
    """
    P0 = exact.sum(1)  # p(. | 0)
    P = exact / P0[:, None].clamp_min(1e-300)  # rows of the chain (row 4 of the root is impossible anyway)
    children = {0: [2, 5, 1], 2: [3, 0], 5: [4], 1: []}  # by token: the tree of `tree_round_counts`
    law = (1 - P0[children[0]].sum()) * P0[:, None] * P  # stop at the root: t1 from the whole row
    for c in children[0]:
        stay = 1 - P[c, children[c]].sum()
        law[c] += P0[c] * stay * P[c]  # stop at c: t2 from the whole row
        law[c, children[c]] += P0[c] * P[c, children[c]]  # go on to a grandchild
    return law


# -- 2. end to end on a tiny Llama --------------------------------------------------------------

VOCAB = 16
PROMPT = torch.tensor([[3, 1, 4, 1, 5, 9]])
NEW = 4  # tokens per run: 1 from the prefill, then rounds that draft min(k, remaining - 1) tokens
N_E2E = 1_000  # runs per case


@pytest.fixture(scope="module")
def model():
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.2,  # peaked distributions, and a draft that is often but not always right
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        m = transformers.LlamaForCausalLM(cfg).to(torch.float64).eval()
    m.generation_config.eos_token_id = m.generation_config.pad_token_id = None
    return m


def exact_joint(model, warpers: LogitsProcessorList, new: int, prompt: torch.Tensor = PROMPT) -> torch.Tensor:
    """Exact joint law `[V]*new` of the first `new` sampled tokens, from full forward passes of the model."""
    v = model.config.vocab_size
    joint = torch.ones((), dtype=torch.float64)
    with torch.no_grad():
        for step in range(new):
            # every continuation of the prompt by `step` tokens, as one batch
            conts = torch.tensor(list(itertools.product(range(v), repeat=step)), dtype=torch.long)
            conts = conts.reshape(v**step, step)
            ids = torch.cat([prompt.expand(len(conts), -1), conts], dim=1)
            logits = model(ids).logits[:, -1].double()  # [V^step, V]
            probs = torch.softmax(warpers(ids, logits), dim=-1)
            joint = joint[..., None] * probs.reshape((v,) * step + (v,))
    return joint


@pytest.fixture(scope="module")
def artifacts(model, tmp_path_factory):
    """An exit head for exit 2 (a perturbed copy of layer 3) and a draft vocabulary, for the tiny model."""
    folder = tmp_path_factory.mktemp("artifacts")
    return {
        "head": str(make_head(model, folder / "head", exit_layer=2, source_layer=3, noise=0.05)),
        "vocab": str(make_vocab(model, folder / "vocab")),
        "features": str(make_feature_head(model, folder / "features", noise=0.05)),
        "eagle3": str(make_feature_head(model, folder / "eagle3", noise=0.05, layout="eagle3")),
    }


CASES = {
    # name: (plan, sampling kwargs, the same processing as transformers' warpers);
    # a plan may be a function of the `artifacts` fixture
    "T=1, exit_layer=2, k=3": (
        selfspec.DraftPlan(exit_layer=2, draft_length=3, policy="fixed"),
        dict(temperature=1.0),
        LogitsProcessorList([]),
    ),
    "T=0.7, top_k=6, layers=[0,2], k=4": (
        selfspec.DraftPlan(layers=[0, 2], draft_length=4, policy="fixed"),
        dict(temperature=0.7, top_k=6),
        LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(6)]),
    ),
    "T=1.3, top_p=0.8, layers=[1,3], k=3": (
        selfspec.DraftPlan(layers=[1, 3], draft_length=3, policy="fixed"),
        dict(temperature=1.3, top_p=0.8),
        LogitsProcessorList([TemperatureLogitsWarper(1.3), TopPLogitsWarper(0.8)]),
    ),
    "T=1, exit_layer=2 + head, k=3": (
        lambda a: selfspec.DraftPlan(exit_layer=2, head=a["head"], draft_length=3, policy="fixed"),
        dict(temperature=1.0),
        LogitsProcessorList([]),
    ),
    "T=0.8, top_p=0.9, head + draft vocabulary 6/16, k=3": (
        lambda a: selfspec.DraftPlan(policy="fixed", exit_layer=2, head=a["head"], draft_vocab=a["vocab"], draft_vocab_size=6,
                                     draft_length=3),
        dict(temperature=0.8, top_p=0.9),
        LogitsProcessorList([TemperatureLogitsWarper(0.8), TopPLogitsWarper(0.9)]),
    ),
    # k chosen per round from the draft's confidences (a flat cost profile makes drafting pay)
    "T=0.9, layers=[0,2], cost policy (flat profile), k<=4": (
        selfspec.DraftPlan(layers=[0, 2], draft_length=4),
        dict(temperature=0.9),
        LogitsProcessorList([TemperatureLogitsWarper(0.9)]),
    ),
}
COSTS = {"T=0.9, layers=[0,2], cost policy (flat profile), k<=4": "flat"}
CASES["static step: T=0.7, top_k=6, layers=[0,2], k=4"] = CASES["T=0.7, top_k=6, layers=[0,2], k=4"]
CASES["static step: T=0.8, top_p=0.9, head + draft vocabulary 6/16, k=3"] = (
    CASES["T=0.8, top_p=0.9, head + draft vocabulary 6/16, k=3"]
)
# Token trees: every token of this prompt occurred twice with different successors, so after any first
# token an n-gram match (n = 1) finds two continuations, and the round verifies a tree (recursive rejection).
TREE_PROMPT = torch.tensor([list(range(VOCAB)) + list(range(0, VOCAB, 2)) + list(range(1, VOCAB, 2))])
TREE_CASES = {
    "T=1, n-gram trees (<= 6 nodes) then layers=[0,2], k=3": (
        selfspec.DraftPlan(ngram=1, tree=6, layers=[0, 2], draft_length=3, policy="fixed"),
        dict(temperature=1.0),
        LogitsProcessorList([]),
    ),
}
CASES.update(TREE_CASES)
CASES["static step: T=1, n-gram trees (<= 6 nodes) then layers=[0,2], k=3"] = (
    TREE_CASES["T=1, n-gram trees (<= 6 nodes) then layers=[0,2], k=3"]
)
# An auto plan (`auto_layers.py`): its layers re-chosen every round from what the rounds before accepted (so from
# earlier samples); the proposal may depend on the past, never on the token it proposes for.
AUTO_CASE = "T=1, auto layers re-chosen every round (flat profile), k<=3"
CASES[AUTO_CASE] = (selfspec.DraftPlan(auto=True, draft_length=3), dict(temperature=1.0),
                    LogitsProcessorList([]))
COSTS[AUTO_CASE] = "flat"
PATCHES = {AUTO_CASE: {"CHOOSE_EVERY": 1, "CHOOSE_EVERY_IDLE": 1, "PROBE_EVERY": 1}}
# A layer draft as a tree: the exit head's draft grown level by level (each level's likeliest nodes, their tokens
# the draft's top choices after the warpers), verified by recursive rejection.
HEAD_TREE_CASE = "T=0.8, top_p=0.9, head drafts a tree (levels of its likeliest nodes, <= 6 nodes), k=3"
CASES[HEAD_TREE_CASE] = (
    lambda a: selfspec.DraftPlan(exit_layer=2, head=a["head"], tree=6, draft_length=3, policy="fixed"),
    dict(temperature=0.8, top_p=0.9),
    LogitsProcessorList([TemperatureLogitsWarper(0.8), TopPLogitsWarper(0.9)]),
)
# Recycled trees (`recycle.py`): grown from the target's own probabilities recorded in this generation's earlier
# passes (a sampled generation starts from an empty table), their tokens fixed candidates for recursive rejection.
RECYCLED_CASE = "T=1, recycled trees (<= 6 nodes), k<=3"
CASES[RECYCLED_CASE] = (selfspec.DraftPlan(recycle=True, tree=6, draft_length=3, policy="fixed"),
                        dict(temperature=1.0), LogitsProcessorList([]))
CASES[f"static step: {RECYCLED_CASE}"] = CASES[RECYCLED_CASE]
# A feature head (`feature_head.py`): drafts from the target's fused states, then from its own; as a chain, on the
# static step, and as a tree grown from its likeliest nodes.
FEATURE_CASE = "T=1, feature head, k=3"
CASES[FEATURE_CASE] = (lambda a: selfspec.DraftPlan(head=a["features"], draft_length=3, policy="fixed"),
                       dict(temperature=1.0), LogitsProcessorList([]))
CASES[f"static step: {FEATURE_CASE}"] = CASES[FEATURE_CASE]
FEATURE_TREE_CASE = "T=0.8, top_p=0.9, feature head drafts a tree (<= 6 nodes), k=3"
CASES[FEATURE_TREE_CASE] = (
    lambda a: selfspec.DraftPlan(head=a["features"], tree=6, draft_length=3, policy="fixed"),
    dict(temperature=0.8, top_p=0.9),
    LogitsProcessorList([TemperatureLogitsWarper(0.8), TopPLogitsWarper(0.9)]),
)
# The same as a head of EAGLE-3's layout (`eagle3.py`): its attention reads the token and f side by side.
EAGLE3_TREE_CASE = "T=0.8, top_p=0.9, EAGLE-3 layout head drafts a tree (<= 6 nodes), k=3"
CASES[EAGLE3_TREE_CASE] = (
    lambda a: selfspec.DraftPlan(head=a["eagle3"], tree=6, draft_length=3, policy="fixed"),
    dict(temperature=0.8, top_p=0.9),
    LogitsProcessorList([TemperatureLogitsWarper(0.8), TopPLogitsWarper(0.9)]),
)
PROMPTS = {case: TREE_PROMPT for case in CASES if "trees" in case}
STEPS = {case: "static" for case in CASES if case.startswith("static step")}


def run_many(spec, n: int, seed: int, prompt: torch.Tensor = PROMPT, **sampling) -> tuple[torch.Tensor, dict]:
    g = torch.Generator().manual_seed(seed)
    seen = collections.Counter()
    totals = dict(drafted=0, accepted=0, recovered=0, bonus=0, tree_rounds=0, layer_tree_rounds=0,
                  recycled_drafted=0, recycled_accepted=0)
    totals["layer set changes"] = 0
    for _ in range(n):
        out = spec.generate(prompt, max_new_tokens=NEW, do_sample=True, generator=g, **sampling)
        new = tuple(out[0, prompt.shape[1] :].tolist())
        assert len(new) == NEW
        seen[new] += 1
        for key in totals:
            if key in GenerationStats.__dataclass_fields__:
                totals[key] += getattr(spec.last_stats, key)
        totals["layer set changes"] += max(0, spec.last_stats.layer_sets.count("round ") - 1)
    counts = torch.zeros((VOCAB,) * NEW, dtype=torch.long)
    for new, c in seen.items():
        counts[new] = c
    return counts, totals


def assert_joint_matches(counts: torch.Tensor, exact: torch.Tensor, what: str) -> None:
    """8 checks: the joint of all 4 tokens, the 4 marginals, the 3 adjacent pairs."""
    assert_distribution(counts, exact, f"{what}: joint of tokens 1-4")
    for i in range(NEW):
        dims = tuple(d for d in range(NEW) if d != i)
        assert_distribution(counts.sum(dims), exact.sum(dims), f"{what}: marginal of new token {i + 1}")
    for i in range(NEW - 1):
        dims = tuple(d for d in range(NEW) if d not in (i, i + 1))
        assert_distribution(counts.sum(dims), exact.sum(dims), f"{what}: joint of new tokens {i + 1},{i + 2}")


@pytest.mark.parametrize("case", list(CASES))
def test_sampling_matches_exact_target_law(model, artifacts, case, monkeypatch):
    """selfspec samples vs the exact law from full forwards: 8 checks at DELTA = 1e-7, N = 1,000 runs."""
    for name, value in PATCHES.get(case, {}).items():
        monkeypatch.setattr(selfspec.auto_layers, name, value)
    plan, sampling, warpers = CASES[case]
    plan = plan(artifacts) if callable(plan) else plan
    prompt = PROMPTS.get(case, PROMPT)
    exact = exact_joint(model, warpers, NEW, prompt)
    spec = selfspec.wrap(model, plan=plan, costs=COSTS.get(case), step=STEPS.get(case, "eager"))
    counts, totals = run_many(spec, N_E2E, seed=11, prompt=prompt, **sampling)
    # the drafted/verified machinery was really exercised, on every path
    assert totals["drafted"] > 0 and totals["accepted"] > 0, totals
    assert totals["accepted"] < totals["drafted"], totals
    if case.endswith(RECYCLED_CASE):  # a sampled generation starts from an empty table: trees from the second round on
        assert totals["tree_rounds"] > N_E2E / 4 and totals["recycled_accepted"] > N_E2E / 10, totals
    elif case in PROMPTS:  # trees were verified, not just chains (a tree's round has no bonus: not all nodes are kept)
        assert totals["tree_rounds"] > N_E2E / 2 and totals["recovered"] > 0, totals
    elif case in (HEAD_TREE_CASE, FEATURE_TREE_CASE, EAGLE3_TREE_CASE):
        assert totals["layer_tree_rounds"] > N_E2E / 2 and totals["recovered"] > 0, totals
    else:
        assert totals["recovered"] > 0 and totals["bonus"] > 0, totals
    if case in PATCHES:  # the layer set really changed within generations
        assert totals["layer set changes"] > N_E2E / 10, totals
    assert_joint_matches(counts, exact, case)


def test_sampling_on_a_quantized_target_matches_its_exact_law(model):
    """The target is the int8 model (torchao, float32 activations): samples follow its own exact law, same checks."""
    pytest.importorskip("torchao")
    from selfspec.quant import quantize_model

    quantized = copy.deepcopy(model).float()
    quantize_model(quantized, "int8", dtype=torch.float32, device=torch.device("cpu"))
    assert type(quantized.lm_head.weight).__name__ == "Int8Tensor"
    warpers = LogitsProcessorList([TemperatureLogitsWarper(0.9)])
    exact = exact_joint(quantized, warpers, NEW)
    spec = selfspec.wrap(quantized, plan=selfspec.DraftPlan(layers=[0, 2], draft_length=3, policy="fixed"))
    counts, totals = run_many(spec, N_E2E, seed=13, temperature=0.9)
    assert totals["drafted"] > 0 and 0 < totals["accepted"] < totals["drafted"], totals
    assert_joint_matches(counts, exact, "int8 target, layers=[0,2], k=3")


def test_end_to_end_check_has_power(model, monkeypatch):
    """An engine that always accepts its draft must fail the same end-to-end check, even at N = 400 runs."""
    plan, sampling, warpers = CASES["T=1, exit_layer=2, k=3"]
    exact = exact_joint(model, warpers, NEW)
    monkeypatch.setattr(selfspec.rounds, "accept_sampling_on_device", always_accept_on_device)
    counts, totals = run_many(selfspec.wrap(model, plan=plan), 400, seed=11, **sampling)
    assert totals["accepted"] == totals["drafted"] > 0
    with pytest.raises(AssertionError, match="differs from the exact one"):
        assert_joint_matches(counts, exact, "always-accept engine")


def always_accept_on_device(draft, draft_probs, target_probs, generator=None):
    """WRONG rule, as the static step would run it: keep every drafted token."""
    k = draft.shape[0]
    return torch.tensor(k), torch.multinomial(target_probs[k], 1, generator=generator)


def test_end_to_end_check_has_power_on_the_static_step(model, monkeypatch):
    """The same power check, with the always-accept rule swapped into the static step's loop."""
    plan, sampling, warpers = CASES["T=1, exit_layer=2, k=3"]
    exact = exact_joint(model, warpers, NEW)
    monkeypatch.setattr(selfspec.rounds, "accept_sampling_on_device", always_accept_on_device)
    counts, totals = run_many(selfspec.wrap(model, plan=plan, step="static"), 400, seed=11, **sampling)
    assert totals["accepted"] == totals["drafted"] > 0
    with pytest.raises(AssertionError, match="differs from the exact one"):
        assert_joint_matches(counts, exact, "always-accept static step")


# -- 2b. a batch: each row keeps its own target law ------------------------------------------------

BATCH_PLAN = selfspec.DraftPlan(ngram=1, draft_length=3)  # n-gram drafts per row, the cost policy picks k


def batch_run_many(spec, n: int, seed: int, prompts: list[torch.Tensor], **sampling) -> tuple[list, dict]:
    """Counts `[V]*NEW` per row over n batched generations of `prompts` (left-padded), one generator."""
    g = torch.Generator().manual_seed(seed)
    width = max(p.shape[1] for p in prompts)
    ids = torch.cat([torch.cat([torch.zeros(1, width - p.shape[1], dtype=torch.long), p], dim=1) for p in prompts])
    mask = torch.tensor([[0] * (width - p.shape[1]) + [1] * p.shape[1] for p in prompts])
    counts = [torch.zeros((VOCAB,) * NEW, dtype=torch.long) for _ in prompts]
    totals = dict(drafted=0, accepted=0, recovered=0, bonus=0, tree_rounds=0, tree_accepted=0, recycled_drafted=0,
                  recycled_accepted=0)
    for _ in range(n):
        out = spec.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=True, generator=g, **sampling)
        for row, row_counts in enumerate(counts):
            row_counts[tuple(out[row, width:].tolist())] += 1
        for stats in spec.last_stats.row_stats:
            for key in totals:
                totals[key] += getattr(stats, key)
    return counts, totals


BATCH_CASES = {
    # name: (plan or a function of `artifacts`, cost profile, sampling kwargs, the same warpers)
    "n-gram drafts per row, cost policy (flat profile), T=0.9": (
        BATCH_PLAN, "flat", dict(temperature=0.9), LogitsProcessorList([TemperatureLogitsWarper(0.9)])),
    "layers=[0,2] for every row, cost policy (flat profile), T=0.9": (
        selfspec.DraftPlan(layers=[0, 2], draft_length=3), "flat", dict(temperature=0.9),
        LogitsProcessorList([TemperatureLogitsWarper(0.9)])),
    "head + draft vocabulary 6/16 for every row, k=3, T=0.8, top_p=0.9": (
        lambda a: selfspec.DraftPlan(policy="fixed", exit_layer=2, head=a["head"], draft_vocab=a["vocab"],
                                     draft_vocab_size=6, draft_length=3),
        None, dict(temperature=0.8, top_p=0.9),
        LogitsProcessorList([TemperatureLogitsWarper(0.8), TopPLogitsWarper(0.9)])),
    "feature head for every row, k=3, T=1": (
        lambda a: selfspec.DraftPlan(policy="fixed", head=a["features"], draft_length=3),
        None, dict(temperature=1.0), LogitsProcessorList([])),
    # Every row grows a layer tree, one pass over all rows' levels (`batch_draft.LayerRows.trees`); each node reads
    # its parent's head output.
    "feature head drafts a tree for every row (<= 6 nodes), k=3, T=0.8, top_p=0.9": (
        lambda a: selfspec.DraftPlan(policy="fixed", head=a["features"], tree=6, draft_length=3),
        None, dict(temperature=0.8, top_p=0.9),
        LogitsProcessorList([TemperatureLogitsWarper(0.8), TopPLogitsWarper(0.9)])),
}


@pytest.mark.parametrize("case", list(BATCH_CASES))
def test_batched_sampling_keeps_each_rows_law(model, artifacts, case):
    """Two rows of other lengths in one batch: each row's first 4 tokens follow its own exact law. 16 checks
    (8 per row) at DELTA = 1e-7, N = 1,000 batches."""
    plan, costs, sampling, warpers = BATCH_CASES[case]
    plan = plan(artifacts) if callable(plan) else plan
    prompts = [TREE_PROMPT, PROMPT]
    spec = selfspec.wrap(model, plan=plan, costs=costs)
    counts, totals = batch_run_many(spec, N_E2E, seed=17, prompts=prompts, **sampling)
    assert totals["drafted"] > 0 and 0 < totals["accepted"] < totals["drafted"] and totals["recovered"] > 0, totals
    if "tree" in case:
        assert totals["tree_rounds"] > 0 and totals["tree_accepted"] > 0, totals
    for row, (prompt, row_counts) in enumerate(zip(prompts, counts)):
        assert_joint_matches(row_counts, exact_joint(model, warpers, NEW, prompt), f"{case}: batch row {row}")


def test_batched_check_has_power(model, monkeypatch):
    """A batch that always accepts its rows' drafts must fail the same check (400 batches)."""
    import selfspec.batch

    monkeypatch.setattr(selfspec.batch, "accept_sampling", always_accept)
    spec = selfspec.wrap(model, plan=BATCH_PLAN, costs="flat")
    counts, totals = batch_run_many(spec, 400, seed=17, prompts=[TREE_PROMPT, PROMPT])
    assert totals["accepted"] == totals["drafted"] > 0
    with pytest.raises(AssertionError, match="differs from the exact one"):
        assert_joint_matches(counts[0], exact_joint(model, LogitsProcessorList([]), NEW, TREE_PROMPT), "always")


BATCH_TREES = selfspec.DraftPlan(ngram=1, tree=4, draft_length=3, policy="fixed")


def scripted_trees(monkeypatch, seed: int) -> None:
    """Every row's n-gram lookup proposes three random continuations (fixed candidates, drawn from a random
    source of their own): of the full budget for `TREE_PROMPT`'s row, of random depths with a first one of a
    single token for `PROMPT`'s, so that row verifies a tree in the room the other's chain leaves."""
    rng = random.Random(seed)
    short = PROMPT[0].tolist()

    def continuations(self, tokens, *, budget, branches):
        first = 1 if tokens[: len(short)] == short else budget
        return [[rng.randrange(VOCAB) for _ in range(rng.randint(1, budget) if i else first)]
                for i in range(3)][:branches], 1

    monkeypatch.setattr(NgramIndex, "continuations", continuations)


BATCH_RECYCLED = selfspec.DraftPlan(recycle=True, ngram=1, tree=6, draft_length=3)


@pytest.mark.parametrize("trees", ["ngram", "recycled"])
def test_batched_sampling_over_trees_keeps_each_rows_law(model, monkeypatch, trees):
    """Rows verify trees in a batch (`batch.py`): n-gram continuations in the room shorter chains leave, or trees
    grown from their own recorded next tokens (`batch_draft.RecycledRows`), alone or under an n-gram chain,
    priced by the cost table. Each row's first 4 tokens follow its own exact law at T=0.9 (16 checks, 8 per
    row, at DELTA = 1e-7, N = 1,000 batches)."""
    if trees == "ngram":
        scripted_trees(monkeypatch, seed=5)
    plan, seed, drafted = (BATCH_TREES, 19, "tree_rounds") if trees == "ngram" else (BATCH_RECYCLED, 23, "recycled_drafted")
    prompts = [TREE_PROMPT, PROMPT]
    spec = selfspec.wrap(model, plan=plan, costs="flat")
    counts, totals = batch_run_many(spec, N_E2E, seed=seed, prompts=prompts, temperature=0.9)
    assert totals[drafted] > 0 and totals["tree_accepted"] > 0, totals
    warpers = LogitsProcessorList([TemperatureLogitsWarper(0.9)])
    for row, (prompt, row_counts) in enumerate(zip(prompts, counts)):
        assert_joint_matches(row_counts, exact_joint(model, warpers, NEW, prompt), f"batch {trees} trees: row {row}")


def keep_the_first_path(tree, target_probs, generator=None):
    """WRONG rule: keep the tree's first path whole (`from_paths` puts it first), then draw from p."""
    path = [0]
    while len(path) < len(tree) and tree.parents[len(path)] == path[-1]:
        path.append(len(path))
    return path, int(torch.multinomial(target_probs[path[-1] + 1].float(), 1, generator=generator))


def test_batched_tree_check_has_power(model, monkeypatch):
    """A batch whose tree rule keeps the first path whatever the target says must fail the same check (400
    batches)."""
    import selfspec.batch

    scripted_trees(monkeypatch, seed=5)
    monkeypatch.setattr(selfspec.batch, "accept_tree_sampling", keep_the_first_path)
    spec = selfspec.wrap(model, plan=BATCH_TREES, costs="flat")
    counts, totals = batch_run_many(spec, 400, seed=19, prompts=[TREE_PROMPT, PROMPT])
    assert totals["tree_rounds"] > 0, totals
    with pytest.raises(AssertionError, match="differs from the exact one"):
        assert_joint_matches(counts[1], exact_joint(model, LogitsProcessorList([]), NEW, PROMPT), "wrong trees")


# -- 3. and 4. seeds and plans -------------------------------------------------------------------

DRAFT_PLAN = selfspec.DraftPlan(exit_layer=1, draft_length=4, policy="fixed")


@pytest.mark.parametrize("step", ["eager", "static"])
def test_seeded_generator_reproduces(model, step):
    spec = selfspec.wrap(model, plan=DRAFT_PLAN, step=step)
    kwargs = dict(max_new_tokens=30, do_sample=True, temperature=0.9, top_k=10)
    torch.manual_seed(0)  # the global RNG must not matter when a generator is given
    a = spec.generate(PROMPT, generator=torch.Generator().manual_seed(123), **kwargs)
    stats_a = spec.last_stats
    torch.manual_seed(1)
    b = spec.generate(PROMPT, generator=torch.Generator().manual_seed(123), **kwargs)
    assert a.shape == (1, PROMPT.shape[1] + 30)
    assert torch.equal(a, b), f"{a.tolist()} != {b.tolist()}"
    assert stats_a.drafted > 0 and stats_a.drafted == spec.last_stats.drafted
    assert stats_a.accepted == spec.last_stats.accepted
    c = spec.generate(PROMPT, generator=torch.Generator().manual_seed(124), **kwargs)
    assert not torch.equal(a, c), "a different seed gave the same 30 tokens: is the generator used at all?"


def test_global_seed_reproduces(model):
    spec = selfspec.wrap(model, plan=DRAFT_PLAN)
    kwargs = dict(max_new_tokens=30, do_sample=True, temperature=0.9, top_p=0.95)
    outs = []
    for _ in range(2):
        torch.manual_seed(5)
        outs.append(spec.generate(PROMPT, **kwargs))
    assert outs[0].shape == (1, PROMPT.shape[1] + 30)
    assert torch.equal(outs[0], outs[1]), f"{outs[0].tolist()} != {outs[1].tolist()}"
    assert spec.last_stats.drafted > 0


@pytest.mark.parametrize("plan", [selfspec.DraftPlan.plain(), DRAFT_PLAN], ids=["plain", "draft"])
def test_plain_and_drafted_sampling_run(model, plan):
    spec = selfspec.wrap(model, plan=plan)
    generator = torch.Generator().manual_seed(3)  # the same seed for both plans
    out = spec.generate(PROMPT, max_new_tokens=30, do_sample=True, temperature=0.8, generator=generator)
    assert out.shape == (1, PROMPT.shape[1] + 30)
    assert torch.equal(out[:, : PROMPT.shape[1]], PROMPT)
    assert int(out.min()) >= 0 and int(out.max()) < VOCAB
    stats = spec.last_stats
    assert stats.new_tokens == 30
    if plan.drafts:
        assert stats.drafted > 0
    else:
        assert stats.drafted == 0 and stats.verify_passes == 30
