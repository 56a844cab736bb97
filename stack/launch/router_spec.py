"""The router processes of a deployment: one builder for every launcher.

Both the emulated stack (``stack.launch.emulated``) and real SGLang pools (``stack.launch.sglang``)
start the same ``smetric router --config FILE`` in front of their workers, one process per
replica (``stack.launch.replicas``). They differ only in what they hand in: the command that
runs ``smetric``, the config file, the host and node, the ports. Building the specs in one
place keeps the replica flags and the treatment of ``launch.router.extra_args`` the same for
both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from stack.config import RouterConfig
from stack.launch import replicas
from stack.launch.spec import LaunchConfigError, ProcessSpec

__all__ = ["router_extra_args", "router_specs"]


def router_extra_args(router: Mapping[str, Any] | None) -> list[str]:
    """``launch.router.extra_args`` as strings, appended after every other router flag.

    Absent or null: none. A list (or tuple): each item as a string. Anything else (a single
    string above all, which would otherwise be split into its characters) is refused, as the
    worker pools' ``extra_args`` are.
    """
    raw = (router or {}).get("extra_args")
    if raw is None:
        return []
    if not isinstance(raw, (list, tuple)):
        raise LaunchConfigError("launch.router.extra_args: must be a list of strings")
    return [str(x) for x in raw]


def drain_grace_s(router: Mapping[str, Any]) -> float:
    """Seconds a router given SIGTERM may take to stop: its drain's deadline
    (``router.drain_timeout_s``, default ``router.request_timeout_s``) and notice, and the
    bound on its shutdown after that (``EXIT_S``, stack/prefill_router/drain.py). ``router``:
    the config's ``router`` section."""
    from stack.prefill_router.drain import EXIT_S

    d = RouterConfig()
    timeout = router.get("drain_timeout_s") or router.get("request_timeout_s") or d.request_timeout_s
    notice = router.get("drain_notice_s", d.drain_notice_s)
    return float(timeout) + float(notice) + EXIT_S


def router_specs(
    *,
    command: Sequence[str],
    config_path: str,
    ports: Sequence[int],
    host: str,
    env: Mapping[str, str],
    extra_args: Sequence[str],
    node: str = "local",
    stop_grace_s: float | None = None,
) -> list[ProcessSpec]:
    """One ``<command> router --config <config_path>`` per port, in replica order.

    Replica ``i`` of several gets ``--port ports[i] --replica-id r{i}`` (a lone router neither:
    it reads its port from the config); ``extra_args`` come last so they can override. Each
    spec is ready when ``http://<host>:<port>/health`` answers. ``node`` defaults to
    ProcessSpec's own (the local machine).
    """
    n = len(ports)
    return [
        ProcessSpec(
            name=replicas.replica_name(i, n),
            role="router",
            argv=[
                *command,
                "router",
                "--config",
                config_path,
                *replicas.replica_args(i, port, n),
                *extra_args,
            ],
            env=dict(env),
            host=host,
            node=node,
            ready_url=f"http://{host}:{port}/health",
            ready_port=port,
            stop_grace_s=stop_grace_s,
        )
        for i, port in enumerate(ports)
    ]
