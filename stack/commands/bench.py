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
the extra stack[ray]; docs/ray.md). Same results either way. A run that fails (or loses
its worker) is retried once; one that fails again is listed under failed_runs in
summary.json, and the command exits 1 after writing everything.
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
import time
from pathlib import Path

import orjson

from stack.bench.bound import clairvoyant, ideal_hits
from stack.bench.executor_choice import EXECUTORS, make_executor, preflight
from stack.bench.executors import Executor, Failure, SweepContext, Task, run_job
from stack.bench.experiments import (
    CORE_POLICIES,
    EXPERIMENTS,
    Setting,
    get_experiment,
    parse_policies,
    parse_rates,
    select_settings,
    split_policy,
)
from stack.bench.rate_search import search
from stack.bench.runner import Outcome, setting_options, validate_setting
from stack.bench.summary import clean, row_label, summarize, write_csv
from stack.commands.simopts import add_cluster_arguments, add_dispatch_arguments, add_load_arguments
from stack.core.cost_model import load_hardware
from stack.paths import default_trace
from stack.sim.options import SimOptions

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
        "stack[ray]; see docs/ray.md)",
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


def parse_dispatches(text: str | None) -> tuple[str, ...]:
    """``--dispatch a,b:k=v,c`` as a tuple of order specs (validated names and parameters)."""
    from stack.dispatch import DispatchSpec

    items = [t.strip() for t in (text or "immediate").split(",") if t.strip()]
    if not items:
        raise ValueError("--dispatch: no order given")
    for t in items:
        DispatchSpec.parse(t)
    return tuple(dict.fromkeys(items))


def compute_bounds(trace, base: SimOptions, settings: tuple[Setting, ...], mode: str) -> tuple[dict, dict]:
    """Clairvoyant bound per setting label, and the search's first rate guess per index."""
    hw = load_hardware(base.hardware)
    hits = ideal_hits(trace)
    bounds: dict[str, dict] = {}
    estimates: dict[int, float] = {}
    for si, s in enumerate(settings):
        n = s.instances if s.instances is not None else base.instances
        cfg = setting_options(base, s).sim_config({})
        b = clairvoyant(trace, hw, n, mode, base.duration, hits, cfg.slo)
        bounds[s.label] = b.as_dict()
        estimates[si] = b.rate if math.isfinite(b.rate) and b.rate > 0 else 1.0
    return bounds, estimates


def write_outputs(out: Path, rows: list[dict], summary: dict, curves: dict, plots: bool, title: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "results.csv", rows)
    (out / "summary.json").write_bytes(orjson.dumps(clean(summary), option=orjson.OPT_INDENT_2) + b"\n")
    cj = [
        {"setting": k[0], "policy": k[1], "rate": k[2], "ttft_quantiles": v[0], "imbalance_quantiles": v[1]}
        for k, v in curves.items()
    ]
    (out / "curves.json").write_bytes(orjson.dumps(clean(cj)) + b"\n")
    from stack.bench.report import markdown

    command = summary.get("command")
    head = (
        f"`{command}`\n\nrates in {summary.get('rate_unit')}; {len(rows)} runs, {summary.get('bench_wall_s', 0):.0f} s\n\n"
        if command
        else ""
    )
    (out / "summary.md").write_text(head + markdown(clean(summary)))
    if any(r.get("mode") == "colocated" for r in rows):
        # colocation's own score: output TPS within the TTFT and TPOT SLOs (paper §5.2)
        from stack.bench.colocation import colocation_markdown, summarize_colocation

        co = clean(summarize_colocation(rows))
        (out / "colocation.json").write_bytes(orjson.dumps(co, option=orjson.OPT_INDENT_2) + b"\n")
        (out / "colocation.md").write_text(head + colocation_markdown(co))
    if plots:
        from stack.bench.plots import plot_all

        plot_all(out, rows, summary, curves, title=title)


def resummarize(args: argparse.Namespace, settings: tuple[Setting, ...], out: Path, plots: bool) -> dict:
    """Recompute summary.json, summary.md and the plots of ``out`` from its results.csv."""
    from stack.bench.summary import read_csv

    if not (out / "results.csv").exists():
        raise ValueError(f"{out}/results.csv: no such file (run the bench first)")
    rows = read_csv(out / "results.csv")
    old = orjson.loads((out / "summary.json").read_bytes()) if (out / "summary.json").exists() else {}
    curves = {}
    if (out / "curves.json").exists():
        for c in orjson.loads((out / "curves.json").read_bytes()):
            curves[(c["setting"], c["policy"], float(c["rate"]))] = (
                c["ttft_quantiles"],
                c["imbalance_quantiles"],
            )
    base = SimOptions.from_args(args)
    trace = base.read_trace()
    mode = base.resolved_mode(trace)
    labels = list(dict.fromkeys(str(r["setting"]) for r in rows))
    by_label = {s.label: s for s in settings}
    used = tuple(by_label.get(lb, Setting(lb)) for lb in labels)
    bounds, _ = compute_bounds(trace, base, used, mode)
    keep = (
        "experiment",
        "trace",
        "load_mode",
        "rate_unit",
        "command",
        "runs",
        "bench_wall_s",
        "capacity_definition",
        "executor",
        "failed_runs",
        "retried_runs",
    )
    meta = {k: old[k] for k in keep if k in old}
    meta.setdefault("experiment", str(rows[0].get("experiment")) if rows else "")
    meta.setdefault("rate_unit", str(rows[0].get("rate_unit")) if rows else "")
    meta["settings_order"] = labels
    summary = summarize(rows, bounds, meta)
    write_outputs(out, rows, summary, curves, plots, f"{meta['experiment']} on {Path(base.trace).name}")
    return {"rows": rows, "summary": summary, "rate_unit": meta["rate_unit"], "curves": curves}


