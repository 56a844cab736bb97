"""An oracle schedule: an offline, greedy schedule of one run's arrivals that knows every
request's cost. It is *achievable* under the simplifications below, not a bound: it shows
what a scheduler with that knowledge makes of the same traffic (stack/sim/headroom.py has
the bounds).

Input: a run's headroom records (stack/sim/headroom.py, ``RECORD_FIELDS``): arrival, prompt
``L``, tokens computed ``n`` and fetched ``f`` as that run served them. The schedule:

- each request costs what it cost in the run on an idle instance: its own transfer
  ``f / bandwidth`` (no link backlog), then ``n`` tokens in chunks of ``chunk``, each chunk
  ``c_fwd + c_lin*k + c_attn*k*(end - k/2)`` (alone in its forward: batching would only
  save forward overheads);
- at its arrival it goes to the instance with the least queued work of *feasible* requests
  (those that can still meet their SLO), hopeless ones to the instance with the least
  queued work overall;
- between forwards an instance runs the next chunk of the ready request with the earliest
  deadline among those that can still meet it; a request that can no longer meet its
  deadline runs only when none that can is ready (SGLang's priority scheduling is
  non-preemptive between forwards, as here).

Simplifications (why it is labelled achievable only in the model): the hit a request got in
the run is assumed available on whichever instance it lands (true of the global tier's part
with a full global tier, at the cost of fetching the local part, which is not charged), link
backlog is ignored, and the arrivals are the run's own (open loop).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import Any

from stack.core.cost_model import CostModel


class _Req:
    __slots__ = ("a", "L", "rem", "pos", "dl", "ready", "inst", "hopeless", "est")


def _chunk_cost(cost: CostModel, k: int, end: int) -> float:
    return cost.c_fwd + cost.c_linear * k + cost.c_attn * k * (end - 0.5 * k)


def _remaining(cost: CostModel, chunk: int, r: _Req) -> float:
    """Seconds of ``r``'s remaining chunks alone on an instance."""
    if r.rem <= 0:
        return 0.0
    n = r.rem
    return cost.c_linear * n + cost.c_attn * n * (r.L - 0.5 * n) + cost.c_fwd * math.ceil(n / chunk)


def oracle_schedule(
    records: Sequence[tuple], cost: CostModel, chunk: int, link_bw: float, slo: Any, instances: int
) -> dict[str, float]:
    """Run the greedy schedule (module docstring) over ``records``; returns the met prompt
    tokens (``met_tokens``), all prompt tokens (``tokens``), met requests and requests."""
    reqs: list[_Req] = []
    for _idx, a, _h, _fw, f, n, L, _t, _q in sorted(records, key=lambda r: r[1]):
        r = _Req()
        r.a, r.L, r.rem, r.pos = a, L, n, L - n
        r.dl = a + slo.ttft(L)
        r.ready = a + (f / link_bw if f and link_bw > 0 else 0.0)
        r.hopeless = False
        r.est = 0.0
        reqs.append(r)
    queues: list[list] = [[] for _ in range(instances)]  # heaps of (hopeless, deadline, seq, req)
    feas_q = [0.0] * instances  # queued seconds of feasible requests
    all_q = [0.0] * instances
    busy = [False] * instances
    free_at = [0.0] * instances  # end of the forward in flight
    ev: list = []  # (time, seq, kind, payload): 0 = arrival, 1 = instance free / wake
    seq = 0
    for r in reqs:
        seq += 1
        ev.append((r.a, seq, 0, r))
    heapq.heapify(ev)
    met = met_tok = tokens = 0.0
    wake = [math.inf] * instances

    def start(i: int, now: float) -> None:
        """Form instance ``i``'s next forward: ready requests that can still meet their
        deadline, earliest first, up to the chunk budget; only if there is none, the
        hopeless one with the earliest deadline."""
        nonlocal seq
        q = queues[i]
        aside = []
        batch: list[tuple[_Req, int]] = []
        budget = chunk
        t = cost.c_fwd
        while q and budget > 0:
            item = heapq.heappop(q)
            r = item[3]
            if r.ready > now:
                aside.append(item)
                continue
            if not r.hopeless and now + _remaining(cost, chunk, r) > r.dl:
                r.hopeless = True  # can no longer meet it: behind every request that can
                feas_q[i] -= r.est
                seq += 1
                heapq.heappush(q, (True, r.dl, seq, r))
                continue
            if r.hopeless and batch:
                aside.append(item)  # never in a forward with one that can still make it
                break
            k = r.rem if r.rem < budget else budget
            t += cost.c_linear * k + cost.c_attn * k * (r.pos + k - 0.5 * k)
            batch.append((r, k))
            budget -= k
            if r.hopeless:
                break
        for item in aside:
            heapq.heappush(q, item)
        if not batch:
            early = min((it[3].ready for it in aside), default=math.inf)
            if early < wake[i]:
                wake[i] = early
                seq += 1
                heapq.heappush(ev, (early, seq, 1, i))
            return
        busy[i] = True
        free_at[i] = now + t
        seq += 1
        heapq.heappush(ev, (now + t, seq, 2, (i, batch)))

    while ev:
        now, _, kind, obj = heapq.heappop(ev)
        if kind == 0:
            r = obj
            tokens += r.L
            r.est = _remaining(cost, chunk, r)
            r.hopeless = r.ready + r.est > r.dl
            loads = all_q if r.hopeless else feas_q
            i = min(range(instances), key=lambda j: max(free_at[j] - now, 0.0) + loads[j])
            r.inst = i
            all_q[i] += r.est
            if not r.hopeless:
                feas_q[i] += r.est
            seq += 1
            heapq.heappush(queues[i], (r.hopeless, r.dl, seq, r))
            if not busy[i]:
                start(i, now)
        elif kind == 1:
            i = obj
            if wake[i] <= now:
                wake[i] = math.inf
                if not busy[i]:
                    start(i, now)
        else:
            i, batch = obj
            busy[i] = False
            for r, k in batch:
                r.rem -= k
                r.pos += k
                est = _remaining(cost, chunk, r)
                all_q[i] += est - r.est
                if not r.hopeless:
                    feas_q[i] += est - r.est
                r.est = est
                if r.rem > 0:
                    seq += 1
                    heapq.heappush(queues[i], (r.hopeless, r.dl, seq, r))
                elif now <= r.dl:
                    met += 1
                    met_tok += r.L
            start(i, now)
    return {"met_tokens": met_tok, "tokens": tokens, "met_requests": met, "requests": float(len(reqs))}
