"""The load a worker reports: one DP rank's entry of SGLang's ``/v1/loads``.

``/v1/loads``, the older ``/get_load`` (:mod:`stack.worker.http.routes_status`) and the load
gauges of ``/metrics`` (:mod:`stack.worker.http.metrics`) are all read from this one entry.
"""

from __future__ import annotations

from typing import Any

from stack.worker.engine import Engine


def rank_load(e: Engine) -> dict[str, Any]:
    """The engine's load now: requests running (prefilling, fetching from the global tier,
    handing off or decoding) and waiting, cache use and the modelled prefill seconds queued."""
    sched = e.scheduler
    waiting_uncached = sum(r.remaining for r in sched.waiting)
    running = len(sched.running) + len(sched.fetching) + len(e.decoding)
    used = e.cache.used_tokens
    cap = e.cache.capacity_pages * e.s.page_size
    c = e.c
    hit = c.cached_tokens / c.prompt_tokens if c.prompt_tokens else 0.0
    return {
        "dp_rank": e.s.dp_rank,
        "num_running_reqs": running,
        "num_waiting_reqs": len(sched.waiting),
        "num_waiting_uncached_tokens": waiting_uncached,
        "num_used_tokens": used,
        "num_total_tokens": used + waiting_uncached,
        "max_total_num_tokens": cap,
        "token_usage": round(used / cap, 4) if cap else 0.0,
        "gen_throughput": 0.0,
        "cache_hit_rate": round(hit, 4),
        "utilization": 1.0 if running else 0.0,
        "max_running_requests": 1024,
        "num_total_reqs": running + len(sched.waiting),
        "queued_prefill_s": round(sched.queued_model_s(), 6),
    }
