"""docs/reference/metrics.md: every metric the router exports, from its Prometheus registry.

The registry is that of a router app built (never served) with every optional part on: API keys
(``router.auth``), the learned cost model (``router.cost_model: learn``), router replicas with the
shared token cache (``router.redis_url``, ``model.path``; nothing connects before the app starts),
the dispatch queue (the default) and the front door. Names are the series Prometheus scrapes:
``prometheus_client`` adds ``_total`` to a counter (and ``_created`` beside it), and ``_bucket``,
``_sum`` and ``_count`` to a histogram.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

from stack.config import parse_config
from stack.reference.markdown import HEADER, code, table, value

#: the env var the metrics' app reads its one client key from (a hash, never a real key)
_KEYS_ENV = "SMETRIC_REFERENCE_KEYS"

#: the series each type exports, by suffix
SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("_sum", "_count"),
    "info": ("_info",),
}


@dataclass(frozen=True)
class Metric:
    name: str
    type: str
    labels: tuple[str, ...]
    help: str
    buckets: tuple[float, ...]

    @property
    def series(self) -> tuple[str, ...]:
        """The names Prometheus scrapes (``_created`` aside)."""
        return tuple(self.name + s for s in SUFFIXES.get(self.type, ("",)))


@contextmanager
def router_registry() -> Iterator[CollectorRegistry]:
    """The registry of a router app with every optional part on (see the module docstring)."""
    from stack.models.tiny import build_tiny_model
    from stack.prefill_router.api.app import create_app

    old = os.environ.get(_KEYS_ENV)
    os.environ[_KEYS_ENV] = "keys: [{name: reference, sha256: '" + "0" * 64 + "'}]"
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model = build_tiny_model(os.path.join(tmp, "model"))
            cfg = parse_config(
                {
                    "model": {"path": str(model)},
                    "router": {
                        "cost_model": "learn",
                        "redis_url": "redis://127.0.0.1:6379/0",
                        "auth": {"keys_env": _KEYS_ENV},
                    },
                }
            )
            app = create_app(cfg)
            state = app.state.router
            try:
                yield state.metrics.registry
            finally:
                tok = state.features.tok
                if tok is not None and tok.shared is not None:
                    tok.shared.close()
    finally:
        if old is None:
            os.environ.pop(_KEYS_ENV, None)
        else:
            os.environ[_KEYS_ENV] = old


def collect(registry: CollectorRegistry) -> list[Metric]:
    """The registry's metrics, sorted by name. prometheus_client lists neither a registry's
    collectors nor a metric's label names publicly; both are read from its attributes here."""
    out = []
    for c in list(registry._collector_to_names):
        if not isinstance(c, MetricWrapperBase):
            raise TypeError(f"{type(c).__name__}: not a metric this page knows how to read")
        buckets = tuple(b for b in getattr(c, "_upper_bounds", ()) if b != float("inf"))
        out.append(Metric(c._name, c._type, tuple(c._labelnames), c._documentation, buckets))
    return sorted(out, key=lambda m: m.name)


def metrics() -> list[Metric]:
    """Every metric the router exports."""
    with router_registry() as reg:
        return collect(reg)


def render() -> str:
    """The page."""
    ms = metrics()
    rows = [
        (
            "<br>".join(code(s) for s in m.series),
            m.type,
            ", ".join(code(label) for label in m.labels),
            m.help + (f" (buckets: {', '.join(value(b) for b in m.buckets)})" if m.buckets else ""),
        )
        for m in ms
    ]
    return "\n".join(
        [
            HEADER,
            "# Metrics reference\n",
            "Every metric the router exports on `GET /metrics` (Prometheus text format), sorted by name: "
            "the series scraped, the type, the labels and the help text. Counters also export "
            "`<name>_created` (histograms too). Some exist only with their feature on: "
            "`smetric_key_*` with client keys (`router.auth`), `smetric_cost_model_*` with "
            "`router.cost_model` observe or learn, `smetric_shared_*` with `router.redis_url` (the token "
            "cache's with `model.path` too), `smetric_dispatch_*` with a dispatch queue. Workers export "
            "their own metrics (SGLang's, or the emulator's); the Grafana dashboard "
            "(`deploy/grafana/stack-dashboard.json`) reads both.\n",
            table(("Series", "Type", "Labels", "Help"), rows),
        ]
    )
