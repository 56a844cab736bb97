"""`smetric demo`: a short simulated comparison of SMetric with the main baselines on the
trace slice shipped in the package (60 real Claude Code agent sessions).

Runs the product's default configuration (smetric-global behind the router's default
dispatch queue, ``ROUTER_DISPATCH``, as the router ships: docs/research/dispatch.md, "The
default"), smetric and smetric-global without a queue, and the baselines as their authors
ship them (lmetric, linear, least-load and dynamo, immediate dispatch) on a simulated
PD-disaggregated prefill cluster (H20 calibration, full global tier) at a few stationary
session arrival rates around the cluster's knee, and prints peak prefill TPS within the
TTFT SLO, capacity (highest rate with >= 90% of requests within SLO), TTFT p50/p90 at
SMetric's peak rate, reuse (local / global tier) and the SMetric-vs-best-baseline ratios.
About a minute on two cores (`--quick`: a few seconds, 8 instances).

For the full study use `smetric bench` (rate search, named experiments, plots).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from stack.bench.experiments import Setting
from stack.commands.simopts import add_cluster_arguments, add_load_arguments
from stack.dispatch import ROUTER_DISPATCH

DEMO_POLICIES = (
    f"smetric-global+{ROUTER_DISPATCH.label()}",  # the product's default: the router's dispatch
    "smetric",
    "smetric-global",
    "lmetric",
    "linear",
    "least-load",
    "dynamo",
)
# rates as fractions of the clairvoyant bound's rate (where offered load = cluster compute)
FULL = {"instances": 32, "duration": 10800.0, "fractions": (0.5, 0.7, 0.85, 1.0)}
QUICK = {"instances": 8, "duration": 3600.0, "fractions": (0.6, 0.85, 1.1)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__
    p.add_argument("--quick", action="store_true", help="even smaller: 8 instances, 1 h of arrivals, 3 rates")
    p.add_argument(
        "--rates", default=None, help="comma-separated session rates (sessions/s) instead of the defaults"
    )
    p.add_argument(
        "--policies", default=None, help=f"comma-separated policies (default: {','.join(DEMO_POLICIES)})"
    )
    p.add_argument("--jobs", type=int, default=2, help="parallel worker processes")
    p.add_argument("--out", default=None, help="also write results.csv, summary.json and plots here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_cluster_arguments(p)
    add_load_arguments(p, rate=False)
    p.set_defaults(instances=None, duration=None)


def run(args: argparse.Namespace) -> int:
    from stack.bench.bound import clairvoyant
    from stack.bench.experiments import parse_policies, parse_rates
    from stack.bench.report import print_summary
    from stack.bench.sweep import run_bench
    from stack.core.cost_model import load_hardware
    from stack.sim.options import SimOptions

    preset = QUICK if args.quick else FULL
    if args.instances is None:
        args.instances = preset["instances"]
    if args.duration is None:
        args.duration = preset["duration"]
    if args.instances <= 0:
        raise ValueError("--instances must be > 0")
    if args.jobs < 1:
        raise ValueError("--jobs must be >= 1")
    policies = parse_policies(args.policies, DEMO_POLICIES)
    rates = parse_rates(args.rates)
    if rates is None:
        opts = SimOptions.from_args(args)
        trace = opts.read_trace()
        b = clairvoyant(
            trace, load_hardware(opts.hardware), opts.instances, opts.resolved_mode(trace), opts.duration
        )
        rates = [round(b.rate * f, 4) for f in preset["fractions"]]
    result = run_bench(
        args,
        experiment="demo",
        settings=(Setting(),),
        policies=policies,
        rates=rates,
        out=Path(args.out) if args.out else None,
        jobs=args.jobs,
        plots=bool(args.out),
        progress=not args.no_progress and sys.stderr.isatty(),
        command="smetric demo" + (" --quick" if args.quick else ""),
    )
    print_summary(result["summary"], result["rate_unit"])
    s = result["summary"]
    print(
        f"\n{len(result['rows'])} simulations: {args.instances} H20 prefill instances, rates {', '.join(f'{r:g}' for r in rates)} "
        f"{result['rate_unit']}, {Path(args.trace).name}. Full study: smetric bench --help"
    )
    if s.get("smetric_vs_best_baseline") is not None:
        print(f"SMetric vs best baseline, peak prefill TPS within SLO: x{s['smetric_vs_best_baseline']:.3f}")
    return 0
