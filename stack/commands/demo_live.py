"""`smetric demo-live`: the main job. The question at the scale where it has an answer, and the
live stack held to its model at a scale it can run.

1. **Cluster scale (simulated).** The product (smetric-global behind the router's default
   dispatch queue) against the baselines as their authors ship them (least-load, LMetric,
   Dynamo) on the full 470-session agentic trace, 32 H20 instances, 8 h of sessions at that
   cluster's knee, over a few seeds, with P99 TTFT and the share of requests past 5x their SLO.
2. **The main job's scale (simulated).** The same policies on the local cluster (8 prefill
   instances) and its workload (``stack/data/agentic_short.jsonl.gz``: 317 short agentic
   sessions) at that cluster's knee, over ``--seeds`` seeds: every policy's band (10th-90th
   percentile over seeds) and the paired ratio of the product to each baseline. A winner is
   named only when the ratio's whole band is on one side of 1. The chaos floor (the same
   run perturbed by 1 ms on arrivals and 1% on think times) says how far one run can move.
3. **Live.** The local PD stack (``smetric up``: mooncake_master, emulated prefill and decode
   workers sharing a few processes, the router) replays the workload through the router at the
   same rate and seed, once per policy (``--repeat``), beside the simulator's figures for that
   seed; each live figure is held to its band, widened by the chaos floor.

Then one verdict line. Everything started is stopped again (also on Ctrl-C). Times are
modelled seconds (wall seconds / the emulator's time factor). How the defaults were chosen
(workload, rates, seeds): docs/research/fidelity.md, "The main job". ``--long``: the longer, tighter
version (1800 s of arrivals, 20 seeds, 5 cluster-scale seeds).
"""

from __future__ import annotations

import argparse
import sys

from stack.bench.live import add_window_arguments
from stack.bench.main_job import DEFAULT_POLICIES, SIM_BASELINES, dispatch_of
from stack.traces.shipped import shipped

__all__ = ["DEFAULT_POLICIES", "add_arguments", "dispatch_of", "main", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__
    p.add_argument(
        "--policies",
        default=",".join(DEFAULT_POLICIES),
        help="comma-separated router policies run live; policy+order[:k=v...] runs the router's dispatch "
        "queue with that order (as `smetric bench --policies`), a bare name runs without a queue "
        "(immediate), live and simulated alike. The first is the one compared against the others "
        "(default: the product, smetric-global with the router's default dispatch, against LMetric "
        "as its authors ship it)",
    )
    p.add_argument(
        "--sim-baselines",
        default=",".join(SIM_BASELINES),
        help="further baselines compared in the simulator only, at the main job's scale ('' for none)",
    )
    p.add_argument("--trace", default=str(shipped("agentic_short")), help="agentic or Mooncake JSONL trace")
    p.add_argument("--prefill", type=int, default=8, help="emulated prefill workers")
    p.add_argument("--decode", type=int, default=2, help="emulated decode workers")
    p.add_argument(
        "--workers-per-process",
        type=int,
        default=4,
        help="emulated workers sharing one process (each its own endpoint, KV events, Mooncake clients)",
    )
    p.add_argument(
        "--time-factor",
        type=float,
        default=0.6,
        help="emulator wall seconds per modelled second (at 0.3 the host work of this workload's ~2,000 "
        "requests saturates 2 cores and the queued product falls far below its model: docs/research/fidelity.md)",
    )
    p.add_argument(
        "--session-rate",
        type=float,
        default=None,
        help="session starts per modelled second (default: the knee, chosen by the simulator)",
    )
    p.add_argument(
        "--knee-share",
        type=float,
        default=0.9,
        help="the knee: highest rate where the best baseline keeps this share of its light-load attainment",
    )
    add_window_arguments(p)
    # 400 modelled s of arrivals (the first 60 warm-up): the shortest window whose bands stay
    # within +-15% at the knee (docs/research/fidelity.md, "The main job")
    p.set_defaults(duration=400.0, warmup=60.0)
    p.add_argument("--seeds", type=int, default=10, help="seeds of the model's bands (0..N-1; at least 10)")
    p.add_argument(
        "--perturbations", type=int, default=10, help="perturbed runs of the run's seed (the chaos floor)"
    )
    p.add_argument("--scale-seeds", type=int, default=3, help="seeds of the cluster-scale comparison")
    p.add_argument("--scale-jobs", type=int, default=2, help="simulator processes for the cluster scale")
    p.add_argument("--no-scale", action="store_true", help="skip the cluster-scale comparison")
    p.add_argument(
        "--long",
        action="store_true",
        help="the longer, tighter version: 1800 modelled s of arrivals, 20 seeds, 20 perturbations, "
        "5 cluster-scale seeds",
    )
    p.add_argument("--repeat", type=int, default=1, help="live runs per policy (run-to-run spread)")
    p.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="wall seconds per request, also the PD twins' bootstrap wait (default: 3000 modelled "
        "seconds, so that only a stuck request times out: the simulator has no timeouts)",
    )
    p.add_argument(
        "--config", default=None, help="deployment YAML for `smetric up` (default configs/local.yaml)"
    )
    p.add_argument("--no-mooncake", action="store_true", help="no mooncake_master (no global tier)")
    p.add_argument(
        "--shared-nic",
        action="store_true",
        help="the prefill workers share one NIC for their global-tier fetches (at most one "
        "server's GPUs, 8 on h20): emulated (launch.emulator.link_file), booked by the router "
        "(router.link: host) and simulated (--link shared) alike; default: a NIC per worker",
    )
    p.add_argument("--no-live", action="store_true", help="the simulated parts only (no local stack)")
    p.add_argument("--no-sim", action="store_true", help="live figures only (no simulator beside them)")
    p.add_argument("--sim", action="store_true", help=argparse.SUPPRESS)  # the default now; kept
    p.add_argument("--out", default=None, help="write all results as one JSON file here")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    from stack.bench.main_job_run import run_main_job

    return run_main_job(args)


def main(argv: list[str] | None = None) -> int:  # `python -m stack.commands.demo_live`
    p = argparse.ArgumentParser(
        prog="smetric demo-live", formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
