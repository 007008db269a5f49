"""What a pass costs on the machine at hand: measured once, cached, refined as the rounds run.

Whether a draft pays depends on the machine (a wide verify pass may cost
little more than a plain step, or several), so nothing here is assumed.
`PassCosts` is a table in seconds: a full pass over q new tokens for every
width a round can verify, and one drafted token through the plan's layers,
each timed at a short and a long context and taken as linear in the context.
`measure_pass_costs` times them; `load_or_measure` caches them on disk, keyed
by model, dtype, device, threads, kernels and processor (the verify passes
are one table for every plan; each plan's draft step joins it as a share of
a step). `PassCosts.profile` builds a table by rule, for tests. `RuntimeCosts`
is what a generation uses: the table at the round's context, scaled by what
the rounds measure, so load and cold starts are learned.

This module times passes; it does not know acceptance or decide draft lengths
(`policy.py`). Details: docs/kernels-and-costs.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .loading import default_cache_dir

COSTS_FORMAT = "selfspec.costs/3"
MEASURE_CONTEXT = 48  # tokens already in the cache while timing
LONG_CONTEXT = 1024  # ... and a second time: how a pass's cost grows with the context
# Raised when the way selfspec runs a pass changes what it costs (2: batched caches written by indexed assignment;
# 3: grouped query heads folded into one attention call, `cpu_kernels.py`; 4: oneDNN among the linear kernels;
# 5: the attention kernel measured, by queries and entries), so tables timed before are measured anew.
PASS_KERNELS = 5
FLAT_UP_TO = 16  # the "flat" profile: a pass over up to this many tokens costs one step
SHAPE_SLACK = 1.2  # how far one width's runtime correction may stray from its context band's (`RuntimeCosts.ratio`)
STEP_FLOOR = 0.5  # at runtime a wider pass costs at least the narrower one plus this share of the table's extra


def long_context(max_positions: int | None, max_width: int) -> int:
    """The second context passes are timed at: `LONG_CONTEXT`, or less where learned positions end sooner
    (at most `MEASURE_CONTEXT`: then only the first is timed)."""
    if max_positions is None:
        return LONG_CONTEXT
    return max(MEASURE_CONTEXT, min(LONG_CONTEXT, max_positions - max_width - 1))


@dataclass(frozen=True)
class PassCosts:
    """Seconds per pass: `verify[q-1]` for a full pass over q tokens, `draft_step` per drafted token."""

    verify: tuple[float, ...]  # q = 1..max width; verify[0] is one plain decoding step
    draft_step: float  # one drafted token through the plan's layers (0.0: the plan has no layer draft)
    num_layers: int
    machine: str = ""
    source: str = "measured"  # "measured", "cached" (measured earlier on this machine), or a profile name
    measure_seconds: float = 0.0  # wall time the measurement took
    context: int = MEASURE_CONTEXT  # entries in the cache when `verify` and `draft_step` were timed
    verify_long: tuple[float, ...] = ()  # the same widths timed at `long_context` entries (empty: not timed)
    draft_long: float = 0.0  # the draft step at `long_context` entries
    long_context: int = 0

    def __post_init__(self) -> None:
        if not self.verify or any(not (t > 0) for t in self.verify):
            raise ValueError(f"verify costs must be positive seconds for widths 1.., got {self.verify}")
        if self.draft_step < 0 or self.draft_long < 0:
            raise ValueError(f"draft steps must be >= 0 seconds, got {self.draft_step} and {self.draft_long}")
        if self.verify_long and (len(self.verify_long) != len(self.verify) or any(not (t > 0) for t in self.verify_long)
                                 or self.long_context <= self.context):
            raise ValueError(f"verify_long must be positive seconds for the same {len(self.verify)} widths, timed at "
                             f"long_context > context ({self.context}); got {self.verify_long} at {self.long_context}")

    @property
    def max_width(self) -> int:
        return len(self.verify)

    @property
    def step(self) -> float:
        """One plain decoding step, in seconds."""
        return self.verify[0]

    def verify_seconds(self, width: int, exact_prefix: int = 0, context: int | None = None) -> float:
        """A verify pass over `width` tokens whose first `exact_prefix` layers already ran for all but one,
        with `context` entries in the cache (None: the table's own `context`)."""
        full = self._full(width, context)
        if width <= 1 or not exact_prefix:
            return full
        return full - (exact_prefix / self.num_layers) * (full - self._full(1, context))  # those layers see one token

    def draft_seconds(self, context: int | None = None) -> float:
        """One drafted token with `context` entries in the cache (0.0: the plan drafts no layers)."""
        return self._at(self.draft_step, self.draft_long, context)

    def width_scale(self, width: int, context: int | None = None) -> float:
        """What a pass over `width` tokens costs in passes over one, by the full pass's measured curve: how a
        draft pass over a tree level's nodes is priced (the same kernels over fewer layers)."""
        return self._full(width, context) / self._full(1, context) if width > 1 else 1.0

    def _full(self, width: int, context: int | None) -> float:
        i = min(width, self.max_width) - 1
        return self._at(self.verify[i], self.verify_long[i] if self.verify_long else 0.0, context)

    def _at(self, short: float, long: float, context: int | None) -> float:
        """A time measured at `self.context` and `self.long_context` entries, at `context` entries: linear in
        the context, extended past the longer measurement, never below the shorter one."""
        if context is None or not self.verify_long or context <= self.context or not short:
            return short
        slope = (long - short) / (self.long_context - self.context)
        return max(short, short + slope * (context - self.context))

    @classmethod
    def profile(
        cls, kind: str, *, max_width: int = 17, step: float = 1.0, draft_fraction: float = 0.25, num_layers: int = 1
    ) -> "PassCosts":
        """A table by rule: "linear" (q tokens cost q steps: AVX2 bfloat16) or "flat" (up to 16 cost one step)."""
        if kind == "linear":
            verify = tuple(step * q for q in range(1, max_width + 1))
        elif kind == "flat":
            verify = tuple(step * max(1.0, q / FLAT_UP_TO) for q in range(1, max_width + 1))
        else:
            raise ValueError(f"unknown cost profile {kind!r} (valid: 'linear', 'flat')")
        return cls(verify, draft_fraction * step, num_layers, machine=f"{kind} profile", source=kind)

    def passes_only(self) -> "PassCosts":
        """The verify passes alone (no draft step): what every plan on this model and machine shares."""
        return dataclasses.replace(self, draft_step=0.0, draft_long=0.0)

    def draft_only(self) -> "PassCosts":
        """The draft step with the plain step it was timed beside (width 1 only): what is the plan's own."""
        return dataclasses.replace(self, verify=self.verify[:1], verify_long=self.verify_long[:1])

    def with_draft(self, draft: "PassCosts") -> "PassCosts":
        """These passes with `draft`'s draft step, taken relative to the plain step it was timed beside: a
        draft timed on a busier (or quieter) moment than these passes keeps its share of a step, not its
        seconds."""
        draft_step = draft.draft_step * self.step / draft.step
        draft_long = 0.0
        if draft.draft_long:
            long_step = self.verify_long[0] if self.verify_long else self.step
            draft_long = draft.draft_long * long_step / (draft.verify_long[0] if draft.verify_long else draft.step)
        return dataclasses.replace(self, draft_step=draft_step, draft_long=draft_long,
                                   measure_seconds=self.measure_seconds + draft.measure_seconds)

    def up_to(self, width: int) -> "PassCosts":
        """The table for passes of at most `width` tokens (a plan that verifies fewer than it was timed for)."""
        if width >= self.max_width:
            return self
        return dataclasses.replace(self, verify=self.verify[:width], verify_long=self.verify_long[:width])

    def merged_into(self, wider: "PassCosts") -> "PassCosts":
        """This table's widths, then `wider`'s beyond them, scaled by the two tables' ratio at this table's widest
        width (its shape kept) and never decreasing: what a narrower plan's refined passes write back over a
        table a wider plan timed, so the wider widths are not lost."""
        if wider.max_width <= self.max_width or (wider.context, wider.long_context) != (self.context, self.long_context):
            return self  # (the same long context: both timed there, or neither)

        def joined(narrow: tuple[float, ...], wide: tuple[float, ...]) -> tuple[float, ...]:
            scale = narrow[-1] / wide[len(narrow) - 1]
            out = list(narrow)
            for t in wide[len(narrow):]:
                out.append(max(out[-1], t * scale))
            return tuple(out)

        return dataclasses.replace(self, verify=joined(self.verify, wider.verify),
                                   verify_long=joined(self.verify_long, wider.verify_long) if self.verify_long else ())

    def relative(self) -> dict[str, Any]:
        """The table in units of one plain step."""
        relative = {
            "verify": [round(t / self.step, 3) for t in self.verify],
            "draft_step": round(self.draft_step / self.step, 3),
        }
        if self.verify_long:
            relative[f"verify at {self.long_context}"] = [round(t / self.step, 3) for t in self.verify_long]
            relative[f"draft_step at {self.long_context}"] = round(self.draft_long / self.step, 3)
        return relative

    def summary(self) -> str:
        widths = sorted({1, 2, 4, 8, 16, self.max_width} & set(range(1, self.max_width + 1)))
        verify = ", ".join(f"{q}: {self.verify[q - 1] / self.step:.2f}" for q in widths)
        draft = f"draft step {self.draft_step / self.step:.3f}" if self.draft_step else "no layer draft"
        long = ""
        if self.verify_long:
            at = ", ".join(f"{q}: {self.verify_long[q - 1] / self.step:.2f}" for q in widths)
            long = f"; at {self.long_context} entries: verify {{{at}}}"
        return (
            f"plain step {self.step * 1e3:.2f} ms; in plain steps: verify of q tokens {{{verify}}}, {draft}{long} "
            f"[{self.source}; {self.machine}]"
        )

    def to_dict(self) -> dict[str, Any]:
        return {"format": COSTS_FORMAT, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PassCosts":
        if data.get("format") != COSTS_FORMAT:
            raise ValueError(f"not a cost table (format {data.get('format')!r}, expected {COSTS_FORMAT!r})")
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in fields}
        values["verify"] = tuple(float(t) for t in values["verify"])
        values["verify_long"] = tuple(float(t) for t in values.get("verify_long", ()))
        return cls(**values)


def machine_description(device: torch.device) -> str:
    """The processor that runs the passes: GPU name, or CPU model, ISA level and thread count."""
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda})"
    return f"{cpu_model()}, {cpu_capability()}, {torch.get_num_threads()} threads"


