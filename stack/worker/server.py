"""The worker process: the app (and a prefill worker's bootstrap server) under uvicorn.

The emulator itself is split by concern: the request path in :mod:`stack.worker.request_path`,
the HTTP layer in :mod:`stack.worker.http`. The names older code imports from here
(``build_app``, ``Worker``, ``FaultInjector``, ...) are re-exported.

Endpoints: ``/generate``, ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``,
``/health``, ``/health_generate``, ``/server_info`` (and ``/get_server_info``),
``/get_model_info``, ``/v1/loads``, ``/get_load``, ``/flush_cache``, ``/abort_request``,
``/metrics``; on a prefill worker also the bootstrap endpoint ``/kv/register`` (on its
bootstrap port).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from stack.worker.http.app import build_app
from stack.worker.http.faults import FaultInjector, with_faults
from stack.worker.http.metrics import render_metrics
from stack.worker.http.routes_bootstrap import add_bootstrap_routes, build_bootstrap_app
from stack.worker.http.routes_status import VERSION
from stack.worker.request_path import Worker
from stack.worker.settings import WorkerSettings


def _uvicorn_server(app, host: str, port: int, log_level: str, lifespan: str):
    """A uvicorn server that leaves signal handling to :func:`serve` (it stops both at once)."""
    import uvicorn

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # we install our own handlers for both servers
            yield

    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, access_log=False, lifespan=lifespan
    )
    return _Server(config)


def serve(settings: WorkerSettings, log_level: str = "warning") -> None:
    """Run the worker (and its bootstrap server) until SIGINT/SIGTERM."""
    serve_many([settings], log_level)


def serve_many(pool: list[WorkerSettings], log_level: str = "warning") -> None:
    """Run several emulated workers in this process, on one event loop, until SIGINT/SIGTERM.

    Each worker keeps everything a worker process has: its own HTTP endpoint (and bootstrap
    server), engine and modelled clock, KV-event publisher, Mooncake store client and
    TransferEngine (several of each share a process: checked with the real mooncake package,
    docs/research/fidelity.md). What they share is the interpreter, so a pool costs one process's idle
    overhead instead of N.
    """
    import signal

    names = [s.name for s in pool]
    if len(set(names)) != len(names):
        raise ValueError(f"worker names in one pool must differ: {names}")
    servers = []
    for settings in pool:
        app, w = build_app(settings)
        servers.append(
            _uvicorn_server(
                with_faults(app, settings, w.engine.publisher), settings.host, settings.port, log_level, "on"
            )
        )
        if (
            settings.mode == "prefill"
            and settings.bootstrap_port
            and settings.bootstrap_port != settings.port
        ):
            servers.append(
                _uvicorn_server(
                    build_bootstrap_app(w), settings.host, settings.bootstrap_port, log_level, "off"
                )
            )

    async def main() -> None:
        loop = asyncio.get_running_loop()

        def stop(*_: object) -> None:
            for s in servers:
                s.should_exit = True

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop)
        await asyncio.gather(*(s.serve() for s in servers))

    logging.basicConfig(
        level=getattr(logging, log_level.upper(), logging.WARNING),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    asyncio.run(main())


__all__ = [
    "VERSION",
    "FaultInjector",
    "Worker",
    "add_bootstrap_routes",
    "build_app",
    "build_bootstrap_app",
    "render_metrics",
    "serve",
    "serve_many",
    "with_faults",
]
