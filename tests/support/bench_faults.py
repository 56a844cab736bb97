"""A bench task that fails on purpose, for the executors' retry-once-then-report path.

:class:`FaultyTask` wraps :func:`stack.bench.executors.run_job`: a job named in
``raise_once`` raises on its first attempt, one in ``crash_once`` kills its worker process
on its first attempt (a lost task), one in ``raise_always`` raises on every attempt. Jobs
are named by ``(policy, rate)``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from stack.bench.executors import SweepContext, run_job
from stack.bench.runner import Job, Outcome

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
