"""The PD hand-off, measured (``smetric calibrate --handoff ROUTER``): what a client waits for
its first token beyond the prefill the calibration already prices.

Through a router in front of a PD pool, one request at a time, fresh random prompts of
``L`` tokens (geometric lengths) go to native ``/generate``, streamed, one output token; each
is timed on this side from the request's send to its first token frame (divided by the
emulated pool's time factor). The prefill's share is the calibration's own
``cost(L, L)``; the rest, ``residual(L) = ttft - cost(L, L)``, is the hand-off as the
simulator charges it: the decode worker's bootstrap, the KV transfer, its first forward and
the HTTP hops, plus whatever else the prefill model leaves out on an idle pool (the prompt's
parse, the router's own work).

The fit: ``residual(L) = bootstrap_s + L * per_token`` by non-negative least squares of the
relative error over one figure per length (the fastest of its repeats: a wall clock, which a
busy host only lengthens), with every ``holdout_every``-th length held out and scored. A
client clock cannot tell the fixed terms apart, nor the KV transfer from the path's other
per-token costs: the fixed part is written as ``bootstrap_s``, the per-token part as
``transfer_gbps`` (the link rate that would explain all of it at the calibration's
``kv_bytes_per_token``), ``first_step`` off and ``hop_s`` 0.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import httpx
import numpy as np
import orjson

from stack.calibrate.design import geometric
from stack.calibrate.measure import MeasureError
from stack.core.cost_model import CostModel, HandoffCost, Hardware, quantile_at
from stack.core.fit import LinearFit, Sample, fit_linear, mape

HANDOFF_TERMS = ("bootstrap_s", "per_token_s")
#: quantiles a recorded hand-off's spread is written as (0, 5%, ..., 100%)
SPREAD_POINTS = 21


@dataclass(frozen=True, slots=True)
class HandoffPoint:
    """A design point: a prompt of ``tokens`` tokens, measured ``repeats`` times."""

    index: int
    tokens: int
    holdout: bool


@dataclass(frozen=True, slots=True)
class HandoffFit:
    """The fitted terms, the fit of the residual, and the held-out error of the whole first
    token (prefill + hand-off) against the measured one."""

    handoff: HandoffCost
    fit: LinearFit
    ttft_holdout_mape: float
    ttft_prefill_only_mape: float  # the same points priced without the hand-off

    def as_dict(self) -> dict:
        h = self.handoff
        return {
            "bootstrap_s": h.bootstrap_s,
            "transfer_gbps": h.transfer_gbps,
            "per_token_s": self.fit.coef[1],
            "spread_p10_p50_p90_s": _spread_summary(h.spread_s),
            "between_forwards": h.between_forwards,
            "residual_holdout_mape": self.fit.holdout_mape,
            "residual_train_mape": self.fit.train_mape,
            "ttft_holdout_mape": self.ttft_holdout_mape,
            "ttft_holdout_mape_without_handoff": self.ttft_prefill_only_mape,
            "train_points": self.fit.n_train,
            "holdout_points": self.fit.n_holdout,
        }


def handoff_design(lo: int, hi: int, levels: int, holdout_every: int) -> list[HandoffPoint]:
    """``levels`` prompt lengths from ``lo`` to ``hi``; every ``holdout_every``-th held out
    (never the shortest or the longest: the fit keeps the whole range)."""
    lengths = geometric(max(1, lo), max(lo, hi), max(2, levels))
    out = []
    for i, n in enumerate(lengths):
        hold = holdout_every > 0 and (i + 1) % holdout_every == 0 and 0 < i < len(lengths) - 1
        out.append(HandoffPoint(i, n, hold))
    return out


def first_token_s(c: httpx.Client, url: str, ids: list[int]) -> float:
    """Seconds from sending a streamed one-token ``/generate`` on ``ids`` to its first token."""
    body = orjson.dumps(
        {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True},
            "stream": True,
        }
    )
    t0 = time.perf_counter()
    try:
        with c.stream(
            "POST", url + "/generate", content=body, headers={"content-type": "application/json"}
        ) as r:
            if r.status_code != 200:
                raise MeasureError(
                    f"/generate through the router answered {r.status_code}: {r.read()[:300]!r}"
                )
            for line in r.iter_lines():
                if line.startswith("data:") and line.strip() != "data: [DONE]":
                    return time.perf_counter() - t0
    except httpx.HTTPError as e:
        raise MeasureError(f"/generate through the router: {type(e).__name__}: {e}") from None
    raise MeasureError("/generate through the router answered no token frame")


def measure(
    c: httpx.Client,
    url: str,
    design: list[HandoffPoint],
    repeats: int,
    fresh: Callable[[int], list[int]],
    time_factor: float,
    step: Callable[[str], None] = lambda s: None,
) -> list[Sample]:
    """Each point ``repeats`` times, one request at a time: ``Sample((L,), ttft)``, modelled
    seconds (wall / ``time_factor``)."""
    out = []
    for p in design:
        for _ in range(repeats):
            wall = first_token_s(c, url, fresh(p.tokens))
            out.append(Sample((float(p.tokens),), wall / time_factor, p.index, p.holdout))
            step(f"hand-off L={p.tokens}")
    return out


def fit_handoff(ttfts: list[Sample], cost: CostModel, kv_bytes_per_token: int) -> HandoffFit:
    """The hand-off's terms from first-token times, the prefill priced by ``cost``."""
    residual = [replace(s, seconds=max(1e-6, s.seconds - cost.cost(s.x[0], s.x[0]))) for s in ttfts]
    fit = fit_linear(residual, lambda x: [1.0, x[0]], HANDOFF_TERMS, "min")
    fixed, per_token = fit.coef
    h = _cost(fixed, per_token, kv_bytes_per_token)
    # the whole first token, on the held-out lengths (fastest repeat each, as fitted)
    best: dict[int, Sample] = {}
    for s in ttfts:
        if s.holdout and (s.point not in best or s.seconds < best[s.point].seconds):
            best[s.point] = s
    held = list(best.values())
    measured = [s.seconds for s in held]
    prefill = [cost.cost(s.x[0], s.x[0]) for s in held]
    whole = [p + fixed + per_token * s.x[0] for p, s in zip(prefill, held, strict=True)]
    return HandoffFit(h, fit, mape(measured, whole), mape(measured, prefill))


