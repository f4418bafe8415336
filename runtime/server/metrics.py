"""Prometheus metrics of one server (its own registry: no process-global state).

The HTTP process observes what it sees (tokens arriving, requests finishing, errors returned);
the scheduler's numbers (queues, KV usage, retractions, grammar times) are fetched from it when
/metrics is scraped, so they cost the scheduler nothing while nobody scrapes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from weft.runtime.server.errors import ERROR_KINDS

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.5, 5.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "weft:num_requests", "finished requests by finish reason", ["finish_reason"], registry=r
        )
        self.prompt_tokens = Counter("weft:prompt_tokens", "prompt tokens", registry=r)
        self.generation_tokens = Counter("weft:generation_tokens", "generated tokens", registry=r)
        self.cached_tokens = Counter(
            "weft:cached_tokens", "prompt tokens served from the prefix cache", registry=r
        )
        self.pending = Gauge(
            "weft:num_pending_reqs", "requests submitted and not finished yet", registry=r
        )
        self.cache_hit_rate = Gauge(
            "weft:cache_hit_rate",
            "prompt tokens served from the prefix cache / prompt tokens, over finished requests",
            registry=r,
        )
        self.errors = Counter(
            "weft:num_errors",
            "failed or aborted requests by kind (an error response, an error event in a stream, "
            "or an abort)",
            ["kind"],
            registry=r,
        )
        for kind in ERROR_KINDS:
            self.errors.labels(kind)  # every kind is exported, at 0 until it happens
        self.ttft = Histogram(
            "weft:time_to_first_token_seconds",
            "time to first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "weft:inter_token_latency_seconds",
            "time between a sample's tokens as the server receives them (a chunk of k tokens "
            "counts k gaps of 1/k of its wait each)",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "weft:e2e_request_latency_seconds",
            "request latency",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.scheduler = SchedulerStats()
        r.register(self.scheduler)

    def request_done(
        self, prompt: int, completion: int, cached: int, latency: float, reason: str
    ) -> None:
        self.requests.labels(reason or "unknown").inc()
        self.prompt_tokens.inc(prompt)
        self.generation_tokens.inc(completion)
        self.cached_tokens.inc(cached)
        self.e2e.observe(latency)

    def tokens_arrived(self, tokens: int, wait_s: float) -> None:
        """`tokens` new tokens of a sample after `wait_s` since its previous token."""
        for _ in range(tokens):
            self.itl.observe(wait_s / tokens)

    def error(self, kind: str) -> None:
        """One failed or aborted request (`errors.error_kind` names the kind of a status)."""
        self.errors.labels(kind).inc()

    def render(self, scheduler: dict[str, Any] | None) -> bytes:
        """The exposition text, with the scheduler's numbers as just fetched (None: left out)."""
        self.scheduler.latest = scheduler
        return generate_latest(self.registry)


# (metric, documentation, key of the scheduler's reply)
_SCHEDULER_GAUGES = (
    ("weft:num_running_reqs", "requests in the running batch", "num_running"),
    ("weft:num_queue_reqs", "requests waiting to be scheduled", "num_waiting"),
    (
        "weft:num_grammar_queue_reqs",
        "requests waiting for their grammar to compile",
        "num_grammar_waiting",
    ),
    ("weft:max_total_num_tokens", "KV pool size in tokens", "kv_total"),
    (
        "weft:num_used_tokens",
        "KV slots in use: neither free nor evictable prefix cache",
        "kv_used",
    ),
    ("weft:num_cached_tokens", "KV slots held by the prefix cache", "kv_cached"),
)
_SCHEDULER_COUNTERS = (
    (
        "weft:num_retracted_requests",
        "requests retracted (their KV freed) to let the others decode",
        "num_retractions",
    ),
    (
        "weft:num_aborted_requests",
        "requests the scheduler aborted (abort_request, a client gone)",
        "num_aborted",
    ),
    (
        "weft:grammar_cache_hits",
        "constrained requests whose compiled grammar was cached when they came",
        "grammar_cache_hits",
    ),
    (
        "weft:spec_verify_ct",
        "forwards that verified a speculative draft, counted per request",
        "spec_verify_ct",
    ),
    (
        "weft:spec_draft_tokens",
        "speculative draft tokens verified (past a grammar's forced tokens)",
        "spec_draft_tokens",
    ),
    (
        "weft:spec_accepted_tokens",
        "speculative draft tokens the model kept",
        "spec_accepted_tokens",
    ),
)


class SchedulerStats:
    """A collector serving the scheduler's reply to `GetMetrics` (see
    `SchedulerService.metrics`) in SGLang's metric names."""

    def __init__(self) -> None:
        self.latest: dict[str, Any] | None = None

    def collect(self) -> Iterator[Metric]:
        s = self.latest
        if s is None:
            return
        for name, documentation, key in _SCHEDULER_GAUGES:
            yield GaugeMetricFamily(name, documentation, value=s[key])
        yield GaugeMetricFamily(
            "weft:token_usage",
            "num_used_tokens / max_total_num_tokens",
            value=s["kv_used"] / s["kv_total"],
        )
        for name, documentation, key in _SCHEDULER_COUNTERS:
            yield CounterMetricFamily(name, documentation, value=s[key])
        served = CounterMetricFamily(
            "weft:grammar_requests",
            "constrained requests by the grammar backend that served them",
            labels=["backend"],
        )
        for backend, count in sorted(s["grammar_served_by"].items()):
            served.add_metric([backend], count)
        yield served
        yield _histogram(
            "weft:grammar_compilation_time_seconds",
            "grammar compile time per constrained request (near 0 on a cache hit)",
            s["grammar_compile_s"],
        )
        yield _histogram(
            "weft:grammar_mask_time_seconds",
            "time filling the grammar token masks, per step with constrained requests",
            s["grammar_mask_s"],
        )


def _histogram(name: str, documentation: str, snapshot: dict[str, Any]) -> Metric:
    """A Prometheus histogram from a `BucketCounts.snapshot()`."""
    buckets = []
    cumulative = 0
    for bound, count in zip([*snapshot["bounds"], float("inf")], snapshot["counts"], strict=True):
        cumulative += count
        buckets.append((floatToGoString(bound), cumulative))
    return HistogramMetricFamily(name, documentation, buckets=buckets, sum_value=snapshot["sum"])
