"""Live against simulated: the knee a run is set at, run-to-run spread, the live/sim gaps and a
one-line verdict. Pure functions over metric dicts (``stack.replay.metrics.summarize`` and the
simulator's ``metrics``, which share their keys)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

#: the figures compared live against simulated, with their tolerance (relative gap) at the
#: default settings: TPS within SLO within 10%, TTFT p50 within 15%
TOLERANCE = {"prefill_tps_within_slo": 0.10, "ttft_p50": 0.15}
#: a lead below this (relative) is a tie
TIE = 0.02
FIGURES = ("prefill_tps_within_slo", "slo_attainment", "ttft_p50", "ttft_p90", "ttft_p99", "over_5x_slo")


@dataclass(frozen=True)
class Knee:
    rate: float  # session starts per modelled second
    attainment: float  # the best baseline's there
    target: float  # the attainment it was chosen for
    ceiling: float  # the best baseline's best attainment on the grid (light load)
    baseline: str  # the policy that set it


def knee_rate(
    attainment: Callable[[str, float], float],
    baselines: Sequence[str],
    rates: Sequence[float],
    share: float = 0.9,
) -> Knee:
    """The highest rate of ``rates`` (ascending) at which the best of ``baselines`` still keeps
    ``share`` of the attainment it reaches at its best on the grid (light load): the knee of
    the attainment curve, where scheduling starts to matter. ``attainment(policy, rate)``."""
    if not baselines or not rates:
        raise ValueError("knee_rate needs at least one baseline and one rate")
    best = {r: max((attainment(b, r), b) for b in baselines) for r in rates}
    ceiling = max(a for a, _ in best.values())
    target = share * ceiling
    ok = [r for r in rates if best[r][0] >= target]
    r = max(ok) if ok else min(rates)
    return Knee(rate=r, attainment=best[r][0], target=target, ceiling=ceiling, baseline=best[r][1])


@dataclass(frozen=True)
class Spread:
    mean: float | None
    lo: float | None
    hi: float | None
    n: int

    @property
    def rel(self) -> float | None:
        """Half the range relative to the mean (run-to-run spread as +-%)."""
        if self.mean in (None, 0) or self.lo is None or self.hi is None:
            return None
        return (self.hi - self.lo) / 2 / abs(self.mean)


def spread(values: Sequence[float | None]) -> Spread:
    xs = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not xs:
        return Spread(None, None, None, 0)
    return Spread(statistics.fmean(xs), min(xs), max(xs), len(xs))


def gap(live: float | None, sim: float | None) -> float | None:
    """live / sim - 1 (None when either is missing or sim is 0)."""
    if live is None or sim is None or sim == 0:
        return None
    return live / sim - 1


def summarize_runs(live_runs: Sequence[dict], sim: dict | None) -> dict:
    """Per figure: the live runs' spread, the simulator's value and the gap of the live mean."""
    out: dict = {}
    for k in FIGURES:
        s = spread([r.get(k) for r in live_runs])
        v = None if sim is None else sim.get(k)
        out[k] = {
            "live_mean": s.mean,
            "live_min": s.lo,
            "live_max": s.hi,
            "live_spread": s.rel,
            "sim": v,
            "gap": gap(s.mean, v),
        }
    out["errors"] = sum(int(r.get("errors") or 0) for r in live_runs)
    out["runs"] = len(live_runs)
    return out


def winner(by_policy: dict[str, float | None]) -> tuple[str, float | None]:
    """The policy with the highest value and its lead over the runner-up (ratio)."""
    vals = {p: v for p, v in by_policy.items() if v is not None}
    if not vals:
        return "-", None
    order = sorted(vals, key=lambda p: vals[p], reverse=True)
    if len(order) < 2 or not vals[order[1]]:
        return order[0], None
    return order[0], vals[order[0]] / vals[order[1]]


def within_tolerance(summary: dict) -> dict[str, bool | None]:
    out: dict[str, bool | None] = {}
    for k, tol in TOLERANCE.items():
        g = summary[k]["gap"]
        out[k] = None if g is None else abs(g) <= tol
    return out


def verdict(runs: dict[str, list[dict]], sims: dict[str, dict] | None) -> str:
    """One line: who wins live (by mean TPS within SLO), by how much, beside P99 TTFT and the
    share past 5x the SLO; the simulator's winner; whether they agree; repeats won."""
    key = "prefill_tps_within_slo"
    means = {p: spread([r.get(key) for r in rs]).mean for p, rs in runs.items()}
    w, lead = winner(means)
    if w == "-":
        return "verdict: no live figures"
    n = max(len(rs) for rs in runs.values())
    won = sum(
        1
        for i in range(n)
        if winner({p: (rs[i].get(key) if i < len(rs) else None) for p, rs in runs.items()})[0] == w
    )

    def tail(p: str) -> str:
        p99 = spread([r.get("ttft_p99") for r in runs[p]]).mean
        o5 = spread([r.get("over_5x_slo") for r in runs[p]]).mean
        return f"{p} P99 TTFT {_f(p99, '{:.1f} s')}, {_f(o5, '{:.1%}')} past 5x SLO"

    line = f"verdict: {w} wins live by {_f(lead, '{:.2f}x')} prefill TPS within SLO"
    line += f" ({'; '.join(tail(p) for p in runs)})"
    if n > 1:
        line += f", in {won} of {n} repeats"
    if sims:
        sw, slead = winner({p: s.get(key) for p, s in sims.items()})
        live_tie = lead is None or lead < 1 + TIE
        sim_tie = slead is None or slead < 1 + TIE
        if sim_tie:
            line += f"; simulator: a tie ({sw} by {_f(slead, '{:.2f}x')})"
            agree = live_tie
        else:
            line += f"; simulator: {sw} by {_f(slead, '{:.2f}x')}"
            agree = sw == w and not live_tie
        line += f": live and simulated {'agree' if agree else 'DISAGREE'}"
    return line


def _f(v: float | None, fmt: str) -> str:
    return "-" if v is None else fmt.format(v)
