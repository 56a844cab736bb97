"""Wall time of one `smetric bench` sweep on each executor: local processes and local Ray workers.

    python benchmarks/bench_executors.py [--sweep "--quick --no-plots"] [--repeat 1] [--out DIR]

Runs the same sweep with `--jobs 1`, `--jobs 2`, `--executor ray --jobs 1` and
`--executor ray --jobs 2` (a local Ray instance with that many CPUs, started and stopped
by the command itself), each as its own `smetric bench` process, and prints per run: the
command's wall time (Ray's start and stop included), the sweep's own wall time
(summary.json's bench_wall_s: from the executor's start to the last simulation back), the
executor's start within it (executor.start_s: Ray's start), the number of simulations,
the 1-minute load average just before the run, and whether results.csv equals the first
configuration's row for row (every column but sim_wall_s and sim_requests_per_s).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

CONFIGS = {
    "local --jobs 1": ["--jobs", "1"],
    "local --jobs 2": ["--jobs", "2"],
    "ray --jobs 1": ["--executor", "ray", "--jobs", "1"],
    "ray --jobs 2": ["--executor", "ray", "--jobs", "2"],
}
WALL_CLOCK = {"sim_wall_s", "sim_requests_per_s"}


def rows_without_wall_clock(path: Path) -> list[dict]:
    with path.open(newline="") as fh:
        return [{k: v for k, v in r.items() if k not in WALL_CLOCK} for r in csv.DictReader(fh)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", default="--quick --no-plots", help="smetric bench arguments of the sweep")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each configuration")
    ap.add_argument(
        "--configs", default=",".join(CONFIGS), help="comma-separated subset of the configurations"
    )
    ap.add_argument("--out", default=None, help="keep each run's output here (default: a temporary folder)")
    args = ap.parse_args()
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown or args.repeat < 1:
        ap.error(
            f"unknown configuration(s) {unknown} (known: {', '.join(CONFIGS)})"
            if unknown
            else "--repeat >= 1"
        )
    sweep = shlex.split(args.sweep)
    root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bench-executors-"))
    table = Table(title=f"smetric bench {args.sweep} ({os.cpu_count()} CPUs)")
    cols = (
        "executor",
        "run",
        "command s",
        "sweep s",
        "executor start s",
        "runs",
        "load before",
        "results.csv",
    )
    for col in cols:
        table.add_column(col, justify="right")
    walls: dict[str, list[float]] = {n: [] for n in names}
    reference: list[dict] | None = None
    failed = False
    for rep in range(args.repeat):
        for name in names:
            out = root / f"{name.replace(' ', '_').replace('--', '')}-{rep}"
            cmd = [sys.executable, "-m", "stack.cli", "bench", *sweep, *CONFIGS[name], "--no-progress"]
            cmd += ["--out", str(out)]
            load = os.getloadavg()[0]
            t0 = time.perf_counter()
            r = subprocess.run(cmd, capture_output=True, text=True)
            wall = time.perf_counter() - t0
            if r.returncode != 0:
                print(f"{name}: exit {r.returncode}\n{r.stderr[-2000:]}", file=sys.stderr)
                failed = True
                continue
            walls[name].append(wall)
            summary = json.loads((out / "summary.json").read_text())
            rows = rows_without_wall_clock(out / "results.csv")
            if reference is None:
                reference, same = rows, "reference"
            else:
                same = "equal" if rows == reference else "DIFFERENT"
                failed |= rows != reference
            table.add_row(
                name, str(rep + 1), f"{wall:.1f}", f"{summary['bench_wall_s']:.1f}",
                f"{summary['executor'].get('start_s', 0.0):.1f}", str(summary["runs"]), f"{load:.2f}", same,
            )  # fmt: skip
    console = Console(width=150)
    console.print(table)
    if args.repeat > 1:
        agg = Table(title=f"command wall s over {args.repeat} runs")
        for col in ("executor", "min", "median", "max"):
            agg.add_column(col, justify="right")
        for n, w in walls.items():
            if w:
                agg.add_row(n, f"{min(w):.1f}", f"{statistics.median(w):.1f}", f"{max(w):.1f}")
        console.print(agg)
    print(f"outputs in {root}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
