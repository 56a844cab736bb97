"""`smetric trace-stats PATH`: does this workload look agentic? The paper's findings (§3)
for any trace in the agentic or the Mooncake format.

- ideal reuse ratio: share of prompt tokens in blocks an infinite block-level prefix
  cache already holds (requests in arrival order; Finding 1);
- intra-session share of reuse: reused blocks first written by the same session
  (Finding 2); first-turn share of requests, their reuse ratio and share of all reuse
  (Finding 3);
- reuse interval: for each reused block, seconds since the last request that carried it
  (arrival to arrival; the trace has no completion times), p50 / p90 and the share within
  100 s, weighted by tokens (Finding 4);
- SLO feasibility: share of requests (and of prompt tokens) whose own prefill on an idle
  instance, with ideal reuse / cold, fits the TTFT SLO ``b + a*L`` under the calibration;
  the rest can never meet it, whatever the routing;
- session token skew: share of prompt tokens of the top 10% / 25% sessions, Gini (Finding 5);
- balance profile (Finding 6): all requests replayed in arrival order on N instances, each
  to the instance with the fewest in-flight tokens (prompt + output of the requests on it),
  staying for its prefill (cost model, ideal reuse) plus decode (output x TPOT); per
  one-minute window, the most loaded instance's time-averaged tokens over the mean.

Example::

    smetric trace-stats stack/data/claude_code_agentic.jsonl.gz --json out/stats.json
"""

from __future__ import annotations

import argparse
import heapq
import math
import sys
from pathlib import Path

import numpy as np

from stack.core.cost_model import Hardware, load_hardware
from stack.core.types import SLO
from stack.kv_tier.prefix_cache import PrefixCache
from stack.traces.load import load_trace
from stack.traces.model import Trace


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__
    p.add_argument("path", help="trace file (agentic or Mooncake JSONL, .gz ok)")
    p.add_argument("--format", default="auto", choices=["auto", "agentic", "mooncake"], help="trace format")
    p.add_argument(
        "--shared-prefix",
        action="store_true",
        help="agentic traces: map each session's tools + system prompt blocks to one shared key (optimistic)",
    )
    p.add_argument(
        "--json", default=None, metavar="FILE", help="also write the statistics as JSON here ('-' = stdout)"
    )
    p.add_argument(
        "--instances", type=int, default=32, help="instances of the balance-profile replay (Finding 6)"
    )
    p.add_argument(
        "--hardware", default="h20", help="calibration for the balance-profile replay's execution times"
    )
    p.add_argument("--window", type=float, default=60.0, help="balance-profile window in seconds")
    p.add_argument(
        "--slo-b", type=float, default=1.0, help="TTFT SLO fixed budget b in seconds (feasibility)"
    )
    p.add_argument(
        "--slo-a", type=float, default=0.0625, help="TTFT SLO per-token budget in seconds per 1k tokens"
    )


def _q(sorted_vals, q: float) -> float | None:
    n = len(sorted_vals)
    if n == 0:
        return None
    x = (n - 1) * q
    lo = int(x)
    hi = min(lo + 1, n - 1)
    return float(sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (x - lo))


def _wq(values: np.ndarray, weights: np.ndarray, q: float) -> float | None:
    """Weighted quantile."""
    if values.size == 0 or weights.sum() <= 0:
        return None
    order = np.argsort(values, kind="stable")
    v = values[order]
    c = np.cumsum(weights[order])
    k = int(np.searchsorted(c, q * c[-1], side="left"))
    return float(v[min(k, v.size - 1)])


def gini(x: list[float]) -> float:
    a = np.sort(np.asarray(x, dtype=float))
    n = a.size
    if n == 0 or a.sum() <= 0:
        return 0.0
    cum = np.cumsum(a)
    return float((n + 1 - 2 * (cum.sum() / cum[-1])) / n)


