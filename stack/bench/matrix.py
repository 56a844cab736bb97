"""The dispatch evidence matrix: a candidate default against the best baseline as shipped in
every setting an operator may be in (``benchmarks/dispatch_matrix.py`` runs it; the table is in
docs/research/dispatch.md, "The evidence matrix").

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

The protocol of issue 48 (docs/research/dispatch.md, "Choosing the next default: the protocol"; written
before any candidate ran) is a second matrix here: :func:`protocol_cells` (the agentic trace,
three SLOs, the H200 calibration, 8 and 64 instances, both Mooncake traces, the shared NIC at
200k and 8M of local room, 4 router replicas; screening or all seeds), judged against the best
of :data:`PROTOCOL_BASELINES` by :func:`protocol_checks`, with each cell's tolerance the larger
of its group's seed spread and its chaos floor (:func:`cell_tolerance`; 1% where neither was
measured). The client model is an option of every run (:class:`Clients`).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stack.bench.experiments import split_policy
from stack.bench.summary import CAPACITY_ATTAINMENT, run_label
from stack.replay import bands

AGENTIC = "stack/data/claude_code_agentic.jsonl.gz"
CONVERSATION = "stack/data/mooncake_conversation.jsonl.gz"
SYNTHETIC = "stack/data/mooncake_synthetic.jsonl.gz"
#: the baselines every cell of docs/research/dispatch.md's study found best (as shipped: immediate)
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
    #: ``smetric bench --hardware`` (None: its default, h20)
    hardware: str | None = None
    #: ``--instances`` (None: 32)
    instances: int | None = None
    #: ``--slo-a`` in seconds per 1k prompt tokens and ``--slo-b`` in seconds (None: 62.5 ms, 1 s)
    slo_a: float | None = None
    slo_b: float | None = None

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


@dataclass(frozen=True)
class Clients:
    """The client model of ``smetric bench --clients`` (stack/sim/clients.py); None fields keep
    bench's defaults (patience 600 s, the SDKs' read timeout; 2 retries)."""

    patience_s: float | None = None
    retries: int | None = None

    def argv(self) -> list[str]:
        a = ["--clients"]
        if self.patience_s is not None:
            a += ["--client-patience", repr(float(self.patience_s))]
        if self.retries is not None:
            a += ["--client-retries", str(int(self.retries))]
        return a


def cell_argv(cell: Cell) -> list[str]:
    """The bench options that make ``cell``'s cluster: experiment setting, hardware, size, SLO."""
    a: list[str] = []
    if cell.experiment:
        a += ["--experiment", cell.experiment]
    if cell.setting:
        a += ["--settings", cell.setting]
    if cell.hardware:
        a += ["--hardware", cell.hardware]
    if cell.instances is not None:
        a += ["--instances", str(cell.instances)]
    if cell.slo_a is not None:
        a += ["--slo-a", repr(float(cell.slo_a))]
    if cell.slo_b is not None:
        a += ["--slo-b", repr(float(cell.slo_b))]
    return a


