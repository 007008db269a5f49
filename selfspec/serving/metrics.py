"""The server's Prometheus metrics, in a registry of their own (one per app, so apps and tests never share counts).

    selfspec_requests_total{outcome}              requests that ended: completed, cancelled, failed
    selfspec_rejected_requests_total{reason}      requests refused before they were queued (queue_full)
    selfspec_prompt_tokens_total                  prompt tokens of the requests run
    selfspec_generated_tokens_total               tokens generated
    selfspec_drafted_tokens_total                 tokens drafted (`last_stats.drafted`)
    selfspec_accepted_tokens_total                drafted tokens the target accepted (`last_stats.accepted`)
    selfspec_source_drafted_tokens_total{source}  drafted tokens by source: layers (and heads), ngram, recycled
    selfspec_source_accepted_tokens_total{source} accepted tokens by source
    selfspec_verify_passes_total                  full forward passes (tokens per pass = generated / passes)
    selfspec_queue_depth                          requests waiting for the worker
    selfspec_batch_size                           requests in the batch the worker is running (0 or 1 today)
    selfspec_kv_cache_bytes                       KV cache the running batch holds (`spec.memory(context=...)`)
    selfspec_prefix_cache_hits_total              requests that started from a stored prefix
    selfspec_prefix_cached_tokens_total           prompt tokens taken from the prefix cache
    selfspec_prefix_cache_evictions_total         stored sequences evicted to keep to the budget
    selfspec_prefix_cache_bytes                   bytes the prefix cache holds
    selfspec_idle_memory_returns_total            times the idle server handed freed memory back to the system
    process_resident_memory_bytes                 the server's RSS (and the other `process_*` metrics)
    selfspec_time_to_first_token_seconds          from the request's arrival (queueing included) to its first token
    selfspec_time_per_output_token_seconds        after the first token, per token (one observation per request)
"""

from __future__ import annotations

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector,
                               generate_latest)

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    """Counters, gauges and histograms of one server; `render()` is the /metrics body."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("selfspec_requests", "Requests that ended, by outcome", ["outcome"],
                                registry=registry)
        self.rejected = Counter("selfspec_rejected_requests", "Requests refused before they were queued",
                                ["reason"], registry=registry)
        self.prompt_tokens = Counter("selfspec_prompt_tokens", "Prompt tokens of the requests run", registry=registry)
        self.generated_tokens = Counter("selfspec_generated_tokens", "Tokens generated", registry=registry)
        self.drafted_tokens = Counter("selfspec_drafted_tokens", "Tokens drafted", registry=registry)
        self.accepted_tokens = Counter("selfspec_accepted_tokens", "Drafted tokens the target accepted",
                                       registry=registry)
        self.source_drafted = Counter("selfspec_source_drafted_tokens", "Tokens drafted, by draft source",
                                      ["source"], registry=registry)
        self.source_accepted = Counter("selfspec_source_accepted_tokens", "Drafted tokens accepted, by draft source",
                                       ["source"], registry=registry)
        self.verify_passes = Counter("selfspec_verify_passes", "Full forward passes", registry=registry)
        self.queue_depth = Gauge("selfspec_queue_depth", "Requests waiting for the worker", registry=registry)
        self.batch_size = Gauge("selfspec_batch_size", "Requests in the batch being run", registry=registry)
        self.batch_rounds = Counter("selfspec_batch_rounds", "Rounds run with continuous batching (--max-batch > 1)",
                                    registry=registry)
        self.batch_rows = Counter("selfspec_batch_rows", "Requests those rounds ran, summed (/ rounds: the mean batch)",
                                  registry=registry)
        self.kv_cache_bytes = Gauge("selfspec_kv_cache_bytes", "KV cache bytes the running batch holds",
                                    registry=registry)
        self.prefix_hits = Counter("selfspec_prefix_cache_hits", "Requests that started from a stored prefix",
                                   registry=registry)
        self.prefix_cached_tokens = Counter("selfspec_prefix_cached_tokens", "Prompt tokens taken from the prefix "
                                            "cache", registry=registry)
        self.prefix_evictions = Counter("selfspec_prefix_cache_evictions", "Stored sequences evicted to keep to "
                                        "the budget", registry=registry)
        self.prefix_bytes = Gauge("selfspec_prefix_cache_bytes", "Bytes the prefix cache holds", registry=registry)
        self.idle_trims = Counter("selfspec_idle_memory_returns", "Times the idle server handed freed memory back "
                                  "to the system", registry=registry)
        ProcessCollector(registry=registry)  # process_resident_memory_bytes and the other process_* metrics
        self.time_to_first_token = Histogram(
            "selfspec_time_to_first_token_seconds", "Seconds from a request's arrival to its first token",
            buckets=LATENCY_BUCKETS, registry=registry)
        self.time_per_output_token = Histogram(
            "selfspec_time_per_output_token_seconds", "Seconds per generated token after the first",
            buckets=LATENCY_BUCKETS, registry=registry)
        for outcome in ("completed", "cancelled", "failed"):  # present from the start, at 0
            self.requests.labels(outcome)
        self.rejected.labels("queue_full")
        for source in ("layers", "ngram", "recycled"):
            self.source_drafted.labels(source)
            self.source_accepted.labels(source)

    def render(self) -> bytes:
        return generate_latest(self.registry)
