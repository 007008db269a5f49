"""`wrap(model)` and one generation: prefill, the rounds (draft, verify, accept, roll back, emit, record), stats.

The loop keeps one invariant: at the top of each round the cache holds the
target's entries for every token but the last emitted one, whose entries the
round computes. A round drafts up to k tokens through the plan's layers,
verifies them in one pass of the remaining layers, keeps the accepted prefix
plus the target's own next token, and crops the cache back to what was kept.

The cache lives for one `generate()` call, so a generation that raises
leaves nothing behind; the model itself is only ever read. With `step="graphs"` the cache and its CUDA graphs stay with the
wrapped model (the graphs hold its addresses); each call empties it first.

The rounds themselves are `rounds.py` (eager) and `static_loop.py` (one
read back a round); a batch's are `batch.py`. It does not choose kernels (`kernel_choice.py`) nor key cost tables
(`cost_tables.py`).
"""

from __future__ import annotations

import copy
import os
import warnings

import torch

from .adapter import Adapter
from .auto_layers import AutoLayers, layer_weights
from .batch import BatchSession
from .cost_tables import CostTables, draft_read_fraction, handed_costs
from .costs import PassCosts, RuntimeCosts, measure_pass_costs
from .cpu_kernels import AttentionKernels, LinearKernels
from .draft import Drafter
from .feature_head import FeatureHead, artifact_kind, load_feature_head
from .head import ExitHead, load_head
from .hf_generation import GenerationSettings, inferred_padding, resolve_settings
from .inputs import check_context, check_prompts
from .kernel_choice import KernelChoice, check_choice
from .memory import MemoryReport, memory_report
from .offload import describe_layers, offloaded_layers, parse_bytes
from .output import Clock, Output
from .parts import ModelParts, text_config
from .passes import TargetPasses
from .plan import DraftPlan
from .prefix_cache import PrefixCache
from .policy import AcceptanceEstimates, DepthCalibration, DraftPolicy, LayerChoosingPolicy, RecycleLedger, policy_for
from .quant import describe_quantization
from .recycle import SuccessorTable, chain_contexts
from .registry import adapter_for
from .runner import LayerRunner
from .rounds import Decoding, eager_rounds
from .scoring import Scorer
from .static import GraphedRunner, StaticRunner
from .static_loop import run_static_rounds
from .stats import BatchStats, GenerationStats
from .vocab import DraftVocab, load_vocab

STEPS = ("auto", "eager", "static", "graphs")
GRAPH_CAPACITY_STEP = 256  # a kept graphed runner's capacity is a multiple of this