def bench_argv(
    cell: Cell,
    specs: Sequence[str],
    rates: Iterable[float],
    out: Path,
    jobs: int,
    *,
    clients: Clients | None = None,
    perturb: int | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """The ``smetric bench`` arguments (after ``smetric``) of one run of ``cell``: with the
    client model when ``clients`` is given, the load perturbed by ``perturb`` (the chaos floor),
    and ``extra`` bench options last (an executor, or a shorter run for a smoke test)."""
    a = ["bench", "--trace", cell.trace, "--policies", ",".join(specs)]
    a += ["--rates", ",".join(repr(float(r)) for r in rates), "--seed", str(cell.seed)]
    a += cell_argv(cell)
    if clients is not None:
        a += clients.argv()
    if perturb is not None:
        a += ["--perturb", str(perturb)]
    return [*a, "--jobs", str(jobs), "--no-progress", "--no-plots", *extra, "--out", str(out)]


@dataclass(frozen=True)
class Point:
    """One bench row: a configuration at a rate."""

    label: str
    rate: float
    tps: float
    p99: float
    over5: float
    #: the share of measured requests within SLO (capacity: the highest rate with >= 90%)
    attainment: float = math.nan
    #: requests failed after their retries (with the client model; else refused measured ones)
    failed: float = 0.0
    slowdown_p90: float = math.nan
    ttft_max: float = math.nan


def _col(row: dict[str, str], *names: str, default: float = math.nan) -> float:
    """The first of ``names`` that the row has a value for, as a float."""
    for n in names:
        v = row.get(n)
        if v not in (None, ""):
            return float(v)
    return default


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
                _col(r, "slo_attainment"),
                _col(r, "failed_after_retries", "rejected_measured", default=0.0),
                _col(r, "session_slowdown_p90"),
                _col(r, "ttft_max"),
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
    #: where the tolerance comes from (seed spread, chaos floor, or the flat 1%)
    tolerance_source: str = ""
    #: capacity at 90% attainment (the highest rate run with >= 90% within SLO; None: none)
    cand_capacity: float | None = None
    base_capacity: float | None = None
    #: the best baseline at the candidate's peak rate (the protocol's figures at that peak)
    base_at_cand: Point | None = None

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
        spread = _rel_range(vals) if len(vals) >= 2 else math.inf
        out[c.name] = spread if math.isfinite(spread) else FLAT_TOLERANCE
    return out


def judge(
    cell: Cell, points: Sequence[Point], candidate: str, baselines: Sequence[str], tol: float
) -> Verdict:
    """The checks of one cell (see the module's docstring); ``candidate`` is the label of the
    candidate's rows (replicas included)."""
    v = _figures(cell, points, candidate, baselines, tol)
    cand, base = v.candidate, v.baseline
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
    """The markdown table of docs/research/dispatch.md, "The evidence matrix"."""
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


# --- the protocol of issue 48 (docs/research/dispatch.md, "Choosing the next default: the protocol") ---

#: the protocol's baselines as shipped (immediate): each cell is judged against the best peak
PROTOCOL_BASELINES = ("least-load", "lmetric", "linear", "dynamo")
#: the agentic grid at 32 instances in sessions/s (scaled with the instance count elsewhere)
AGENTIC_RATES = (0.12, 0.13, 0.14, 0.15, 0.16)
#: the cluster the agentic rates are per (the bench's default ``--instances``)
BASE_INSTANCES = 32
#: perturbations (``--perturb 0..N-1``) the chaos floor is measured over
CHAOS_RUNS = 10
#: the agentic peak gain over seeds 0-5 the chosen default must reach
PROTOCOL_GAIN = 1.07
#: the protocol's stages: screening (every cell at seed 0, agentic at seeds 0-2), then all seeds
STAGES = ("screen", "full")
SCREEN_AGENTIC_SEEDS = (0, 1, 2)
#: the protocol's checks, in the order of its rule for choosing
PROTOCOL_CHECKS = ("peak TPS", "capacity", "P99 TTFT at 1.1x", "failed at 1.1x", "slowdown p90 at 1.1x")


def scaled_rates(rates: Iterable[float], instances: int) -> tuple[float, ...]:
    """``rates`` per :data:`BASE_INSTANCES` instances scaled to ``instances`` (the load per
    instance kept, as the ``scale`` experiment does)."""
    return tuple(round(r * instances / BASE_INSTANCES, 6) for r in rates)


def _group(name: str, seeds: Iterable[int], trace: str, rates: Sequence[float], **kw: Any) -> list[Cell]:
    return [Cell(f"{name} s{s}", trace, tuple(rates), seed=s, group=name, **kw) for s in seeds]


def _protocol_all() -> tuple[Cell, ...]:
    three = (0, 1, 2)
    cells = _group("agentic", range(6), AGENTIC, AGENTIC_RATES)
    cells += _group("tight SLO", three, AGENTIC, (0.10, 0.11, 0.12, 0.13, 0.14), slo_a=0.03125)
    cells += _group("loose fixed budget", three, AGENTIC, AGENTIC_RATES, slo_b=2.0)
    cells += _group("loose per-token budget", three, AGENTIC, AGENTIC_RATES, slo_a=0.125)
    cells += _group("H200", three, AGENTIC, (0.42, 0.46, 0.51, 0.56), hardware="h200")
    for n in (8, 64):
        cells += _group(f"{n} instances", three, AGENTIC, scaled_rates(AGENTIC_RATES, n), instances=n)
    conv = (6.3187, 6.549452946, 6.7892588709, 7.0378452057, 7.5626568429)
    cells += _group("mooncake conversation", (0,), CONVERSATION, conv)
    cells += _group("mooncake synthetic", (0,), SYNTHETIC, (6.55, 6.887, 7.245, 7.622, 8.018))
    for room, rates in (("200k", (0.10, 0.11, 0.12, 0.13)), ("8M", (0.12, 0.13, 0.14, 0.15))):
        cells += _group(
            f"{room} shared NIC", three, AGENTIC, rates, experiment="local-tier", setting=f"hbm={room}/shared"
        )
    cells += _group("4 replicas", three, AGENTIC, AGENTIC_RATES, replicas=4)
    return tuple(cells)


def protocol_cells(stage: str = "screen") -> tuple[Cell, ...]:
    """The protocol's cells: ``screen`` is every cell at seed 0 and agentic at seeds 0-2;
    ``full`` every cell at every seed (agentic 0-5, the Mooncake traces at seed 0, which their
    chaos floor spans, the others 0-2)."""
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r} (known: {', '.join(STAGES)})")
    cells = _protocol_all()
    if stage == "full":
        return cells
    return tuple(c for c in cells if c.seed == 0 or (c.group == "agentic" and c.seed in SCREEN_AGENTIC_SEEDS))


