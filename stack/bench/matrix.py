"""The dispatch evidence matrix: a candidate default against the best baseline as shipped in
every setting an operator may be in (``benchmarks/dispatch_matrix.py`` runs it; the table is in
docs/dispatch.md, "The evidence matrix").

A *cell* is a trace, a cluster setting and a seed, with a grid of rates around the peaks. In
each cell the candidate and the baselines (as their authors ship them: routed at arrival) run
over the grid; then everyone runs once more at 10% above the best baseline's peak rate, where
an operator's load lands when it does not stop at the knee. Pure functions here (what to run,
how to judge it); the runner shells out to ``smetric bench``, so every figure is a bench row.

The checks, per cell (:func:`judge`):

- **peak**: the candidate's peak TPS within SLO >= the best baseline's peak x (1 - tolerance).
  A cell's tolerance is the seed-to-seed spread of the best baseline's peak in its group (the
  relative range over the group's seeds) where the group has seeds, 1% otherwise;
- **tail at the peak**: the candidate's share of requests past 5x SLO at the best baseline's
  peak rate <= the baseline's there;
- **tail past the peak**: the same at 1.1x that rate;
- **gain** (cells marked ``gain_bar``): candidate peak / best baseline peak >= the bar;
- **replicas** (cells with ``replicas`` > 1, paired with the single-replica cell of the same
  trace and seed): the gain over the best baseline with N replicas >= 80% of the gain with one.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from stack.bench.experiments import split_policy
from stack.bench.summary import run_label

AGENTIC = "stack/data/claude_code_agentic.jsonl.gz"
CONVERSATION = "stack/data/mooncake_conversation.jsonl.gz"
SYNTHETIC = "stack/data/mooncake_synthetic.jsonl.gz"
#: the baselines every cell of docs/dispatch.md's study found best (as shipped: immediate)
BASELINES = ("least-load", "lmetric")
#: the tolerance of a cell without seeds
FLAT_TOLERANCE = 0.01
#: the share of the single-replica gain N replicas must keep
REPLICA_SHARE = 0.80
#: how far past the best baseline's peak rate the second tail check runs
PAST_PEAK = 1.10


@dataclass(frozen=True)
class Cell:
    """One setting of the matrix. ``group``: cells whose seeds give one tolerance."""

    name: str
    trace: str
    rates: tuple[float, ...]
    seed: int = 0
    experiment: str | None = None
    setting: str | None = None
    replicas: int = 1
    group: str | None = None
    gain_bar: float | None = None

    @property
    def key(self) -> str:
        """A file-name-safe key (the cell's output folder)."""
        return "".join(c if c.isalnum() or c in "-_." else "_" for c in self.name)


def _agentic(seed: int, gain_bar: float | None = None) -> Cell:
    return Cell(
        f"agentic default s{seed}",
        AGENTIC,
        (0.12, 0.13, 0.14, 0.15),
        seed=seed,
        group="agentic default",
        gain_bar=gain_bar,
    )


#: the issue's matrix: agentic at seeds 0-2 (and 3-5, held out for the gain bar), both Mooncake
#: traces, the shared NIC at 200k and 8M of local room, and 4 router replicas
CELLS: tuple[Cell, ...] = (
    *(_agentic(s) for s in (0, 1, 2)),
    *(_agentic(s, gain_bar=1.07) for s in (3, 4, 5)),
    Cell(
        "mooncake conversation", CONVERSATION, (6.3187, 6.549452946, 6.7892588709, 7.0378452057, 7.5626568429)
    ),
    Cell("mooncake synthetic", SYNTHETIC, (6.55, 6.887, 7.245, 7.622, 8.018)),
    Cell(
        "agentic 200k shared NIC s0",
        AGENTIC,
        (0.10, 0.11, 0.12, 0.13),
        experiment="local-tier",
        setting="hbm=200k/shared",
    ),
    Cell(
        "agentic 8M shared NIC s0",
        AGENTIC,
        (0.12, 0.13, 0.14),
        experiment="local-tier",
        setting="hbm=8M/shared",
    ),
    Cell("agentic default s0, 4 replicas", AGENTIC, (0.13, 0.14, 0.15), replicas=4),
)


#: how replicas share the queue in the matrix: the router's own with Redis (docs/router.md)
REPLICA_MODE = "claims"


def with_replicas(spec: str, n: int) -> str:
    """``spec`` run by ``n`` router replicas sharing the queue as the router does
    (``policy+order:...:replicas=n:replica_mode=claims``); a spec without a queue
    (``immediate``) has nothing to share, so it is returned as is."""
    if n <= 1:
        return spec
    policy, order = split_policy(spec)
    if order is None or order.split(":", 1)[0] == "immediate":
        return spec
    if "replica_mode=" in order:
        return f"{policy}+{order}:replicas={n}"
    return f"{policy}+{order}:replicas={n}:replica_mode={REPLICA_MODE}"


def label_of(spec: str) -> str:
    """The label a bench row of ``spec`` carries (its dispatch spec in canonical form)."""
    from stack.dispatch import DispatchSpec

    policy, order = split_policy(spec)
    return run_label(policy, None if order is None else DispatchSpec.parse(order).label())


def bench_argv(cell: Cell, specs: Sequence[str], rates: Iterable[float], out: Path, jobs: int) -> list[str]:
    """The ``smetric bench`` arguments (after ``smetric``) of one run of ``cell``."""
    a = ["bench", "--trace", cell.trace, "--policies", ",".join(specs)]
    a += ["--rates", ",".join(repr(float(r)) for r in rates), "--seed", str(cell.seed)]
    if cell.experiment:
        a += ["--experiment", cell.experiment]
    if cell.setting:
        a += ["--settings", cell.setting]
    return [*a, "--jobs", str(jobs), "--no-progress", "--no-plots", "--out", str(out)]


@dataclass(frozen=True)
class Point:
    """One bench row: a configuration at a rate."""

    label: str
    rate: float
    tps: float
    p99: float
    over5: float


def read_points(results_csv: Path) -> list[Point]:
    with results_csv.open() as f:
        rows = list(csv.DictReader(f))
    out = []
    for r in rows:
        d = r.get("dispatch") or None
        out.append(
            Point(
                run_label(r["policy"], d),
                float(r["rate"]),
                float(r["prefill_tps_within_slo"]),
                float(r["ttft_p99"]),
                float(r["over_5x_slo"]),
            )
        )
    return out


def peak(points: Iterable[Point], label: str) -> Point | None:
    """``label``'s point of highest TPS within SLO (the lower rate on a tie)."""
    best = None
    for p in points:
        if p.label == label and (
            best is None or p.tps > best.tps or (p.tps == best.tps and p.rate < best.rate)
        ):
            best = p
    return best


def at(points: Iterable[Point], label: str, rate: float) -> Point | None:
    for p in points:
        if p.label == label and math.isclose(p.rate, rate, rel_tol=1e-9):
            return p
    return None


def best_baseline(points: Sequence[Point], baselines: Sequence[str]) -> Point:
    peaks = [p for p in (peak(points, b) for b in baselines) if p is not None]
    if not peaks:
        raise ValueError("no baseline ran in this cell")
    return max(peaks, key=lambda p: p.tps)


def past_peak_rate(rate: float) -> float:
    return round(rate * PAST_PEAK, 6)


@dataclass
class Verdict:
    """One cell judged: the figures of its row in the table and each check's outcome."""

    cell: Cell
    candidate: Point
    baseline: Point
    tolerance: float
    cand_at_base: Point | None
    cand_past: Point | None
    base_past: Point | None
    checks: dict[str, bool] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        return self.candidate.tps / self.baseline.tps if self.baseline.tps > 0 else math.inf

    @property
    def ok(self) -> bool:
        return all(self.checks.values())


def tolerances(cells: Sequence[Cell], baseline_peaks: dict[str, float]) -> dict[str, float]:
    """Each cell's tolerance: the relative range (max - min) / mean of the best baseline's peak
    over the seeds of its group (two seeds at least), else :data:`FLAT_TOLERANCE`."""
    groups: dict[str, list[float]] = {}
    for c in cells:
        if c.group is not None and c.name in baseline_peaks and c.replicas == 1:
            groups.setdefault(c.group, []).append(baseline_peaks[c.name])
    out = {}
    for c in cells:
        vals = groups.get(c.group or "", [])
        if len(vals) >= 2:
            mean = sum(vals) / len(vals)
            out[c.name] = (max(vals) - min(vals)) / mean if mean > 0 else FLAT_TOLERANCE
        else:
            out[c.name] = FLAT_TOLERANCE
    return out


def judge(
    cell: Cell, points: Sequence[Point], candidate: str, baselines: Sequence[str], tol: float
) -> Verdict:
    """The checks of one cell (see the module's docstring); ``candidate`` is the label of the
    candidate's rows (replicas included)."""
    base = best_baseline(points, baselines)
    cand = peak(points, candidate)
    if cand is None:
        raise ValueError(f"{cell.name}: the candidate {candidate!r} did not run")
    r2 = past_peak_rate(base.rate)
    v = Verdict(
        cell,
        cand,
        base,
        tol,
        at(points, candidate, base.rate),
        at(points, candidate, r2),
        at(points, base.label, r2),
    )
    v.checks["peak"] = cand.tps >= base.tps * (1.0 - tol)
    v.checks["tail at peak"] = v.cand_at_base is not None and v.cand_at_base.over5 <= base.over5
    v.checks["tail past peak"] = (
        v.cand_past is not None and v.base_past is not None and v.cand_past.over5 <= v.base_past.over5
    )
    if cell.gain_bar is not None:
        v.checks[f"gain >= {cell.gain_bar:g}"] = v.ratio >= cell.gain_bar
    return v


def replica_check(multi: Verdict, single: Verdict) -> bool:
    """N replicas keep >= :data:`REPLICA_SHARE` of the single replica's gain over the best
    baseline (a single replica with no gain has nothing to lose: then N must not lose)."""
    g1 = single.ratio - 1.0
    gn = multi.ratio - 1.0
    if g1 <= 0:
        return gn >= g1
    return gn >= REPLICA_SHARE * g1


def table(verdicts: Sequence[Verdict]) -> str:
    """The markdown table of docs/dispatch.md, "The evidence matrix"."""
    head = (
        "| cell | candidate peak (k) @rate | best baseline as shipped | x | tolerance "
        "| P99 s cand / base (base's peak rate) | >5x SLO cand / base, base's peak rate "
        "| >5x SLO cand / base, 1.1x that rate | checks |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for v in verdicts:
        cb, cp, bp = v.cand_at_base, v.cand_past, v.base_past
        failed = [k for k, ok in v.checks.items() if not ok]
        lines.append(
            f"| {v.cell.name} | {v.candidate.tps / 1e3:.1f} @{v.candidate.rate:g} "
            f"| {v.baseline.label} {v.baseline.tps / 1e3:.1f} @{v.baseline.rate:g} | x{v.ratio:.3f} "
            f"| {v.tolerance * 100:.1f}% "
            f"| {_f(cb and cb.p99, '.0f')} / {v.baseline.p99:.0f} "
            f"| {_pct(cb and cb.over5)} / {_pct(v.baseline.over5)} "
            f"| {_pct(cp and cp.over5)} / {_pct(bp and bp.over5)} "
            f"| {'all met' if not failed else 'missed: ' + ', '.join(failed)} |"
        )
    return head + "\n".join(lines) + "\n"


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.2f}%"


def worst(verdicts: Sequence[Verdict]) -> Verdict:
    """The candidate's worst cell: its lowest ratio to the best baseline, less the tolerance."""
    return min(verdicts, key=lambda v: v.ratio + v.tolerance)
