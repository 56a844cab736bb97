"""Each simulation of a sweep a Ray task (``smetric bench --executor ray``; the ``ray`` extra).

The sweep's :class:`~stack.bench.executors.SweepContext` (the trace, the options, the
settings) goes into Ray's object store once (``ray.put``); tasks get its reference inside
a list, so Ray does not resolve it per task: a worker process fetches it on its first task
(Ray copies the object to a node once, whichever of its workers asks) and keeps the
deserialized context for the rest of the sweep. ``trace_loads`` counts those first fetches.

Ray itself retries nothing (``max_retries=0``): the shared loop in
:meth:`Executor.run <stack.bench.executors.Executor.run>` resubmits a task that raised or
whose worker or node was lost, once, and then records it as failed.

Where Ray runs: the process's existing Ray session if there is one (a caller that ran
``ray.init`` itself keeps it); else ``address`` or ``$RAY_ADDRESS`` (``auto``, ``host:port``
of a cluster's GCS, or ``ray://host:port`` for Ray Client); else a local instance with
``jobs`` CPUs, shut down by :meth:`RayExecutor.close` (on loopback when
:func:`stack.bench.executor_choice.make_executor` imports Ray: see ``stack.bench.executors.LOOPBACK_ENV``).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Hashable

import ray
from ray.exceptions import RayError, RayTaskError

from stack.bench.executors import Executor, SweepContext, Task, run_job
from stack.bench.runner import Job, Outcome

CONNECT_TIMEOUT_S = 5.0

# per Ray worker process: the context of the sweep being run, by its object reference
_CTX: dict[str, SweepContext] = {}


def _context(box: list) -> tuple[SweepContext, bool]:
    """The sweep's context from the reference in ``box``; True when fetched just now."""
    key = box[0].hex()
    ctx = _CTX.get(key)
    if ctx is not None:
        return ctx, False
    _CTX.clear()  # one sweep at a time: drop an earlier sweep's trace
    ctx = ray.get(box[0])
    _CTX[key] = ctx
    return ctx, True


@ray.remote(num_cpus=1, max_retries=0)
def _simulate(box: list, task: Task, job: Job, attempt: int) -> tuple[Outcome, bool, str]:
    ctx, loaded = _context(box)
    return task(ctx, job, attempt), loaded, ray.get_runtime_context().get_node_id()


def check_address(address: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """ValueError unless something accepts TCP at ``address`` (``host:port`` or
    ``ray://host:port``; ``auto`` is left to Ray). Ray itself retries a dead address for
    minutes before it gives up."""
    if address == "auto":
        return
    hostport = address.split("://", 1)[1] if "://" in address else address
    host, sep, port = hostport.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--address {address!r}: expected auto, HOST:PORT or ray://HOST:PORT")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            pass
    except OSError as e:
        raise ValueError(f"--address {address}: no Ray cluster answers there ({e})") from e


class RayExecutor(Executor):
    """Simulations as Ray tasks of one CPU each."""

    kind = "ray"

    def __init__(
        self,
        ctx: SweepContext,
        jobs: int = 1,
        address: str | None = None,
        task: Task = run_job,
        retries: int = 1,
    ) -> None:
        super().__init__(ctx, task, retries)
        self.address = address or os.environ.get("RAY_ADDRESS") or None
        self._owns = False
        if not ray.is_initialized():
            quiet = {"include_dashboard": False, "logging_level": logging.WARNING}
            if self.address:
                try:
                    ray.init(address=self.address, **quiet)
                except Exception as e:  # Ray raises ConnectionError, RuntimeError, ValueError...
                    raise ValueError(f"--address {self.address}: cannot join the Ray cluster ({e})") from e
            else:
                ray.init(num_cpus=jobs, **quiet)
            self._owns = True
        self._box = [ray.put(ctx)]  # once per sweep; nodes fetch it once each
        self.trace_loads = 0
        self.nodes: set[str] = set()

    @property
    def workers(self) -> int:
        return int(ray.cluster_resources().get("CPU", 0))

    def describe(self) -> dict:
        return {
            "kind": self.kind,
            "address": self.address or "local",
            "workers": self.workers,
            "nodes_used": len(self.nodes),
            "trace_loads": self.trace_loads,
        }

    def _submit(self, job: Job, attempt: int) -> Hashable:
        name = f"sim {job.label} @ {job.rate:.4g}" + (f" (retry {attempt})" if attempt else "")
        return _simulate.options(name=name).remote(self._box, self.task, job, attempt)

    def _next(self, pending: list[Hashable]) -> list[tuple[Hashable, Outcome | BaseException]]:
        ready, rest = ray.wait(pending, num_returns=1)
        if rest:
            more, _ = ray.wait(rest, num_returns=len(rest), timeout=0)
            ready += more
        out: list[tuple[Hashable, Outcome | BaseException]] = []
        for ref in ready:
            try:
                outcome, loaded, node = ray.get(ref)
            except RayTaskError as e:  # the task raised: report its own exception
                cause = getattr(e, "cause", None)
                out.append((ref, cause if isinstance(cause, BaseException) else e))
                continue
            except RayError as e:  # its worker or node was lost, or its object
                out.append((ref, e))
                continue
            self.trace_loads += int(loaded)
            self.nodes.add(node)
            out.append((ref, outcome))
        return out

    def _cancel(self, pending: list[Hashable]) -> None:
        for ref in pending:
            try:
                ray.cancel(ref, force=True)
            except Exception:  # already finished or gone
                pass

    def close(self) -> None:
        self._box = []
        if self._owns and ray.is_initialized():
            ray.shutdown()
        self._owns = False
