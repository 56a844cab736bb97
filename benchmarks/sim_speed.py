"""Simulator speed and memory: requests simulated per second of wall time, peak RSS.

    python benchmarks/sim_speed.py [--trace PATH] [--policies smetric,lmetric] [--rate-scale 2] [--clients]
    python benchmarks/sim_speed.py --policies 'smetric-global+deadline-defer:...,smetric-global+...' \
        --modes sessions --clients --repeat 5      # two dispatch specs, 5 interleaved runs each

Runs the whole trace (every session once, in compress mode at the trace's own clock, and a
stationary sessions-mode run) on one core and prints the figures side by side. A policy written
``policy+order[:k=v...]`` runs behind that dispatch spec. With ``--repeat N`` every policy runs N
times, the policies' order alternating from one round to the next, and the table gives each
one's median wall and CPU seconds (the CPU seconds move less with what else the machine runs).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

from rich.console import Console
from rich.table import Table

from stack.bench.main_job import dispatch_of
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
    ap.add_argument("--modes", default="compress,sessions", help="load modes to run (compress, sessions)")
    ap.add_argument(
        "--repeat", type=int, default=1, help="runs per policy and mode, interleaved; medians shown"
    )
    args = ap.parse_args()
    t0 = time.perf_counter()
    trace = load_trace(args.trace)
    load_s = time.perf_counter() - t0
    table = Table(
        title=f"simulator speed: {trace.name}, {len(trace.requests)} requests, {args.instances} instances"
        + (", client model on" if args.clients else "")
        + (f", median of {args.repeat} interleaved runs" if args.repeat > 1 else "")
    )
    for col in ("policy", "load", "requests", "wall s", "CPU s", "requests/s"):
        table.add_column(col, justify="right", overflow="fold")
    pols = [p.strip() for p in args.policies.split(",") if p.strip()]
    for mode in [m.strip() for m in args.modes.split(",")]:
        spec = LoadSpec(mode=mode, rate_scale=args.rate_scale if mode == "sessions" else 1.0)
        runs: dict[str, list[tuple[float, float, int]]] = {p: [] for p in pols}
        for i in range(args.repeat):
            for pol in pols if i % 2 == 0 else pols[::-1]:
                name, dispatch = dispatch_of(pol)
                clients = ClientModel() if args.clients else None
                cfg = SimConfig(instances=args.instances, clients=clients, dispatch=dispatch)
                c0 = time.process_time()
                m = Simulator(trace, name, cfg, spec).run().metrics
                runs[pol].append((m["sim_wall_s"], time.process_time() - c0, m["requests_total"]))
        label = "whole trace, own clock" if mode == "compress" else f"stationary x{args.rate_scale}, 8 h"
        for pol in pols:
            wall = statistics.median(r[0] for r in runs[pol])
            cpu = statistics.median(r[1] for r in runs[pol])
            n = runs[pol][0][2]
            table.add_row(pol, label, f"{n:,}", f"{wall:.2f}", f"{cpu:.2f}", f"{n / wall:,.0f}")
    Console().print(table)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"trace load: {load_s:.2f} s; peak RSS of the whole run: {rss:.0f} MiB")


if __name__ == "__main__":
    main()
