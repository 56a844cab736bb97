"""Run the dispatch evidence matrix, or the protocol of issue 48: a candidate default against the
best baseline as shipped in every cell (stack/bench/matrix.py says what a cell is and how it is
judged), and print the table of docs/research/dispatch.md, "The evidence matrix", or the protocol's.

    python benchmarks/dispatch_matrix.py --candidate smetric-global+slack:T=4 --out out/matrix
    python benchmarks/dispatch_matrix.py --cells 'agentic default s0,mooncake synthetic' ...
    # the protocol (docs/research/dispatch.md, "Choosing the next default: the protocol"): screening,
    # then every seed; the client model on, the chaos floor measured per group of cells
    python benchmarks/dispatch_matrix.py --matrix protocol --stage screen --clients \\
        --candidate "smetric-global+deadline-defer:..." --out out/p48/c0-screen

Each cell is two `smetric bench` runs (the rate grid; then 1.1x the best baseline's peak rate),
written under OUT/<cell>/grid and OUT/<cell>/past; with --chaos N (the protocol's default 10),
the first cell of each group adds N runs of the best baseline at its peak rate under
`--perturb 0..N-1` (OUT/<cell>/chaos/pK), whose band gives the group's chaos floor. A run whose
results.csv exists is not run again (delete the folder to rerun it): give each candidate its
own --out. With --baselines-from DIR (another candidate's --out), the baselines' runs are read
from DIR and only the candidate runs. Writes OUT/matrix.md and OUT/matrix.json. Exit status 0 when every check of every
cell is met.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from stack.bench import matrix as M


@dataclass(frozen=True)
class Run:
    """How every bench run of this matrix is made (besides its cell, policies and rates)."""

    jobs: int
    clients: M.Clients | None
    extra: tuple[str, ...]

    def argv(
        self,
        cell: M.Cell,
        specs: Sequence[str],
        rates: Sequence[float],
        out: Path,
        perturb: int | None = None,
        jobs: int | None = None,
    ) -> list[str]:
        return M.bench_argv(
            cell,
            specs,
            rates,
            out,
            self.jobs if jobs is None else jobs,
            clients=self.clients,
            perturb=perturb,
            extra=self.extra,
        )


def run_bench(argv: list[str], log: Path) -> None:
    out = Path(argv[argv.index("--out") + 1])
    if (out / "results.csv").exists():
        return
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        r = subprocess.run([sys.executable, "-m", "stack.cli", *argv], stdout=f, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        raise SystemExit(f"smetric {' '.join(argv)} failed (exit {r.returncode}); log: {log}")


def run_cell(
    c: M.Cell,
    candidate: str,
    baselines: Sequence[str],
    d: Path,
    run: Run,
    say: Callable[[str], None],
    reuse: Path | None = None,
) -> list[M.Point]:
    """The grid, then the best baseline and the candidate at 1.1x the baseline's peak rate.
    ``reuse``: the baselines' runs of this cell are read from there (another candidate's
    ``--out`` for the same cells and options), and only the candidate runs."""
    say(f"{c.name}: grid")
    if reuse is None:
        run_bench(run.argv(c, [*baselines, candidate], c.rates, d / "grid"), d / "grid.log")
        pts = M.read_points(d / "grid" / "results.csv")
    else:
        run_bench(run.argv(c, [candidate], c.rates, d / "grid"), d / "grid.log")
        pts = M.read_points(d / "grid" / "results.csv") + reused(reuse / "grid", baselines, c.rates)
    base = M.best_baseline(pts, baselines)
    say(f"{c.name}: 1.1x {base.label}'s peak rate")
    r2 = M.past_peak_rate(base.rate)
    if reuse is None:
        run_bench(run.argv(c, [base.label, candidate], [r2], d / "past"), d / "past.log")
        return pts + M.read_points(d / "past" / "results.csv")
    run_bench(run.argv(c, [candidate], [r2], d / "past"), d / "past.log")
    return pts + M.read_points(d / "past" / "results.csv") + reused(reuse / "past", [base.label], [r2])


def reused(d: Path, labels: Sequence[str], rates: Sequence[float]) -> list[M.Point]:
    """The points of ``labels`` at ``rates`` in the run at ``d`` (``--baselines-from``): every
    one must be there, or the reuse is refused (the runs were made with other cells or rates)."""
    f = d / "results.csv"
    if not f.exists():
        raise SystemExit(
            f"dispatch_matrix: --baselines-from: {f} is missing (run that candidate's matrix first)"
        )
    pts = M.read_points(f)
    out = []
    for label in labels:
        for r in rates:
            p = M.at(pts, label, r)
            if p is None:
                raise SystemExit(f"dispatch_matrix: --baselines-from: {f} has no {label} at rate {r}")
            out.append(p)
    return out


def run_chaos(c: M.Cell, base: M.Point, n: int, d: Path, run: Run, reuse: bool = False) -> list[float]:
    """The best baseline at its peak rate under ``--perturb 0..n-1`` (one simulation each, run
    side by side): its TPS within SLO per perturbation. ``reuse``: read from ``d``, run nothing."""

    def one(k: int) -> float:
        out = d / "chaos" / f"p{k}"
        if reuse:
            return next(p.tps for p in reused(out, [base.label], [base.rate]))
        run_bench(run.argv(c, [base.label], [base.rate], out, perturb=k, jobs=1), d / "chaos" / f"p{k}.log")
        return next(p.tps for p in M.read_points(out / "results.csv") if p.label == base.label)

    with ThreadPoolExecutor(max_workers=max(1, run.jobs)) as pool:
        return list(pool.map(one, range(n)))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--candidate", required=True, help="the default under test, policy+order:params")
    ap.add_argument(
        "--matrix",
        choices=("evidence", "protocol"),
        default="evidence",
        help="evidence: the 11 cells of docs/research/dispatch.md's evidence matrix; protocol: issue 48's cells "
        "and checks (docs/research/dispatch.md, 'Choosing the next default: the protocol')",
    )
    ap.add_argument(
        "--stage",
        choices=M.STAGES,
        default="screen",
        help="--matrix protocol: screen (every cell at seed 0, agentic at seeds 0-2) or full (every seed)",
    )
    ap.add_argument(
        "--baselines",
        default=None,
        help="baselines as shipped (immediate), comma-separated (default: least-load,lmetric for the "
        "evidence matrix, least-load,lmetric,linear,dynamo for the protocol)",
    )
    ap.add_argument("--cells", default=None, help="comma-separated cell or group names (default: all)")
    ap.add_argument(
        "--baselines-from",
        type=Path,
        default=None,
        metavar="DIR",
        help="read the baselines' runs (grid, 1.1x, chaos floor) from DIR, another candidate's --out made "
        "with the same matrix, stage, baselines, client model and bench args; only the candidate runs",
    )
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument(
        "--clients",
        action="store_true",
        help="the client model (smetric bench --clients: timeouts and retries, TTFT from the first attempt)",
    )
    ap.add_argument(
        "--client-patience", type=float, default=None, help="--clients: bench's --client-patience"
    )
    ap.add_argument("--client-retries", type=int, default=None, help="--clients: bench's --client-retries")
    ap.add_argument(
        "--chaos",
        type=int,
        default=None,
        metavar="N",
        help="measure each group's chaos floor over --perturb 0..N-1 (default: 10 for the protocol, "
        "0 (none) for the evidence matrix)",
    )
    ap.add_argument(
        "--bench-args",
        default="",
        help="more smetric bench options for every run, one string (e.g. '--executor ray', or a short "
        "smoke run: '--instances 4 --duration 600'); write it --bench-args='...'",
    )
    return ap.parse_args(argv)


def setup(args: argparse.Namespace) -> tuple[tuple[M.Cell, ...], tuple[str, ...], Run, int]:
    """The cells, baselines, how to run them and the chaos runs per group, from the options."""
    protocol = args.matrix == "protocol"
    cells = M.select_cells(M.protocol_cells(args.stage) if protocol else M.CELLS, args.cells)
    default = M.PROTOCOL_BASELINES if protocol else M.BASELINES
    baselines = tuple(b.strip() for b in (args.baselines or ",".join(default)).split(",") if b.strip())
    if args.client_patience is not None or args.client_retries is not None:
        if not args.clients:
            raise ValueError("--client-patience and --client-retries need --clients")
    clients = M.Clients(args.client_patience, args.client_retries) if args.clients else None
    run = Run(args.jobs, clients, tuple(shlex.split(args.bench_args)))
    chaos = args.chaos if args.chaos is not None else (M.CHAOS_RUNS if protocol else 0)
    if chaos == 1 or chaos < 0:
        raise ValueError("--chaos: 0 (none) or at least 2 perturbations")
    return cells, baselines, run, chaos


def add_replica_checks(cells: Sequence[M.Cell], verdicts: Sequence[M.Verdict]) -> None:
    """The evidence matrix's replica check: N replicas keep 80% of the 1-replica gain."""
    by_name = {v.cell.name: v for v in verdicts}
    for v in verdicts:
        if v.cell.replicas <= 1:
            continue
        single = next(
            (
                by_name[c.name]
                for c in cells
                if c.replicas == 1 and c.trace == v.cell.trace and c.seed == v.cell.seed and c.setting is None
            ),
            None,
        )
        if single is not None:
            v.checks[f"keeps {M.REPLICA_SHARE:.0%} of 1-replica gain"] = M.replica_check(v, single)


