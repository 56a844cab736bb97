"""Headroom accounting: where the prompt tokens that miss their TTFT SLO go, and an upper
bound on prefill TPS within SLO tighter than the clairvoyant one (stack/bench/bound.py).

**Records.** With ``Simulator.hr`` set to a list, the batcher (stack/sim/batching.py)
appends one tuple per measured request as its first token is out (:data:`RECORD_FIELDS`):
its trace index, arrival, router hold ``H`` (arrival to dispatch), fetch wait ``Fw``
(dispatch until its global-tier KV is in; 0 without a fetch), the tokens it fetched ``f``,
the tokens it computed ``n``, its prompt ``L``, its TTFT, and ``q_min``: the least queued
prefill seconds on any instance at the moment it was placed. Nothing is recorded (or
computed) when ``hr`` is ``None``.

**Decomposition.** Every measured request's TTFT is the sum of four parts::

    TTFT = H + Fw + Q + C
    C  = own compute: n tokens at context L on an idle instance, in chunks of ``chunk``:
         c_lin*n + c_attn*n*(L - n/2) + c_fwd*ceil(n/chunk)
    F  = own transfer: f / link bandwidth (the part of Fw an idle link would also take)
    B  = Fw - F: link backlog (waiting behind other transfers on its link)
    Q  = TTFT - H - Fw - C: from its KV being in until its first token, beyond its own
         compute: queued behind other work at its instance (and sharing its forwards)
    Qi = min(Q, max(0, Q - q_min)): imbalance, the part of Q that the least loaded instance
         at its placement would not have imposed (an idle one: all of Q); Qq = Q - Qi

(``Q`` is clamped at 0; it is never negative under ``match_at=arrival`` since a forward that
carries other requests is never shorter than the request's own.) ``q_min`` is read when
the request is placed: it prices the placement, not instances that became idle later
while it waited (only a router queue or migration could use those), and it ignores the
reuse the request might lose elsewhere (with a full per-GPU global tier a lost local hit
costs a fetch of ~0.5 s for 120k tokens), so it is an upper estimate of what better
placement would buy.

**Attribution.** A missed request (TTFT > SLO(L)) whose own part ``F + C`` already exceeds
its SLO is *infeasible*: all its tokens go there (no schedule can meet it as served;
``infeasible_ideal`` counts those that could not even with ideal reuse, local). Any other
missed request had the slack ``SLO - F - C`` and lost it to the avoidable parts ``H``
(router), ``B`` (fetch), ``Qq`` (queue) and ``Qi`` (imbalance); its L tokens are split over
them in proportion to their seconds. Proportional, not "the largest part takes all":
the per-cause tokens then add up exactly to the missed tokens, a cause's share does not
jump when two parts are close, and each avoidable second is charged the same. The
largest-part rule is reported beside it (``dominant_*``) as a check. (``other``: a missed
request with no avoidable part, which the decomposition above does not produce; kept so
the split always adds up.)

**The window bound** (:func:`window_bound`). A request meets its SLO only if its prefill
runs inside ``[a, a + SLO(L)]``. Relax the cluster to one pooled machine of speed
``instances`` (any real schedule is one of the pooled machine's, so this only adds
schedules) and charge each request the least GPU time it can take: ``w = c_lin*n +
c_attn*n*(L - n/2) + c_fwd*n/chunk`` (its forward overhead shared by a full chunk), with
``n = L - max(ideal hit, the hit it got)``. Then for every interval ``I``, the requests met
whose whole window lies in ``I`` fit in its capacity: ``sum w_r x_r <= instances*|I|``;
a request whose own compute on an idle instance (``c_fwd`` per chunk) exceeds its SLO has
``x_r = 0``. Maximising the met prompt tokens ``sum L_r x_r`` over ``0 <= x_r <= 1`` under
those constraints for a family of intervals (lengths 5 s .. 2560 s, doubling, each at
offsets of half its length) is a linear program whose optimum is at least that of every
schedule's 0/1 choice, hence of every schedule: dropping constraints (intervals not in the
family, work already queued at an interval's start, requests that must still be served
after missing, one request not being split over instances) only raises it. Divided by the
measurement window, it bounds prefill TPS within SLO *for the arrivals of that run*. In a
closed loop (sessions mode) a different schedule would shift later turns by their TTFT
difference: the bound is over schedules of these arrivals, which is the question here
(what a better scheduler could have made of the same traffic). The clairvoyant bound
ignores when work arrives; this one charges the bursts: the tokens that arrive in any
window beyond what the cluster can compute in it must miss.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from stack.core.cost_model import CostModel

#: the fields of one engine record (``Simulator.hr``), in order
RECORD_FIELDS = ("idx", "arrival", "hold", "fetch_wait", "fetched", "new", "prompt", "ttft", "q_min")
#: the causes a missed request's tokens go to
CAUSES = ("infeasible", "fetch", "queue", "imbalance", "router", "other")
#: interval lengths of the window bound, seconds (each at offsets of half its length)
DEFAULT_LENGTHS = (5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0, 1280.0, 2560.0)


def own_compute(cost: CostModel, chunk: int, n: int, L: int) -> float:
    """Seconds to prefill ``n`` new tokens at context ``L`` alone on an idle instance, in
    chunks of ``chunk`` tokens (one forward overhead per chunk)."""
    if n <= 0:
        return 0.0
    return cost.c_linear * n + cost.c_attn * n * (L - 0.5 * n) + cost.c_fwd * math.ceil(n / chunk)


def least_work(cost: CostModel, chunk: int, n: int, L: int) -> float:
    """The least GPU seconds ``n`` new tokens at context ``L`` take in any schedule: the
    forward overhead shared by a full chunk (the clairvoyant bound's charge)."""
    if n <= 0:
        return 0.0
    return cost.c_linear * n + cost.c_attn * n * (L - 0.5 * n) + cost.c_fwd * n / chunk


@dataclass
class Split:
    """Missed prompt tokens and seconds per cause (:data:`CAUSES`) over a run's records."""

    tokens: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CAUSES, 0.0))
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CAUSES, 0.0))
    dominant: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CAUSES, 0.0))
    requests: int = 0
    missed: int = 0
    missed_tokens: float = 0.0
    met_tokens: float = 0.0
    infeasible_ideal: float = 0.0  # of the infeasible tokens: infeasible even with ideal local reuse
    imbalance_idle: float = 0.0  # of the imbalance tokens: those placed while an instance was idle