def run_bench(
    args: argparse.Namespace,
    experiment: str,
    settings: tuple[Setting, ...],
    policies: tuple[str, ...],
    rates: list[float] | None,
    out: Path | None,
    jobs: int = 2,
    plots: bool = True,
    progress: bool = False,
    command: str = "",
    max_rounds: int = 6,
    log: bool = False,
    executor: str = "local",
    address: str | None = None,
    task: Task = run_job,
) -> dict:
    """Run a grid on the ``executor`` (:func:`~stack.bench.executor_choice.make_executor`) and
    write its files (``out=None``: write nothing). Returns ``{"rows", "summary",
    "rate_unit", "curves"}``; the summary lists the runs that failed twice (``failed_runs``)
    and those that failed once and then ran (``retried_runs``). ``task`` runs one
    simulation (tests wrap it to inject faults)."""
    base = SimOptions.from_args(args)
    # validate everything before any work starts
    preflight(executor, address)
    dispatches = parse_dispatches(getattr(args, "dispatches", None))
    keys: list[tuple[str, int, str]] = []
    for si, s in enumerate(settings):
        for spec in policies:
            p, pinned = split_policy(spec)
            if s.applies_to(p):
                for d in (pinned,) if pinned else dispatches:
                    validate_setting(base, s, p, d)
                    keys.append((p, si, d))
    if not keys:
        raise ValueError("no (policy, setting) pair to run")
    trace = base.read_trace()
    mode = base.resolved_mode(trace)
    base.load_spec(trace, 1.0)  # raises ValueError on nonsensical load options
    bounds, estimates = compute_bounds(trace, base, settings, mode)
    rate_unit = "sessions/s" if mode == "sessions" else "x time compression"

    t0 = time.perf_counter()
    pool: Executor = make_executor(
        executor, SweepContext(trace, base, settings, experiment), jobs=jobs, address=address, task=task
    )
    start_s = time.perf_counter() - t0  # a Ray instance's start or a cluster's join
    prog = None
    bar = None
    state = {"total": 0, "done": 0}
    if progress:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        prog = Progress(
            TextColumn(f"bench {experiment}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.description}"),
            TimeElapsedColumn(),
            transient=True,
        )
        prog.start()
        bar = prog.add_task("", total=0)

    def on_round(n: int) -> None:
        state["total"] += n
        if prog is not None:
            prog.update(bar, total=state["total"])
        elif log:
            print(
                f"bench {experiment}: {n} more runs ({state['done']} done, {time.perf_counter() - t0:.0f} s)",
                file=sys.stderr,
                flush=True,
            )

    def on_done(o: Outcome) -> None:
        state["done"] += 1
        if prog is not None:
            prog.update(bar, completed=state["done"], description=f"{o.job.policy} @ {o.job.rate:.4g}")
        elif log and state["done"] % 10 == 0:
            print(
                f"bench {experiment}: {state['done']}/{state['total']} runs done", file=sys.stderr, flush=True
            )

    def on_fail(f: Failure) -> None:
        state["done"] += 1
        if prog is not None:
            prog.update(bar, completed=state["done"])
        print(
            f"bench {experiment}: {f.job.label} @ {f.job.rate:.4g} ({f.setting}) failed "
            f"{f.attempts} times: {f.error}",
            file=sys.stderr,
            flush=True,
        )

    try:
        outcomes = search(
            pool,
            keys,
            estimates,
            on_done,
            on_round,
            max_rounds=max_rounds,
            explicit=rates,
            align=True,
            on_fail=on_fail,
        )
        ran_on = {**pool.describe(), "start_s": start_s}
    finally:
        if prog is not None:
            prog.stop()
        pool.close()
    wall = time.perf_counter() - t0

    porder: dict[str, int] = {}
    for spec in policies:
        porder.setdefault(split_policy(spec)[0], len(porder))
    dorder = {d: i for i, d in enumerate(dispatches)}
    outcomes.sort(
        key=lambda o: (
            o.job.setting,
            porder.get(o.job.policy, 99),
            dorder.get(o.job.dispatch, 99),
            o.job.rate,
        )
    )
    rows = [o.row for o in outcomes]
    curves = {
        (settings[o.job.setting].label, row_label(o.row), o.job.rate): (o.ttft_q, o.imb_q) for o in outcomes
    }
    meta = {
        "experiment": experiment,
        "trace": str(base.trace),
        "load_mode": mode,
        "rate_unit": rate_unit,
        "command": command,
        "runs": len(rows),
        "bench_wall_s": wall,
        "settings_order": [s.label for s in settings],
        "capacity_definition": "highest rate with slo_attainment >= 0.9",
        "executor": ran_on,
        "failed_runs": [f.as_dict() for f in pool.failures],
        "retried_runs": [f.as_dict() for f in pool.retried],
    }
    summary = summarize(rows, bounds, meta)
    if out is not None:
        write_outputs(out, rows, summary, curves, plots, f"{experiment} on {Path(base.trace).name}")
    return {"rows": rows, "summary": summary, "rate_unit": rate_unit, "curves": curves}
