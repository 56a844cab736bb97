"""A bench task that fails on purpose, for the executors' retry-once-then-report path.

:class:`FaultyTask` wraps :func:`stack.bench.executors.run_job`: a job named in
``raise_once`` raises on its first attempt, one in ``crash_once`` kills its worker process
on its first attempt (a lost task), one in ``raise_always`` raises on every attempt. Jobs
are named by ``(policy, rate)``. :func:`sweep` runs a small sweep with such a task.
"""

from __future__ import annotations

import argparse
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
