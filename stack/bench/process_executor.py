"""The local executor's worker processes (``smetric bench --jobs N``, N > 1).

``jobs`` forked processes, each running one simulation at a time over its own pipe: the
parent knows which job each worker holds, so a worker that dies (killed, out of memory,
a crash in native code) loses exactly that job, which the shared retry loop runs again
on a fresh worker, and the other workers carry on. Forked workers inherit the sweep's
context (the loaded trace) instead of receiving a copy.
"""

from __future__ import annotations

import itertools
import multiprocessing
import pickle
import signal
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

from stack.bench.executors import Executor, SweepContext, Task, describe_error, run_job
from stack.bench.runner import Job, Outcome

JOIN_TIMEOUT_S = 5.0


class WorkerLost(RuntimeError):
    """The worker process running a job died before it answered."""


def _serve(conn: Connection, ctx: SweepContext, task: Task) -> None:
    """A worker's loop: ``(handle, job, attempt)`` in, ``(handle, ok, outcome or error)`` out."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        h, job, attempt = msg
        try:
            reply = (h, True, task(ctx, job, attempt))
        except Exception as e:
            try:
                pickle.dumps(e)
                reply = (h, False, e)
            except Exception:
                reply = (h, False, RuntimeError(describe_error(e)))
        conn.send(reply)


@dataclass
class _Worker:
    proc: BaseProcess
    conn: Connection
    handle: int | None = None  # the job it runs now


def _mp_context() -> multiprocessing.context.BaseContext:
    try:
        return multiprocessing.get_context("fork")
    except ValueError:  # pragma: no cover - platforms without fork pickle the context instead
        return multiprocessing.get_context()


class ProcessExecutor(Executor):
    """Up to ``jobs`` worker processes, started as work arrives, replaced when one dies."""

    kind = "local"

    def __init__(self, ctx: SweepContext, jobs: int, task: Task = run_job, retries: int = 1) -> None:
        super().__init__(ctx, task, retries)
        self.jobs = jobs
        self._mp = _mp_context()
        self._ids = itertools.count()
        self._queue: deque[tuple[int, Job, int]] = deque()
        self._workers: list[_Worker] = []

    @property
    def workers(self) -> int:
        return self.jobs

    def _spawn(self) -> _Worker:
        parent, child = self._mp.Pipe()
        proc = self._mp.Process(target=_serve, args=(child, self.ctx, self.task), daemon=True)
        proc.start()
        child.close()
        w = _Worker(proc, parent)
        self._workers.append(w)
        return w

    def _dispatch(self) -> None:
        while self._queue:
            idle = next((w for w in self._workers if w.handle is None), None)
            if idle is None:
                if len(self._workers) >= self.jobs:
                    return
                idle = self._spawn()
            item = self._queue.popleft()
            try:
                idle.conn.send(item)
            except OSError:  # it died while idle: replace it, keep the job queued
                self._queue.appendleft(item)
                self._drop(idle)
                continue
            idle.handle = item[0]

    def _submit(self, job: Job, attempt: int) -> int:
        h = next(self._ids)
        self._queue.append((h, job, attempt))
        self._dispatch()
        return h

    def _drop(self, w: _Worker) -> None:
        self._workers.remove(w)
        w.conn.close()
        w.proc.join(JOIN_TIMEOUT_S)

    def _next(self, pending: list[Hashable]) -> list[tuple[Hashable, Outcome | BaseException]]:
        out: list[tuple[Hashable, Outcome | BaseException]] = []
        while not out:
            busy = [w for w in self._workers if w.handle is not None]
            if not busy:
                raise RuntimeError("no job is running")  # the loop only waits on started jobs
            ready = set(wait([w.conn for w in busy] + [w.proc.sentinel for w in busy]))
            for w in busy:
                h = w.handle
                if w.conn in ready:
                    try:
                        rh, _ok, value = w.conn.recv()
                    except (EOFError, OSError):
                        pass  # the worker died: its sentinel says so
                    else:
                        w.handle = None
                        out.append((rh, value))
                        continue
                if w.proc.sentinel in ready or w.conn in ready:
                    w.proc.join(JOIN_TIMEOUT_S)
                    code = w.proc.exitcode
                    self._drop(w)
                    out.append((h, WorkerLost(f"worker process {w.proc.pid} died (exit code {code})")))
        self._dispatch()  # the freed (or replaced) workers take the queued jobs
        return out

    def _cancel(self, pending: list[Hashable]) -> None:
        self._queue.clear()
        for w in list(self._workers):
            if w.handle is not None:
                w.proc.terminate()
                self._drop(w)

    def close(self) -> None:
        self._queue.clear()
        for w in self._workers:
            try:
                w.conn.send(None)
            except OSError:
                pass
        for w in list(self._workers):
            w.proc.join(JOIN_TIMEOUT_S)
            if w.proc.is_alive():
                w.proc.terminate()
            self._drop(w)