def reuse_stats(trace: Trace) -> tuple[dict, list[int]]:
    """Ideal reuse, provenance and intervals. Returns (stats, per-request hit tokens)."""
    bs = trace.block_size
    cache = PrefixCache(None)
    seg: dict[int, list[tuple[int, int]]] = {}  # owner -> [(end_block, writer session)]
    last: dict[int, float] = {}  # owner -> last time a request carried it
    hits = [0] * len(trace.requests)
    prompt = reused = intra = 0
    first_n = first_prompt = first_reused = 0
    intervals: list[float] = []
    weights: list[int] = []
    for r in sorted(trace.requests, key=lambda r: (r.timestamp, r.idx)):
        L = r.input_len
        prompt += L
        h_blocks = cache.hit(r.path) if r.path else 0
        h = min(h_blocks * bs, max(0, L - 1))
        hits[r.idx] = h
        reused += h
        if r.turn <= 1:
            first_n += 1
            first_prompt += L
            first_reused += h
        # attribute the hit blocks to their writers and to their last use
        left = h_blocks
        for owner, start, end in r.path:
            if left <= 0 or start >= h_blocks:
                break
            e = min(end, h_blocks)
            n = e - start
            if n <= 0:
                continue
            dt = r.timestamp - last.get(owner, r.timestamp)
            intervals.append(max(0.0, dt))
            weights.append(n)
            prev_end = start
            for seg_end, sess in seg.get(owner, ()):
                a, b = max(prev_end, start), min(seg_end, e)
                if b > a and sess == r.session:
                    intra += b - a
                prev_end = seg_end
                if seg_end >= e:
                    break
            left -= n
        if r.path:
            for owner, _start, end in r.path:
                s = seg.get(owner)
                if s is None:
                    seg[owner] = [(end, r.session)]
                elif end > s[-1][0]:
                    s.append((end, r.session))
                last[owner] = r.timestamp
            cache.insert(r.path)
    iv = np.asarray(intervals, dtype=float)
    w = np.asarray(weights, dtype=float) * bs
    within = float(w[iv <= 100.0].sum() / w.sum()) if w.size and w.sum() > 0 else None
    n_req = len(trace.requests)
    blocks_reused = sum(weights)
    stats = {
        "ideal_reuse_ratio": reused / prompt if prompt else 0.0,
        "intra_session_share_of_reuse": intra / blocks_reused if blocks_reused else None,
        "first_turn_share_of_requests": first_n / n_req if n_req else 0.0,
        "first_turn_reuse_ratio": first_reused / first_prompt if first_prompt else None,
        "first_turn_share_of_reuse": first_reused / reused if reused else None,
        "reuse_interval_p50_s": _wq(iv, w, 0.5),
        "reuse_interval_p90_s": _wq(iv, w, 0.9),
        "reuse_within_100s_share": within,
    }
    return stats, hits


def skew_stats(trace: Trace) -> dict:
    tok = sorted((sum(trace.requests[i].input_len for i in s) for s in trace.sessions), reverse=True)
    total = sum(tok) or 1
    n = len(tok)

    def top(frac: float) -> float:
        k = max(1, math.ceil(frac * n))
        return sum(tok[:k]) / total

    return {
        "sessions": n,
        "single_request_sessions_share": sum(1 for s in trace.sessions if len(s) == 1) / n if n else 0.0,
        "top10pct_sessions_token_share": top(0.10),
        "top25pct_sessions_token_share": top(0.25),
        "session_token_gini": gini(tok),
        "session_tokens_p50": _q(sorted(tok), 0.5),
        "session_tokens_max": tok[0] if tok else 0,
    }