def select_cells(cells: Sequence[Cell], names: str | None) -> tuple[Cell, ...]:
    """``names``: comma-separated cell or group names (a group selects its cells); None: all.
    An unknown name is a ValueError."""
    if not names:
        return tuple(cells)
    want = {n.strip() for n in names.split(",") if n.strip()}
    known = {c.name for c in cells} | {c.group for c in cells if c.group}
    unknown = want - known
    if unknown:
        raise ValueError(f"unknown cell(s) {sorted(unknown)}; known: {sorted(known)}")
    return tuple(c for c in cells if c.name in want or c.group in want)


def group_of(cell: Cell) -> str:
    """The cell's group (a cell without one is its own)."""
    return cell.group or cell.name


def floor_cells(cells: Sequence[Cell]) -> dict[str, Cell]:
    """Per group, the cell its chaos floor is measured in: its lowest seed."""
    out: dict[str, Cell] = {}
    for c in cells:
        g = group_of(c)
        if g not in out or c.seed < out[g].seed:
            out[g] = c
    return out


def _rel_range(vals: Sequence[float]) -> float:
    mean = sum(vals) / len(vals)
    return (max(vals) - min(vals)) / mean if mean > 0 else math.inf


def seed_spreads(cells: Sequence[Cell], baseline_peaks: dict[str, float]) -> dict[str, float]:
    """Per group with two seeds or more: the best baseline's peak, relative range
    (max - min) / mean over the group's seeds."""
    vals: dict[str, list[float]] = {}
    for c in cells:
        if c.name in baseline_peaks:
            vals.setdefault(group_of(c), []).append(baseline_peaks[c.name])
    return {g: _rel_range(v) for g, v in vals.items() if len(v) >= 2}


def chaos_floor(perturbed_tps: Sequence[float]) -> float | None:
    """The half-width of the band of TPS within SLO over the perturbed runs, relative to its
    median (:func:`stack.replay.bands.chaos_floor`); None with fewer than two runs."""
    if len(perturbed_tps) < 2:
        return None
    return bands.chaos_floor(perturbed_tps, min_n=len(perturbed_tps))


@dataclass(frozen=True)
class Tolerance:
    """A cell's tolerance: the larger of its seed spread and its chaos floor, 1% where neither
    exists (``source`` says which)."""

    value: float
    source: str
    spread: float | None = None
    floor: float | None = None

    def describe(self) -> str:
        return f"{self.value * 100:.1f}% ({self.source})"


def cell_tolerance(spread: float | None, floor: float | None) -> Tolerance:
    known = [(v, s) for v, s in ((spread, "seed spread"), (floor, "chaos floor")) if v is not None]
    if not known:
        return Tolerance(FLAT_TOLERANCE, "neither measured: 1%", spread, floor)
    v, src = max(known, key=lambda x: x[0])
    return Tolerance(v, src, spread, floor)


