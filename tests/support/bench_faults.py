"""A bench task that fails on purpose, for the executors' retry-once-then-report path.

:class:`FaultyTask` wraps :func:`stack.bench.executors.run_job`: a job named in
``raise_once`` raises on its first attempt, one in ``crash_once`` kills its worker process
on its first attempt (a lost task), one in ``raise_always`` raises on every attempt. Jobs
are named by ``(policy, rate)``. :func:`sweep` runs a small sweep with such a task;
:func:`check_retried_once_then_reported` runs the scenario every executor is held to
(tests/integration/test_bench_executors.py locally, tests/integration/test_bench_ray.py on Ray).
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass

from stack.bench.executors import SweepContext, run_job
from stack.bench.experiments import Setting
from stack.bench.runner import Job, Outcome
from stack.commands import bench

Name = tuple[str, float]


class InjectedFault(RuntimeError):
    pass


@dataclass(frozen=True)
class FaultyTask:
    raise_once: frozenset[Name] = frozenset()
    crash_once: frozenset[Name] = frozenset()
    raise_always: frozenset[Name] = frozenset()

    def __call__(self, ctx: SweepContext, job: Job, attempt: int) -> Outcome:
        name = (job.policy, job.rate)
        if name in self.raise_always:
            raise InjectedFault(f"injected: {job.policy} @ {job.rate} always fails (attempt {attempt})")
        if attempt == 0 and name in self.raise_once:
            raise InjectedFault(f"injected: {job.policy} @ {job.rate} fails once")
        if attempt == 0 and name in self.crash_once:
            os._exit(3)  # the worker process dies mid-task
        return run_job(ctx, job, attempt)


def bench_args(*argv: str) -> argparse.Namespace:
    """``smetric bench``'s options for a tiny run (2 instances, 1200 s of arrivals)."""
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    return p.parse_args([*argv, *TINY])


TINY = ["--instances", "2", "--duration", "1200", "--no-progress", "--no-plots"]
POLICIES = ("smetric", "lmetric", "least-load")
RATES = (0.004, 0.008)


def sweep(executor: str, jobs: int, task: FaultyTask) -> dict:
    """``run_bench`` of POLICIES x RATES on ``executor`` with ``task``, writing nothing."""
    return bench.run_bench(
        bench_args(),
        experiment="pd-disagg",
        settings=(Setting(),),
        policies=POLICIES,
        rates=list(RATES),
        out=None,
        jobs=jobs,
        executor=executor,
        task=task,
    )


WALL_CLOCK = {"sim_wall_s", "sim_requests_per_s"}
RAISE_ONCE = ("smetric", 0.004)
CRASH_ONCE = ("lmetric", 0.004)
ALWAYS = ("least-load", 0.008)


def by_run(rows: list[dict]) -> dict:
    """(policy, rate) -> the row without its wall-clock columns (a figure with no data, NaN,
    as None, so that two equal rows compare equal)."""
    return {
        (r["policy"], r["rate"]): {k: _nan_as_none(v) for k, v in r.items() if k not in WALL_CLOCK}
        for r in rows
    }


def _nan_as_none(v):
    return None if isinstance(v, float) and math.isnan(v) else v


def check_retried_once_then_reported(executor: str, jobs: int, lost: str | None, capsys) -> None:
    """One run raises once, one kills its worker once (``lost``: how the executor names
    that; None: no worker to kill, in-process), one always raises: the sweep completes,
    the first two ran on their second attempt with the results of a sweep without faults,
    the third is in summary.json's failed_runs after two attempts."""
    task = FaultyTask(
        raise_once=frozenset({RAISE_ONCE}),
        crash_once=frozenset({CRASH_ONCE} if lost else set()),
        raise_always=frozenset({ALWAYS}),
    )
    res = sweep(executor, jobs, task)
    s = res["summary"]
    assert set(by_run(res["rows"])) == {(p, r) for p in POLICIES for r in RATES} - {ALWAYS}
    assert s["runs"] == 5 and s["executor"]["kind"] == executor
    [failed] = s["failed_runs"]
    assert (failed["policy"], failed["rate"], failed["attempts"]) == (*ALWAYS, 2)
    assert failed["setting"] == "default" and failed["dispatch"] == "immediate"
    assert failed["error"] == "InjectedFault: injected: least-load @ 0.008 always fails (attempt 1)"
    assert "least-load @ 0.008 (default) failed 2 times: InjectedFault" in capsys.readouterr().err
    retried = {(r["policy"], r["rate"]): r for r in s["retried_runs"]}
    assert set(retried) == ({RAISE_ONCE, CRASH_ONCE} if lost else {RAISE_ONCE})
    assert retried[RAISE_ONCE]["error"] == "InjectedFault: injected: smetric @ 0.004 fails once"
    if lost:
        assert retried[CRASH_ONCE]["error"].startswith(lost)
    assert all(r["attempts"] == 2 for r in retried.values())
    clean = by_run(sweep("local", 1, FaultyTask())["rows"])
    assert by_run(res["rows"]) == {k: v for k, v in clean.items() if k != ALWAYS}