CAPABILITY_CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")  # environment variables that cap the kernels' ISA


def cpu_capability() -> str:
    """The instruction set torch's CPU kernels dispatch to, and any cap set on it in the environment.

    `ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2` makes an AVX-512 host run its passes as an AVX2-only
    one does (what the benchmarks' "emulated AVX2" runs use); a figure measured so must say so."""
    caps = [f"{name}={os.environ[name]}" for name in CAPABILITY_CAPS if os.environ.get(name)]
    capability = torch.backends.cpu.get_cpu_capability()
    return f"{capability} (capped: {', '.join(caps)})" if caps else capability


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@torch.no_grad()
def measure_pass_costs(
    runner_for: Callable[[int], Any],
    draft_step: Callable[[Any, int], None] | None,
    *,
    num_layers: int,
    vocab_size: int,
    max_width: int,
    repeats: int = 3,
    bucketed: bool = False,
    max_positions: int | None = None,
    draft_only: bool = False,
) -> PassCosts:
    """Time full passes over 1, 2, 4, 8, ... and `max_width` tokens, and one draft step.

    `draft_only`: time the draft step and one plain step beside it (a table
    of width 1, `PassCosts.draft_only`), for a plan whose passes are timed
    already (`PassCosts.with_draft`).

    `bucketed`: the runner pads a pass to the next power of two (the static
    step), so a width between two measured ones costs what the wider does;
    otherwise widths between are interpolated linearly.

    `runner_for(capacity)` makes a `LayerRunner` on the shared-cache layout;
    `draft_step(runner, position)` runs one drafted token at `position` (it may
    write cache entries; they are cropped after). Everything is timed twice:
    after a prefill of `MEASURE_CONTEXT` tokens, and with `long_context(...)`
    entries (zeros: no prefill needed, attention costs the same; a model
    whose learned positions end before it is timed once). Each timing
    is the minimum of `repeats` runs after one warm-up round, all tasks
    interleaved: on a shared machine the minimum is the cost, the rest is
    other load. The rounds refine it later.
    """
    began = time.perf_counter()
    context, long = MEASURE_CONTEXT, long_context(max_positions, max_width)
    runner = runner_for(long + max_width + 1)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (context + max_width,), generator=generator).tolist()
    embeds = runner.embed(ids[:context], 0)  # [1, context, hidden]
    runner.run(embeds, range(num_layers), 0)
    if runner.head is not None:  # its slot written too (with zero states for a feature head: values do not matter)
        runner.run(runner.head_input(embeds), [num_layers], 0)
    device = runner.positions.device
    widths = [1] if draft_only else sorted({q for q in (1, 2, 4, 8, 16, 32, 64) if q < max_width} | {max_width})

    def timed_at(position: int) -> dict[Any, float]:
        def full_pass(q: int) -> Callable[[], None]:
            def run() -> None:
                hidden = runner.run(runner.embed(ids[context : context + q], position), range(num_layers), position)
                runner.logits(hidden)

            return run

        tasks: dict[Any, Callable[[], None]] = {q: full_pass(q) for q in widths}
        if draft_step is not None:
            tasks["draft"] = lambda: draft_step(runner, position)
        return fastest(tasks, repeats=repeats, device=device, after=lambda: runner.cache.crop(position))

    short = timed_at(context)
    at_long: dict[Any, float] = {}
    if long > context:
        runner.cache.fill_zeros(long)
        at_long = timed_at(long)
    timed_width = widths[-1]  # max_width, or 1 for `draft_only`
    return PassCosts(
        interpolate({q: short[q] for q in widths}, timed_width, step_up=bucketed),
        short.get("draft", 0.0),
        num_layers,
        machine=machine_description(device),
        measure_seconds=time.perf_counter() - began,
        context=context,
        verify_long=interpolate({q: at_long[q] for q in widths}, timed_width, step_up=bucketed) if at_long else (),
        draft_long=at_long.get("draft", 0.0),
        long_context=long if at_long else 0,
    )