def balance_profile(trace: Trace, hits: list[int], hw: Hardware, instances: int, window: float) -> dict:
    """Finding 6: least in-flight tokens placement; max/mean tokens per window."""
    if instances <= 0:
        raise ValueError("--instances must be > 0")
    if window <= 0:
        raise ValueError("--window must be > 0")
    c = hw.cost
    tpot = hw.decode_tpot_s
    load = [0] * instances
    heap: list[tuple[float, int, int]] = []  # (end, instance, tokens)
    area: dict[int, np.ndarray] = {}
    reqs = sorted(trace.requests, key=lambda r: (r.timestamp, r.idx))
    t0 = reqs[0].timestamp if reqs else 0.0

    def add(inst: int, a: float, b: float, tokens: int) -> None:
        w0, w1 = int((a - t0) // window), int((b - t0) // window)
        for w in range(w0, w1 + 1):
            lo = max(a, t0 + w * window)
            hi = min(b, t0 + (w + 1) * window)
            if hi > lo:
                arr = area.get(w)
                if arr is None:
                    arr = area[w] = np.zeros(instances)
                arr[inst] += tokens * (hi - lo)

    arrivals: dict[int, int] = {}
    for r in reqs:
        now = r.timestamp
        while heap and heap[0][0] <= now:
            _, i, tok = heapq.heappop(heap)
            load[i] -= tok
        i = min(range(instances), key=load.__getitem__)
        tok = r.input_len + r.output_len
        dur = c.cost(r.input_len - hits[r.idx], r.input_len) + r.output_len * tpot
        load[i] += tok
        heapq.heappush(heap, (now + dur, i, tok))
        add(i, now, now + dur, tok)
        w = int((now - t0) // window)
        arrivals[w] = arrivals.get(w, 0) + 1
    ratios = []
    for arr in area.values():
        m = arr.mean()
        if m > 0:
            ratios.append(float(arr.max() / m))
    ratios.sort()
    per_window = sorted(arrivals.values())
    return {
        "instances": instances,
        "window_s": window,
        "windows": len(ratios),
        "imbalance_p50": _q(ratios, 0.5),
        "imbalance_p90": _q(ratios, 0.9),
        "imbalance_max": ratios[-1] if ratios else None,
        "arrivals_per_window_per_instance_mean": (sum(per_window) / len(per_window) / instances)
        if per_window
        else None,
        "arrivals_per_window_per_instance_p10": (_q(per_window, 0.1) or 0) / instances
        if per_window
        else None,
    }


def feasibility(trace: Trace, hits: list[int], hw: Hardware, slo: SLO) -> dict:
    c = hw.cost
    ok = ok_tok = cold = 0
    tot = sum(r.input_len for r in trace.requests) or 1
    for r in trace.requests:
        L = r.input_len
        lim = slo.ttft(L)
        if c.cost(L - hits[r.idx], L) <= lim:
            ok += 1
            ok_tok += L
        if c.cost(L, L) <= lim:
            cold += 1
    n = max(1, len(trace.requests))
    return {
        "slo_feasible_request_share": ok / n,
        "slo_feasible_token_share": ok_tok / tot,
        "slo_feasible_cold_request_share": cold / n,
    }


def trace_stats(
    trace: Trace, instances: int = 32, hardware: str = "h20", window: float = 60.0, slo: SLO | None = None
) -> dict:
    reqs = trace.requests
    hw = load_hardware(hardware)
    ins = sorted(r.input_len for r in reqs)
    outs = [r.output_len for r in reqs]
    ts = [r.timestamp for r in reqs]
    reuse, hits = reuse_stats(trace)
    return {
        "trace": trace.name,
        "format": trace.fmt,
        "block_size": trace.block_size,
        "requests": len(reqs),
        "span_s": (max(ts) - min(ts)) if ts else 0.0,
        "has_global_clock": trace.has_global_clock,
        "input_mean": sum(ins) / len(ins) if ins else 0.0,
        "input_p50": _q(ins, 0.5),
        "input_p99": _q(ins, 0.99),
        "output_mean": sum(outs) / len(outs) if outs else 0.0,
        **reuse,
        **feasibility(trace, hits, hw, slo or SLO()),
        **skew_stats(trace),
        "balance_profile": balance_profile(trace, hits, hw, instances, window),
    }


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.4g}" if abs(v) < 1e5 else f"{v:,.0f}"
    return f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else str(v)


def run(args: argparse.Namespace) -> int:
    if args.instances <= 0:
        raise ValueError("--instances must be > 0")
    if args.window <= 0:
        raise ValueError("--window must be > 0")
    if args.slo_b < 0 or args.slo_a < 0:
        raise ValueError("--slo-b and --slo-a must be >= 0")
    trace = load_trace(args.path, fmt=args.format, shared_prefix=args.shared_prefix)
    stats = trace_stats(
        trace, args.instances, args.hardware, args.window, SLO(b=args.slo_b, a=args.slo_a / 1000.0)
    )
    from rich.console import Console
    from rich.table import Table

    console = Console(stderr=args.json == "-")
    t = Table(title=f"trace-stats {Path(args.path).name}", title_justify="left")
    t.add_column("statistic")
    t.add_column("value", justify="right")
    for k, v in stats.items():
        if isinstance(v, dict):
            for k2, v2 in v.items():
                t.add_row(f"{k}.{k2}", _fmt(v2))
        else:
            t.add_row(k, _fmt(v))
    console.print(t)
    if args.json:
        from stack.commands.output import write_json

        p = write_json(stats, args.json, numpy=True)
        if p is not None:
            print(f"wrote {p}", file=sys.stderr)
    return 0
