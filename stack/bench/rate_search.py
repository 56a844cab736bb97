"""Which simulations a sweep runs: the rate search over (policy, setting[, dispatch order]).

Without explicit rates, :func:`search` finds each (policy, setting)'s peak of prefill TPS
within SLO: a coarse geometric sweep around an estimate from the clairvoyant bound, then
rounds that extend the sweep while the curve still rises at an end, and refine between
the neighbours of the peak and around the 90%-attainment capacity, until neighbouring
rates are within a few percent. A last round runs every policy at SMetric's peak rate so
that latencies can be compared at one load. The jobs run on an executor
(:mod:`stack.bench.executors`); what one job is lives in :mod:`stack.bench.runner`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from stack.bench.executors import Executor, Failure
from stack.bench.runner import Job, Outcome
from stack.bench.summary import run_label
from stack.policies import is_smetric

TPS = "prefill_tps_within_slo"
ATT = "slo_attainment"


def _val(row: dict, key: str) -> float:
    if key == TPS and row.get("mode") == "colocated":
        key = "tps_within_slo"  # colocation's TPS: output tokens within both SLOs (§5.2)
    v = row.get(key)
    return v if isinstance(v, (int, float)) and math.isfinite(v) else 0.0


def _gmid(a: float, b: float) -> float:
    return math.sqrt(a * b)


def next_rates(rows: dict[float, dict], resolution: float = 1.06, lo_limit: float = 0.0) -> list[float]:
    """Rates to add to one policy's sweep (empty when its peak and capacity are resolved).

    ``rows``: rate -> row for the rates run so far.
    """
    rates = sorted(rows)
    if not rates:
        return []
    tps = [_val(rows[r], TPS) for r in rates]
    i = max(range(len(rates)), key=lambda k: (tps[k], -k))
    new: list[float] = []
    if i == len(rates) - 1:
        # still rising at the top: extend upwards
        new += [rates[-1] * 1.5, rates[-1] * 2.25]
    elif i == 0 and rates[0] / 4 > lo_limit:
        new += [rates[0] / 2, rates[0] / 4]
    else:
        for a, b in ((rates[i - 1] if i > 0 else None, rates[i]), (rates[i], rates[i + 1])):
            if a is not None and b / a > resolution:
                new.append(_gmid(a, b))
    # capacity: the highest rate with >= 90% attainment, and the next rate above it
    ok = [r for r in rates if _val(rows[r], ATT) >= 0.9]
    if ok:
        c = max(ok)
        above = [r for r in rates if r > c]
        if above and above[0] / c > resolution:
            new.append(_gmid(c, above[0]))
        elif not above:
            new.append(c * 1.5)
    elif rates[0] / 4 > lo_limit:
        new.append(rates[0] / 2)
    return sorted({round(r, 10) for r in new if r not in rows})


def coarse_grid(estimate: float) -> list[float]:
    return [estimate * f for f in (0.25, 0.5, 0.75, 1.0, 1.5)]


def search(
    pool: Executor,
    keys: list[tuple[str, int]] | list[tuple[str, int, str]],
    estimates: dict[int, float],
    on_done: Callable[[Outcome], None],
    on_round: Callable[[int], None] | None = None,
    max_rounds: int = 6,
    max_per_key: int = 16,
    explicit: list[float] | None = None,
    align: bool = True,
    on_fail: Callable[[Failure], None] | None = None,
) -> list[Outcome]:
    """Run sweeps for every (policy, setting index[, dispatch order]) key; returns every
    outcome. Each (policy, dispatch) pair is searched as a policy of its own. A job the
    executor gives up on (``on_fail``) is not proposed again; the search goes on from the
    rates that ran."""
    k3: list[tuple[str, int, str]] = [(k[0], k[1], k[2] if len(k) > 2 else "immediate") for k in keys]
    results: dict[tuple[str, int, str], dict[float, Outcome]] = {k: {} for k in k3}
    failed: dict[tuple[str, int, str], set[float]] = {k: set() for k in k3}
    outcomes: list[Outcome] = []

    def fail(f: Failure) -> None:
        failed[(f.job.policy, f.job.setting, f.job.dispatch)].add(f.job.rate)
        if on_fail is not None:
            on_fail(f)

    def run(jobs: list[Job]) -> None:
        if on_round is not None:
            on_round(len(jobs))
        for o in pool.run(jobs, on_done, fail):
            results[(o.job.policy, o.job.setting, o.job.dispatch)][o.job.rate] = o
            outcomes.append(o)

    if explicit is not None:
        jobs = [Job(p, si, r * pool.settings[si].rate_factor, d) for p, si, d in k3 for r in explicit]
        run(jobs)
    else:
        run([Job(p, si, r, d) for p, si, d in k3 for r in coarse_grid(estimates[si])])
        for _ in range(max_rounds):
            jobs = []
            for k in k3:
                done = results[k]
                left = max_per_key - len(done) - len(failed[k])
                if left <= 0:
                    continue
                rows = {r: o.row for r, o in done.items()}
                fresh = [r for r in next_rates(rows, lo_limit=estimates[k[1]] / 64) if r not in failed[k]]
                for r in fresh[:left]:
                    jobs.append(Job(k[0], k[1], r, k[2]))
            if not jobs:
                break
            run(jobs)
    if align:
        # every policy also at SMetric's peak rate of its setting (latency at one load)
        jobs = []
        for si in sorted({si for _, si, _ in k3}):
            ref = smetric_peak_rate(
                {
                    run_label(p, d): {r: o.row for r, o in results[(p, s, d)].items()}
                    for p, s, d in k3
                    if s == si
                }
            )
            if ref is None:
                continue
            for p, s, d in k3:
                if s == si and ref not in results[(p, s, d)] and ref not in failed[(p, s, d)]:
                    jobs.append(Job(p, s, ref, d))
        if jobs:
            run(jobs)
    return outcomes


def smetric_peak_rate(by_policy: dict[str, dict[float, dict]]) -> float | None:
    """The rate where faithful ``smetric`` peaks (else the best SMetric-family policy)."""

    def peak(rows: dict[float, dict]) -> tuple[float, float] | None:
        if not rows:
            return None
        r = max(sorted(rows), key=lambda r: _val(rows[r], TPS))
        return _val(rows[r], TPS), r

    if "smetric" in by_policy and by_policy["smetric"]:
        p = peak(by_policy["smetric"])
        return p[1] if p else None
    best = None
    for name, rows in by_policy.items():
        if is_smetric(name):
            p = peak(rows)
            if p and (best is None or p[0] > best[0]):
                best = p
    return best[1] if best else None