def fastest(tasks: dict[Any, Callable[[], None]], *, repeats: int, device: torch.device,
            after: Callable[[], None] | None = None) -> dict[Any, float]:
    """Each task's fastest of `repeats` timed runs, after one warm-up round; `after` runs after every task.

    The rounds interleave every task, so other load on the machine hits all
    alike; the minimum is the cost, the rest is that load.
    """
    best = {name: float("inf") for name in tasks}
    for i in range(repeats + 1):  # round 0 warms up
        for name, fn in tasks.items():
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            if i:
                best[name] = min(best[name], time.perf_counter() - start)
            if after is not None:
                after()
    return best


def interpolate(measured: dict[int, float], max_width: int, *, step_up: bool = False) -> tuple[float, ...]:
    """Seconds for every width 1..max_width, never decreasing: linear between measured widths, or (`step_up`)
    the cost of the next measured width."""
    points = sorted(measured.items())
    out, floor = [], 0.0
    for q in range(1, max_width + 1):
        lo = max((p for p in points if p[0] <= q), default=points[0])
        hi = min((p for p in points if p[0] >= q), default=points[-1])
        if step_up:
            value = hi[1]
        else:
            value = lo[1] if hi[0] == lo[0] else lo[1] + (hi[1] - lo[1]) * (q - lo[0]) / (hi[0] - lo[0])
        floor = max(floor, value)
        out.append(floor)
    return tuple(out)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cache_key(**identity: Any) -> str:
    """A short stable key for a cost table's identity (model, plan's draft, dtype, device, threads, processor)."""
    identity = {**identity, "torch": torch.__version__, "format": COSTS_FORMAT, "kernels": PASS_KERNELS}
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:20]