def attribute(
    records: Sequence[tuple],
    cost: CostModel,
    chunk: int,
    link_bw: float,
    slo: Any,
    ideal: Sequence[int] | None = None,
) -> Split:
    """The split of missed tokens (module docstring) over ``records`` (:data:`RECORD_FIELDS`);
    ``link_bw``: a link's tokens per second; ``slo``: has ``ttft(L)``; ``ideal``: per trace
    request, the tokens an ideal cache would hit (for ``infeasible_ideal``)."""
    out = Split()
    tok, sec, dom = out.tokens, out.seconds, out.dominant
    for idx, _a, hold, fwait, fetched, n, L, ttft, qmin in records:
        out.requests += 1
        s = slo.ttft(L)
        if ttft <= s:
            out.met_tokens += L
            continue
        out.missed += 1
        out.missed_tokens += L
        C = own_compute(cost, chunk, n, L)
        F = fetched / link_bw if fetched and link_bw > 0 else 0.0
        if F + C > s:
            tok["infeasible"] += L
            sec["infeasible"] += ttft - s
            dom["infeasible"] += L
            if ideal is not None:
                ni = L - max(ideal[idx], L - n)
                if own_compute(cost, chunk, ni, L) > s:
                    out.infeasible_ideal += L
            continue
        B = fwait - F if fwait > F else 0.0
        Q = ttft - hold - fwait - C
        if Q < 0.0:
            Q = 0.0
        Qi = Q - qmin if Q > qmin else 0.0
        parts = (("router", hold), ("fetch", B), ("queue", Q - Qi), ("imbalance", Qi))
        A = hold + B + Q
        if A <= 0.0:
            tok["other"] += L
            dom["other"] += L
            continue
        best = max(parts, key=lambda p: p[1])[0]
        dom[best] += L
        for name, v in parts:
            if v > 0.0:
                tok[name] += L * v / A
                sec[name] += v
        if Qi > 0.0 and qmin <= 0.0:
            out.imbalance_idle += L * Qi / A
    return out