def _cost(
    fixed: float, per_token: float, kv_bytes_per_token: int, spread: tuple[float, ...] = ()
) -> HandoffCost:
    """The fitted line as the calibration's terms: the fixed part as ``bootstrap_s``, the
    per-token part as the link rate that would explain it (module docstring)."""
    gbps = kv_bytes_per_token * 8.0 / (per_token * 1e9) if per_token > 0 else 0.0
    return HandoffCost(bootstrap_s=fixed, transfer_gbps=gbps, spread_s=spread)


def between_forwards(f: HandoffFit) -> HandoffFit:
    """``f`` for a pool whose prefill workers hand over between forwards (SGLang's PD prefill
    loop: ``HandoffCost.between_forwards``)."""
    return replace(f, handoff=replace(f.handoff, between_forwards=True))


def with_handoff(hw: Hardware, f: HandoffFit) -> Hardware:
    return replace(hw, handoff=f.handoff)


def describe(f: HandoffFit) -> str:
    def pct(x: float) -> str:
        return "-" if math.isnan(x) else f"{100 * x:.1f}%"

    h = f.handoff
    rate = f"{h.transfer_gbps:.3g} Gbit/s" if h.transfer_gbps else "no per-token part"
    return (
        f"hand-off: {1000 * h.bootstrap_s:.1f} ms fixed + {1e6 * f.fit.coef[1]:.2f} us per prompt token "
        f"({rate} at the calibration's KV bytes per token); first token held-out MAPE "
        f"{pct(f.ttft_holdout_mape)} on {f.fit.n_holdout} points ({pct(f.ttft_prefill_only_mape)} "
        "priced without the hand-off)" + ("; handed over between forwards" if h.between_forwards else "")
    )


# -- from a recording: the path beyond the prefill, as the router's own traffic paid it ---------


@dataclass(frozen=True, slots=True)
class RecordedFirst:
    """One recorded request's first token, in the pool's seconds: ``ttft`` as the router saw it,
    ``before`` the part the simulator prices itself (its wait in the router's queue, the prefill
    worker's queue and forwards), ``tokens`` its prompt."""

    tokens: int
    ttft: float
    before: float

    @property
    def beyond(self) -> float:
        return self.ttft - self.before


