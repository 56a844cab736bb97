"""The dispatch queue's Prometheus series (``smetric_dispatch_*``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from stack.dispatch import MAX_QUEUE_WAIT, QUEUE_FULL, Dispatcher

_WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64)


class DispatchMetrics:
    def __init__(self, disp: Dispatcher, r: CollectorRegistry) -> None:
        self.depth = Gauge(
            "smetric_dispatch_queue_depth", "requests waiting in the dispatch queue", registry=r
        )
        self.depth.set_function(lambda: disp.counters.depth)
        self.wait = Histogram(
            "smetric_dispatch_queue_wait_seconds",
            "time a request waited in the dispatch queue before it was released",
            buckets=_WAIT_BUCKETS,
            registry=r,
        )
        self.deferrals = Counter(
            "smetric_dispatch_deferrals",
            "queued requests put behind others because they could no longer meet their deadline",
            registry=r,
        )
        self.rejected = Counter(
            "smetric_dispatch_rejected", "requests the dispatch queue refused", ["reason"], registry=r
        )
        for reason in (QUEUE_FULL, MAX_QUEUE_WAIT):  # every reason is a series from the start
            self.rejected.labels(reason)
        self.cancelled = Counter(
            "smetric_dispatch_cancelled", "waiting requests whose client left", registry=r
        )
        self.bypassed = Counter(
            "smetric_dispatch_bypassed",
            "link-bound requests dispatched at once instead of queued (router.dispatch.bypass)",
            registry=r,
        )
        self.overdue = Counter(
            "smetric_dispatch_overdue",
            "retries of requests refused for their wait, routed at their bound instead of refused again",
            registry=r,
        )
        self.unbound = Counter(
            "smetric_dispatch_unbound",
            "released requests routed over every worker, not the ready ones, where those would "
            "fetch what another holds (router.dispatch.affinity)",
            registry=r,
        )
        self.gate = Histogram(
            "smetric_dispatch_gate_seconds",
            "from a request's release to its booking, while no other request is released (the gate)",
            buckets=_WAIT_BUCKETS,
            registry=r,
        )
        self._deferrals_seen = 0

    def sync_deferrals(self, n: int) -> None:
        if n > self._deferrals_seen:
            self.deferrals.inc(n - self._deferrals_seen)
            self._deferrals_seen = n