def window_bound(
    records: Sequence[tuple],
    cost: CostModel,
    chunk: int,
    slo: Any,
    instances: float,
    ideal: Sequence[int] | None = None,
    lengths: Sequence[float] = DEFAULT_LENGTHS,
) -> dict[str, float]:
    """The window bound (module docstring) over the requests of ``records``: the most prompt
    tokens any schedule of these arrivals could serve within SLO (``tokens``), beside the
    prompt tokens of the individually feasible requests (``feasible_tokens``, the bound
    with no capacity limit). An LP (scipy's HiGHS); ``lengths``: the interval lengths."""
    import numpy as np
    from scipy.optimize import linprog
    from scipy.sparse import csr_matrix

    a_l, d_l, w_l, L_l = [], [], [], []
    doomed = 0.0  # least work of the individually infeasible requests
    for idx, a, _h, _fw, _f, n, L, _t, _q in records:
        s = slo.ttft(L)
        nl = L - max(ideal[idx], L - n) if ideal is not None else n
        if own_compute(cost, chunk, nl, L) > s:
            doomed += least_work(cost, chunk, nl, L)
            continue  # individually infeasible: x = 0
        a_l.append(a)
        d_l.append(a + s)
        w_l.append(least_work(cost, chunk, nl, L))
        L_l.append(float(L))
    feasible = float(sum(L_l))
    if not L_l:
        return {"tokens": 0.0, "feasible_tokens": 0.0, "intervals": 0, "work_s": 0.0, "doomed_work_s": doomed}
    a = np.asarray(a_l)
    d = np.asarray(d_l)
    w = np.asarray(w_l)
    t0 = float(a.min())
    rows: list[np.ndarray] = []
    cols: list[np.ndarray] = []
    caps: list[float] = []
    base = 0
    ridx = np.arange(len(a))
    for ell in lengths:
        if ell <= 0:
            raise ValueError("interval lengths must be > 0")
        h = ell / 2.0
        kmax = np.floor((a - t0) / h).astype(np.int64)  # last interval starting by a
        n_int = int(kmax.max()) + 1
        for back in range(3):
            k = kmax - back
            ok = (k >= 0) & (t0 + k * h + ell >= d)
            rows.append(base + k[ok])
            cols.append(ridx[ok])
        caps.extend([instances * ell] * n_int)
        base += n_int
    r = np.concatenate(rows)
    c = np.concatenate(cols)
    A = csr_matrix((w[c], (r, c)), shape=(base, len(a)))
    used = np.unique(r)  # intervals holding no whole window constrain nothing
    A = A[used]
    b = np.asarray(caps)[used]
    res = linprog(-np.asarray(L_l), A_ub=A, b_ub=b, bounds=(0.0, 1.0), method="highs")
    if res.status != 0:
        raise RuntimeError(f"window bound: the LP failed ({res.message})")
    return {
        "tokens": float(-res.fun),
        "feasible_tokens": feasible,
        "intervals": int(len(used)),
        "work_s": float(w.sum()),
        "doomed_work_s": doomed,
    }