def _behind_another(lines: list[dict]) -> set[int]:
    """The indices of the lines whose request reached the router while another request on the
    same prefill worker had not yet had its first token. SGLang's PD prefill worker takes a new
    request into its queue only between forwards (its bootstrap queue holds it meanwhile), so
    such a request may have waited behind the other's forward without the wait showing in its
    ``prefill_queue_s``: it shows in what follows the prefill, which the simulator prices as
    queueing already."""
    spans: dict[str, list[tuple[float, float, int]]] = {}
    for i, r in enumerate(lines):
        ts, ttft, w = r.get("timestamp"), r.get("ttft_ms"), r.get("prefill")
        if isinstance(ts, int | float) and isinstance(ttft, int | float) and w:
            spans.setdefault(str(w), []).append((float(ts), float(ts) + float(ttft), i))
    out: set[int] = set()
    for rows in spans.values():
        rows.sort()
        end = -math.inf  # the latest first token among the earlier arrivals
        for ts, done, i in rows:
            if ts < end:
                out.add(i)
            if done > end:
                end = done
    return out


def recorded_firsts(lines: list[dict]) -> list[RecordedFirst]:
    """The lines of a recording (``router.record``) that time a PD first token: answered
    (``ok``), streamed (a non-streamed answer's time is its whole answer), a decode worker in
    the pair, and the prefill worker's own timing read (``router.cost_model`` observe or
    learn), leaving out a request that arrived while another on its prefill worker was still
    on its way to its first token (:func:`_behind_another`). Each time in the pool's seconds
    (the line's ``time_factor``)."""
    out = []
    behind = _behind_another(lines)
    for i, r in enumerate(lines):
        if r.get("outcome") != "ok" or not r.get("stream") or not r.get("decode") or i in behind:
            continue
        ttft, fwd = r.get("ttft_ms"), r.get("prefill_forward_s")
        if not isinstance(ttft, int | float) or not isinstance(fwd, int | float):
            continue
        tf = float(r.get("time_factor") or 1.0)
        wait = float(r.get("router_wait_ms") or 0.0) / 1000.0 / tf
        before = wait + float(r.get("prefill_queue_s") or 0.0) + float(fwd)
        tokens = int(r.get("input_length") or 0)
        if tokens > 0:
            out.append(RecordedFirst(tokens, float(ttft) / 1000.0 / tf, before))
    return out


def fit_recorded(
    firsts: list[RecordedFirst], levels: int, holdout_every: int, kv_bytes_per_token: int
) -> HandoffFit:
    """The hand-off's terms from recorded first tokens: ``beyond(L) = bootstrap_s + L *
    per_token`` over ``levels`` geometric bins of the prompt length, each bin its median
    (the typical cost: a recording is traffic, not a quiet sweep, so no fastest repeat),
    every ``holdout_every``-th non-empty bin held out (never the first or the last). The
    held-out error is of the whole first token of each held-out request: its own ``before``
    plus the fitted hand-off, against its ``ttft``."""
    if not firsts:
        raise ValueError(
            "no recorded first token to fit: the recording needs streamed PD requests with the "
            "prefill worker's timing (router.cost_model: observe or learn)"
        )
    lo = min(f.tokens for f in firsts)
    hi = max(f.tokens for f in firsts)
    n = max(2, levels)
    edges = [lo * (hi / lo) ** (i / n) for i in range(1, n)] if hi > lo else []
    bins: dict[int, list[RecordedFirst]] = {}
    for f in firsts:
        bins.setdefault(sum(1 for e in edges if f.tokens >= e), []).append(f)
    order = sorted(bins)
    held_bins = {
        b
        for i, b in enumerate(order)
        if holdout_every > 0 and (i + 1) % holdout_every == 0 and 0 < i < len(order) - 1
    }
    samples = [
        Sample((float(f.tokens),), max(1e-6, f.beyond), b, b in held_bins) for b in order for f in bins[b]
    ]
    fit = fit_linear(samples, lambda x: [1.0, x[0]], HANDOFF_TERMS, "median")
    fixed, per_token = fit.coef
    # the spread: how far the fitted requests' own hand-offs lie from the line
    offsets = [f.beyond - fixed - per_token * f.tokens for b in order if b not in held_bins for f in bins[b]]
    spread = tuple(float(x) for x in np.quantile(offsets, np.linspace(0.0, 1.0, SPREAD_POINTS)))
    held = [f for b in held_bins for f in bins[b]]
    measured = [f.ttft for f in held]
    whole = [f.before + fixed + per_token * f.tokens for f in held]
    return HandoffFit(
        _cost(fixed, per_token, kv_bytes_per_token, spread),
        fit,
        mape(measured, whole),
        mape(measured, [f.before for f in held]),
    )


def _spread_summary(q: tuple[float, ...]) -> list[float] | None:
    """The spread's 10th, 50th and 90th percentiles (None: no spread)."""
    return [quantile_at(q, u) for u in (0.1, 0.5, 0.9)] if len(q) >= 2 else None