def cell_tolerances(
    cells: Sequence[Cell], baseline_peaks: dict[str, float], floors: dict[str, float | None]
) -> dict[str, Tolerance]:
    """Each cell's :class:`Tolerance` from its group's seed spread and chaos floor (``floors``
    by group)."""
    spreads = seed_spreads(cells, baseline_peaks)
    return {c.name: cell_tolerance(spreads.get(group_of(c)), floors.get(group_of(c))) for c in cells}


def capacity(points: Iterable[Point], label: str) -> float | None:
    """``label``'s highest rate with at least 90% of its measured requests within SLO."""
    ok = [p.rate for p in points if p.label == label and p.attainment >= CAPACITY_ATTAINMENT]
    return max(ok) if ok else None


def at_least(cand: float | None, base: float | None, tol: float) -> bool:
    """``cand`` >= ``base`` less ``tol`` (relative); a baseline without the figure (no rate at
    90%) has nothing to beat, a candidate without it while the baseline has it fails."""
    if base is None:
        return True
    return cand is not None and cand >= base * (1.0 - tol)


def at_most(cand: float | None, base: float | None, tol: float) -> bool:
    """``cand`` <= ``base`` plus ``tol`` (relative). A figure missing on either side fails; a
    figure neither side measured (NaN on both) passes."""
    if cand is None or base is None:
        return False
    if math.isnan(cand) and math.isnan(base):
        return True
    return cand <= base * (1.0 + tol)


def _fig(p: Point | None, name: str) -> float | None:
    return None if p is None else float(getattr(p, name))


def protocol_checks(v: Verdict) -> dict[str, bool]:
    """The protocol's checks of one judged cell (:data:`PROTOCOL_CHECKS`): peak TPS within SLO
    and capacity at least the best baseline's less the tolerance; at 1.1x the baseline's peak
    rate, P99 TTFT (from the first attempt), failed requests and session slowdown p90 at most
    the baseline's plus the tolerance."""
    t, cp, bp = v.tolerance, v.cand_past, v.base_past
    return {
        "peak TPS": at_least(v.candidate.tps, v.baseline.tps, t),
        "capacity": at_least(v.cand_capacity, v.base_capacity, t),
        "P99 TTFT at 1.1x": at_most(_fig(cp, "p99"), _fig(bp, "p99"), t),
        "failed at 1.1x": at_most(_fig(cp, "failed"), _fig(bp, "failed"), t),
        "slowdown p90 at 1.1x": at_most(_fig(cp, "slowdown_p90"), _fig(bp, "slowdown_p90"), t),
    }


def judge_protocol(
    cell: Cell, points: Sequence[Point], candidate: str, baselines: Sequence[str], tol: Tolerance
) -> Verdict:
    """One cell judged by the protocol's rule (:func:`protocol_checks`); ``candidate`` is the
    label of the candidate's rows (replicas included)."""
    v = _figures(cell, points, candidate, baselines, tol.value)
    v.tolerance_source = tol.source
    v.cand_capacity = capacity(points, candidate)
    v.base_capacity = capacity(points, v.baseline.label)
    v.base_at_cand = at(points, v.baseline.label, v.candidate.rate)
    v.checks = protocol_checks(v)
    return v


def _figures(
    cell: Cell, points: Sequence[Point], candidate: str, baselines: Sequence[str], tol: float
) -> Verdict:
    """A cell's verdict before its checks: the candidate's peak and the best baseline's, and
    the candidate at the baseline's peak rate and both at 1.1x it."""
    base = best_baseline(points, baselines)
    cand = peak(points, candidate)
    if cand is None:
        raise ValueError(f"{cell.name}: the candidate {candidate!r} did not run")
    r2 = past_peak_rate(base.rate)
    return Verdict(
        cell,
        cand,
        base,
        tol,
        at(points, candidate, base.rate),
        at(points, candidate, r2),
        at(points, base.label, r2),
    )


def failed_checks(verdicts: Sequence[Verdict]) -> int:
    """How many checks failed over all cells (the rule's tie-break when no candidate passes
    every cell)."""
    return sum(not ok for v in verdicts for ok in v.checks.values())


def group_gain(verdicts: Sequence[Verdict], group: str) -> tuple[float, float] | None:
    """The candidate's peak over the best baseline's in ``group``'s cells: (mean, lowest);
    None when the group did not run."""
    rs = [v.ratio for v in verdicts if group_of(v.cell) == group]
    return (sum(rs) / len(rs), min(rs)) if rs else None