def costs_cache_dir() -> Path | None:
    """Where cost tables are kept: $SELFSPEC_COSTS_CACHE ("off": nowhere), else `costs/` in selfspec's cache."""
    explicit = os.environ.get("SELFSPEC_COSTS_CACHE")
    if explicit == "off":
        return None
    return Path(explicit).expanduser() if explicit else default_cache_dir() / "costs"


def load_or_measure(folder: Path | None, key: str, measure: Callable[[], Any], *, kind: type = None,
                    usable: Callable[[Any], bool] | None = None) -> Any:
    """The table cached under `folder/key.json`, else measured now (and cached when `folder` is given).

    `kind`: what the file holds (`PassCosts`, marked `source="cached"` when read back; or anything with
    `to_dict` and `from_dict`). `usable(cached)`: whether the cached one serves (a table timed for fewer
    widths than asked is measured again, and the new one replaces it)."""
    cached = load_costs(folder, key, kind=kind)
    if cached is not None and (usable is None or usable(cached)):
        return cached
    costs = measure()
    save_costs(folder, key, costs)
    return costs


def load_costs(folder: Path | None, key: str, *, kind: type = None) -> Any:
    """What `folder/key.json` holds (see `load_or_measure`), or None: no folder, no file, or a damaged or older one."""
    kind = kind or PassCosts
    path = folder / f"{key}.json" if folder is not None else None
    if path is None or not path.is_file():
        return None
    try:
        loaded = kind.from_dict(json.loads(path.read_text()))
    except (ValueError, KeyError, TypeError, json.JSONDecodeError):
        return None  # measured again and overwritten
    return dataclasses.replace(loaded, source="cached") if kind is PassCosts else loaded


