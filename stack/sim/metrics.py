"""A simulator run's metrics: the figures ``smetric sim`` writes, from the run's tally
(stack/sim/tally.py) and the state its engine ends in.

:func:`result` builds the metrics of every run (the groups below, in this order: the run,
TTFT and SLO, KV reuse and fetches, utilization, the router's queue, the client model,
session slowdown (stack/sim/sessions.py), the run's own cost);
PD colocation adds what it measures (TPOT, output tokens:
:func:`stack.sim.colocated.decode_metrics`). What a run hands over is :class:`RunRecord`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

from stack.sim.config import SimConfig, SimResult
from stack.sim.instance import Instance, Link
from stack.sim.load import LoadSpec, rate_of
from stack.sim.sessions import SessionClock
from stack.sim.tally import Tally
from stack.stats import percentile
from stack.traces.model import Trace


class RunRecord(Protocol):
    """What a finished run hands to :func:`result` (the engine's state at its end)."""

    cfg: SimConfig
    trace: Trace
    policy: Any
    load: LoadSpec
    insts: list[Instance]
    links: list[Link]
    tally: Tally
    queue: Any  # stack.sim.queues.RouterQueue: its replicas' dispatchers (``disps``)
    end_time: float
    w_start: float
    w_end: float
    sessions: SessionClock


def imbalance(insts: Sequence[Instance], window_s: float, w_start: float, w_end: float) -> list[float]:
    """Per window of ``window_s`` seconds over the measurement window: the busiest instance's
    mean queue length (running + waiting) over the instances' mean; windows with no load left out."""
    imb: list[float] = []
    w_lo = int(w_start // window_s)
    w_hi = int(math.ceil(w_end / window_s))
    n = len(insts)
    for w in range(w_lo, w_hi):
        loads = [inst.area.get(w, 0.0) / window_s for inst in insts]
        mean = sum(loads) / n
        if mean > 0:
            imb.append(max(loads) / mean)
    return imb


def result(sim: RunRecord, wall: float, uspan: float, imb: list[float]) -> SimResult:
    """The metrics of a finished run (``sim.w_end`` closed, the instances' load integrated);
    ``uspan``: the seconds utilization is over, ``imb``: :func:`imbalance`."""
    span = max(sim.w_end - sim.w_start, 1e-9)
    metrics = {
        **_run(sim, span),
        **_ttft(sim, span, imb),
        **_reuse(sim),
        **_utilization(sim, uspan),
        **_queue(sim),
        **_clients(sim),
        **sim.sessions.metrics(),
        "sim_end_s": sim.end_time,
        "sim_wall_s": wall,
        "sim_requests_per_s": sim.tally.served / wall if wall > 0 else float("nan"),
    }
    return SimResult(metrics=metrics, ttfts=sim.tally.ttfts, imbalance=imb)


def _run(sim: RunRecord, span: float) -> dict:
    """What ran: trace, policy, cluster, load, and how many requests were served."""
    cfg = sim.cfg
    gt = cfg.global_tier
    return {
        "trace": sim.trace.name,
        "policy": sim.policy.name,
        "instances": len(sim.insts),
        "hardware": cfg.hardware.name,
        "global_tier": gt.mode if gt.mode != "sized" else str(gt.capacity_tokens),
        "link": cfg.link,
        "load_mode": sim.load.mode,
        "session_rate": None if sim.load.mode == "compress" else round(rate_of(sim.load, sim.trace), 6),
        "rate_scale": sim.load.rate_scale,
        "requests": sim.tally.requests,
        "requests_total": sim.tally.served,
        "duration_s": span,
    }


def _ttft(sim: RunRecord, span: float, imb: list[float]) -> dict:
    """Throughput within the TTFT SLO, attainment, the TTFT distribution, load imbalance."""
    t = sim.tally
    ttfts = sorted(t.ttfts)
    # attainment counts a rejected (measured) request as a miss, and with the client model one
    # that failed after its retries; none without bounds
    admitted = t.requests + t.rejected_measured + t.failed
    imb_sorted = sorted(imb)
    return {
        "prefill_tps_within_slo": t.prompt_met / span,
        "prefill_tps": t.prompt / span,
        "slo_attainment": t.met / admitted if admitted else float("nan"),
        "ttft_p50": percentile(ttfts, 0.5),
        "ttft_p90": percentile(ttfts, 0.9),
        "ttft_p99": percentile(ttfts, 0.99),
        "ttft_mean": sum(ttfts) / len(ttfts) if ttfts else float("nan"),
        "ttft_max": ttfts[-1] if ttfts else float("nan"),
        "imbalance_mean": sum(imb) / len(imb) if imb else float("nan"),
        "imbalance_p99": percentile(imb_sorted, 0.99),
    }


def _reuse(sim: RunRecord) -> dict:
    """KV reuse by tier, the routing decisions' kinds, global-tier fetches and writes."""
    t = sim.tally
    prompt = max(1, t.prompt)
    return {
        "reuse_total": (t.local + t.glob) / prompt,
        "reuse_local": t.local / prompt,
        "reuse_global": t.glob / prompt,
        "computed_tokens": t.computed,
        "prompt_tokens": t.prompt,
        "reused_tokens": t.local + t.glob,
        "sticks": t.sticks,
        "migrations": t.migrations,
        "first_turns": t.first_turns,
        "evicted_followups": t.evicted_followups,
        "balanced": t.balanced,
        "match_at": sim.cfg.match_at,
        "global_write": sim.cfg.global_write,
        "fetch_tokens": t.fetch_tokens,
        "fetch_requests": t.fetch_requests,
        "fetch_wait_s": t.fetch_wait_s,
        "fetch_wait_mean_s": t.fetch_wait_s / t.requests if t.requests else 0.0,
        "fetch_wait_per_fetch_s": t.fetch_wait_s / t.fetch_requests if t.fetch_requests else 0.0,
        "write_tokens": sum(lk.write_tokens for lk in sim.links),
        "rematch_short": t.rematch_short,
        "rematch_short_tokens": t.rematch_short_tokens,
    }


def _utilization(sim: RunRecord, uspan: float) -> dict:
    """Over the measurement window (busy time inside it / its length); ``*_run``: the whole
    simulated span, warm-up and drain included."""
    links, insts = sim.links, sim.insts
    n = len(insts)
    end = max(sim.end_time, 1e-9)
    return {
        "link_utilization": sum(lk.busy_w for lk in links) / (len(links) * uspan),
        "gpu_utilization": sum(i.busy_w for i in insts) / (n * uspan),
        "link_utilization_run": sum(lk.busy_s for lk in links) / (len(links) * end),
        "gpu_utilization_run": sum(i.busy_s for i in insts) / (n * end),
    }


def _clients(sim: RunRecord) -> dict:
    """The client model's figures (``SimConfig.clients``; nothing without it), over the
    measured requests (by their first attempt): attempts sent, retries among them, overload
    answers and timeouts met, requests that failed after their retries (refused or timed out
    on the last attempt), and answers computed for a client that had already given up."""
    cm = sim.cfg.clients
    if cm is None:
        return {}
    t = sim.tally
    failed = t.rejected_measured + t.failed
    unique = t.requests + failed
    return {
        "clients": cm.describe(),
        "attempts": t.attempts,
        "retries": t.attempts - unique,
        "refusals": t.refusals,
        "timeouts": t.timeouts,
        "failed_after_retries": failed,
        "failed_share": failed / unique if unique else float("nan"),
        "abandoned_served": t.abandoned_served,
    }


def _queue(sim: RunRecord) -> dict:
    """The router's queue (the dispatch order): the TTFT tail, waits, deferrals, rejections."""
    t = sim.tally
    nreq = t.requests
    qwaits = sorted(t.qwaits)
    cs = [d.counters for d in sim.queue.disps]
    return {
        "dispatch": sim.cfg.dispatch.label(),
        # measured requests whose TTFT exceeded 2x / 5x their SLO (the tail that deadline
        # orders may buy their gain with), as shares of the measured requests served
        "over_2x_slo": t.over_2x / nreq if nreq else float("nan"),
        "over_5x_slo": t.over_5x / nreq if nreq else float("nan"),
        "queue_wait_mean": sum(qwaits) / len(qwaits) if qwaits else float("nan"),
        "queue_wait_p50": percentile(qwaits, 0.5),
        "queue_wait_p99": percentile(qwaits, 0.99),
        "queue_wait_max": qwaits[-1] if qwaits else float("nan"),
        # the longest a refused request waited before its overload answer (0: none refused)
        "rejected_wait_max": t.rejected_wait_max,
        "queue_depth_max": t.queue_depth_max,
        "deferrals": sum(c.deferrals for c in cs),
        "aged": sum(c.aged for c in cs),
        "dispatch_replicas": len(sim.queue.disps),
        "rejected": t.rejected,
        # of those, queued requests shed at max_queue for a newcomer worth more
        "shed": sum(c.shed for c in cs),
        # retries of requests refused for their wait, released at their bound (Dispatcher)
        "overdue": sum(c.overdue for c in cs),
        "rejected_measured": t.rejected_measured,
        "requests_issued": t.issued,
    }