def summarize(
    split: Split, bound: dict[str, float] | None, span: float, metrics: dict, clairvoyant_within: float | None
) -> dict[str, Any]:
    """One run's headroom row: TPS within SLO, bounds, missed tokens/s per cause and share,
    the tail figures beside them."""
    span = max(span, 1e-9)
    row: dict[str, Any] = {
        "policy": metrics.get("policy"),
        "dispatch": metrics.get("dispatch"),
        "session_rate": metrics.get("session_rate"),
        "rate_scale": metrics.get("rate_scale"),
        "prefill_tps_within_slo": metrics.get("prefill_tps_within_slo"),
        "prefill_tps": metrics.get("prefill_tps"),
        "slo_attainment": metrics.get("slo_attainment"),
        "ttft_p99": metrics.get("ttft_p99"),
        "over_5x_slo": metrics.get("over_5x_slo"),
        "gpu_utilization": metrics.get("gpu_utilization"),
        "rejected_measured": metrics.get("rejected_measured", 0),
        "clairvoyant_within_slo": clairvoyant_within,
        "requests": split.requests,
        "missed_requests": split.missed,
        "missed_tps": split.missed_tokens / span,
        "infeasible_ideal_tps": split.infeasible_ideal / span,
        "imbalance_idle_tps": split.imbalance_idle / span,
    }
    if bound is not None:
        row["window_bound_tps"] = bound["tokens"] / span
        row["feasible_offered_tps"] = bound["feasible_tokens"] / span
        row["window_bound_intervals"] = bound["intervals"]
        tight = bound["tokens"] / span
        if clairvoyant_within is not None:
            tight = min(tight, clairvoyant_within)
        row["tighter_bound_tps"] = tight
    mt = split.missed_tokens or 1.0
    for c in CAUSES:
        row[f"missed_{c}_tps"] = split.tokens[c] / span
        row[f"missed_{c}_share"] = split.tokens[c] / mt
        row[f"dominant_{c}_share"] = split.dominant[c] / mt
        row[f"late_{c}_s_mean"] = split.seconds[c] / split.missed if split.missed else 0.0
    return row


def run_headroom(
    trace: Any,
    policy: str,
    cfg: Any,
    load: Any,
    ideal: Sequence[int] | None = None,
    clairvoyant_within: float | None = None,
    lengths: Sequence[float] | None = DEFAULT_LENGTHS,
    progress: Any = None,
    keep: list | None = None,
    oracle: bool = False,
) -> dict[str, Any]:
    """Simulate ``policy`` on ``trace`` (``cfg``: a SimConfig, ``load``: a LoadSpec) with
    per-request records and return its headroom row (:func:`summarize`); ``lengths``
    ``None``: no window bound; ``keep``: a list to extend with the records; ``oracle``: add
    the greedy offline schedule's TPS within SLO (stack/sim/oracle.py; achievable, not a bound)."""
    from stack.sim.engine import Simulator

    sim = Simulator(trace, policy, cfg, load)
    sim.hr = []
    res = sim.run(progress=progress)
    m = res.metrics
    records = sim.hr
    if keep is not None:
        keep.extend(records)
    split = attribute(records, sim.cost, sim.chunk, sim.fetch_bw_est, cfg.slo, ideal)
    bound = None
    span = m["duration_s"]
    if lengths is not None:
        bound = window_bound(records, sim.cost, sim.chunk, cfg.slo, cfg.instances, ideal, lengths)
    row = summarize(split, bound, span, m, clairvoyant_within)
    if bound is not None:
        # the least work of the feasible / doomed requests as shares of the cluster over the
        # window; and a steady-state variant (not a strict bound): every interval's capacity
        # less the doomed requests' average work rate, as if their work were spread evenly
        cap = cfg.instances * max(span, 1e-9)
        row["feasible_work_share"] = bound["work_s"] / cap
        row["doomed_work_share"] = d = bound["doomed_work_s"] / cap
        if d < 1.0:
            st = window_bound(records, sim.cost, sim.chunk, cfg.slo, cfg.instances * (1 - d), ideal, lengths)
            row["window_bound_steady_tps"] = st["tokens"] / max(span, 1e-9)
    if oracle:
        from stack.sim.oracle import oracle_schedule

        o = oracle_schedule(records, sim.cost, sim.chunk, sim.fetch_bw_est, cfg.slo, cfg.instances)
        row["oracle_tps_within_slo"] = o["met_tokens"] / max(m["duration_s"], 1e-9)
        row["oracle_attainment"] = o["met_requests"] / o["requests"] if o["requests"] else float("nan")
    return row