def save_costs(folder: Path | None, key: str, costs: Any) -> None:
    """Write `folder/key.json` in one rename; a read-only folder only costs a measurement next time."""
    if folder is None:
        return
    path = folder / f"{key}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(costs.to_dict(), indent=1) + "\n")
        tmp.replace(path)
    except OSError:
        pass


class RuntimeCosts:
    """A cost table as one generation uses it: at the round's context, scaled by what its rounds measure.

    The decode loop sets `context` (entries in the cache) every round. Each
    observed verify pass gives a ratio (observed / table at that context) for
    its width and context band (0-127, 128-255, 256-511, ... entries), each
    layer draft one for the draft step. The ratio used is the median of the
    last `WINDOW` observations of that width in that band; one seen fewer than
    `MIN_SEEN` times there uses the band's median over all widths, and a band
    seen too little the median over everything. The corrected table stays a
    cost curve: a wider pass never costs less than a narrower one plus the
    measured table's extra for the extra tokens (at the band's ratio), so
    noise in one width's rounds cannot make widening look free. Bands keep what was learned
    local: how a wide pass grows with the context is not quite linear, and a
    correction learned on short contexts must not price long ones. A median
    follows a machine that became slower or faster, and ignores a burst of
    other load that hit a few rounds. With `learn=False` the table is used as
    it is (injected profiles; sampling, whose draws must not depend on timing
    noise).
    """

    WINDOW = 9  # recent observations per width and band
    MIN_SEEN = 3  # observations before a median is used

    def __init__(self, table: PassCosts, *, learn: bool = True) -> None:
        self.table = table
        self.learn = learn
        self._context: int | None = None  # entries in the cache this round (the decode loop sets `context`)
        self.priced: dict[tuple[int, int], float] = {}  # (width, exact prefix) -> seconds, until context or ratios change
        # Recent ratios by (width, band) and by band (every width); their medians once seen MIN_SEEN times,
        # kept up to date by `observe_verify` so that pricing a round reads them and computes nothing.
        self.seen: dict[tuple[int, int] | int, deque[float]] = {}
        self.medians: dict[tuple[int, int] | int, float] = {}
        self.seen_all: deque[float] = deque(maxlen=3 * self.WINDOW)
        self.overall = 1.0  # the median over everything seen (1.0 until something is)
        self.seen_draft: deque[float] = deque(maxlen=self.WINDOW)
        self.draft_ratio = 1.0
        self.ratios: dict[int, tuple[float, ...]] = {}  # per band, every width's correction (until an observation)

    @property
    def context(self) -> int | None:
        return self._context

    @context.setter
    def context(self, context: int | None) -> None:
        if context != self._context:
            self._context = context
            self.priced.clear()

    def ratio(self, width: int, context: int | None) -> float:
        """observed / table for a pass over `width` tokens at `context` entries (1.0 until something is seen)."""
        ratios = self._band_ratios_of(self._band(context))
        return ratios[min(width, len(ratios)) - 1]

    def _band_ratios_of(self, band: int) -> tuple[float, ...]:
        ratios = self.ratios.get(band)
        if ratios is None:
            ratios = self.ratios[band] = self._band_ratios(band)
        return ratios

    def _learned_band(self, band: int) -> int:
        """`band`, or where no round has been seen in it, the nearest band where rounds were (the lower on a tie)."""
        seen = [key for key in self.medians if isinstance(key, int)]
        if not seen or band in seen:
            return band
        return min(seen, key=lambda b: (abs(b - band), b))

    def _band_ratios(self, band: int) -> tuple[float, ...]:
        """Each width's correction in `band`: its own median, bounded, then kept a cost curve.

        A width's own ratio stays within `SHAPE_SLACK` of its band's: the
        measured table's shape across widths is trusted that far. Without the
        bound, a burst of load on the few rounds of one width could price it
        out for good: a width thought too dear is never drafted, so never
        observed again, and the refined table carries it to the next process.
        Then each width costs at least the narrower one plus `STEP_FLOOR` of
        what the table says the extra tokens add (at the band's ratio):
        without that, a width whose rounds happened to run fast would look
        as cheap as a narrower one, and the policy would widen every pass to
        it for free. Only a share: the table's steps are timed too, and with
        the whole step as the floor a step it overstated stayed overstated
        however the rounds ran (measured, SmolLM2 bfloat16 under AVX2
        kernels: a table that timed 2 tokens at 1.72 plain steps priced them
        there for good while the rounds ran them at 1.5, so the plan rarely
        verified an n-gram pair, and its refined table kept the error).
        """
        general = self.medians.get(band, self.overall)
        shape = self.table.verify  # seconds per width at the table's context: the measured shape
        ratios: list[float] = []
        for q, seconds in enumerate(shape, start=1):
            own = self.medians.get((q, band))
            ratio = general if own is None else min(max(own, general / SHAPE_SLACK), general * SHAPE_SLACK)
            if ratios:
                narrower = shape[q - 2] * ratios[-1]
                ratio = max(ratio, (narrower + STEP_FLOOR * general * (seconds - shape[q - 2])) / seconds)
            ratios.append(ratio)
        return tuple(ratios)

    def _band(self, context: int | None) -> int:
        return context_band(self.table.context if context is None else context)

    def verify(self, width: int, exact_prefix: int = 0) -> float:
        """A verify pass over `width` tokens at this round's context (priced once per round and width: a round
        asks for the same widths many times, and on a GPU its host time is not hidden behind the passes)."""
        seconds = self.priced.get((width, exact_prefix))
        if seconds is None:
            seconds = self.table.verify_seconds(width, exact_prefix, self.context) * self.ratio(width, self.context)
            self.priced[(width, exact_prefix)] = seconds
        return seconds

    def draft(self, width: int = 1) -> float:
        """A draft pass over `width` tokens (one drafted token, or a tree level's nodes) at this round's context."""
        return self.table.draft_seconds(self.context) * self.draft_ratio * self.table.width_scale(width, self.context)

    def draft_steps(self, widths: Sequence[int]) -> float:
        """Draft passes over `widths` tokens each, counted in passes over one token."""
        return sum(self.table.width_scale(w, self.context) for w in widths)

    def refined(self) -> PassCosts:
        """The table as the rounds measured it: what the next process should start from.

        Each of the table's two contexts takes the corrections of its own band,
        or, where no round ran there, of the nearest band where some did: a
        generation of 128 tokens after a prompt of a few hundred ran in bands
        1-3 only, and what it learned per width there would otherwise reach the
        next process only as the median over every width."""

        def scaled(times: tuple[float, ...], context: int) -> tuple[float, ...]:
            ratios = self._band_ratios_of(self._learned_band(context_band(context)))
            out, floor = [], 0.0
            for q, t in enumerate(times, start=1):
                floor = max(floor, t * ratios[min(q, len(ratios)) - 1])
                out.append(floor)
            return tuple(out)

        table = self.table
        return dataclasses.replace(table, verify=scaled(table.verify, table.context),
                                   verify_long=scaled(table.verify_long, table.long_context),
                                   draft_step=table.draft_step * self.draft_ratio,
                                   draft_long=table.draft_long * self.draft_ratio, source="refined")

    def observe_verify(self, width: int, exact_prefix: int, seconds: float) -> None:
        """A pass over `width` tokens at this round's context took `seconds`."""
        if not self.learn or seconds <= 0:
            return
        ratio = seconds / self.table.verify_seconds(width, exact_prefix, self.context)
        band = self._band(self.context)
        for key, window in (((width, band), self.WINDOW), (band, 3 * self.WINDOW)):
            seen = self.seen.setdefault(key, deque(maxlen=window))
            seen.append(ratio)
            if len(seen) >= self.MIN_SEEN:
                self.medians[key] = statistics.median(seen)
        self.seen_all.append(ratio)
        self.overall = statistics.median(self.seen_all)
        self.ratios.clear()
        self.priced.clear()

    def observe_draft(self, steps: float, seconds: float) -> None:
        """Draft passes worth `steps` one-token passes (`draft_steps`) took `seconds`."""
        if not self.learn or steps <= 0 or seconds <= 0 or not self.table.draft_step:
            return
        self.seen_draft.append(seconds / steps / self.table.draft_seconds(self.context))
        self.draft_ratio = statistics.median(self.seen_draft)


def context_band(context: int) -> int:
    """0 for 0-127 entries, 1 for 128-255, 2 for 256-511, ...: where runtime corrections are kept apart."""
    return max(0, (context // 64).bit_length() - 1)


def moving_average(average: float, value: float, weight: float) -> float:
    """`weight` x the past + (1 - weight) x the new value."""
    return weight * average + (1 - weight) * value
