"""One bench sweep: validate the grid, run it on an executor (rate search or explicit rates),
sort and summarize the outcomes, write results.csv, summary.json/.md, curves.json and plots
(``smetric bench``, ``smetric demo``); and ``--resummarize``: the same files again from a
results.csv."""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import orjson

from stack.bench.bound import clairvoyant, ideal_hits
from stack.bench.executor_choice import make_executor, preflight
from stack.bench.executors import Executor, Failure, SweepContext, Task, run_job
from stack.bench.experiments import Setting, split_policy
from stack.bench.rate_search import search
from stack.bench.runner import Outcome, setting_options, validate_setting
from stack.bench.summary import clean, row_label, summarize, write_csv
from stack.core.cost_model import load_hardware
from stack.sim.options import SimOptions


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
    keys = grid_keys(base, settings, policies, dispatches)
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
    report = SweepProgress(experiment, t0, bar=progress, log=log)
    try:
        outcomes = search(
            pool,
            keys,
            estimates,
            report.on_done,
            report.on_round,
            max_rounds=max_rounds,
            explicit=rates,
            align=True,
            on_fail=report.on_fail,
        )
        ran_on = {**pool.describe(), "start_s": start_s}
    finally:
        report.stop()
        pool.close()
    wall = time.perf_counter() - t0

    sort_outcomes(outcomes, policies, dispatches)
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


def grid_keys(
    base: SimOptions, settings: tuple[Setting, ...], policies: tuple[str, ...], dispatches: tuple[str, ...]
) -> list[tuple[str, int, str]]:
    """The (policy, setting index, dispatch order) pairs to run, each validated; a
    ``policy+order`` entry runs its own order only, a bare policy every order of ``dispatches``."""
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
    return keys


def sort_outcomes(outcomes: list[Outcome], policies: tuple[str, ...], dispatches: tuple[str, ...]) -> None:
    """In place: by setting, then the order of ``policies`` and ``dispatches``, then rate."""
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


class SweepProgress:
    """A sweep's progress: a rich bar (``bar``), or lines on stderr (``log``), or nothing;
    a run that failed for good is always reported."""

    def __init__(self, experiment: str, t0: float, bar: bool, log: bool) -> None:
        self.experiment = experiment
        self.t0 = t0
        self.log = log
        self.total = 0
        self.done = 0
        self.prog = None
        self.bar = None
        if bar:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.prog = Progress(
                TextColumn(f"bench {experiment}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.description}"),
                TimeElapsedColumn(),
                transient=True,
            )
            self.prog.start()
            self.bar = self.prog.add_task("", total=0)

    def on_round(self, n: int) -> None:
        self.total += n
        if self.prog is not None:
            self.prog.update(self.bar, total=self.total)
        elif self.log:
            print(
                f"bench {self.experiment}: {n} more runs "
                f"({self.done} done, {time.perf_counter() - self.t0:.0f} s)",
                file=sys.stderr,
                flush=True,
            )

    def on_done(self, o: Outcome) -> None:
        self.done += 1
        if self.prog is not None:
            self.prog.update(self.bar, completed=self.done, description=f"{o.job.policy} @ {o.job.rate:.4g}")
        elif self.log and self.done % 10 == 0:
            print(f"bench {self.experiment}: {self.done}/{self.total} runs done", file=sys.stderr, flush=True)

    def on_fail(self, f: Failure) -> None:
        self.done += 1
        if self.prog is not None:
            self.prog.update(self.bar, completed=self.done)
        print(
            f"bench {self.experiment}: {f.job.label} @ {f.job.rate:.4g} ({f.setting}) failed "
            f"{f.attempts} times: {f.error}",
            file=sys.stderr,
            flush=True,
        )

    def stop(self) -> None:
        if self.prog is not None:
            self.prog.stop()
