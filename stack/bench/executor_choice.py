"""Which executor a sweep gets (``smetric bench --executor`` / ``--jobs`` / ``--address``):
the check made before a trace is read (:func:`preflight`) and the factory
(:func:`make_executor`). The concrete executors are imported only when asked for, so the
``local`` kind needs no Ray.
"""

from __future__ import annotations

import os
import sys

from stack.bench.executors import LOOPBACK_ENV, Executor, InlineExecutor, SweepContext, Task, run_job

EXECUTORS = ("local", "ray")
RAY_EXTRA_HINT = "pip install 'stack[ray]' (or scripts/setup.sh)"


def preflight(kind: str, address: str | None = None) -> None:
    """ValueError now (before a trace is read) for what :func:`make_executor` would refuse:
    an unknown kind, ``address`` without Ray, Ray not installed, or an address where
    nothing answers."""
    if kind not in EXECUTORS:
        raise ValueError(f"--executor must be one of {', '.join(EXECUTORS)}, got {kind!r}")
    if kind == "local":
        if address:
            raise ValueError("--address needs --executor ray")
        return
    if not address and not os.environ.get("RAY_ADDRESS") and "ray" not in sys.modules:
        os.environ.setdefault(*LOOPBACK_ENV)  # a local instance: nothing listens beyond 127.0.0.1
    try:
        import ray  # noqa: F401
    except ImportError as e:
        raise ValueError(f"--executor ray needs Ray, which is not installed: {RAY_EXTRA_HINT}") from e
    from stack.bench.ray_executor import check_address

    if address or os.environ.get("RAY_ADDRESS"):
        check_address(address or os.environ["RAY_ADDRESS"])


def make_executor(
    kind: str,
    ctx: SweepContext,
    jobs: int = 1,
    address: str | None = None,
    task: Task = run_job,
    retries: int = 1,
) -> Executor:
    """The executor ``kind`` (``local`` or ``ray``, checked by :func:`preflight`) running
    ``task`` with up to ``jobs`` simulations at once (a Ray cluster's size sets its own)."""
    if jobs < 1:
        raise ValueError("--jobs must be >= 1")
    preflight(kind, address)
    if kind == "local":
        if jobs == 1:
            return InlineExecutor(ctx, task, retries)
        from stack.bench.process_executor import ProcessExecutor

        return ProcessExecutor(ctx, jobs, task, retries)
    from stack.bench.ray_executor import RayExecutor

    return RayExecutor(ctx, jobs=jobs, address=address, task=task, retries=retries)
