"""Where a sweep's simulations run: the executor interface, its retry loop, the in-process executor.

An executor runs :class:`~stack.bench.runner.Job` s against one :class:`SweepContext` (the
trace, the command line's options, the settings) and hands each finished
:class:`~stack.bench.runner.Outcome` to a callback as it arrives. Every executor retries a
failed or lost simulation once (``retries``); a job that fails again is recorded as a
:class:`Failure` (``executor.failures``, written to summary.json) and the sweep goes on.

Two kinds (``smetric bench --executor``, made by :mod:`stack.bench.executor_choice`):

- ``local`` (the default, no extra dependency): in this process for ``jobs=1``, else
  ``jobs`` forked processes that inherit the already loaded trace
  (:mod:`stack.bench.process_executor`); a worker that dies loses only its own job.
- ``ray`` (:mod:`stack.bench.ray_executor`, the optional ``ray`` extra): each simulation a
  Ray task, on a local Ray instance or an existing cluster (``--address``).

Subclasses implement three primitives (:meth:`Executor._submit`, :meth:`Executor._next`,
:meth:`Executor._cancel`); the retry loop in :meth:`Executor.run` is shared.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

from stack.bench.experiments import Setting
from stack.bench.runner import Job, Outcome, run_one
from stack.bench.summary import run_label
from stack.sim.options import SimOptions
from stack.traces.model import Trace

# Ray on Linux binds a node to the host's reachable address, even when asked for 127.0.0.1;
# this switch (read when ray is imported) keeps a single-machine instance on loopback.
LOOPBACK_ENV = ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


@dataclass(frozen=True)
class SweepContext:
    """What every simulation of one sweep shares (shipped once per worker or node)."""

    trace: Trace
    base: SimOptions
    settings: tuple[Setting, ...]
    experiment: str


# A simulation: (context, job, attempt number from 0) -> outcome. Tests wrap it to inject faults.
Task = Callable[[SweepContext, Job, int], Outcome]


def run_job(ctx: SweepContext, job: Job, attempt: int = 0) -> Outcome:
    """The default task: one simulation (``attempt`` does not change the result)."""
    return run_one(ctx.trace, ctx.base, ctx.settings, job, ctx.experiment)


def describe_error(e: BaseException, limit: int = 500) -> str:
    """One line naming an exception: ``Type: message`` (cut at ``limit`` characters)."""
    msg = " ".join(str(e).split())
    text = f"{type(e).__name__}: {msg}" if msg else type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True)
class Failure:
    """A job that failed on every attempt (in ``retried``: one that failed, then ran);
    ``error``: its last failure (in ``retried``: its first); ``attempts``: how many ran."""

    job: Job
    setting: str
    error: str
    attempts: int

    def as_dict(self) -> dict:
        return {
            "policy": self.job.policy,
            "dispatch": self.job.dispatch,
            "label": run_label(self.job.policy, self.job.dispatch),
            "setting": self.setting,
            "rate": self.job.rate,
            "attempts": self.attempts,
            "error": self.error,
        }


class Executor:
    """Runs jobs with ``retries`` retries each; subclasses say how a job is started and
    awaited. ``failures``: the jobs given up; ``retried``: those that failed, then ran."""

    kind = "executor"

    def __init__(self, ctx: SweepContext, task: Task = run_job, retries: int = 1) -> None:
        self.ctx = ctx
        self.task = task
        self.retries = retries
        self.failures: list[Failure] = []
        self.retried: list[Failure] = []

    @property
    def settings(self) -> tuple[Setting, ...]:
        return self.ctx.settings

    @property
    def workers(self) -> int:
        """How many simulations may run at once (for the summary)."""
        return 1

    def describe(self) -> dict:
        return {"kind": self.kind, "workers": self.workers}

    # ---- what a subclass provides
    def _submit(self, job: Job, attempt: int) -> Hashable:
        """Start ``job``; a handle that :meth:`_next` later returns."""
        raise NotImplementedError

    def _next(self, pending: list[Hashable]) -> Iterable[tuple[Hashable, Outcome | BaseException]]:
        """Block until at least one pending handle is finished; each finished handle with
        its outcome, or the exception that ended its job (a lost worker included)."""
        raise NotImplementedError

    def _cancel(self, pending: list[Hashable]) -> None:
        """Give up the pending handles (the run is being interrupted)."""

    def close(self) -> None:
        """Release what the executor holds (idempotent)."""

    # ---- the shared loop
    def run(
        self,
        jobs: list[Job],
        on_done: Callable[[Outcome], None],
        on_fail: Callable[[Failure], None] | None = None,
    ) -> list[Outcome]:
        """Run ``jobs``; ``on_done`` for each outcome as it arrives, ``on_fail`` for each
        job given up after ``1 + retries`` attempts. Returns the outcomes (any order)."""
        out: list[Outcome] = []
        pending: dict[Hashable, tuple[Job, int, str]] = {}
        try:
            for j in jobs:
                pending[self._submit(j, 0)] = (j, 0, "")
            while pending:
                for h, res in self._next(list(pending)):
                    job, attempt, first_error = pending.pop(h)
                    if isinstance(res, BaseException):
                        err = describe_error(res)
                        if attempt < self.retries:
                            pending[self._submit(job, attempt + 1)] = (job, attempt + 1, first_error or err)
                            continue
                        f = Failure(job, self.settings[job.setting].label, err, attempt + 1)
                        self.failures.append(f)
                        if on_fail is not None:
                            on_fail(f)
                        continue
                    if attempt > 0:
                        self.retried.append(
                            Failure(job, self.settings[job.setting].label, first_error, attempt + 1)
                        )
                    out.append(res)
                    on_done(res)
        except BaseException:
            self._cancel(list(pending))
            raise
        return out


class InlineExecutor(Executor):
    """Runs each job in this process when it is awaited (``--jobs 1``)."""

    kind = "local"

    def __init__(self, ctx: SweepContext, task: Task = run_job, retries: int = 1) -> None:
        super().__init__(ctx, task, retries)
        self._ids = itertools.count()
        self._jobs: dict[int, tuple[Job, int]] = {}

    def _submit(self, job: Job, attempt: int) -> int:
        h = next(self._ids)
        self._jobs[h] = (job, attempt)
        return h

    def _next(self, pending: list[Hashable]) -> list[tuple[Hashable, Outcome | BaseException]]:
        h = min(pending)  # in submission order
        job, attempt = self._jobs.pop(h)
        try:
            return [(h, self.task(self.ctx, job, attempt))]
        except Exception as e:
            return [(h, e)]

    def _cancel(self, pending: list[Hashable]) -> None:
        self._jobs.clear()