def wrap(
    model,
    *,
    plan: DraftPlan | str | os.PathLike | dict | None = None,
    costs: PassCosts | str | None = None,
    step: str = "auto",
    kernels: str = "measured",
    reproducible: bool = True,
    prefix_cache: int | str | None = None,
) -> "SelfSpecModel":
    """Wrap a Hugging Face causal LM for self-speculative generation. The model is not modified.

    `plan`: a `DraftPlan`, a path to a saved plan (JSON), a plan dict, "auto"
    (layers chosen per context while generating, `auto_layers.py`), or None
    for the adapter's plan for this model (its tuned plan, else "auto").
    `costs`: None to measure what passes cost on this machine (on first use,
    then cached on disk; with `reproducible=False` also refined by every
    round); a `PassCosts` table or a profile name ("linear": a pass over q
    tokens costs q plain steps; "flat": up to 16 tokens cost one step) to
    decide with those costs instead.
    `step`: how a pass runs. "eager": shapes follow the tokens, and the draft
    reads each choice back; "static": fixed shapes (`static.py`) and one read
    back per round (`static_loop.py`); "graphs": static, with every pass
    captured as a CUDA graph once and replayed (CUDA only); "auto": "graphs"
    on CUDA, "eager" elsewhere.
    `kernels` (the CPU's): "measured", the attention and linear kernels
    that run fastest here (`cpu_kernels.py`; the same sums in another order,
    so a low-precision output may part from `model.generate`'s at a rounding
    near-tie even with drafting off); "transformers", its own functions
    throughout (drafting off then computes exactly what `model.generate` does).
    `reproducible` (True): every call decides its drafts from its input tokens
    and a cost table fixed for the wrapper (loaded from disk as measured, never
    refined by timings), each call starting afresh, so the same input gives the
    same output on every call, and in every process on this machine until the
    table is re-measured (`measure_costs(cached=False)`, `selfspec costs`).
    Greedy output is the target's either way, but in bfloat16 (or float32)
    drafts of other lengths round differently and may part from it at a
    near-tie. False: refine the table from every round's timings (written back
    for the next process), carry acceptance estimates, recycled successors and
    the recycle ledger across greedy calls, and pause a fixed plan's drafting
    by timing; faster where the measured table misprices passes or the calls
    share text, but a low-precision output may change from call to call.
    `prefix_cache` (a size such as "512MiB", or bytes; None or 0: off): keep
    the KV of finished generations, least recently used out first, so a prompt
    that starts as an earlier sequence did (a chat's next turn) prefills only
    the rest (`prefix_cache.py`; `last_stats.cached_tokens` says how much).
    """
    adapter = adapter_for(model)
    offloaded = offloaded_layers(adapter.bind(model).layers)
    return SelfSpecModel(model, adapter=adapter, plan=_as_plan(plan, adapter, model.config, offloaded), costs=costs,
                         step=step, kernels=kernels, reproducible=reproducible, prefix_cache=prefix_cache)


def _as_plan(plan, adapter: Adapter, config, offloaded: tuple[int, ...] = ()) -> DraftPlan:
    if plan is None and offloaded:  # draft from resident weights only: every offloaded layer a draft ran is a load
        return DraftPlan.resident_plan()
    if plan is None:
        return adapter.plan_for(config)
    if isinstance(plan, DraftPlan):
        return plan
    if isinstance(plan, dict):
        return DraftPlan.from_dict(plan)
    if isinstance(plan, str) and plan == "auto":
        return DraftPlan.auto_plan()
    if isinstance(plan, (str, os.PathLike)):
        return DraftPlan.load(plan)
    raise ValueError(f"plan must be a DraftPlan, a dict, \"auto\", a path to a plan JSON file or None, "
                     f"got {type(plan).__name__}")


def _warn_offloaded_draft(plan: DraftPlan, offloaded: tuple[int, ...], num_layers: int) -> None:
    """Warn when a plan's draft runs offloaded layers: each draft step then loads their weights."""
    if not offloaded or not plan.drafts or plan.head is not None and plan.exit_layer is None:
        return
    runs = set(range(num_layers)) if plan.auto else set(plan.draft_layers(num_layers))
    through = tuple(sorted(runs & set(offloaded)))
    if through:
        warnings.warn(f"the plan's draft runs offloaded layers ({describe_layers(through)}): "
                      f"each draft step loads their weights. Plans that draft from resident weights only: n-grams and "
                      f"recycled predictions (the default here), a feature head, or an exit before layer "
                      f"{offloaded[0]} with its head", stacklevel=3)


def load_any_head(plan: DraftPlan, *, model, parts):
    """The plan's head: a feature head when its manifest says so (the plan then names no exit), else an exit head."""
    if artifact_kind(plan.head) == "feature_head":
        if plan.exit_layer is not None:
            raise ValueError(f"the feature head {plan.head} drafts without the target's layers: drop exit_layer=")
        return load_feature_head(plan.head, model=model, parts=parts)
    if plan.exit_layer is None:
        raise ValueError(f"head={plan.head!r} needs exit_layer=E, the exit the head was trained for")
    return load_head(plan.head, model=model, parts=parts)


