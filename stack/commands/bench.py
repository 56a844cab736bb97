"""`smetric bench`: sweep policies x rates (x settings) in parallel; results, summary, plots.

Examples::

    smetric bench --quick                                   # small run on the shipped slice (~1 min)
    smetric bench --trace stack/data/claude_code_agentic.jsonl.gz --policies all --out out/main --jobs 2
    smetric bench --trace T --experiment global-tier --out out/gt
    smetric bench --trace T --policies smetric,lmetric,dynamo --rates 0.1,0.13,0.16 --out out/x

Rates: for traces without a global clock (the agentic trace; `--load-mode sessions`),
a rate is a stationary session arrival rate in sessions per second (seeded Poisson session
starts replaying whole sessions; docs/definitions.md). For traces with a real global
clock (Mooncake) in the default `compress` load mode, a rate is a time-compression
factor of the trace's own clock (1 = as recorded). Without --rates, each policy's peak is
found by a search whose rates bracket the knee of its TPS-within-SLO curve.

Writes DIR/results.csv (one row per policy x rate x setting: the setting's columns plus
every field of `smetric sim`), DIR/summary.json (per setting and policy: peak prefill TPS
within SLO and its rate, capacity = the highest rate with >= 90% SLO attainment, TTFT
p50/p90 at SMetric's peak rate, smetric_vs_best_baseline and
smetric_capacity_vs_best_baseline, the same for faithful smetric alone, and the
clairvoyant upper bound), DIR/curves.json (TTFT and imbalance quantiles per run), PNG
plots, and prints a table.

Dispatch (--dispatch immediate,deadline-defer,slack:age_k=2, ...): an axis beside
--policies; each (policy, order) pair is run as a policy of its own, labelled
``policy+order`` (the policy's name alone for the default ``immediate``), each row says its
``dispatch``; summary.json adds per label ``dispatch``, TTFT p99 and the shares of requests
over 2x / 5x their SLO at SMetric's peak rate (and at the label's own peak), and
tail_tradeoff.png plots TPS within SLO against the tail. --dispatch-param applies to every
order but immediate.

Experiments (--experiment): pd-disagg (default; main comparison), global-tier, slo,
hyper, ablation, scale, local-tier, colocation (PD colocation: adds DIR/colocation.json and
colocation.md, peak output TPS within the TTFT and TPOT SLOs per policy). See
stack/bench/experiments.py.

Executors (--executor): local (default; --jobs processes) or ray (each simulation a Ray
task: a local Ray instance with --jobs CPUs, or the cluster at --address / $RAY_ADDRESS;
the extra stack[ray]; docs/research/ray.md). Same results either way. A run that fails (or loses
its worker) is retried once; one that fails again is listed under failed_runs in
summary.json, and the command exits 1 after writing everything.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from stack.bench.executor_choice import EXECUTORS
from stack.bench.experiments import (
    CORE_POLICIES,
    EXPERIMENTS,
    get_experiment,
    parse_policies,
    parse_rates,
    select_settings,
)
from stack.bench.sweep import resummarize, run_bench
from stack.commands.simopts import (
    add_client_arguments,
    add_cluster_arguments,
    add_dispatch_arguments,
    add_load_arguments,
)
from stack.paths import default_trace

QUICK = {"instances": 8, "duration": 7200.0}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__
    p.add_argument(
        "--policies",
        default=None,
        help="all, main (the paper's comparison + our variants), core, or a comma-separated list "
        "(default: the experiment's list); an entry policy+order (e.g. smetric-global+slack) runs "
        "that policy with that dispatch order only, instead of every order of --dispatch",
    )
    p.add_argument(
        "--rates",
        default=None,
        help="comma-separated rates: sessions/s (sessions mode) or time-compression factors "
        "(compress mode, traces with a global clock). Default: search each policy's peak",
    )
    p.add_argument("--experiment", default="pd-disagg", help=f"named experiment: {', '.join(EXPERIMENTS)}")
    p.add_argument(
        "--settings",
        default=None,
        help="comma-separated subset of the experiment's settings (labels as in results.csv)",
    )
    p.add_argument(
        "--out", default=None, help="output directory (default: bench-out/<experiment>, or bench-out/quick)"
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"small version on the shipped slice: {QUICK['instances']} instances, {QUICK['duration']:.0f} s of "
        f"arrivals, policies {','.join(CORE_POLICIES)} (unless given); ~1 min on two cores",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=2,
        help="parallel simulations: local worker processes, or the CPUs of the local Ray instance "
        "(--executor ray without --address; a cluster's size sets its own)",
    )
    p.add_argument(
        "--executor",
        choices=EXECUTORS,
        default="local",
        help="where simulations run: local processes, or Ray tasks (the optional extra "
        "stack[ray]; see docs/research/ray.md)",
    )
    p.add_argument(
        "--address",
        default=None,
        help="with --executor ray: the Ray cluster to join (auto, HOST:PORT of its GCS, or "
        "ray://HOST:PORT); default $RAY_ADDRESS, else a local Ray instance with --jobs CPUs",
    )
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument(
        "--resummarize",
        action="store_true",
        help="run nothing: recompute summary.json, summary.md and the plots from DIR/results.csv "
        "(give the same --trace and --experiment)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--max-rounds", type=int, default=6, help="rate-search refinement rounds (without --rates)"
    )
    add_cluster_arguments(p)
    add_dispatch_arguments(p, axis=True)
    add_client_arguments(p)
    add_load_arguments(p, rate=False)


def _explicit(argv: list[str], *flags: str) -> bool:
    return any(a == f or a.startswith(f + "=") for a in argv for f in flags)


def apply_quick(args: argparse.Namespace, argv: list[str]) -> None:
    if not _explicit(argv, "--instances"):
        args.instances = QUICK["instances"]
    if not _explicit(argv, "--duration"):
        args.duration = QUICK["duration"]
    if not _explicit(argv, "--trace"):
        args.trace = str(default_trace())
    if args.policies is None and args.experiment == "pd-disagg":
        args.policies = ",".join(CORE_POLICIES)


def run(args: argparse.Namespace) -> int:
    argv = sys.argv[2:] if len(sys.argv) > 2 else []
    if args.quick:
        apply_quick(args, argv)
    exp = get_experiment(args.experiment)
    policies = parse_policies(args.policies, exp.policies)
    rates = parse_rates(args.rates)
    if args.jobs < 1:
        raise ValueError("--jobs must be >= 1")
    if args.max_rounds < 0:
        raise ValueError("--max-rounds must be >= 0")
    out = Path(args.out or ("bench-out/quick" if args.quick else f"bench-out/{exp.name}"))
    command = "smetric bench " + " ".join(shlex.quote(a) for a in argv)
    if args.resummarize:
        result = resummarize(args, get_experiment(args.experiment).settings, out, not args.no_plots)
        from stack.bench.report import print_summary

        print_summary(result["summary"], result["rate_unit"])
        return 0
    result = run_bench(
        args,
        experiment=exp.name,
        settings=select_settings(exp, args.settings),
        policies=policies,
        rates=rates,
        out=out,
        jobs=args.jobs,
        plots=not args.no_plots,
        progress=not args.no_progress and sys.stderr.isatty(),
        command=command,
        max_rounds=args.max_rounds,
        log=True,
        executor=args.executor,
        address=args.address,
    )
    from stack.bench.report import print_summary

    print_summary(result["summary"], result["rate_unit"])
    print(
        f"wrote {out}/results.csv, {out}/summary.json" + ("" if args.no_plots else " and plots"),
        file=sys.stderr,
    )
    failed = result["summary"].get("failed_runs") or []
    if failed:
        print(
            f"smetric bench: {len(failed)} run(s) failed twice and are missing from results.csv "
            f"(listed under failed_runs in {out}/summary.json)",
            file=sys.stderr,
        )
        return 1
    return 0