def judge_all(
    args: argparse.Namespace,
    cells: Sequence[M.Cell],
    baselines: Sequence[str],
    points: dict[str, list[M.Point]],
    tols: dict[str, M.Tolerance],
) -> list[M.Verdict]:
    verdicts = []
    for c in cells:
        label = M.label_of(M.with_replicas(args.candidate, c.replicas))
        if args.matrix == "protocol":
            verdicts.append(M.judge_protocol(c, points[c.name], label, baselines, tols[c.name]))
        else:
            v = M.judge(c, points[c.name], label, baselines, tols[c.name].value)
            v.tolerance_source = tols[c.name].source
            verdicts.append(v)
    if args.matrix == "evidence":
        add_replica_checks(cells, verdicts)
    return verdicts


def report(
    args: argparse.Namespace,
    baselines: Sequence[str],
    verdicts: Sequence[M.Verdict],
    tols: dict[str, M.Tolerance],
    edge: dict[str, bool],
    wall: float,
) -> None:
    protocol = args.matrix == "protocol"
    text = M.protocol_table(verdicts) if protocol else M.table(verdicts)
    clients = "client model on" if args.clients else "client model off"
    print(
        f"candidate {args.candidate}; baselines {', '.join(baselines)} (immediate); {clients}; {wall:.0f} s\n"
    )
    print(text)
    gain = M.group_gain(verdicts, "agentic") if protocol else None
    if gain is not None:
        print(
            f"agentic peak gain: mean x{gain[0]:.3f}, lowest x{gain[1]:.3f} (the chosen default needs x{M.PROTOCOL_GAIN})"
        )
    if not protocol:
        w = M.worst(verdicts)
        print(f"worst cell: {w.cell.name} (x{w.ratio:.3f}, tolerance {w.tolerance * 100:.1f}%)")
    top = [v.cell.name for v in verdicts if edge.get(v.cell.name)]
    if top:
        print(f"note: a peak at the highest rate run (widen the grid): {', '.join(top)}")
    nfail = M.failed_checks(verdicts)
    passed = sum(v.ok for v in verdicts)
    print(f"{passed} of {len(verdicts)} cells pass; {nfail} check(s) failed")
    (args.out / "matrix.md").write_text(text)
    doc = {
        "matrix": args.matrix,
        "stage": args.stage if protocol else None,
        "candidate": args.candidate,
        "baselines": list(baselines),
        "baselines_from": None if args.baselines_from is None else str(args.baselines_from),
        "clients": args.clients,
        "chaos_runs": args.chaos_runs,
        "wall_s": wall,
        "cells_passed": passed,
        "failed_checks": nfail,
        "agentic_gain": None
        if gain is None
        else {"mean": gain[0], "lowest": gain[1], "bar": M.PROTOCOL_GAIN},
        "cells": [
            {**M.verdict_json(v, tols[v.cell.name]), "peak_at_top_rate": edge[v.cell.name]} for v in verdicts
        ],
    }
    (args.out / "matrix.json").write_text(json.dumps(doc, indent=2))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cells, baselines, run, chaos = setup(args)
    except ValueError as e:
        raise SystemExit(f"dispatch_matrix: {e}") from None
    args.chaos_runs = chaos
    if args.matrix == "protocol" and not args.clients:
        print("note: the protocol runs with the client model on (--clients)", file=sys.stderr)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    floor_at = M.floor_cells(cells) if chaos else {}
    points: dict[str, list[M.Point]] = {}
    floors: dict[str, float | None] = {}
    t0 = time.time()
    with Progress(
        TextColumn("matrix"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
    ) as prog:
        task = prog.add_task("", total=len(cells))

        def say(text: str) -> None:
            prog.update(task, description=text)

        for c in cells:
            cand = M.with_replicas(args.candidate, c.replicas)
            d = args.out / c.key
            reuse = args.baselines_from / c.key if args.baselines_from is not None else None
            points[c.name] = run_cell(c, cand, baselines, d, run, say, reuse)
            if floor_at.get(M.group_of(c)) == c:
                base = M.best_baseline(points[c.name], baselines)
                say(f"{c.name}: chaos floor, {base.label} under {chaos} perturbations")
                tps = run_chaos(c, base, chaos, reuse or d, run, reuse is not None)
                floors[M.group_of(c)] = M.chaos_floor(tps)
            prog.advance(task)
    base_peaks = {n: M.best_baseline(p, baselines).tps for n, p in points.items()}
    tols = M.cell_tolerances(cells, base_peaks, floors)
    verdicts = judge_all(args, cells, baselines, points, tols)
    edge = {
        v.cell.name: M.peak_at_top(points[v.cell.name], v.candidate.label)
        or M.peak_at_top(points[v.cell.name], v.baseline.label)
        for v in verdicts
    }
    report(args, baselines, verdicts, tols, edge, time.time() - t0)
    return 0 if all(v.ok for v in verdicts) else 1


if __name__ == "__main__":
    raise SystemExit(main())