class SelfSpecModel:
    """A model wrapped for self-speculative decoding; `generate()` works as in transformers."""

    def __init__(
        self, model, *, adapter: Adapter, plan: DraftPlan, costs: PassCosts | str | None = None, step: str = "auto",
        kernels: str = "measured", reproducible: bool = True, prefix_cache: int | str | None = None,
    ) -> None:
        check_choice(kernels)
        budget = parse_bytes(prefix_cache) if prefix_cache is not None else 0
        self.prefix = PrefixCache(budget) if budget else None  # KV of earlier sequences (`prefix_cache.py`)
        if not isinstance(reproducible, bool):
            raise ValueError(f"reproducible must be True or False, got {reproducible!r}")
        self.reproducible = reproducible  # decide from the tokens and a fixed table alone (`wrap`)
        self.model = model
        self.adapter = adapter
        self.parts: ModelParts = adapter.bind(model)
        self.plan = plan
        self.offloaded = offloaded_layers(self.parts.layers)  # layers whose weights a hook loads for every call
        _warn_offloaded_draft(plan, self.offloaded, self.parts.num_layers)
        self.quantization = describe_quantization(model)  # None, or which weights are quantized and how
        self.head: ExitHead | FeatureHead | None = None
        self.vocab: DraftVocab | None = None
        if plan.drafts and plan.head is not None:
            self.head = load_any_head(plan, model=model, parts=self.parts)
        if plan.drafts and plan.draft_vocab is not None:
            self.vocab = load_vocab(plan.draft_vocab, plan.draft_vocab_size, model=model, parts=self.parts)
        # Drafter validates the plan against the model (layer indices, the head's exit).
        self.drafter = Drafter(plan, self.parts.num_layers, head=self.head, vocab=self.vocab)
        self.passes = TargetPasses(self.parts.num_layers, exact_prefix=self.drafter.exact_prefix, head=self.head)
        self.layer_weights = layer_weights(self.parts) if plan.auto else None  # what each layer costs a draft
        self.max_width = max(plan.draft_length, plan.tree) + 1  # the widest verify pass (a chain, or a tree)
        self.injected_costs = handed_costs(costs, max_width=self.max_width, num_layers=self.parts.num_layers,
                                           draft_fraction=self.draft_read_fraction)
        self.step = self._resolve_step(step)
        self.kernel_choice = KernelChoice(model, self.parts, quantization=self.quantization, choice=kernels)
        self.cost_tables = CostTables(model, self.parts, kernels=self.kernel_choice, quantization=self.quantization,
                                      step=self.step, plan_name=self.describe_plan(),
                                      draft_layers=self.drafter.has_layers, offloaded=self.offloaded)
        self.graphed: GraphedRunner | None = None  # kept across generations: its graphs hold its cache's addresses
        self.last_stats: GenerationStats | BatchStats | None = None
        # Unless reproducible, a recycled-draft plan's successor table (`recycle.py`) lives across greedy
        # generations: it only ever changes what is drafted. Sampling starts each call afresh, so a seed
        # reproduces its sample; so does every call of a reproducible wrapper.
        self.successors = SuccessorTable()
        # So do the cost policy's acceptance estimates (`policy.py`): each greedy call goes on from what the
        # earlier ones learned instead of trying every draft source afresh at the plan's prior. A reproducible
        # wrapper keeps the last greedy call's here, for its `recycle_ledger`, but starts each call afresh.
        self.learned: tuple[AcceptanceEstimates, DepthCalibration, RecycleLedger] | None = None

    def _resolve_step(self, step: str) -> str:
        if step not in STEPS:
            raise ValueError(f"step={step!r} is not a way to run a pass (valid: {', '.join(map(repr, STEPS))})")
        on_cuda = self.parts.device.type == "cuda"
        if step == "graphs" and not on_cuda:
            raise ValueError(f"step='graphs' needs the model on a CUDA device; it is on {self.parts.device} "
                             f"(valid here: 'auto', 'eager', 'static')")
        if self.offloaded and step in ("static", "graphs"):
            raise ValueError(f"step={step!r} needs every layer's weights in place; layers "
                             f"{describe_layers(self.offloaded)} are offloaded (valid here: 'auto', 'eager')")
        if step == "auto":
            return "graphs" if on_cuda and not self.offloaded else "eager"
        return step

    def _runner(self, capacity: int, *, keep: bool = True) -> LayerRunner:
        """A runner for one generation (`keep`) or one measurement, of the kind `self.step` names."""
        if self.step == "eager":
            return LayerRunner(self.parts, capacity=capacity, head=self.head)
        if self.step == "static":
            return StaticRunner(self.parts, capacity=capacity, max_width=self.max_width, head=self.head)
        if not keep:
            return GraphedRunner(self.parts, capacity=capacity, max_width=self.max_width, head=self.head)
        if self.graphed is None or self.graphed.valid_capacity < capacity:
            # Captured once per wrapped model; a longer generation recaptures at a rounded-up capacity.
            self.graphed = None  # free the old graphs and cache first
            rounded = -(-capacity // GRAPH_CAPACITY_STEP) * GRAPH_CAPACITY_STEP
            self.graphed = GraphedRunner(self.parts, capacity=rounded, max_width=self.max_width, head=self.head)
        self.graphed.cache.crop(0)
        return self.graphed

    def release(self) -> None:
        """Drop the cache and graphs kept between generations (`step="graphs"`); the next call captures anew."""
        self.graphed = None

    def __repr__(self) -> str:
        return f"SelfSpecModel({type(self.model).__name__}, adapter={self.adapter.name!r}, plan={self.describe_plan()!r})"

    def describe_plan(self) -> str:
        return self.plan.describe(self.parts.num_layers)

    @property
    def recycle_ledger(self) -> RecycleLedger | None:
        """Whether recycling pays, as the greedy calls so far (a reproducible wrapper: the last one) judged it
        (`policy.RecycleLedger`; None before the first greedy call of a cost policy). Its `describe()` says whether
        recycling is on and how often it paused."""
        return self.learned[2] if self.learned is not None else None

    @property
    def costs(self) -> PassCosts:
        """What a pass costs here: the table the rounds start from (measured on first use, cached on disk; with
        `reproducible=False`, as earlier processes' rounds refined it)."""
        if self.injected_costs is not None:
            return self.injected_costs
        return self._runtime_costs().table

    def _runtime_costs(self) -> RuntimeCosts:
        return self.cost_tables.runtime(lambda: self._load_costs(refined=not self.reproducible))

    def draft_read_fraction(self) -> float:
        """The weights one drafted token reads, in plain steps (`cost_tables.draft_read_fraction`)."""
        return draft_read_fraction(self.parts, self.drafter, head=self.head, vocab=self.vocab)

    def measure_costs(self, *, cached: bool = True, repeats: int = 3) -> PassCosts:
        """Time the passes this plan uses here (see `costs.py`), or read them from the disk cache.

        `cached=False` re-measures: the new table replaces the cached one (and
        any refinement of it) on disk and for this wrapper's next generation;
        a reproducible wrapper's decisions change only so.
        """
        table = self._load_costs(refined=cached and not self.reproducible, cached=cached, repeats=repeats)
        if not cached:
            self.cost_tables.forget()  # the next generation starts from the new table
        return table

    def _load_costs(self, *, refined: bool, cached: bool = True, repeats: int = 3) -> PassCosts:
        """The table of this plan's passes (`refined`: as earlier rounds refined it, where they did)."""

        def draft_step(runner: LayerRunner, position: int) -> None:
            logits = self.drafter.step(runner, 0, position)  # [1, vocab]
            float(torch.softmax(logits[0], dim=-1).max())  # the confidence the policy reads

        def measure(*, draft: bool) -> PassCosts:
            if draft and self.plan.auto:  # an auto plan's draft times its reference set (`auto_layers.py` scales)
                self.drafter.set_layers(self.plan.draft_layers(self.parts.num_layers))
            with self.kernels():
                return measure_pass_costs(
                    lambda capacity: self._runner(capacity, keep=False),
                    draft_step if draft else None,
                    num_layers=self.parts.num_layers,
                    vocab_size=self.parts.vocab_size,
                    max_width=self.max_width,
                    repeats=repeats,
                    bucketed=self.step != "eager",  # the static step pads a pass to its bucket
                    max_positions=self.parts.max_positions,
                    draft_only=draft,
                )

        return self.cost_tables.load_or_measure(measure, max_width=self.max_width, cached=cached, refined=refined)

    def memory(self, *, context: int | None = None) -> MemoryReport:
        """Bytes held: weights as stored, the KV cache for `context` positions, the plan's head and vocabulary.

        `context`: positions the cache holds (default: the model's context,
        `max_position_embeddings`; a generation holds prompt + max_new_tokens +
        draft_length + 1).
        """
        if context is None:
            context = getattr(text_config(self.model.config), "max_position_embeddings", None)
            if context is None:
                raise ValueError("this model's config has no max_position_embeddings: pass context=N (positions)")
        vocab = () if self.vocab is None else (self.vocab.weight, self.vocab.bias, self.vocab.ids)
        return memory_report(self.model, self.parts, context=context, head=self.head, vocab_tensors=vocab,
                             quantization=self.quantization)

    def _save_refined(self, costs: RuntimeCosts) -> None:
        self.cost_tables.save_refined(costs)

    def linear_kernels(self) -> LinearKernels:
        """How the linear layers run their passes here (`kernel_choice.py`)."""
        return self.kernel_choice.linear()

    def attention_kernels(self) -> AttentionKernels:
        """Which attention kernel the passes run here, by queries and cache entries (`kernel_choice.py`)."""
        return self.kernel_choice.attention()

    def kernels(self):
        """The context every pass of this model runs in: the linear and attention kernels chosen here."""
        return self.kernel_choice.context()

    def _policy(self, settings: GenerationSettings) -> DraftPolicy:
        # A seed must reproduce a sample, and a reproducible wrapper its greedy output: then decide from the table
        # and the tokens alone, never from timing noise or earlier calls. Otherwise greedy runs learn from every
        # round (greedy output is the target's whatever is drafted, up to rounding at a near-tie).
        fixed = settings.do_sample or self.reproducible
        if self.plan.policy == "fixed" or not self.plan.drafts:
            return policy_for(self.plan, off_switch=not fixed)
        if self.injected_costs is None and not fixed:
            runtime = self._runtime_costs()
        else:
            runtime = RuntimeCosts(self.costs, learn=False)
        policy = policy_for(self.plan, runtime, exact_prefix=self.drafter.exact_prefix)
        if not settings.do_sample:  # a sample's drafts depend on its seed and the prompt alone
            if self.learned is None or self.reproducible:
                self.learned = (policy.acceptance, policy.recycled, policy.ledger)
            policy.acceptance, policy.recycled, policy.ledger = self.learned
        return policy

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        generation_config=None,
        logits_processor=None,
        stopping_criteria=None,
        streamer=None,
        generator: torch.Generator | None = None,
        tokenizer=None,
        **kwargs,
    ):
        """Generate after `input_ids` `[batch, prompt]`; returns `[batch, prompt + new]` int64, stats in `last_stats`.

        A batch (or a padded prompt) is left-padded, with its `attention_mask`,
        as `model.generate` takes it: the rows decode together (`batch.py`),
        each with its own drafts and acceptance, and rows that end early are
        padded with `pad_token_id` (EOS when the model has none), as
        `model.generate` pads them; `last_stats` is then a `BatchStats` (per
        row and in total).

        `kwargs` are `GenerationConfig` fields, merged with the model's
        `generation_config` exactly as `model.generate` merges them (an explicit
        `None` overrides the model's default): `max_new_tokens` (no
        `max_new_tokens` and no `max_length`: 20 new tokens), `max_length`,
        `min_new_tokens`, `do_sample`, `temperature`, `top_k`, `top_p`,
        `eos_token_id` (int, list or tensor), `max_time`, `stop_strings`
        (with `tokenizer=`), `return_dict_in_generate` (then an object with
        `.sequences`), ... A field selfspec does not implement (`num_beams`,
        `output_scores`, ...) is refused when set to anything but its default.
        """
        self.last_stats = None  # a failed call leaves no stale stats behind
        if attention_mask is None:  # tokens model.generate would hide (the pad id, when not an EOS id) are padding
            padded = inferred_padding(self.model, input_ids, generation_config=generation_config, kwargs=kwargs)
            if padded is not None:
                result = self.generate(padded[0], attention_mask=padded[1], generation_config=generation_config,
                                       logits_processor=logits_processor, stopping_criteria=stopping_criteria,
                                       streamer=streamer, generator=generator, tokenizer=tokenizer, **kwargs)
                sequences = getattr(result, "sequences", result)
                sequences[:, : input_ids.shape[1]] = input_ids  # the prompt as given, its hidden tokens in place
                return result
        prompts = check_prompts(input_ids, attention_mask, vocab_size=self.model.get_input_embeddings().num_embeddings,
                                device=self.parts.lm_head.weight.device)
        if len(prompts) > 1 or len(prompts[0]) < input_ids.shape[1]:
            return self._generate_rows(input_ids, prompts, generation_config=generation_config,
                                       logits_processor=logits_processor, stopping_criteria=stopping_criteria,
                                       streamer=streamer, generator=generator, tokenizer=tokenizer, kwargs=kwargs)
        prompt = prompts[0]
        self._check_context(len(prompt), None)
        device = self.parts.lm_head.weight.device
        settings = resolve_settings(
            self.model,
            prompt=torch.tensor([prompt], dtype=torch.long, device=device),
            has_attention_mask=attention_mask is not None,
            generation_config=generation_config,
            logits_processor=logits_processor,
            stopping_criteria=stopping_criteria,
            tokenizer=tokenizer,
            device=device,
            kwargs=kwargs,
        )
        self._check_context(len(prompt), settings.max_new_tokens)
        if streamer is not None:
            streamer.put(input_ids.cpu())
        with self.kernels():
            tokens, self.last_stats = self._decode(prompt, settings, streamer, generator)
        if streamer is not None:
            streamer.end()
        sequences = torch.tensor([tokens], dtype=torch.long, device=input_ids.device)  # int64, as transformers
        return settings.output(sequences)  # the tensor, or an object with .sequences (return_dict_in_generate)

    def _reuses_prefixes(self) -> bool:
        """Whether one sequence's generation uses the prefix cache: the eager step, no feature head (whose
        first entry after a stored prefix would need the target's state there)."""
        return self.prefix is not None and self.step == "eager" and not isinstance(self.head, FeatureHead)

    def batch_session(self) -> BatchSession:
        """Sequences that decode together, joining (`add`) and leaving at round boundaries (`batch.py`).

        What `generate` runs for a batch, and what a server runs for its
        concurrent requests: `session.add(prompt_ids, max_new_tokens=..., ...)`
        prefills a row (generation options as `generate` takes them),
        `session.step()` runs one round for every row and returns the rows
        that finished.
        """
        if self.plan.drafts and (self.plan.tree or self.plan.recycle):
            warnings.warn(f"plan {self.describe_plan()!r}: a batch drafts chains (its rows take no token trees "
                          f"or recycled nodes); one sequence drafts them", stacklevel=2)
        return BatchSession(self.parts, self.plan, settings_for=self._row_settings, costs_for=self._batch_costs,
                            check_context=self._check_context, linear=self.linear_kernels(),
                            attention=self.attention_kernels(), draft_layers=self._batch_draft_layers(),
                            head=self.head, vocab=self.vocab, prefix=self.prefix)

    def _row_settings(self, prompt: list[int], *, logits_processor, stopping_criteria, kwargs,
                      generation_config=None, tokenizer=None) -> GenerationSettings:
        device = self.parts.lm_head.weight.device
        return resolve_settings(self.model, prompt=torch.tensor([prompt], dtype=torch.long, device=device),
                                has_attention_mask=True, generation_config=generation_config,
                                logits_processor=logits_processor, stopping_criteria=stopping_criteria,
                                tokenizer=tokenizer, device=device, kwargs=kwargs)

    def _batch_costs(self, rows: int, learn: bool) -> RuntimeCosts:
        """What a pass over `rows` rows costs here, by width, and a draft step over them: measured once per row
        count (and cached on disk)."""
        return self.cost_tables.batch_costs(rows, learn and not self.reproducible, injected=self.injected_costs,
                                            width=self.plan.draft_length + 1, draft_layers=self._batch_draft_layers(),
                                            draft=self.describe_plan(), head=self.head, vocab=self.vocab)

    def _batch_draft_layers(self) -> tuple[int, ...]:
        """The layers a batch's draft step runs: the plan's (an auto plan's reference set), or 0..E-1 and a head."""
        layers = self.plan.draft_layers(self.parts.num_layers)
        if isinstance(self.head, FeatureHead):
            layers = (self.head.slot,)
        elif self.head is not None:
            layers = (*range(self.head.exit_layer), self.head.slot)
        return tuple(layers)

    def _generate_rows(self, input_ids: torch.Tensor, prompts: list[list[int]], *, generation_config,
                       logits_processor, stopping_criteria, streamer, generator, tokenizer, kwargs):
        """A left-padded batch: every row in one `BatchSession`; the output padded as `model.generate` pads it."""
        if streamer is not None and len(prompts) > 1:
            raise ValueError(f"a streamer takes one sequence; this batch has {len(prompts)} "
                             f"(valid: batch size 1 with a streamer, as transformers' streamers)")
        device = self.parts.lm_head.weight.device
        padded = input_ids.to(device)
        # The length rule counts the padded prompt, as model.generate does; each row then gets that many new tokens.
        whole = resolve_settings(self.model, prompt=padded[:1], has_attention_mask=True,
                                 generation_config=generation_config, logits_processor=None, stopping_criteria=None,
                                 tokenizer=tokenizer, device=device, kwargs=kwargs)
        row_kwargs = {k: v for k, v in kwargs.items() if k != "max_length"}
        row_kwargs["max_new_tokens"] = whole.max_new_tokens
        if generation_config is not None:
            generation_config = copy.deepcopy(generation_config)
            generation_config.max_length = None
        session = self.batch_session()
        clock = Clock(self.parts.device)
        rows = [session.add(prompt, streamer=streamer, stopping_criteria=stopping_criteria,
                            logits_processor=logits_processor, generator=generator,
                            generation_config=generation_config, tokenizer=tokenizer, **row_kwargs)
                for prompt in prompts]
        while len(session):
            session.step()
        stats = session.stats
        stats.total_seconds = clock.total()
        stats.plan = self.describe_plan()
        self.last_stats = stats
        pad = whole.config._pad_token_tensor
        pad = int(pad.reshape(-1)[0]) if pad is not None else min(whole.eos_token_ids, default=0)
        longest = max(len(row.new_tokens) for row in rows)
        new = [row.new_tokens + [pad] * (longest - len(row.new_tokens)) for row in rows]
        sequences = torch.cat([input_ids.long(), torch.tensor(new, dtype=torch.long, device=input_ids.device)], dim=1)
        return whole.output(sequences)

    def _decode(
        self, prompt: list[int], settings: GenerationSettings, streamer, generator
    ) -> tuple[list[int], GenerationStats]:
        if self.plan.auto:  # every generation chooses its layers afresh, from the set the cost table timed
            self.drafter.set_layers(self.plan.draft_layers(self.parts.num_layers))
            self.passes.exact_prefix = self.drafter.exact_prefix
        self.passes.probe = None
        policy = self._policy(settings)  # first: measuring the costs (once) uses a runner of its own
        capacity = len(prompt) + settings.max_new_tokens + self.max_width  # room for the widest verify pass
        runner = self._runner(capacity)
        runner.weights_read = 0  # a kept (graphed) runner counted the generations before
        auto = None
        if self.plan.auto and isinstance(policy, LayerChoosingPolicy):  # the prefill reports every layer's change to it
            weights, head = self.layer_weights
            auto = AutoLayers(self.drafter, self.passes, layer_weights=weights, head_weight=head,
                              device=self.parts.device, probe_verify=not isinstance(runner, GraphedRunner))
        successors = None
        if self.plan.recycle and self.plan.drafts:
            successors = SuccessorTable() if settings.do_sample or self.reproducible else self.successors
            policy.count_recording(successors)
        scorer = Scorer(settings, generator)
        out = Output(prompt, settings, streamer)
        stats = GenerationStats(plan=self.describe_plan())
        capture_before = runner.capture_seconds if isinstance(runner, GraphedRunner) else 0.0
        clock = Clock(self.parts.device)

        # Prefill: the prompt through every layer (from a stored prefix, if one starts it); its last row gives
        # the first new token.
        reused = 0
        if self._reuses_prefixes():
            reused, entries = self.prefix.lookup(prompt)
            if reused:
                runner.cache.restore(entries, reused)
        stats.cached_tokens = reused
        first_scores = scorer.scores(self.passes.prefill(runner, prompt, reused), out.tokens, len(out.tokens))
        if successors is not None:
            successors.record(chain_contexts(prompt, []), first_scores)
        out.emit([scorer.target_choice(first_scores)])
        stats.verify_passes += 1
        stats.prefill_seconds = clock.lap()

        decoding = Decoding(runner, self.drafter, self.passes, policy, scorer, out, stats, self.plan.draft_length,
                            auto=auto, successors=successors)
        if self.step == "eager":
            eager_rounds(decoding, clock)
        else:
            run_static_rounds(decoding)
        self.passes.probe = None
        if auto is not None:
            stats.layer_sets = auto.describe()
        stats.step = runner.describe() if isinstance(runner, GraphedRunner) else self.step
        if isinstance(runner, GraphedRunner):
            stats.capture_seconds = runner.capture_seconds - capture_before

        stats.new_tokens = len(out.tokens) - len(prompt)
        if self._reuses_prefixes():  # what the cache holds, for a later prompt that starts alike
            held, entries = runner.cache.held(self.parts.num_layers)
            self.prefix.add(out.tokens[:held], entries)
        stats.total_seconds = clock.total()
        plain_step = sum(runner.layer_bytes[: self.parts.num_layers]) + runner.head_bytes  # every layer, the head
        stats.steps_read = runner.weights_read / plain_step
        if policy.costs is not None and policy.costs.learn:  # the next process starts from what was learned
            self._save_refined(policy.costs)
        stats.policy = policy.describe()
        stats.final_threshold = policy.threshold
        if policy.costs is not None:
            stats.costs = policy.costs.table.summary()
        return out.tokens, stats

    def _check_context(self, prompt_length: int, max_new_tokens: int | None) -> None:
        """The prompt, and the prompt with `max_new_tokens` more (when given), must fit in the context."""
        check_context(getattr(text_config(self.model.config), "max_position_embeddings", None), prompt_length,
                      max_new_tokens)
