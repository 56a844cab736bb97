"""Prometheus metrics of the router (one registry per app, so tests can run several).

The Grafana dashboard in deploy/grafana/ reads these and the workers' (docs/operate/monitoring.md,
"Dashboard"); tests/e2e/test_dashboard.py holds every panel to data from a real Prometheus.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from stack.pool import Worker

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)
_OVERHEAD_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5)
_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)

#: the kinds of ``smetric_errors_total``: the request was malformed (bad_request) or too large
#: (too_large), its client left (cancelled), no healthy worker could take it (no_worker), the
#: dispatch queue refused it (overloaded), a worker refused it (upstream: its 4xx passed on), or
#: workers failed on both tries (bad_gateway)
ERROR_KINDS = ("bad_request", "too_large", "cancelled", "no_worker", "overloaded", "upstream", "bad_gateway")


class RouterMetrics:
    """The router's counters, gauges and histograms, on a registry of its own."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("smetric_requests", "requests received", ["endpoint", "status"], registry=r)
        self.decisions = Counter("smetric_decisions", "routing decisions", ["policy", "kind"], registry=r)
        self.prompt_tokens = Counter("smetric_prompt_tokens", "prompt tokens routed", registry=r)
        self.local_hit_tokens = Counter(
            "smetric_local_hit_tokens", "prompt tokens cached on the chosen worker", registry=r
        )
        self.global_hit_tokens = Counter(
            "smetric_global_hit_tokens", "prompt tokens found in the global tier", registry=r
        )
        self.local_hit_ratio = Gauge(
            "smetric_local_hit_ratio", "local hit tokens / prompt tokens (cumulative)", registry=r
        )
        self.queued_tokens = Gauge(
            "smetric_worker_queued_tokens", "queued prefill tokens", ["worker"], registry=r
        )
        self.queued_seconds = Gauge(
            "smetric_worker_queued_seconds", "queued prefill seconds (estimated)", ["worker"], registry=r
        )
        self.inflight = Gauge("smetric_worker_inflight", "requests in flight", ["worker", "role"], registry=r)
        self.healthy = Gauge(
            "smetric_worker_healthy", "1 if the worker is admitted", ["worker", "role"], registry=r
        )
        self.draining = Gauge(
            "smetric_worker_draining",
            "1 while the worker drains (no new requests; removed once idle: POST /admin/workers/drain)",
            ["worker", "role"],
            registry=r,
        )
        self.index_blocks = Gauge(
            "smetric_worker_index_blocks", "blocks in the worker's prefix index", ["worker"], registry=r
        )
        self.ttft = Histogram(
            "smetric_ttft_seconds",
            "time to first token as seen by the router",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.overhead = Histogram(
            "smetric_routing_seconds",
            "router time before dispatch (parse, tokenize, route)",
            buckets=_OVERHEAD_BUCKETS,
            registry=r,
        )
        self.session_hints = Counter(
            "smetric_session_hints",
            "hinted requests (an agent's session id): same prefill worker as the session's previous one"
            " (agree), another (disagree), or a new session (first)",
            ["source", "outcome"],
            registry=r,
        )
        self.retries = Counter("smetric_retries", "requests retried on another prefill worker", registry=r)
        self.disconnects = Counter(
            "smetric_client_disconnects",
            "clients gone before their request body was read (front-door body timeouts included), by endpoint",
            ["endpoint"],
            registry=r,
        )
        self.stale_retries = Counter(
            "smetric_stale_retries",
            "calls to workers sent again on a fresh connection after a stale pooled one failed",
            registry=r,
        )
        self.upstream_errors = Counter(
            "smetric_upstream_errors", "failed upstream calls", ["role"], registry=r
        )
        self.stream_errors = Counter(
            "smetric_stream_errors",
            "streamed answers that ended with an error event after their first token (a worker's "
            "own, passed on, or the router's when a worker failed mid-stream)",
            registry=r,
        )
        self.ejections = Counter(
            "smetric_ejections", "workers ejected by health checks or failures", registry=r
        )
        self.kv_events = Counter(
            "smetric_kv_event_batches", "KV event batches applied", ["worker"], registry=r
        )
        self.kv_gaps = Counter(
            "smetric_kv_event_gaps", "KV event sequence gaps (index dropped)", ["worker"], registry=r
        )
        self.kv_lag = Histogram(
            "smetric_kv_event_lag_seconds",
            "KV-event lag: from the worker stamping a batch to the router applying it to its index",
            ["worker"],
            buckets=_LAG_BUCKETS,
            registry=r,
        )
        self.errors = Counter(
            "smetric_errors",
            "requests answered with an error, by endpoint and kind",
            ["endpoint", "kind"],
            registry=r,
        )
        self.slo_requests = Counter(
            "smetric_slo_requests",
            "streamed requests whose first token came within the router's TTFT SLO (met=true) or not",
            ["met"],
            registry=r,
        )
        self.prompt_tokens_within_slo = Counter(
            "smetric_prompt_tokens_within_slo",
            "prompt tokens of streamed requests whose first token came within the TTFT SLO "
            "(its rate: prefill TPS within SLO)",
            registry=r,
        )
        self._slo = (self.slo_requests.labels("true"), self.slo_requests.labels("false"))
        self._prompt = 0
        self._local = 0

    def record_hit(self, prompt: int, local: int, global_: int) -> None:
        self.prompt_tokens.inc(prompt)
        self.local_hit_tokens.inc(local)
        self.global_hit_tokens.inc(global_)
        self._prompt += prompt
        self._local += local
        if self._prompt:
            self.local_hit_ratio.set(self._local / self._prompt)

    def record_slo(self, prompt_tokens: int, met: bool) -> None:
        """A streamed request's first token: within its TTFT SLO (``met``) or not."""
        if met:
            self._slo[0].inc()
            self.prompt_tokens_within_slo.inc(prompt_tokens)
        else:
            self._slo[1].inc()

    def kv_batch(self, worker: str, ts: float) -> None:
        """A KV-event batch of ``worker`` (its URL), stamped ``ts`` (epoch seconds) by the worker,
        was applied: counted, and its lag observed (a clock behind the router's counts 0)."""
        self.kv_events.labels(worker).inc()
        if ts > 0:  # a batch with no stamp has no lag to tell
            self.kv_lag.labels(worker).observe(max(0.0, time.time() - ts))

    def update_workers(self, workers: Iterable[Worker], index_blocks: Callable[[int], int]) -> None:
        """Set the per-worker gauges from the pool (at scrape time: they are not kept
        current on the hot path). ``index_blocks``: a prefill worker's blocks in the
        prefix index, by worker id."""
        for w in workers:
            self.healthy.labels(w.url, w.role).set(1 if w.healthy else 0)
            self.draining.labels(w.url, w.role).set(0 if w.draining_until is None else 1)
            self.inflight.labels(w.url, w.role).set(w.inflight)
            if w.role == "prefill":
                self.queued_tokens.labels(w.url).set(w.queued_tokens)
                self.queued_seconds.labels(w.url).set(w.queued_seconds)
                self.index_blocks.labels(w.url).set(index_blocks(w.wid))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
