"""Simulator speed and memory: requests simulated per second of wall time, peak RSS.

    python benchmarks/sim_speed.py [--trace PATH] [--policies smetric,lmetric] [--rate-scale 2] [--clients]

Runs the whole trace (every session once, in compress mode at the trace's own clock, and a
stationary sessions-mode run) on one core and prints the figures side by side.
"""

from __future__ import annotations

import argparse
import resource
import time

from rich.console import Console
from rich.table import Table

from stack.sim.clients import ClientModel
from stack.sim.engine import SimConfig, Simulator
from stack.sim.load import LoadSpec
from stack.traces import shipped
from stack.traces.load import load_trace


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--trace",
        default=str(shipped("claude_code_agentic")),
        help="trace file (default: the shipped 470-session agentic trace, stack/data/)",
    )
    ap.add_argument("--policies", default="smetric,smetric-global,lmetric,least-load")
    ap.add_argument("--rate-scale", type=float, default=2.0)
    ap.add_argument("--instances", type=int, default=32)
    ap.add_argument(
        "--clients",
        action="store_true",
        help="with the client model on (stack/sim/clients.py: patience, retries), to measure its cost",
    )
    args = ap.parse_args()
    t0 = time.perf_counter()
    trace = load_trace(args.trace)
    load_s = time.perf_counter() - t0
    table = Table(
        title=f"simulator speed: {trace.name}, {len(trace.requests)} requests, {args.instances} instances"
        + (", client model on" if args.clients else "")
    )
    for col in ("policy", "load", "requests", "wall s", "requests/s"):
        table.add_column(col, justify="right")
    for pol in args.policies.split(","):
        for mode in ("compress", "sessions"):
            spec = LoadSpec(mode=mode, rate_scale=args.rate_scale if mode == "sessions" else 1.0)
            clients = ClientModel() if args.clients else None
            sim = Simulator(trace, pol, SimConfig(instances=args.instances, clients=clients), spec)
            m = sim.run().metrics
            label = "whole trace, own clock" if mode == "compress" else f"stationary x{args.rate_scale}, 8 h"
            table.add_row(
                pol,
                label,
                f"{m['requests_total']:,}",
                f"{m['sim_wall_s']:.2f}",
                f"{m['sim_requests_per_s']:,.0f}",
            )
    Console().print(table)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"trace load: {load_s:.2f} s; peak RSS of the whole run: {rss:.0f} MiB")


if __name__ == "__main__":
    main()
