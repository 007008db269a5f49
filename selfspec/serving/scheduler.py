"""The request queue and its one worker thread.

Requests wait in a bounded queue (full: `QueueFull`, which the HTTP layer
answers with 429). One worker thread owns the model.

- `max_batch=1`: the worker runs one request at a time, each a whole
  `spec.generate` call (every plan feature: layer drafts, heads, trees, the
  static step).
- `max_batch=N > 1`: continuous batching. The worker keeps one
  `spec.batch_session()` (`selfspec/batch.py`): at every round boundary it
  admits waiting requests while fewer than N run (each joins with its
  prefill), runs one round for all of them (one forward pass; each row its
  own n-gram draft, the cost model choosing the batch's draft length), and
  answers the requests whose rows finished, which leave the batch and free
  their cache row.

A cancelled request (its client went away) leaves the queue at once; a
running one stops at its next token (`generation.JobCriteria`), and its row
leaves the batch. On a signal (`drain`), new and waiting requests get 503
and the running ones a grace period, after which they are stopped the same way.
"""

from __future__ import annotations

import logging
import threading
from collections import deque

from ..heap import give_back_freed
from .generation import Engine, Failed, Job
from .metrics import Metrics

log = logging.getLogger("selfspec.serving")


class QueueFull(Exception):
    """The queue holds `max_queue` requests already."""


class ShuttingDown(Exception):
    """The server is stopping and takes no more requests."""


