"""``python -m stack.faults``: run the scenarios, print each one's counts and the table of
docs/research/faults.md."""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from stack.faults.scenarios import SCENARIOS, Result


def table(results: list[Result]) -> str:
    lines = [
        "| fault | sent | succeeded | clean error | lost | checks |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        checks = ", ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in r.checks.items())
        c = r.counts
        lines.append(f"| {r.fault} | {c.sent} | {c.ok} | {c.clean} | {c.lost} | {checks} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m stack.faults", description="fault-injection scenarios against a local PD stack"
    )
    ap.add_argument("--only", action="append", choices=sorted(SCENARIOS), help="run only these (repeatable)")
    ap.add_argument(
        "--requests", type=int, default=200, help="requests per scenario (before the after-batch)"
    )
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument(
        "--deadline", type=float, default=60.0, help="seconds after which a request counts as hung"
    )
    ap.add_argument("--log-dir", default=None, help="keep process logs here (default: a temp dir)")
    a = ap.parse_args(argv)
    base = Path(a.log_dir or tempfile.mkdtemp(prefix="smetric-faults-"))
    results = []
    for name in a.only or list(SCENARIOS):
        t0 = time.monotonic()
        r = SCENARIOS[name](base / name, n=a.requests, concurrency=a.concurrency, deadline=a.deadline)
        results.append(r)
        print(f"{name}: {r.counts.row()} checks={r.checks} ({time.monotonic() - t0:.0f} s)", flush=True)
        for reason, k in sorted(r.counts.reasons.items()):
            print(f"    {k:5d}  {reason}")
        for note in r.notes:
            print(f"    {note}")
    print()
    print(table(results))
    print(f"\nload average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; logs in {base}")
    return 0 if all(r.passed for r in results) else 1
