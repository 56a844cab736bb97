"""Run the dispatch evidence matrix: a candidate default against the best baseline as shipped in
every cell (stack/bench/matrix.py says what a cell is and how it is judged), and print the table
of docs/dispatch.md, "The evidence matrix".

    python benchmarks/dispatch_matrix.py --candidate smetric-global+slack:T=4 --out out/matrix
    python benchmarks/dispatch_matrix.py --cells 'agentic default s0,mooncake synthetic' ...

Each cell is two `smetric bench` runs (the rate grid; then 1.1x the best baseline's peak rate),
written under OUT/<cell>/grid and OUT/<cell>/past. A run whose results.csv exists is not run
again (delete the folder to rerun it): give each candidate its own --out. Exit status 0 when
every check of every cell is met.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from stack.bench import matrix as M


def run_bench(argv: list[str], log: Path) -> None:
    out = Path(argv[argv.index("--out") + 1])
    if (out / "results.csv").exists():
        return
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        r = subprocess.run([sys.executable, "-m", "stack.cli", *argv], stdout=f, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        raise SystemExit(f"smetric {' '.join(argv)} failed (exit {r.returncode}); log: {log}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--candidate", required=True, help="the default under test, policy+order:params")
    ap.add_argument("--baselines", default=",".join(M.BASELINES), help="baselines as shipped (immediate)")
    ap.add_argument("--cells", default=None, help="comma-separated cell names (default: all)")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    baselines = tuple(b.strip() for b in args.baselines.split(",") if b.strip())
    cells = M.CELLS
    if args.cells:
        want = {c.strip() for c in args.cells.split(",")}
        unknown = want - {c.name for c in M.CELLS}
        if unknown:
            ap.error(f"unknown cell(s) {sorted(unknown)}; known: {[c.name for c in M.CELLS]}")
        cells = tuple(c for c in M.CELLS if c.name in want)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    points: dict[str, list[M.Point]] = {}
    t0 = time.time()
    with Progress(
        TextColumn("matrix"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
    ) as prog:
        task = prog.add_task("", total=2 * len(cells))
        for c in cells:
            cand = M.with_replicas(args.candidate, c.replicas)
            specs = [*baselines, cand]
            d = args.out / c.key
            prog.update(task, description=f"{c.name}: grid")
            run_bench(M.bench_argv(c, specs, c.rates, d / "grid", args.jobs), d / "grid.log")
            pts = M.read_points(d / "grid" / "results.csv")
            prog.advance(task)
            base = M.best_baseline(pts, baselines)
            prog.update(task, description=f"{c.name}: 1.1x {base.label}'s peak rate")
            r2 = M.past_peak_rate(base.rate)
            run_bench(M.bench_argv(c, [base.label, cand], [r2], d / "past", args.jobs), d / "past.log")
            points[c.name] = pts + M.read_points(d / "past" / "results.csv")
            prog.advance(task)
    base_peaks = {n: M.best_baseline(p, baselines).tps for n, p in points.items()}
    tol = M.tolerances(cells, base_peaks)
    verdicts = []
    for c in cells:
        v = M.judge(
            c, points[c.name], M.label_of(M.with_replicas(args.candidate, c.replicas)), baselines, tol[c.name]
        )
        verdicts.append(v)
    by_name = {v.cell.name: v for v in verdicts}
    for v in verdicts:
        if v.cell.replicas > 1:
            single = next(
                (
                    by_name[c.name]
                    for c in cells
                    if c.replicas == 1
                    and c.trace == v.cell.trace
                    and c.seed == v.cell.seed
                    and c.setting is None
                ),
                None,
            )
            if single is not None:
                v.checks[f"keeps {M.REPLICA_SHARE:.0%} of 1-replica gain"] = M.replica_check(v, single)
    text = M.table(verdicts)
    w = M.worst(verdicts)
    print(
        f"candidate {args.candidate}; baselines {', '.join(baselines)} (immediate); {time.time() - t0:.0f} s\n"
    )
    print(text)
    print(f"worst cell: {w.cell.name} (x{w.ratio:.3f}, tolerance {w.tolerance * 100:.1f}%)")
    print("all checks met" if all(v.ok for v in verdicts) else "some checks missed")
    (args.out / "matrix.md").write_text(text)
    (args.out / "matrix.json").write_text(
        json.dumps(
            [
                {
                    "cell": v.cell.name,
                    "ratio": v.ratio,
                    "tolerance": v.tolerance,
                    "candidate": vars(v.candidate),
                    "baseline": vars(v.baseline),
                    "checks": v.checks,
                }
                for v in verdicts
            ],
            indent=2,
        )
    )
    return 0 if all(v.ok for v in verdicts) else 1


if __name__ == "__main__":
    raise SystemExit(main())