class Scheduler:
    def __init__(self, engine: Engine, metrics: Metrics, *, max_batch: int = 1, max_queue: int = 64) -> None:
        if max_batch < 1 or max_queue < 1:
            raise ValueError(f"max_batch and max_queue must be >= 1 (got {max_batch}, {max_queue})")
        self.engine = engine
        self._evictions_seen = 0  # the prefix cache's evictions already counted in the metrics
        self.metrics = metrics
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.queue: deque[Job] = deque()
        self.running: list[Job] = []  # the batch the worker holds: the running request and those after it
        self.condition = threading.Condition()
        self.stopping = False
        self.draining = False  # a signal came: no new requests; the running ones have a grace period
        self.cut_off_timer: threading.Timer | None = None
        self.worker: threading.Thread | None = None

    # ------------------------------------------------------------------ the HTTP side

    def start(self) -> None:
        self.worker = threading.Thread(target=self._work, name="selfspec-worker", daemon=True)
        self.worker.start()

    def drain(self, grace: float) -> None:
        """The server is asked to stop (a signal): refuse new requests and fail the waiting ones (503), let the
        running ones go on for `grace` seconds, then stop them at their next token (each gets a 503, or a
        stream an error event then `[DONE]`). Once they have ended, the server can exit."""
        with self.condition:
            if self.draining or self.stopping:
                return
            self.draining = True
            waiting = list(self.queue)
            self.queue.clear()
            self.metrics.queue_depth.set(0)
            running = len(self.running)
        if waiting or running:
            log.info("shutting down: %d running request(s) get %g s to finish; %d waiting refused", running, grace,
                     len(waiting))
        for job in waiting:
            job.cancel()
            self._count(job, "cancelled")
            job.send(Failed(ShuttingDown("the server is shutting down")))
        self.cut_off_timer = threading.Timer(grace, self._cut_off)
        self.cut_off_timer.daemon = True
        self.cut_off_timer.start()

    def _cut_off(self) -> None:
        with self.condition:
            for job in self.running:
                if job.outcome is None:
                    log.info("shutting down: stopping a running request after the grace period")
                    job.cut_off = True
                    job.cancel()

    def stop(self, timeout: float = 10.0) -> None:
        """Refuse new requests, cancel the waiting and running ones, and wait for the worker to end."""
        if self.cut_off_timer is not None:
            self.cut_off_timer.cancel()
        with self.condition:
            self.stopping = True
            waiting = list(self.queue)
            self.queue.clear()
            self.metrics.queue_depth.set(0)
            for job in self.running:
                job.cancel()
            self.condition.notify_all()
        for job in waiting:
            job.cancel()
            job.send(Failed(ShuttingDown("the server is shutting down")))
        if self.worker is not None:
            self.worker.join(timeout)

    def submit(self, job: Job) -> None:
        """Queue `job`; raises QueueFull (nothing queued) when `max_queue` requests are waiting."""
        with self.condition:
            if self.stopping or self.draining:
                raise ShuttingDown("the server is shutting down")
            if len(self.queue) >= self.max_queue:
                self.metrics.rejected.labels("queue_full").inc()
                raise QueueFull(f"the queue is full ({self.max_queue} requests waiting); try again later")
            self.queue.append(job)
            self.metrics.queue_depth.set(len(self.queue))
            self.condition.notify()

    def cancel(self, job: Job) -> None:
        """The client went away: drop `job` from the queue, or stop it at its next token."""
        job.cancel()
        with self.condition:
            if job in self.queue:
                self.queue.remove(job)
                self.metrics.queue_depth.set(len(self.queue))
                self._count(job, "cancelled")

    @property
    def queue_depth(self) -> int:
        with self.condition:
            return len(self.queue)

    # ------------------------------------------------------------------ the worker

    def _work(self) -> None:
        if self.max_batch > 1:
            self._work_batched()
            return
        while True:
            batch = self._next_batch()
            if not batch:
                return
            try:
                self._run_batch(batch)
            finally:
                with self.condition:
                    self.running = []
                    self.metrics.batch_size.set(0)

    def _work_batched(self) -> None:
        """Continuous batching: admit at round boundaries, one round for every running request, answer the done."""
        session = self.engine.session(self.max_batch)
        rows: dict[object, Job] = {}  # the session's rows and their jobs
        while True:
            with self.condition:
                while not self.queue and not rows and not self.stopping:
                    self.condition.wait()
                if self.stopping and not rows:
                    return
                joining = [] if self.stopping else [self.queue.popleft()
                                                    for _ in range(min(self.max_batch - len(rows), len(self.queue)))]
                self.running = list(rows.values()) + joining
                self.metrics.queue_depth.set(len(self.queue))
            for job in joining:
                if job.cancelled.is_set():
                    self._count(job, "cancelled")
                    continue
                try:
                    row = self.engine.join(session, job)
                except Exception as error:  # the request fails (a bad option, say), the batch goes on
                    self._fail(job, error)
                    continue
                if row.done:
                    self._answer(job, self.engine.finished(job, row))
                else:
                    rows[row] = job
            with self.condition:
                self.running = list(rows.values())
            self.metrics.batch_size.set(len(rows))
            self.metrics.kv_cache_bytes.set(session.kv_cache_bytes())
            if not rows:  # the answers carried each row's stats: the long-lived session keeps none
                session.restart_stats()
                self._idle()
                continue
            self.metrics.batch_rounds.inc()
            self.metrics.batch_rows.inc(len(rows))
            try:
                finished = session.step()
            except Exception as error:  # a round failed: its requests fail, a fresh batch serves the rest
                for job in rows.values():
                    self._fail(job, error)
                rows.clear()
                session = self.engine.session(self.max_batch)
                continue
            for row in finished:
                job = rows.pop(row)
                self._answer(job, self.engine.finished(job, row))
            with self.condition:
                self.running = list(rows.values())
            self.metrics.batch_size.set(len(rows))
            self.metrics.kv_cache_bytes.set(session.kv_cache_bytes())
            if not rows:  # the answers carried each row's stats: the long-lived session keeps none
                session.restart_stats()
                self._idle()

    def _next_batch(self) -> list[Job]:
        """Wait for requests and take up to `max_batch` of them (a round boundary); [] when stopping."""
        with self.condition:
            while not self.queue and not self.stopping:
                self.condition.wait()
            if self.stopping:
                return []
            batch = [self.queue.popleft() for _ in range(min(self.max_batch, len(self.queue)))]
            self.running = list(batch)
            self.metrics.queue_depth.set(len(self.queue))
            self.metrics.batch_size.set(len(batch))
            return batch

    def _run_batch(self, batch: list[Job]) -> None:
        """Run the taken requests (one, with max_batch=1) one after another, each to its end."""
        for job in batch:
            self._run_one(job)
            with self.condition:
                self.running.remove(job)
                self.metrics.batch_size.set(len(self.running))
        self._idle()

    def _run_one(self, job: Job) -> None:
        if job.cancelled.is_set():
            self._count(job, "cancelled")
            return
        try:
            self.metrics.kv_cache_bytes.set(self.engine.kv_cache_bytes(job))
            result = self.engine.run(job)
        except Exception as error:  # the request fails, the worker goes on
            self._fail(job, error)
            return
        finally:
            self.metrics.kv_cache_bytes.set(0)
        self._answer(job, result)

    def _idle(self) -> None:
        """Nothing runs: if nothing waits either, hand the memory the finished requests freed back to the system
        (their KV caches; a batch's cache went with its last row), so an idle server's RSS comes back down."""
        with self.condition:
            if self.queue or self.running:
                return
        give_back_freed(self.engine.device)
        self.metrics.idle_trims.inc()

    def _fail(self, job: Job, error: BaseException) -> None:
        log.error("generation failed", exc_info=error)  # the client gets a 500 naming the exception's type only
        self._count(job, "failed")
        job.send(Failed(error))

    def _answer(self, job: Job, result) -> None:
        """Count a finished job's tokens and latencies, and send its result."""
        metrics = self.metrics
        metrics.prompt_tokens.inc(result.prompt_tokens)
        metrics.generated_tokens.inc(result.completion_tokens)
        metrics.drafted_tokens.inc(result.drafted)
        metrics.accepted_tokens.inc(result.accepted)
        for source, (drafted, accepted) in result.by_source.items():
            metrics.source_drafted.labels(source).inc(drafted)
            metrics.source_accepted.labels(source).inc(accepted)
        metrics.verify_passes.inc(result.verify_passes)
        if result.cached_tokens:
            metrics.prefix_hits.inc()
            metrics.prefix_cached_tokens.inc(result.cached_tokens)
        if prefix := getattr(self.engine.spec, "prefix", None):
            metrics.prefix_bytes.set(prefix.bytes)
            metrics.prefix_evictions.inc(prefix.stats.evictions - self._evictions_seen)
            self._evictions_seen = prefix.stats.evictions
        if job.first_token_at is not None:
            metrics.time_to_first_token.observe(job.first_token_at - job.arrived)
            if result.completion_tokens > 1 and job.finished_at is not None:
                per_token = (job.finished_at - job.first_token_at) / (result.completion_tokens - 1)
                metrics.time_per_output_token.observe(per_token)
        if job.cut_off:  # the shutdown stopped it: the client learns why (a stream keeps what it was sent)
            self._count(job, "cancelled")
            job.send(Failed(ShuttingDown(f"the server is shutting down: this generation was stopped after "
                                         f"{result.completion_tokens} tokens")))
            return
        self._count(job, "cancelled" if result.cancelled else "completed")
        job.send(result)

    def _count(self, job: Job, outcome: str) -> None:
        """Count how `job` ended, once."""
        with self.condition:
            if job.outcome is None:
                job.outcome = outcome
                self.metrics.requests.labels(outcome).inc()
