"""`wrap(model)` and the wrapper: `generate()` as transformers has it, over one sequence or a batch.

`SelfSpecModel` holds what every generation shares: the adapter's view of
the model, the plan and its draft pieces (drafter, head, vocabulary), the
step (how a pass runs), the kernels and cost tables, the prefix cache, and
what a non-reproducible wrapper learns across calls. `generate` resolves the
options as `model.generate` does, then hands one sequence to
`sequence.decode_sequence` (prefill, rounds, stats) and a padded batch to
`batch_generate.generate_rows`. A generation's cache lives for that call,
except a CUDA-graphed runner's, which stays with the wrapper (its graphs hold
the cache's addresses). The model itself is only ever read.

It does not run a round (`rounds.py`, `batch.py`), choose
kernels (`kernel_choice.py`) nor key cost tables (`cost_tables.py`).
"""

from __future__ import annotations

import dataclasses
import os

import torch

from .adapter import Adapter
from .auto_layers import layer_weights
from .batch import BatchSession
from .batch_generate import generate_rows, open_session
from .cost_tables import CostTables, draft_read_fraction, handed_costs, plan_costs
from .costs import PassCosts, RuntimeCosts
from .cpu_kernels import AttentionKernels, LinearKernels
from .draft import Drafter
from .feature_head import FeatureHead
from .head import ExitHead
from .hf_generation import GenerationSettings, inferred_padding, resolve_settings
from .inputs import check_context, check_prompts
from .kernel_choice import KernelChoice, check_choice
from .memory import MemoryReport, memory_report
from .offload import describe_layers, offloaded_layers, parse_bytes
from .parts import ModelParts, text_config
from .passes import TargetPasses
from .plan import DraftPlan
from .plan_choice import as_plan, load_any_head, warn_offloaded_draft
from .prefix_cache import PrefixCache
from .policy import AcceptanceEstimates, DepthCalibration, DraftPolicy, RecycleLedger, policy_for
from .quant import describe_quantization
from .recycle import SuccessorTable
from .registry import adapter_for
from .runner import LayerRunner
from .sequence import decode_sequence
from .static import GraphedRunner, StaticRunner
from .streaming import LayerStream
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
    offload_stream: bool = True,
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
    back per round (`rounds.py`); "graphs": static, with every pass
    captured as a CUDA graph once and replayed (CUDA only; not with offloaded
    layers, whose weights move in for each pass); "auto": "graphs" on CUDA
    with every layer in place, "eager" elsewhere.
    `kernels` (the CPU's): "measured", the attention and linear kernels
    that run fastest here (`cpu_kernels.py`; the same sums in another order,
    so a low-precision output may part from `model.generate`'s at a rounding
    near-tie even with drafting off); "packed", those and oneDNN on packed
    copies of the resident linear weights where that is faster (a wide pass
    then costs little more than a narrow one; the copies hold the weights'
    bytes again, shown by `memory()`); "transformers", its own functions
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
    `offload_stream` (True): the layers accelerate offloads are loaded by
    selfspec for its passes, the next one while one computes
    (`streaming.py`); False: accelerate's hooks load them at every call.
    """
    adapter = adapter_for(model)
    offloaded = offloaded_layers(adapter.bind(model).layers)
    return SelfSpecModel(model, adapter=adapter, plan=as_plan(plan, adapter, model.config, offloaded), costs=costs,
                         step=step, kernels=kernels, reproducible=reproducible, prefix_cache=prefix_cache,
                         offload_stream=offload_stream)


class SelfSpecModel:
    """A model wrapped for self-speculative decoding; `generate()` works as in transformers."""

    def __init__(
        self, model, *, adapter: Adapter, plan: DraftPlan, costs: PassCosts | str | None = None, step: str = "auto",
        kernels: str = "measured", reproducible: bool = True, prefix_cache: int | str | None = None,
        offload_stream: bool = True,
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
        if self.offloaded and offload_stream:  # selfspec loads them itself, the next while one computes
            self.parts = dataclasses.replace(self.parts, stream=LayerStream(self.parts.layers, self.parts.device))
        warn_offloaded_draft(plan, self.offloaded, self.parts.num_layers)
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
        if self.offloaded and step == "graphs":  # a captured graph cannot read weights from elsewhere
            raise ValueError(f"step='graphs' needs every layer's weights in place; layers "
                             f"{describe_layers(self.offloaded)} are offloaded (valid here: 'auto', 'eager', "
                             f"'static')")
        if step == "auto":
            return "graphs" if on_cuda and not self.offloaded else "eager"
        return step

    def runner_for(self, capacity: int, *, keep: bool = True) -> LayerRunner:
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
        return self.cost_tables.runtime(lambda: plan_costs(self, refined=not self.reproducible))

    def draft_read_fraction(self) -> float:
        """The weights one drafted token reads, in plain steps (`cost_tables.draft_read_fraction`)."""
        return draft_read_fraction(self.parts, self.drafter, head=self.head, vocab=self.vocab)

    def measure_costs(self, *, cached: bool = True, repeats: int = 3) -> PassCosts:
        """Time the passes this plan uses here (see `costs.py`), or read them from the disk cache.

        `cached=False` re-measures: the new table replaces the cached one (and
        any refinement of it) on disk and for this wrapper's next generation;
        a reproducible wrapper's decisions change only so.
        """
        table = plan_costs(self, refined=cached and not self.reproducible, cached=cached, repeats=repeats)
        if not cached:
            self.cost_tables.forget()  # the next generation starts from the new table
        return table

    def memory(self, *, context: int | None = None) -> MemoryReport:
        """Bytes held: weights as stored, the KV cache for `context` positions, the plan's head and vocabulary, and
        the packed weight copies the passes run (`kernels="packed"`, once measured).

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
                             quantization=self.quantization, packed_bytes=self.kernel_choice.packed_bytes())

    def linear_kernels(self) -> LinearKernels:
        """How the linear layers run their passes here (`kernel_choice.py`)."""
        return self.kernel_choice.linear()

    def attention_kernels(self) -> AttentionKernels:
        """Which attention kernel the passes run here, by queries and cache entries (`kernel_choice.py`)."""
        return self.kernel_choice.attention()

    def kernels(self):
        """The context every pass of this model runs in: the linear and attention kernels chosen here."""
        return self.kernel_choice.context()

    def policy_for(self, settings: GenerationSettings) -> DraftPolicy:
        """The policy one generation decides its drafts with (`policy.py`), and what it starts from."""
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
            return generate_rows(self, input_ids, prompts, generation_config=generation_config,
                                 logits_processor=logits_processor, stopping_criteria=stopping_criteria,
                                 streamer=streamer, generator=generator, tokenizer=tokenizer, kwargs=kwargs)
        prompt = prompts[0]
        self.check_context(len(prompt), None)
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
        self.check_context(len(prompt), settings.max_new_tokens)
        if streamer is not None:
            streamer.put(input_ids.cpu())
        with self.kernels():
            tokens, self.last_stats = decode_sequence(self, prompt, settings, streamer, generator)
        if streamer is not None:
            streamer.end()
        sequences = torch.tensor([tokens], dtype=torch.long, device=input_ids.device)  # int64, as transformers
        return settings.output(sequences)  # the tensor, or an object with .sequences (return_dict_in_generate)

    def batch_session(self) -> BatchSession:
        """Sequences that decode together, joining (`add`) and leaving at round boundaries (`batch.py`).

        What `generate` runs for a batch, and what a server runs for its
        concurrent requests: `session.add(prompt_ids, max_new_tokens=..., ...)`
        prefills a row (generation options as `generate` takes them),
        `session.step()` runs one round for every row and returns the rows
        that finished.
        """
        return open_session(self)

    def check_context(self, prompt_length: int, max_new_tokens: int | None) -> None:
        """The prompt, and the prompt with `max_new_tokens` more (when given), must fit in the context."""
        check_context(getattr(text_config(self.model.config), "max_position_embeddings", None), prompt_length,
                      max_new_tokens)