def _pair(c: float | None, b: float | None, fmt: str, ok: bool | None = None) -> str:
    text = f"{_f(c, fmt)} / {_f(b, fmt)}"
    return text if ok is None else f"{text} {'PASS' if ok else 'FAIL'}"


def _num(x: float | None) -> float | None:
    return None if x is None or math.isnan(x) else x


def protocol_row(v: Verdict) -> str:
    """One cell's row of :func:`protocol_table`."""
    ck, cp, bp = v.checks, v.cand_past, v.base_past
    failed = [k for k, ok in ck.items() if not ok]
    cells = [
        v.cell.name,
        f"{v.tolerance * 100:.1f}% ({v.tolerance_source})",
        f"{v.candidate.tps / 1e3:.1f} @{v.candidate.rate:g} / {v.baseline.label} {v.baseline.tps / 1e3:.1f} "
        f"@{v.baseline.rate:g} (x{v.ratio:.3f}) {'PASS' if ck['peak TPS'] else 'FAIL'}",
        _pair(v.cand_capacity, v.base_capacity, "g", ck["capacity"]),
        _pair(_num(_fig(cp, "p99")), _num(_fig(bp, "p99")), ".1f", ck["P99 TTFT at 1.1x"]),
        _pair(_fig(cp, "failed"), _fig(bp, "failed"), ".0f", ck["failed at 1.1x"]),
        _pair(
            _num(_fig(cp, "slowdown_p90")), _num(_fig(bp, "slowdown_p90")), ".2f", ck["slowdown p90 at 1.1x"]
        ),
        f"{_pct(_fig(cp, 'over5'))} / {_pct(_fig(bp, 'over5'))}",
        _pair(_num(_fig(cp, "ttft_max")), _num(_fig(bp, "ttft_max")), ".0f"),
        "PASS" if not failed else f"FAIL ({len(failed)})",
    ]
    return "| " + " | ".join(cells) + " |"


def protocol_table(verdicts: Sequence[Verdict]) -> str:
    """The protocol's table: per cell the tolerance used, each check's figures (candidate /
    best baseline) with PASS or FAIL, the reported figures at 1.1x, and the cell's verdict."""
    head = (
        "| cell | tolerance | peak TPS within SLO (k) @rate, cand / best baseline | capacity (90%) "
        "| P99 TTFT s at 1.1x | failed at 1.1x | session slowdown p90 at 1.1x | >5x SLO at 1.1x "
        "| max TTFT s at 1.1x | cell |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n"
    )
    return head + "\n".join(protocol_row(v) for v in verdicts) + "\n"


def _clean(x: object) -> object:
    """JSON-safe: NaN and infinities as None."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(y) for k, y in x.items()}
    return x


def _point_json(p: Point | None) -> object:
    return None if p is None else _clean(vars(p))


def verdict_json(v: Verdict, tol: Tolerance | None = None) -> dict:
    """One judged cell as JSON: the figures at the peaks, at the baseline's peak rate and at 1.1x
    it, the capacities, the tolerance and each check as PASS or FAIL."""
    return {
        "cell": v.cell.name,
        "group": group_of(v.cell),
        "seed": v.cell.seed,
        "ratio": _clean(v.ratio),
        "tolerance": _clean(vars(tol)) if tol is not None else {"value": v.tolerance},
        "candidate": _point_json(v.candidate),
        "baseline": _point_json(v.baseline),
        "candidate_at_baseline_peak_rate": _point_json(v.cand_at_base),
        "baseline_at_candidate_peak_rate": _point_json(v.base_at_cand),
        "past_rate": past_peak_rate(v.baseline.rate),
        "candidate_past": _point_json(v.cand_past),
        "baseline_past": _point_json(v.base_past),
        "capacity": {"candidate": v.cand_capacity, "baseline": v.base_capacity},
        "checks": {k: "PASS" if ok else "FAIL" for k, ok in v.checks.items()},
        "ok": v.ok,
    }


def peak_at_top(points: Iterable[Point], label: str) -> bool:
    """Whether ``label``'s peak is at the highest rate it ran (its true peak may lie above the
    grid: widen the cell's rates)."""
    pts = [p for p in points if p.label == label]
    pk = peak(pts, label)
    return pk is not None and pk.rate >= max(p.rate for p in pts)
