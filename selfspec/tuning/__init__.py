"""Plan search: which layers the draft runs and how many tokens it drafts, tuned for measured speed.

    from selfspec.tuning import builtin_prompts, encode_prompts, tune
    prompts = encode_prompts(tokenizer, builtin_prompts())
    result = tune(model, prompts=prompts[:10], heldout=prompts[10:15], budget=200)
    result.best_plan.save("plan.json")       # wrap(model, plan="plan.json")
    print(result.table())

The steps, each in a module of this package:

1. **Calibration** (`calibration.make_calibration`; prompt sets in `prompts`):
   the target's own greedy continuations of a prompt set, generated once with
   the engine's plain path. These are the tokens a draft must predict.
2. **Cost model** (`cost.measure_cost_model`): on this machine and in the model's
   dtype, the time of one layer and of the LM head on q = 1..k+1 tokens, as
   fractions of one plain decoding step (medians of interleaved repeats).
3. **Proxy** (`proxy.ProxyEvaluator`; the rounds' replay in `replay`): the
   draft's greedy agreement with the target, measured without decoding. The
   target's hidden states after every layer and its keys and values are
   captured once per calibration sequence. A round is then started at every
   generated position at once: the draft's layers past its exact prefix run on
   all those positions in one batch, each query attending to the target's
   entries before its round and to the draft's own entries for its round's
   earlier tokens, exactly what the engine's draft sees. Depth d is scored only
   for rounds whose tokens 0..d-1 were all accepted, so the cost is about one
   partial forward pass per accepted-length step. The result equals real greedy
   acceptance (tests check it token for token in float64; in bfloat16 it tracks
   it within about 0.01). A one-pass proxy that scores round starts only (exact
   for k = 1) does the wide search, the exact one re-scores the best; the
   cruder teacher-forced proxy is kept for comparison. The engine's rounds are
   then replayed on the agreements, for every draft-length policy of a grid
   (fixed k, a fixed confidence threshold, Draft & Verify's moving threshold)
   with the engine's own `AdaptivePolicy`, each round costed by the cost model.
   The proxy speedup is emitted tokens over cost in plain steps (Leviathan et
   al.'s tokens per round over cost per round, on the measured agreement
   pattern rather than an i.i.d. rate; the i.i.d. figure is reported too).
4. **Search** (`layer_search.search`): early exits 1..L-1, then a greedy walk that drops,
   one at a time, the layer whose removal costs the least agreement (tracing
   the acceptance-versus-cost front), then random local moves around the best
   sets. `optimizer="random"` is plain random search; `optimizer="optuna"`
   runs TPE over per-layer keep/skip choices (or NSGA-II for the front).
5. **Confirmation** (`confirm.confirm_plans`): timed greedy generation on held-out
   prompts, the plain path and the candidates interleaved in one process, with
   a check that every output equals the plain path's. The best measured plan
   wins.

`tune` (`pipeline`) runs them in order, with a check of the proxy against real
runs (`proxy_check`) between search and confirmation; `report` holds its
result (tables, Pareto front, JSON, PNG) and `adapter_toml` writes a plan as
an adapter file entry.

What it does not know: sampling (the proxy scores greedy agreement; a plan good
for greedy is usually good for sampling, but the acceptance rule differs);
logits processors (ignored by the proxy; the confirmation runs plain greedy);
batch sizes above 1; anything about the machine beyond what it measures here.
"""

from __future__ import annotations

from .adapter_toml import adapter_entry
from .calibration import CalibrationSequence, make_calibration
from .candidate import Candidate
from .confirm import Confirmation, confirm_plans
from .cost import CostModel, expected_tokens_per_round, iid_speedup, measure_cost_model
from .layer_search import search
from .pipeline import tune
from .prompts import BUILTIN_PROMPTS, builtin_prompts, encode_prompts, read_prompts
from .proxy import ProxyEvaluator
from .proxy_check import ProxyCheck, check_proxy
from .replay import Agreement, Policy, Simulation, policy_grid, simulate
from .report import TuneResult, pareto_front

__all__ = [
    "BUILTIN_PROMPTS",
    "Agreement",
    "CalibrationSequence",
    "Candidate",
    "Confirmation",
    "CostModel",
    "Policy",
    "ProxyCheck",
    "ProxyEvaluator",
    "Simulation",
    "TuneResult",
    "adapter_entry",
    "builtin_prompts",
    "check_proxy",
    "confirm_plans",
    "encode_prompts",
    "expected_tokens_per_round",
    "iid_speedup",
    "make_calibration",
    "measure_cost_model",
    "pareto_front",
    "policy_grid",
    "read_prompts",
    "search",
    "simulate",
    "tune",
]
