"""The request queue and its one worker thread.

Requests wait in a bounded queue (full: `QueueFull`, which the HTTP layer
answers with 429). One worker thread owns the model: at each round boundary
it takes the next batch (`Scheduler._next_batch`: up to `max_batch` waiting
requests) and runs it (`Scheduler._run_batch`).

Today `_run_batch` runs its requests one at a time, each a whole
`spec.generate` call, so `max_batch > 1` only changes how many requests are
taken off the queue at once, not how many share a forward pass. That pair of
methods is the seam where batched rounds drop in: `_next_batch` already takes
requests at a round boundary, and a batched engine would run the batch's
rounds together, admitting new requests between rounds.

A cancelled request (its client went away) leaves the queue at once; a
running one stops at its next token (`generation.JobCriteria`), and the worker
moves on.
"""

from __future__ import annotations

import logging
import threading
from collections import deque

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
        self.metrics = metrics
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.queue: deque[Job] = deque()
        self.running: list[Job] = []  # the batch the worker holds: the running request and those after it
        self.condition = threading.Condition()
        self.stopping = False
        self.worker: threading.Thread | None = None

    # ------------------------------------------------------------------ the HTTP side

    def start(self) -> None:
        self.worker = threading.Thread(target=self._work, name="selfspec-worker", daemon=True)
        self.worker.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Refuse new requests, cancel the waiting and running ones, and wait for the worker to end."""
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
            if self.stopping:
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
        """Run a batch. Today: its requests one after another, each to its end."""
        for job in batch:
            self._run_one(job)
            with self.condition:
                self.running.remove(job)
                self.metrics.batch_size.set(len(self.running))

    def _run_one(self, job: Job) -> None:
        if job.cancelled.is_set():
            self._count(job, "cancelled")
            return
        metrics = self.metrics
        try:
            metrics.kv_cache_bytes.set(self.engine.kv_cache_bytes(job))
            result = self.engine.run(job)
        except Exception as error:  # the request fails, the worker goes on
            if not isinstance(error, ValueError):
                log.exception("generation failed")
            self._count(job, "failed")
            job.send(Failed(error))
            return
        finally:
            metrics.kv_cache_bytes.set(0)
        metrics.prompt_tokens.inc(result.prompt_tokens)
        metrics.generated_tokens.inc(result.completion_tokens)
        metrics.drafted_tokens.inc(result.drafted)
        metrics.accepted_tokens.inc(result.accepted)
        metrics.verify_passes.inc(result.verify_passes)
        if job.first_token_at is not None:
            metrics.time_to_first_token.observe(job.first_token_at - job.arrived)
            if result.completion_tokens > 1 and job.finished_at is not None:
                per_token = (job.finished_at - job.first_token_at) / (result.completion_tokens - 1)
                metrics.time_per_output_token.observe(per_token)
        self._count(job, "cancelled" if result.cancelled else "completed")
        job.send(result)

    def _count(self, job: Job, outcome: str) -> None:
        """Count how `job` ended, once."""
        with self.condition:
            if job.outcome is None:
                job.outcome = outcome
                self.metrics.requests.labels(outcome).inc()
