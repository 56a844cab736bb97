"""`smetric sim`: simulate one routing policy on a trace; write one JSON object of metrics.

Example::

    smetric sim --policy smetric --rate-scale 2 --out out/smetric.json

Metrics: requests, duration_s, prefill_tps_within_slo (prompt tokens of requests that met
the TTFT SLO per second of the measurement window), slo_attainment, ttft_p50/p90/p99,
imbalance_mean/p99 (max/mean of per-instance running+waiting requests over 30 s windows),
reuse_total/local/global, sticks, migrations, first_turns (true first turns; SMetric's
follow-ups balanced because their session was evicted are evicted_followups), fetch_tokens,
fetch_wait_s (seconds requests waited for global-tier transfers), gpu_utilization and
link_utilization over the measurement window (*_run: over the whole simulated span),
sim_wall_s, and more. Dispatch (--dispatch): over_2x_slo / over_5x_slo (shares of measured
requests whose TTFT exceeded 2x / 5x their SLO), queue_wait_p50/p99 (seconds held at the
router), deferrals, rejected (explicit overload answers; 0 unless bounds are set). --match-at and --global-write choose how faithful the KV tiers are
(docs/research/simulator.md). --mode colocated: each instance also decodes (TPOT per request);
adds tps_within_slo (output tokens/s of requests meeting both the TTFT and the TPOT SLO),
output_tps, slo_attainment_both, tpot_attainment, tpot_p50/p90/p99, over_2x_tpot,
decode_batch_mean, decode_forwards / decode_events.
"""

from __future__ import annotations

import argparse
import math
import sys

from stack.commands.output import write_json
from stack.commands.simopts import (
    add_client_arguments,
    add_cluster_arguments,
    add_dispatch_arguments,
    add_load_arguments,
    check_policy,
)
from stack.policies import POLICIES
from stack.sim.engine import make_simulator
from stack.sim.options import SimOptions


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__
    p.add_argument("--policy", required=True, help=f"routing policy: {', '.join(POLICIES)}")
    add_cluster_arguments(p)
    add_dispatch_arguments(p)
    add_client_arguments(p)
    add_load_arguments(p)
    p.add_argument("--out", default="-", help="write the JSON metrics here ('-' = standard output)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def clean(metrics: dict) -> dict:
    """JSON-safe floats (NaN/inf become null)."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}


def run(args: argparse.Namespace) -> int:
    check_policy(args.policy)
    opts = SimOptions.from_args(args)
    cfg = opts.sim_config()
    trace = opts.read_trace()
    spec = opts.load_spec(trace)
    sim = make_simulator(trace, args.policy, cfg, spec)
    if args.no_progress or not sys.stderr.isatty():
        result = sim.run()
    else:
        from rich.progress import Progress

        with Progress(transient=True) as prog:
            task = prog.add_task(f"sim {args.policy}", total=1.0)
            horizon = spec.duration if spec.mode == "sessions" else None

            def report(t: float) -> None:
                h = horizon or getattr(sim, "horizon", 1.0) or 1.0
                prog.update(task, completed=min(1.0, t / h))

            result = sim.run(progress=report)
    out = write_json(clean(result.metrics), args.out)
    if out is not None:
        print(f"wrote {out}", file=sys.stderr)
    return 0
