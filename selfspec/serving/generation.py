"""One request's generation on the engine's public API: `spec.generate` with a streamer and a stopping criterion.

A `Job` is what the HTTP layer hands the scheduler: token ids, sampling
options, stop strings, a cancel flag and a sink for events. `Engine.run(job)`
calls `spec.generate(...)` once, unchanged, so the output is the engine's own
(greedy: `model.generate`'s tokens). Two hooks that `generate` accepts do the
serving work:

- a `StoppingCriteria` (checked after every emitted token) ends the
  generation when the job is cancelled (the client went away) or a stop
  string has appeared in the text; stopping only shortens the output;
- a streamer (`put` once per accepted chunk) decodes the text so far and
  sends the new part as a `Delta` event, holding back a tail that could still
  become a stop string (and an incomplete UTF-8 character), so that what was
  streamed always equals the final text.
"""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import StoppingCriteria, StoppingCriteriaList


class Tokenizer:
    """The model's tokenizer, two copies each behind its own lock: the HTTP side encodes (in a thread of its own)
    while the worker decodes, so a long prompt being encoded never holds up the worker's streams."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer  # the worker's: decode
        self.lock = threading.Lock()
        self.encoder = copy.deepcopy(tokenizer)  # the requests': encode_chat, encode_text
        self.encode_lock = threading.Lock()

    @property
    def has_chat_template(self) -> bool:
        return getattr(self.tokenizer, "chat_template", None) is not None

    def encode_chat(self, messages: list[dict]) -> list[int]:
        with self.encode_lock:
            encoded = self.encoder.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                       return_dict=True)
        return list(encoded["input_ids"])

    def encode_text(self, text: str) -> list[int]:
        with self.encode_lock:
            return list(self.encoder(text)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        with self.lock:
            return self.tokenizer.decode(ids, skip_special_tokens=True)


@dataclass
class Delta:
    """New text for a streaming client."""

    text: str


@dataclass
class Result:
    """A finished job: its whole text and what the response reports."""

    text: str
    finish_reason: str  # "stop" (EOS or a stop string) or "length" (max_tokens)
    prompt_tokens: int
    completion_tokens: int
    drafted: int
    accepted: int
    tokens_per_pass: float
    verify_passes: int
    cancelled: bool = False
    by_source: dict[str, tuple[int, int]] = field(default_factory=dict)  # (drafted, accepted) per draft source
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache


@dataclass
class Failed:
    """The job raised: `error` is the exception (a ValueError is the request's fault, anything else the server's)."""

    error: BaseException


@dataclass(eq=False)
class Job:
    """One request, as the worker runs it."""

    prompt: list[int]
    max_tokens: int
    temperature: float  # 0: greedy
    top_p: float
    seed: int | None
    stop: list[str]
    stream: bool
    sink: Callable[[object], None]  # receives Delta, then one Result or Failed; called from the worker thread
    arrived: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)
    first_token_at: float | None = None
    finished_at: float | None = None
    outcome: str | None = None  # how it ended, as counted: "completed", "cancelled" or "failed"
    cut_off: bool = False  # stopped because the server is shutting down (its grace period ran out)

    def cancel(self) -> None:
        self.cancelled.set()

    def send(self, event) -> None:
        try:
            self.sink(event)
        except Exception:  # the client's side is gone (its event loop closed): nothing to tell it
            pass


def find_stop(text: str, stops: list[str]) -> int | None:
    """Where the earliest stop string begins in `text`, or None."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def held_back(text: str, stops: list[str]) -> int:
    """How many trailing characters to hold back: an incomplete character, or a tail a stop string may start with."""
    hold = 0
    while hold < len(text) and text[len(text) - 1 - hold] == "\ufffd":
        hold += 1
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:n]):
                hold = max(hold, n)
                break
    return hold


class JobCriteria(StoppingCriteria):
    """Stops the generation when the job is cancelled or a stop string has appeared (checked per token)."""

    def __init__(self, job: Job, tokenizer: Tokenizer) -> None:
        self.job = job
        self.tokenizer = tokenizer
        self.stop_found = False
        # A stop string is found in the text of the last few tokens (each decodes to at least one character
        # in practice), so the check costs the same at token 10 and at token 10,000.
        self.window = max((len(s) for s in job.stop), default=0) + 8

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        done = self.job.cancelled.is_set() or self.stop_found
        if not done and self.job.stop:
            new = input_ids[0, len(self.job.prompt):].tolist()
            if find_stop(self.tokenizer.decode(new[-self.window:]), self.job.stop) is not None:
                self.stop_found = done = True
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


