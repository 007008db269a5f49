"""One sequence's generation on a wrapped model: prefill, the rounds, the stats.

`decode_sequence` sets up what the rounds run with (`rounds.Decoding`): the
runner of the wrapper's step, the policy, the optional auto-layer choice and
successor table; prefills the prompt (from a stored prefix when the prefix
cache has one); runs the rounds (`rounds.py`); and stores the finished
sequence's KV for later prompts. The cache invariant is the rounds': at the
top of a round it holds the target's entries for every token but the last.

It does not resolve generation options (`hf_generation.py`), choose kernels
or tables (the wrapper's), nor run a batch (`batch.py`).
"""

from __future__ import annotations

from .auto_layers import AutoLayers
from .feature_head import FeatureHead
from .hf_generation import GenerationSettings
from .output import Clock, Output
from .policy import LayerChoosingPolicy
from .recycle import SuccessorTable, chain_contexts
from .rounds import Decoding, run_rounds
from .scoring import Scorer
from .static import GraphedRunner
from .stats import GenerationStats


def reuses_prefixes(spec) -> bool:
    """Whether one sequence's generation uses the wrapper's prefix cache: the eager step, no feature head (whose
    first entry after a stored prefix would need the target's state there)."""
    return spec.prefix is not None and spec.step == "eager" and not isinstance(spec.head, FeatureHead)


def decode_sequence(spec, prompt: list[int], settings: GenerationSettings, streamer,
                    generator) -> tuple[list[int], GenerationStats]:
    """Generate after `prompt` on the wrapper `spec` (`engine.SelfSpecModel`); the tokens and the stats."""
    plan, parts, passes = spec.plan, spec.parts, spec.passes
    if plan.auto:  # every generation chooses its layers afresh, from the set the cost table timed
        spec.drafter.set_layers(plan.draft_layers(parts.num_layers))
        passes.exact_prefix = spec.drafter.exact_prefix
    passes.probe = None
    policy = spec.policy_for(settings)  # first: measuring the costs (once) uses a runner of its own
    runner = spec.runner_for(len(prompt) + settings.max_new_tokens + spec.max_width)  # the widest verify fits
    runner.weights_read = 0  # a kept (graphed) runner counted the generations before
    streamed = parts.stream.bytes_read if parts.stream else 0  # offloaded bytes read before this generation
    auto = None
    if plan.auto and isinstance(policy, LayerChoosingPolicy):  # the prefill reports every layer's change to it
        weights, head = spec.layer_weights
        auto = AutoLayers(spec.drafter, passes, layer_weights=weights, head_weight=head, device=parts.device,
                          probe_verify=not isinstance(runner, GraphedRunner))
    successors = None
    if plan.recycle and plan.drafts:
        successors = SuccessorTable() if settings.do_sample or spec.reproducible else spec.successors
        policy.count_recording(successors)
    scorer = Scorer(settings, generator)
    out = Output(prompt, settings, streamer)
    stats = GenerationStats(plan=spec.describe_plan())
    capture_before = runner.capture_seconds if isinstance(runner, GraphedRunner) else 0.0
    clock = Clock(parts.device)

    # Prefill: the prompt through every layer (from a stored prefix, if one starts it); its last row gives
    # the first new token.
    reused = 0
    if reuses_prefixes(spec):
        reused, entries = spec.prefix.lookup(prompt)
        if reused:
            runner.cache.restore(entries, reused)
    stats.cached_tokens = reused
    first_scores = scorer.scores(passes.prefill(runner, prompt, reused), out.tokens, len(out.tokens))
    if successors is not None:
        successors.record(chain_contexts(prompt, []), first_scores)
    out.emit([scorer.target_choice(first_scores)])
    stats.verify_passes += 1
    stats.prefill_seconds = clock.lap()

    decoding = Decoding(runner, spec.drafter, passes, policy, scorer, out, stats, plan.draft_length, auto=auto,
                        successors=successors)
    run_rounds(decoding)
    passes.probe = None
    if auto is not None:
        stats.layer_sets = auto.describe()
    stats.step = runner.describe() if isinstance(runner, GraphedRunner) else spec.step
    if isinstance(runner, GraphedRunner):
        stats.capture_seconds = runner.capture_seconds - capture_before

    stats.new_tokens = len(out.tokens) - len(prompt)
    if reuses_prefixes(spec):  # what the cache holds, for a later prompt that starts alike
        held, entries = runner.cache.held(parts.num_layers)
        spec.prefix.add(out.tokens[:held], entries)
    stats.total_seconds = clock.total()
    plain_step = sum(runner.layer_bytes[: parts.num_layers]) + runner.head_bytes  # every layer, and the head
    stats.steps_read = runner.weights_read / plain_step
    stats.streamed_bytes = parts.stream.bytes_read - streamed if parts.stream else 0
    if policy.costs is not None and policy.costs.learn:  # the next process starts from what was learned
        spec.cost_tables.save_refined(policy.costs)
    stats.policy = policy.describe()
    stats.final_threshold = policy.threshold
    if policy.costs is not None:
        stats.costs = policy.costs.table.summary()
    return out.tokens, stats
