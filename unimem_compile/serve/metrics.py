"""``/metrics``: the server's Prometheus metrics (prometheus-client), one registry per app.

Engine gauges are read at scrape time from :meth:`EngineClient.metrics` by a custom collector, so a scrape
shows the engine as it is, not as of the last request. Names (docs/serve.md lists them with their labels):

* ``unimem_requests_running``, ``unimem_requests_waiting``: the engine's requests in a step / queued.
* ``unimem_arena_bytes{side="kv"|"state"|"free"|"reserved"}``, ``unimem_arena_capacity_bytes``: the unified
  arena; the four sides add up to the capacity exactly (``reserved``: the sink page and the tail pad).
* ``unimem_engine_tokens_per_second``: the engine's output rate since it started; ``unimem_preemptions_total``;
  ``unimem_engine_requests_total{outcome="finished"|"failed"|"cancelled"}``.
* ``unimem_output_tokens_per_second``: tokens the server delivered over the last 10 s, per second.
* ``unimem_http_requests_total{endpoint, status}``, ``unimem_prompt_tokens_total``,
  ``unimem_generation_tokens_total``, ``unimem_time_to_first_token_seconds``,
  ``unimem_request_duration_seconds`` (histograms), ``unimem_server_ready`` (1 once warm).
"""

from __future__ import annotations

import collections
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["ServerMetrics", "RATE_WINDOW_S"]

#: seconds over which ``unimem_output_tokens_per_second`` averages
RATE_WINDOW_S = 10.0

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ServerMetrics:
    """The registry and the server-side instruments. ``state`` is the app's :class:`ServerState`
    (read at scrape time: its ``engine`` may appear only once the model is loaded)."""

    def __init__(self, state):
        self.registry = CollectorRegistry()
        self.http_requests = Counter("unimem_http_requests", "HTTP requests answered", ["endpoint", "status"],
                                     registry=self.registry)
        self.prompt_tokens = Counter("unimem_prompt_tokens", "prompt tokens of admitted requests",
                                     registry=self.registry)
        self.generation_tokens = Counter("unimem_generation_tokens", "tokens generated and delivered",
                                         registry=self.registry)
        self.ttft = Histogram("unimem_time_to_first_token_seconds", "request arrival to first text sent",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.duration = Histogram("unimem_request_duration_seconds", "request arrival to last text sent",
                                  buckets=_LATENCY_BUCKETS, registry=self.registry)
        self._recent: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self.registry.register(_EngineCollector(state, self))

    def delivered(self, n_tokens: int) -> None:
        """Count ``n_tokens`` tokens sent to a client now."""
        if n_tokens <= 0:
            return
        self.generation_tokens.inc(n_tokens)
        now = time.monotonic()
        with self._lock:
            self._recent.append((now, n_tokens))
            self._trim(now)

    def _trim(self, now: float) -> None:
        while self._recent and now - self._recent[0][0] > RATE_WINDOW_S:
            self._recent.popleft()

    def output_tokens_per_s(self) -> float:
        now = time.monotonic()
        with self._lock:
            self._trim(now)
            return sum(n for _, n in self._recent) / RATE_WINDOW_S


class _EngineCollector:
    def __init__(self, state, metrics: ServerMetrics):
        self.state, self.metrics = state, metrics

    def collect(self):
        ready = GaugeMetricFamily("unimem_server_ready", "1 once the model is compiled and warm")
        ready.add_metric([], 1.0 if self.state.ready else 0.0)
        yield ready
        rate = GaugeMetricFamily("unimem_output_tokens_per_second",
                                 f"tokens delivered to clients over the last {RATE_WINDOW_S:g} s, per second")
        rate.add_metric([], self.metrics.output_tokens_per_s())
        yield rate
        engine = self.state.engine
        if engine is None:
            return
        m = engine.metrics()
        for name, doc, value in (("unimem_requests_running", "requests in the engine's steps", m.running),
                                 ("unimem_requests_waiting", "requests queued for admission", m.waiting),
                                 ("unimem_arena_capacity_bytes", "bytes of the unified arena", m.total_bytes),
                                 ("unimem_engine_tokens_per_second", "the engine's output tokens per second",
                                  m.tokens_per_s)):
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], float(value))
            yield g
        arena = GaugeMetricFamily("unimem_arena_bytes", "arena bytes per side (kv pages, state slots, free gap, "
                                  "reserved: sink and tail pad); the sides add up to the capacity", labels=["side"])
        for side, value in (("kv", m.kv_bytes), ("state", m.state_bytes), ("free", m.free_bytes),
                            ("reserved", m.reserved_bytes)):
            arena.add_metric([side], float(value))
        yield arena
        pre = CounterMetricFamily("unimem_preemptions", "running requests preempted (memory freed, recomputed)")
        pre.add_metric([], float(m.preemptions))
        yield pre
        outcomes = {k: m.extra[k] for k in ("finished", "failed", "cancelled") if k in m.extra}
        if outcomes:
            ended = CounterMetricFamily("unimem_engine_requests", "engine requests ended, by outcome",
                                        labels=["outcome"])
            for outcome, value in outcomes.items():
                ended.add_metric([outcome], float(value))
            yield ended
