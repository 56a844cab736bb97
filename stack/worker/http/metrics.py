"""``/metrics``: SGLang's Prometheus gauges and counters plus the emulator's own.

SGLang's names (``sglang:*``) are what dashboards and the router's scrapers expect (the TTFT and
per-request TPOT histograms too: :mod:`stack.worker.latency`); the ``smetric_worker_*`` series
split hits into local and global tier and count the PD hand-offs.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse, Response

from stack.worker.load import rank_load
from stack.worker.request_path import Worker

_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def render_metrics(w: Worker) -> str:
    """The exposition text (one labelled sample per series)."""
    e = w.engine
    c = e.c
    lab = f'{{model_name="{w.s.model}",worker="{w.s.name}",mode="{w.s.mode}"}}'
    ld = rank_load(e)
    rows: list[tuple[str, str, str, float]] = [
        ("sglang:num_running_reqs", "gauge", "running requests", ld["num_running_reqs"]),
        ("sglang:num_queue_reqs", "gauge", "waiting requests", ld["num_waiting_reqs"]),
        ("sglang:num_used_tokens", "gauge", "tokens held by the prefix cache", ld["num_used_tokens"]),
        ("sglang:token_usage", "gauge", "cache usage ratio", ld["token_usage"]),
        ("sglang:cache_hit_rate", "gauge", "cached / prompt tokens", ld["cache_hit_rate"]),
        ("sglang:prompt_tokens_total", "counter", "prompt tokens", c.prompt_tokens),
        ("sglang:generation_tokens_total", "counter", "output tokens", c.generation_tokens),
        (
            "sglang:cached_tokens_total",
            "counter",
            "prompt tokens served from a cache (local+global)",
            c.cached_tokens,
        ),
        ("sglang:num_requests_total", "counter", "requests received", c.requests),
        (
            "smetric_worker_cached_tokens_local_total",
            "counter",
            "prompt tokens hit in the local prefix cache",
            c.cached_tokens_local,
        ),
        (
            "smetric_worker_cached_tokens_global_total",
            "counter",
            "prompt tokens read back from the Mooncake global tier",
            c.cached_tokens_global,
        ),
        ("smetric_worker_computed_tokens_total", "counter", "prompt tokens computed", c.computed_tokens),
        (
            "smetric_worker_queued_prefill_seconds",
            "gauge",
            "modelled prefill seconds queued or running",
            ld["queued_prefill_s"],
        ),
        (
            "smetric_worker_store_fetch_pages_total",
            "counter",
            "pages read from the global tier",
            c.store_fetch_pages,
        ),
        (
            "smetric_worker_store_fetch_seconds_total",
            "counter",
            "seconds spent reading the global tier",
            c.store_fetch_seconds,
        ),
        (
            "smetric_worker_store_write_pages_total",
            "counter",
            "pages written to the global tier",
            c.store_write_pages,
        ),
        ("smetric_worker_store_errors_total", "counter", "global-tier errors", c.store_errors),
        (
            "smetric_worker_kv_transfer_bytes_sent_total",
            "counter",
            "KV bytes sent to decode workers",
            c.kv_transfer_bytes_sent,
        ),
        (
            "smetric_worker_kv_transfer_bytes_received_total",
            "counter",
            "KV bytes received from prefill workers",
            c.kv_transfer_bytes_received,
        ),
        (
            "smetric_worker_kv_transfer_verified_total",
            "counter",
            "hand-offs whose bytes matched",
            c.kv_transfer_verified,
        ),
        (
            "smetric_worker_kv_transfer_mismatch_total",
            "counter",
            "hand-offs whose bytes did not match",
            c.kv_transfer_mismatch,
        ),
        (
            "smetric_worker_bootstrap_timeouts_total",
            "counter",
            "PD twins that never arrived",
            c.bootstrap_timeouts,
        ),
        ("smetric_worker_aborted_total", "counter", "aborted requests", c.aborted),
        ("smetric_worker_kv_events_seq", "gauge", "last published KV-event sequence number", e.publisher.seq),
        ("smetric_worker_cache_pages", "gauge", "pages in the prefix cache", len(e.cache)),
        ("smetric_worker_cache_evicted_pages_total", "counter", "pages evicted", e.cache.stats.removed_pages),
    ]
    out = []
    for name, kind, help_, val in rows:
        out.append(f"# HELP {name} {help_}\n# TYPE {name} {kind}\n{name}{lab} {float(val)}")
    out.append(w.latency.exposition(lab[1:-1]))
    return "\n".join(out) + "\n"


def add_metrics_route(app: FastAPI, w: Worker) -> None:
    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(render_metrics(w), media_type=_CONTENT_TYPE)
