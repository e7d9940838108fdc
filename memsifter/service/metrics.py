"""Prometheus metrics of one service instance (``GET /metrics``, text exposition format).

A registry per instance (not the process-global one), so that several instances in one process (tests)
do not collide. Under Ray Serve each replica answers ``/metrics`` with its own counts; Serve's own
metrics (queue lengths, replica counts) are exported by Ray's metrics agent.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0)


class ServiceMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("memsifter_serve_requests", "HTTP requests by route and status code",
                                ["route", "code"], registry=r)
        self.latency = Histogram("memsifter_serve_request_seconds", "request latency by route", ["route"],
                                 buckets=BUCKETS, registry=r)
        self.errors = Counter("memsifter_serve_errors", "requests answered with an error, by route and kind "
                              "(client: 4xx, server: 5xx)", ["route", "kind"], registry=r)
        self.queries = Counter("memsifter_serve_queries", "queries answered, by mode", ["mode"], registry=r)
        self.fallbacks = Counter("memsifter_serve_ranker_fallbacks", "ranked queries answered by the first stage "
                                 "instead (ranker error, timeout or unparsable answer)", ["reason"], registry=r)
        self.corpora = Gauge("memsifter_serve_index_corpora", "corpora served (published haystacks + user "
                             "memories loaded)", ["kind"], registry=r)
        self.sessions = Gauge("memsifter_serve_index_sessions", "sessions indexed", ["kind"], registry=r)
        self.units = Gauge("memsifter_serve_index_units", "unit vectors held for the dense leg", registry=r)
        self.reloads = Counter("memsifter_serve_index_reloads", "index loads by outcome", ["outcome"], registry=r)
        self.appended = Counter("memsifter_serve_memory_sessions_appended", "sessions added to user memories",
                                registry=r)
        self.query_batch = Histogram("memsifter_serve_query_batch_size", "queries per encoder forward pass",
                                     buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