class JobStreamer:
    """The transformers streamer interface (`put`, `end`): records the first token's time, streams text deltas."""

    def __init__(self, job: Job, tokenizer: Tokenizer, criteria: JobCriteria) -> None:
        self.job = job
        self.tokenizer = tokenizer
        self.criteria = criteria  # told when the streamed text shows a stop string
        self.tokens: list[int] = []
        self.sent = 0  # characters already sent
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # generate() puts the prompt first
            self.prompt_seen = True
            return
        chunk = value.reshape(-1).tolist()
        if not chunk:
            return
        if self.job.first_token_at is None:
            self.job.first_token_at = time.perf_counter()
        self.tokens += chunk
        if self.job.stream:
            self._send(self.tokenizer.decode(self.tokens), final=False)

    def end(self) -> None:
        pass

    def _send(self, text: str, *, final: bool) -> None:
        cut = find_stop(text, self.job.stop) if self.job.stop else None
        if cut is not None:
            text, final = text[:cut], True
            self.criteria.stop_found = True
        safe = len(text) if final else len(text) - held_back(text, self.job.stop)
        if safe > self.sent:
            self.job.send(Delta(text[self.sent:safe]))
            self.sent = safe

    def flush(self, text: str) -> None:
        """Send what is left of the final text."""
        if self.job.stream:
            self._send(text, final=True)


class Engine:
    """Runs jobs on a wrapped model (`selfspec.wrap(model)`): alone (`run`: one `generate` call) or as rows of a
    batch (`session`, `join`, `finished`)."""

    def __init__(self, spec, tokenizer: Tokenizer) -> None:
        self.spec = spec
        self.tokenizer = tokenizer
        self.device = spec.model.device
        eos = spec.model.generation_config.eos_token_id
        self.eos = set() if eos is None else {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}

    def kv_cache_bytes(self, job: Job) -> int:
        """What the one KV cache holds for this job: prompt, max_tokens and the widest verify pass."""
        plan = self.spec.plan
        context = len(job.prompt) + job.max_tokens + max(plan.draft_length, plan.tree) + 1
        return self.spec.memory(context=context).kv_cache_bytes

    def options(self, job: Job) -> dict:
        """`generate` options of a job: its length, and greedy or sampling with its seed.

        OpenAI's API has no top-k: sampling draws from the whole vocabulary (after `top_p`), so `top_k=0`
        overrides transformers' default of 50 and any `top_k` in the model's generation config.
        """
        options: dict = dict(max_new_tokens=job.max_tokens)
        if job.temperature == 0 or job.top_p == 0:
            options["do_sample"] = False
        else:
            options.update(do_sample=True, temperature=job.temperature, top_p=job.top_p, top_k=0)
            if job.seed is not None:
                options["generator"] = torch.Generator(device=self.device).manual_seed(job.seed)
        return options

    def run(self, job: Job) -> Result:
        """Generate for `job` alone, streaming deltas to it as they come; returns (and does not send) the result."""
        criteria = JobCriteria(job, self.tokenizer)
        streamer = JobStreamer(job, self.tokenizer, criteria)
        input_ids = torch.tensor([job.prompt], dtype=torch.long, device=self.device)
        # Every prompt token is text the client sent, the pad id included (transformers hides it when no mask is
        # given and the pad id is not an EOS id); a batch row (`join`) attends to every token too.
        output = self.spec.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                    stopping_criteria=StoppingCriteriaList([criteria]), streamer=streamer,
                                    **self.options(job))
        return self.result(job, output[0, len(job.prompt):].tolist(), self.spec.last_stats, streamer)

    def session(self, max_rows: int):
        """A batch that requests join and leave at round boundaries (`spec.batch_session()`), its costs measured."""
        session = self.spec.batch_session()
        session.prepare(max_rows)
        return session

    def join(self, session, job: Job):
        """Add `job` to `session` as a new row (its prefill and first token); returns the row."""
        criteria = JobCriteria(job, self.tokenizer)
        streamer = JobStreamer(job, self.tokenizer, criteria)
        return session.add(job.prompt, stopping_criteria=StoppingCriteriaList([criteria]), streamer=streamer,
                           **self.options(job))

    def finished(self, job: Job, row) -> Result:
        """The result of a job whose row left its batch."""
        return self.result(job, row.new_tokens, row.stats, row.out.streamer)

    def result(self, job: Job, new: list[int], stats, streamer: "JobStreamer") -> Result:
        """The job's text (cut at a stop string), why it ended, and its counts; the stream's last delta is sent."""
        text = self.tokenizer.decode(new)
        cut = find_stop(text, job.stop) if job.stop else None
        if cut is not None:
            text, reason = text[:cut], "stop"
        elif new and new[-1] in self.eos:
            reason = "stop"
        elif len(new) >= job.max_tokens:
            reason = "length"
        else:
            reason = "stop"
        streamer.flush(text)
        job.finished_at = time.perf_counter()
        return Result(text=text, finish_reason=reason, prompt_tokens=len(job.prompt), completion_tokens=len(new),
                      drafted=stats.drafted, accepted=stats.accepted, tokens_per_pass=stats.tokens_per_pass,
                      verify_passes=stats.verify_passes, cancelled=job.cancelled.is_set(),
                      by_source=stats.by_source(), cached_tokens=stats.cached_tokens)
