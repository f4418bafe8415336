"""Prometheus metrics of one server (its own registry: no process-global state)."""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

_LATENCY_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "weft:num_requests",
            "finished requests by finish reason",
            ["finish_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter("weft:prompt_tokens", "prompt tokens", registry=r)
        self.generation_tokens = Counter("weft:generation_tokens", "generated tokens", registry=r)
        self.cached_tokens = Counter(
            "weft:cached_tokens", "prompt tokens served from the prefix cache", registry=r
        )
        self.running = Gauge("weft:num_running_reqs", "requests in flight", registry=r)
        self.ttft = Histogram(
            "weft:time_to_first_token_seconds",
            "time to first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "weft:e2e_request_latency_seconds",
            "request latency",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    def request_done(
        self, prompt: int, completion: int, cached: int, latency: float, reason: str
    ) -> None:
        self.requests.labels(reason or "unknown").inc()
        self.prompt_tokens.inc(prompt)
        self.generation_tokens.inc(completion)
        self.cached_tokens.inc(cached)
        self.e2e.observe(latency)

    def render(self) -> bytes:
        return generate_latest(self.registry)
